"""The fault suite, short versions: every fault of kvgate_bench.faults under a steady load through
the whole stack, and the fuzz corpus. (``kvgate-bench faults`` runs the long versions.)

Goals, as the scores count them: no client-visible failure for a request that was not yet streaming
while a healthy backend existed; every in-flight count back to 0 within 2 s of idle; under fuzz no
5xx, no error that is not JSON, no connection left without an answer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgate_bench import fault_scenarios, fault_stack, faults, fuzz
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[fault_stack.Stack]:
    s = fault_stack.Stack.start(tmp_path_factory.mktemp("faults") / "run")
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("name", list(fault_scenarios.SCENARIOS))
def test_fault_under_load(stack: fault_stack.Stack, name: str) -> None:
    s = faults.run_scenario(
        stack, fault_scenarios.SCENARIOS[name], concurrency=6, before=1.0, hold=2.0, after=2.0
    )
    assert s.requests > 50 and s.ok > 0, s
    assert s.failed == 0, s
    assert s.idle_zero_s is not None, s
    if name == "backend cuts streams":
        assert s.failed_by_design > 0  # the cut streams were seen, and scored as what they are
    if name == "all backends down":
        assert s.failed_by_design > 0 and s.recover_s is not None
    seen = stack.observed.get(name, {})
    if name == "stream token limit":  # the attacker got at most its budget in any minute, then 429s
        assert (
            seen["tokens_by_minute"] and max(seen["tokens_by_minute"].values()) <= fault_stack.LIMITED_TOKENS
        ), seen
        assert seen["statuses"].get("429", 0) > 0, seen
    if name == "rogue backend port":
        assert seen["connections"] == 0, seen
    if name == "queue flood":  # the flood's excess was refused by name; the load above lost nothing
        assert seen["statuses"].get("429", 0) > 0, seen


def test_fuzz_corpus(stack: fault_stack.Stack) -> None:
    """A short version: every family of the corpus, 150 times (kvgate-bench faults sends 12,000)."""
    result = fuzz.run(stack.port, 3_000, key=fault_stack.LOAD_KEY)
    assert result.requests == 3_000
    assert result.server_errors == 0 and result.non_json_errors == 0 and result.transport_errors == 0, result
    assert set(result.statuses) <= {"200", "400", "404", "413", "415", "422"}, result.statuses
    wait_until(lambda: stack.inflight() == 0, timeout=2)
