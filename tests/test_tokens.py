"""The token estimate: bytes per token learned per model from what the backends counted, or fixed."""

from __future__ import annotations

import pytest
from kvgate.config import ConfigError, TokensConfig
from kvgate.config.fields import load
from kvgate.tokens import HARD_WINDOW_TOKENS, MAX_WINDOW_TOKENS, TokenEstimator

from tests.cores import MODEL


def test_bytes_per_token_is_learned_from_what_each_backend_counted() -> None:
    t = TokenEstimator(TokensConfig())
    assert t.ratio(MODEL) == 4.0  # until something is learned
    t.counted("a", 100.0)  # first sight: the window starts here
    t.served("a", MODEL, 20_000)
    t.counted("a", 100.0 + 10_000)  # 20,000 bytes were 10,000 tokens
    first = t.ratio(MODEL)
    assert 2.0 < first < 3.0  # most of the way from the default (4.0) at once
    counter = 10_100.0
    for _ in range(40):  # the default's weight decays away
        t.served("a", MODEL, 20_000)
        counter += 10_000
        t.counted("a", counter)
    assert t.ratio(MODEL) == pytest.approx(2.0, rel=0.02)
    t.served("a", MODEL, 40_000)
    t.counted("a", counter + 10_000)  # 4 bytes per token now: smoothed, not jumped to
    assert 2.0 < t.ratio(MODEL) < 4.0


def test_a_first_window_that_met_another_prompts_bytes_moves_the_estimate_only_part_way() -> None:
    """One 3,000-token prompt counted with the bytes of three such prompts (their reports came early,
    their tokens fall in the next windows): 15 bytes per token, where the truth is 5. The estimate
    goes part of the way, then comes back as the other prompts' tokens are counted."""
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0)
    t.served("a", MODEL, 45_000)
    t.counted("a", 3_000.0)
    assert t.ratio(MODEL) < 10.0  # without the prior: 15
    t.counted("a", 9_000.0)  # the other two prompts' tokens, their bytes already counted
    assert 3.5 < t.ratio(MODEL) < 6.0


def test_the_ratio_holds_when_reports_and_scrapes_are_out_of_step() -> None:
    """Prompts of 3 bytes per token, 2,000 to 40,000 tokens long; the backend counts each one when
    its prefill ends, and Nginx's first-byte report reaches the sidecar up to a scrape later (or
    earlier than the scrape that reads the count). The learned ratio stays near 3 throughout: it is
    a ratio of sums over the same prompts, not an average of each window's ratio."""
    import random

    rng = random.Random(7)
    t = TokenEstimator(TokensConfig())
    counter = 0.0
    t.counted("a", counter)
    late: list[int] = []  # bytes whose report comes after the next scrape
    seen = []
    for _ in range(400):
        for size in late:
            t.served("a", MODEL, size)
        late = []
        for _ in range(rng.randint(0, 2)):  # prompts whose prefill ended in this window
            tokens = rng.randint(2_000, 40_000)
            counter += tokens
            if rng.random() < 0.5:
                t.served("a", MODEL, 3 * tokens)
            else:
                late.append(3 * tokens)
        t.counted("a", counter)
        if MODEL in t.learned:
            seen.append(t.ratio(MODEL))
    assert len(seen) > 300
    assert all(2.4 < r < 3.6 for r in seen[20:])  # within 20 % once it has a few windows
    assert abs(sum(seen[20:]) / len(seen[20:]) - 3.0) < 0.15


def test_a_window_waits_for_the_first_bytes_of_the_prompts_its_counter_may_hold() -> None:
    """16,000-token documents at 8 bytes a token, one at a time: the engine counts each a moment
    before its first byte is reported, and every other scrape falls in that moment, reading its
    tokens without its bytes. Told a prompt is still unreported, the window stays open and closes on
    whole prompts; blind to it, the estimate swings with each window."""

    def run(aware: bool) -> list[float]:
        t = TokenEstimator(TokensConfig())
        t.counted("a", 0.0)
        counter, seen = 0.0, []
        for i in range(20):
            counter += 16_000
            if i % 2:  # this scrape comes between the count and the report
                t.counted("a", counter, unreported=1 if aware else 0)
                t.served("a", MODEL, 128_000)
            else:
                t.served("a", MODEL, 128_000)
                t.counted("a", counter)
            seen.append(t.ratio(MODEL))
        return seen[10:]  # once the prior has mostly decayed

    assert all(r == pytest.approx(8.0, rel=0.02) for r in run(aware=True))
    blind = run(aware=False)
    assert min(blind) < 7.6 and max(blind) - min(blind) > 0.5  # 7.1 to 8.2 in the ten windows


def _busy(t: TokenEstimator, counter: float, until: float, bytes_per_token: int) -> float:
    """Prompts of 10,000 tokens counted and reported while others stay unreported, up to ``until``
    counted tokens; the counter reached."""
    while counter < until:
        counter += 10_000
        t.served("a", MODEL, 10_000 * bytes_per_token)
        t.counted("a", counter, unreported=3)
    return counter


def test_a_busy_backends_window_closes_at_its_size_limit() -> None:
    """A backend always holding some unreported prompt still teaches: its window closes at
    ``MAX_WINDOW_TOKENS``, where one prompt astride its edge weighs little."""
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0)
    counter = _busy(t, 0.0, MAX_WINDOW_TOKENS - 10_000, 6)
    assert MODEL not in t.learned  # (a ratio once learned stays)
    t.served("a", MODEL, 60_000)
    t.counted("a", counter + 10_000, unreported=3)
    assert MODEL in t.learned and t.ratio(MODEL) < 6.5


def test_a_busy_window_past_its_size_limit_waits_for_a_long_prompts_bytes() -> None:
    """At the size limit a window still closes only if its bytes and tokens agree with the estimate
    (within ``BALANCE``): a 120,000-token prompt counted a moment before its first byte is reported
    would otherwise close a window at 1.6 bytes a token where the truth is 4, its bytes in the next."""
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0)
    counter = _busy(t, 0.0, MAX_WINDOW_TOKENS - 20_000, 4)
    counter += 120_000  # the long prompt's tokens, its bytes not yet reported
    t.counted("a", counter, unreported=3)
    assert MODEL not in t.learned
    t.served("a", MODEL, 480_000)
    t.counted("a", counter + 1_000, unreported=3)
    assert t.ratio(MODEL) == pytest.approx(4.0, rel=0.02)


def test_a_window_that_never_agrees_closes_at_the_hard_limit() -> None:
    """Tokens no byte of this replica's explains (clients that reach the backend without kvgate)
    keep a busy window unbalanced: it still closes, at ``HARD_WINDOW_TOKENS``."""
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0)
    counter = 0.0
    while MODEL not in t.learned:
        counter += 50_000
        t.served("a", MODEL, 1_000)
        t.counted("a", counter, unreported=1)
    assert counter == HARD_WINDOW_TOKENS


def test_with_several_replicas_each_learns_from_its_share_of_the_counts() -> None:
    """Two replicas each send half the prompts; each sees the whole counter move but only its own
    bytes, so each divides the counted tokens by the replica count."""
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0, replicas=2)
    t.served("a", MODEL, 30_000)  # ours: 10,000 tokens at 3 bytes per token
    t.counted("a", 20_000.0, replicas=2)  # ours and the other replica's, 10,000 tokens each
    one = TokenEstimator(TokensConfig())
    one.counted("a", 0.0)
    one.served("a", MODEL, 30_000)
    one.counted("a", 10_000.0)  # what a single replica sending those prompts learns
    assert t.ratio(MODEL) == pytest.approx(one.ratio(MODEL))
    assert t.ratio(MODEL) < 3.5  # from 4.0 towards 3.0


def test_windows_that_mix_models_or_follow_a_restart_teach_nothing() -> None:
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0)
    t.served("a", MODEL, 20_000)
    t.served("a", "other", 20_000)
    t.counted("a", 10_000.0)
    assert t.learned == {}
    t.served("a", MODEL, 20_000)
    t.counted("a", 5.0)  # the counter went back: the backend restarted
    assert t.learned == {}
    t.served("a", MODEL, 100)
    t.counted("a", 105.0)  # 100 tokens: too small a window to trust
    assert t.learned == {}


def test_a_ratio_set_in_the_config_wins_and_bad_ones_are_refused() -> None:
    t = TokenEstimator(load(TokensConfig, {"bytes_per_token": {MODEL: 2.5}}, "tokens"))
    t.counted("a", 0.0)
    t.served("a", MODEL, 40_000)
    t.counted("a", 10_000.0)
    assert t.ratio(MODEL) == 2.5 and t.ratio("other") == 4.0
    for bad in (0, "x", True, 100, float("nan")):
        with pytest.raises(ConfigError, match="bytes_per_token"):
            load(TokensConfig, {"bytes_per_token": {MODEL: bad}}, "tokens")


def test_tokens_from_clients_that_bypass_the_gateway_cannot_collapse_the_ratio() -> None:
    """The backend is kept busy by clients this replica never sees (tests posting to vLLM directly,
    a router beside kvgate): window after window of tokens against none of its bytes. The ratio
    stops at one byte per token (it fell to 0.00016, and a 2 KB prompt counted as 12 million
    tokens), and comes back with the first window of this replica's own prompts."""
    t = TokenEstimator(TokensConfig())
    counter = 0.0
    t.counted("a", counter)
    t.served("a", MODEL, 12_000)
    counter += 3_000.0
    t.counted("a", counter)
    assert t.ratio(MODEL) == 4.0
    for _ in range(100):
        counter += 50_000.0
        t.counted("a", counter)
    assert t.ratio(MODEL) == 1.0
    t.served("a", MODEL, 12_000)
    counter += 3_000.0
    t.counted("a", counter)
    assert 3.6 < t.ratio(MODEL) <= 4.0  # one window of its own
