"""Tenants, their decaying service, and the queue depth per tenant as Prometheus reads it."""

from __future__ import annotations

from kvgate.features import Features
from kvgate.tenants import (
    ANONYMOUS,
    MAX_NAMED,
    OTHER,
    SWEEP_EVERY,
    DepthCollector,
    ServiceCollector,
    TenantLabels,
    TenantLedger,
    tenant_of,
)


def f(key: str | None = None, addr: str | None = None, header: str | None = None) -> Features:
    return Features("m", None, "none", (), 400, client_key=key, client_addr=addr, tenant=header)


def test_a_tenant_is_its_header_else_its_api_key_else_its_address_and_labels_stay_bounded() -> None:
    assert tenant_of(f("team-a", "10.0.0.1", "acme")) == "tenant:acme"
    assert tenant_of(f("team-a", "10.0.0.1")) == "key:team-a"
    assert tenant_of(f(None, "10.0.0.1")) == "addr:10.0.0.1"
    assert tenant_of(f()) == ANONYMOUS
    label = TenantLabels()
    assert label("key:team-a") == "team-a"
    assert label("addr:10.0.0.1") == label(ANONYMOUS) == ANONYMOUS  # addresses are unbounded
    # Header values are client text where an edge passes them on: the first MAX_NAMED are named,
    # and they stay named; the rest share one label.
    assert [label(f"tenant:t{i}") for i in range(MAX_NAMED + 2)] == [f"t{i}" for i in range(MAX_NAMED)] + [
        OTHER,
        OTHER,
    ]
    assert label("tenant:t0") == "t0" and label("key:team-b") == "team-b"


def test_service_decays_by_half_each_window_and_old_tenants_are_forgotten() -> None:
    ledger = TenantLedger(half_life_s=10.0)
    ledger.add("a", 800, now=0.0)
    assert ledger.attained("a", 0.0) == 800
    assert abs(ledger.attained("a", 10.0) - 400) < 1e-6
    ledger.add("a", 100, now=10.0)
    assert abs(ledger.attained("a", 20.0) - 250) < 1e-6
    assert ledger.attained("nobody", 5.0) == 0.0
    for i in range(SWEEP_EVERY):  # a sweep, much later: "a" has decayed under one token
        ledger.add(f"t{i}", 1000, now=1000.0)
    assert len(ledger) == SWEEP_EVERY and ledger.attained("a", 1000.0) == 0.0


def test_the_depth_collector_counts_what_waits_now() -> None:
    waiting = [f("a"), f("a"), f("b"), f(None, "10.0.0.9")]
    (family,) = DepthCollector(lambda: waiting, TenantLabels()).collect()
    assert {s.labels["tenant"]: s.value for s in family.samples} == {"a": 2, "b": 1, ANONYMOUS: 1}
    waiting.clear()
    (family,) = DepthCollector(lambda: waiting, TenantLabels()).collect()
    assert family.samples == []


def test_a_tenant_is_past_its_share_with_more_than_an_equal_part_of_the_recent_service() -> None:
    ledger = TenantLedger(half_life_s=10.0)
    ledger.add("flood", 3_000, now=0.0)
    assert not ledger.over_share("flood", 0.0)  # alone: no one to share with
    ledger.add("quiet", 1_000, now=0.0)
    assert ledger.over_share("flood", 0.05) and not ledger.over_share("quiet", 0.05)
    ledger.add("quiet", 4_000, now=1.0)
    assert ledger.over_share("quiet", 1.0) and not ledger.over_share("flood", 1.0)
    # A burst within one refresh of the active count: the total is the one of now, so no more than
    # one of two tenants is ever past its share (a total summed before the burst put both past it).
    ledger.add("flood", 9_000, now=1.01)
    assert ledger.over_share("flood", 1.02) and not ledger.over_share("quiet", 1.02)
    tiny = TenantLedger(half_life_s=10.0)
    tiny.add("big", 100_000, now=0.0)
    tiny.add("speck", 10, now=0.0)  # under 1 % of the service: not competing
    assert not tiny.over_share("big", 0.0)


def test_a_correction_moves_a_tenant_s_service_and_the_total_never_under_zero() -> None:
    ledger = TenantLedger(half_life_s=10.0)
    ledger.add("a", 800, now=0.0)
    ledger.add("b", 200, now=0.0)
    ledger.correct("a", -500, now=10.0)  # it wrote less than it was charged for, one half-life on
    assert ledger.attained("a", 10.0) == 0.0  # 400 left, 500 taken back: none, not negative
    ledger.correct("b", 50, now=10.0)  # b wrote more than it was charged for
    assert abs(ledger.attained("b", 10.0) - 150) < 1e-6
    # The total follows each correction as it was applied: b alone holds it now.
    assert abs(ledger._total.tokens - 150) < 1e-6
    ledger.correct("nobody", -100, now=10.0)  # a tenant not (or no longer) known stays unknown
    assert "nobody" not in ledger.tenants() and len(ledger) == 2


def test_the_service_collector_reads_what_the_fair_order_counts_now() -> None:
    ledger, now = TenantLedger(half_life_s=10.0), [0.0]
    ledger.add("key:a", 800, 0.0)
    ledger.add("addr:10.0.0.1", 100, 0.0)
    ledger.add("addr:10.0.0.2", 300, 0.0)
    now[0] = 10.0
    (family,) = ServiceCollector(ledger, lambda: now[0], TenantLabels()).collect()
    assert {s.labels["tenant"]: s.value for s in family.samples} == {"a": 400.0, ANONYMOUS: 200.0}
    ledger.correct("key:a", -400, 10.0)
    (family,) = ServiceCollector(ledger, lambda: now[0], TenantLabels()).collect()
    assert {s.labels["tenant"]: s.value for s in family.samples}["a"] == 0.0
