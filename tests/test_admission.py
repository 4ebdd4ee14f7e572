"""Admission alone: counting a request against its key's and address's limits, the max_tokens a
token limit gives, giving tokens back, correcting by the reported usage, and the request's class."""

from __future__ import annotations

import dataclasses

import pytest
from kvgate.admission import Admission, RateLimited
from kvgate.config import Config
from kvgate.features import Features
from kvgate.limits import RateLimiter
from kvgate.messages import Outcome, OutcomeKind
from kvgate.metrics import SidecarMetrics

KEY = {"name": "team-a", "sha256": "a" * 64, "priority": -1}


def admission(**sections: object) -> Admission:
    cfg = Config.from_mapping(
        {"redis": {"url": None}, "backends": [{"url": "http://127.0.0.1:1"}], **sections}
    )
    limiter = RateLimiter(cfg.limits, cfg.auth, None, cfg.redis.prefix) if cfg.limited else None
    return Admission(cfg, SidecarMetrics(), limiter)


def feats(key: str | None = "team-a", max_tokens: int | None = None, priority: int | None = None) -> Features:
    return Features("m", None, "none", (), 4_000, client_key=key, max_tokens=max_tokens, priority=priority)


def ended(did: str, prompt: int, completion: int) -> Outcome:
    return Outcome(OutcomeKind.END, did, "b0", 200, prompt_tokens=prompt, completion_tokens=completion)


def test_a_request_over_its_keys_request_rate_is_refused_with_the_wait() -> None:
    a = admission(auth={"keys": [KEY]}, limits={"per_key": {"requests_per_minute": 2}})
    a.admit("d1", feats())
    a.admit("d2", feats())
    with pytest.raises(RateLimited) as refused:
        a.admit("d3", feats())
    assert 0 < refused.value.retry_after <= 60
    a.admit("d4", feats(key="other"))  # another key has its own budget
    assert len(a) == 3


def test_under_a_token_limit_a_request_without_max_tokens_gets_what_is_left() -> None:
    a = admission(limits={"per_key": {"tokens_per_minute": 10_000}, "default_max_tokens": 4096})
    a.admit("d1", feats())  # 1,000 prompt tokens (4 bytes each): 9,000 left, at most 4,096
    assert a.given_max_tokens("d1") == 4096
    a.admit("d2", feats(max_tokens=100))  # asked for its own: nothing given
    assert a.given_max_tokens("d2") is None
    a.admit("d3", feats())  # 10,000 - 5,096 - 1,100 counted: 3,804 left after its prompt, 2,804
    assert a.given_max_tokens("d3") == 10_000 - 5_096 - 1_100 - 1_000


def test_each_of_n_completions_counts_its_output_and_shares_what_is_left() -> None:
    """vLLM generates up to max_tokens for each of a request's ``n`` completions: a token limit
    counts every one, and what it gives a request without max_tokens is shared among them, so the
    n together cannot outrun what the key had left."""
    a = admission(limits={"per_key": {"tokens_per_minute": 10_000}, "default_max_tokens": 4096})
    four = Features("m", None, "none", (), 4_000, client_key="team-a", completions=4)
    a.admit("d1", four)  # 1,000 prompt tokens: 9,000 left for 4 completions
    assert a.given_max_tokens("d1") == 9_000 // 4
    with pytest.raises(RateLimited):  # 1,000 + 4 x 2,000 = 9,000 more: over the 1,000 left
        a.admit(
            "d2", Features("m", None, "none", (), 4_000, client_key="team-a", max_tokens=2_000, completions=4)
        )
    a.unadmit("d1")
    a.admit(
        "d2", Features("m", None, "none", (), 4_000, client_key="team-a", max_tokens=2_000, completions=4)
    )
    with pytest.raises(RateLimited):  # the 9,000 counted leave 1,000: not another prompt and 1 token
        a.admit("d3", feats(max_tokens=1))


def test_tokens_come_back_when_a_request_never_runs_and_are_corrected_by_its_usage() -> None:
    a = admission(limits={"per_key": {"tokens_per_minute": 6_000}})
    a.admit("d1", feats(max_tokens=2_000))  # 3,000 counted
    with pytest.raises(RateLimited):
        a.admit("d2", feats(max_tokens=2_500))  # 3,500 more: over
    a.unadmit("d1")  # it left the queue: its 3,000 come back
    a.admit("d2", feats(max_tokens=2_500))
    a.settle(ended("d2", 1_000, 10))  # it used 1,010 of its 3,500
    a.admit("d3", feats(max_tokens=3_900))  # 4,900 fits the 4,990 left
    assert len(a) == 1  # settled and given back: only d3 awaits its usage


def test_the_class_is_the_clients_when_allowed_else_the_keys() -> None:
    a = admission(auth={"keys": [KEY]})
    assert a.priority_of(feats(priority=5)) == -1  # clients may not choose: the key's
    assert a.priority_of(feats(key=None)) == 0
    b = admission(auth={"keys": [KEY]}, queue={"enabled": True, "client_priority": True})
    assert b.priority_of(feats(priority=5)) == 5


def test_the_key_list_nginx_reads_is_versioned_by_its_content() -> None:
    one, same = admission(auth={"keys": [KEY]}).keys(), admission(auth={"keys": [KEY]}).keys()
    other = admission(auth={"keys": [{**KEY, "sha256": "b" * 64}]}).keys()
    assert one == same and one.version != other.version and one.keys == {"a" * 64: "team-a"}
    # Each limited key's rate goes too, for Nginx to hold it to while it routes on its own.
    assert one.rates == {}
    limited = admission(auth={"keys": [KEY]}, limits={"per_key": {"requests_per_minute": 30}}).keys()
    assert limited.rates == {"team-a": (30, 0)} and limited.version != one.version


def test_a_request_nginx_routed_on_its_own_counts_against_its_key_when_it_ends() -> None:
    """No decision counted it (the sidecar was slow or away): its end, with its key and address,
    counts it by its usage then, over the limit or not, and the next decided request sees that."""
    a = admission(limits={"per_key": {"tokens_per_minute": 6_000}, "per_client": {"requests_per_minute": 2}})
    unrouted = Outcome.end(None, "b0", 200, prompt_tokens=4_000, completion_tokens=1_500, client_key="team-a")
    a.count_unrouted(unrouted)
    with pytest.raises(RateLimited):
        a.admit("d1", feats(max_tokens=100))  # 1,100 more: over the 500 left
    a.admit("d2", feats(key="team-b", max_tokens=100))  # another key's budget is untouched
    by_addr = Features("m", None, "none", (), 40, client_addr="10.0.0.7", max_tokens=1)
    a.count_unrouted(dataclasses.replace(unrouted, client_key=None, client_addr="10.0.0.7"))
    a.admit("d3", by_addr)  # the address's second request this minute
    with pytest.raises(RateLimited):
        a.admit("d4", by_addr)
    a.count_unrouted(
        Outcome.end("d5", "b0", 200, prompt_tokens=9_000, completion_tokens=0, client_key="team-b")
    )
    a.admit("d6", feats(key="team-b", max_tokens=100))  # a decided request's end is settled, not counted
