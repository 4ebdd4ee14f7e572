"""The rate limiter alone: per-minute windows, local counts, corrections to real usage."""

from kvgate.config import AuthConfig, LimitsConfig, Rate
from kvgate.limits import MAX_IDENTITIES, RateLimiter


def test_the_limiter_alone() -> None:
    limits = LimitsConfig(per_key=Rate(requests_per_minute=2), per_client=Rate(tokens_per_minute=100))
    r = RateLimiter(limits, AuthConfig(), None, "t")
    assert r.admit(["key:a", "ip:1"], 40, 0.0) is None and r.admit(["key:a", "ip:1"], 40, 1.0) is None
    assert r.admit(["key:a"], 1, 2.0) == 58  # a third request in the minute: wait for the next one
    assert r.admit(["ip:1"], 40, 3.0) == 57  # 120 > 100 tokens
    r.correct(["ip:1"], -50, 4.0)  # the first two used 30 tokens less each than counted
    assert r.admit(["ip:1"], 40, 5.0) is None
    assert r.admit(["key:a", "ip:1"], 1, 61.0) is None  # a new window


def test_a_client_cycling_addresses_cannot_grow_the_map_past_its_bound() -> None:
    r = RateLimiter(LimitsConfig(per_client=Rate(requests_per_minute=5)), AuthConfig(), None, "t")
    for i in range(MAX_IDENTITIES + 50):
        r.admit([f"ip:{i}"], 1, 0.0)
    assert len(r) <= MAX_IDENTITIES
