"""Prompt length in tokens, estimated from bytes: a ratio per model, learned from what the backends
count or fixed in the config.

Nginx sends the prompt's canonical text length in bytes, never its tokens (tokenizing at the gateway
would cost more than routing). A fixed 4 bytes per token is right for English under BPE tokenizers and
2x off elsewhere, and the estimate feeds every prefill-cost and saturation figure. So each scrape
compares what a backend counted (``vllm:prompt_tokens_total``, chat template included) with the bytes
of the prompts it served since the previous scrape, and the model's ratio follows.

Both sides of that comparison must describe the same prompts. vLLM counts a prompt's tokens when its
prefill ends (with the first token), so a prompt's bytes are counted here when Nginx reports its first
byte (or its whole JSON answer), not when it is routed: routed bytes run ahead of the counter by a
whole queue and prefill, seconds to minutes, and the ratio of such windows swings 1-10x around the
truth. And what is learned is a ratio of sums (bytes over tokens, both decayed), not an average of
per-window ratios, which small windows would bias upwards.

Reports and scrapes still fall on either side of each other: the engine counts a prompt a few
milliseconds before its first byte reaches Nginx, and a scrape between the two reads the tokens of
a prompt whose bytes come in the next window. A window closed at every scrape past
``MIN_SAMPLE_TOKENS`` was then a single long prompt half the time, its tokens without its bytes or
the bytes of two with the tokens of one (on a workload of 16,000-token documents the learned ratio
went 15.8 -> 9.8 -> 10.7 -> 8.6 against a true 7.9, and every prefill estimate with it). So a window
closes only at a scrape where every prompt this replica sent the backend has had its first byte
reported (``InflightLedger.unreported``), when the two sides describe the same prompts, or once it
has grown to ``MAX_WINDOW_TOKENS``, where a prompt or two astride its edge weigh little. Not a
prompt of 100,000 tokens, which is the whole window: there the window also waits until its bytes and
tokens agree with the estimate within ``BALANCE`` (on the conversation trace its longest prompts made
windows of 0 and of 20-400 bytes a token against 7.9, each pair swinging the estimate by 20 %), and
closes whatever they say at ``HARD_WINDOW_TOKENS``. The sums
also start from the configured ratio, weighing as much as ``PRIOR_TOKENS`` of counted prompts: the
first windows pull the estimate towards what they saw, and the prior has decayed away after a few
dozen.

A backend's counter also counts the prompts other gateway replicas sent it; each replica sees only
its own bytes. So a window's tokens are divided by the number of replicas (``kvgate.replicas``):
exact when the edge spreads clients evenly over the replicas, as a round-robin load balancer does over
time. Clients that reach a backend without kvgate make the estimate too low: their tokens are counted
against none of this replica's bytes. Left alone, a backend that others keep busy drives the ratio
towards zero (each such window adds tokens and no bytes while the bytes decay): in the real-vLLM
suite, where tests also post to the servers directly, a prompt of a few kilobytes came to count as
millions of tokens, and every prefill cost and saturation figure with it. So the learned ratio stays
within ``MIN_RATIO`` and ``MAX_RATIO`` bytes per token: tokens no byte of this replica's can
explain are dropped from the sums, so that they weigh nothing once its own prompts are counted
again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.config import TokensConfig
from kvgate.config.fields import specs

MIN_SAMPLE_TOKENS = 2000  # a window this small says little: it waits for more
# A window still waiting for first bytes closes at this size: a busy backend always has some.
MAX_WINDOW_TOKENS = 50 * MIN_SAMPLE_TOKENS
BALANCE = 2.0  # ... if its bytes and tokens agree with the estimate within this factor
HARD_WINDOW_TOKENS = 10 * MAX_WINDOW_TOKENS  # and at this size whatever they say
DECAY = 0.05  # each window's weight in the sums: the estimate follows about the last 20 windows
PRIOR_TOKENS = 2 * MIN_SAMPLE_TOKENS  # the default ratio's weight in the sums before any window
# A byte-level BPE token covers at least one byte of text; a chat template's own tokens push a
# window of tiny prompts a little under that, never the way traffic from elsewhere does.
MIN_RATIO = 1.0


def _default_ceiling() -> float:
    """No learned ratio goes past what the configured default itself may be."""
    hi = next(spec.hi for name, spec in specs(TokensConfig) if name == "default_bytes_per_token")
    assert hi is not None
    return hi


MAX_RATIO = _default_ceiling()


@dataclass(slots=True)
class _Backend:
    counter: float | None = None  # the backend's prompt-token counter at the last scrape
    bytes: dict[str | None, int] = field(default_factory=dict)  # model -> bytes served since then
    tokens: float = 0.0  # tokens counted since the window began
    model: str | None = None  # the last model it served (a window whose prompts all came in earlier)
    seen: bool = False  # it has served a prompt since the counter was first read


class TokenEstimator:
    def __init__(self, config: TokensConfig) -> None:
        self.config = config
        self.learned: dict[str | None, float] = {}
        self._sums: dict[str | None, tuple[float, float]] = {}  # model -> decayed (bytes, tokens)
        self._backends: dict[str, _Backend] = {}

    def ratio(self, model: str | None) -> float:
        fixed = self.config.ratio(model)
        if fixed is not None:
            return fixed
        return self.learned.get(model, self.config.default_bytes_per_token)

    def served(self, backend: str, model: str | None, prompt_bytes: int) -> None:
        """``backend`` has counted a prompt of ``prompt_bytes`` (its first token came back)."""
        if not self.config.learn:
            return
        b = self._backends.setdefault(backend, _Backend())
        b.bytes[model] = b.bytes.get(model, 0) + prompt_bytes
        b.model = model
        b.seen = True

    def counted(self, backend: str, counter: float | None, replicas: int = 1, unreported: int = 0) -> None:
        """A scrape of ``backend`` read its prompt-token counter; ``replicas`` gateway replicas
        (this one included) share the backend; ``unreported``: prompts this replica sent it whose
        first byte it has not heard of yet (counted there, perhaps, but not here)."""
        if not self.config.learn or counter is None:
            return
        b = self._backends.setdefault(backend, _Backend())
        previous, b.counter = b.counter, counter
        if previous is None or counter < previous:  # first sight, or the backend restarted
            b.bytes.clear()
            b.tokens = 0.0
            b.seen = False
            return
        b.tokens += (counter - previous) / max(1, replicas)
        if b.tokens < MIN_SAMPLE_TOKENS or (unreported and not self._closes_busy(b)):
            return
        # A window that mixed models cannot tell their ratios apart; one whose tokens came from
        # prompts reported in an earlier window (reports and scrapes are not in step) still counts,
        # for the model the backend served last, so that no token is left out of the sums.
        models = set(b.bytes) or ({b.model} if b.seen else set())
        if len(models) == 1:
            (model,) = models
            self._add(model, b.bytes.get(model, 0), b.tokens)
        b.bytes.clear()
        b.tokens = 0.0

    def _closes_busy(self, b: _Backend) -> bool:
        """Whether a window still waiting for first bytes closes: at ``MAX_WINDOW_TOKENS`` if its
        bytes and tokens agree with the estimate within ``BALANCE`` (one that holds a long prompt's
        tokens without its bytes, or its bytes without its tokens, does not), at
        ``HARD_WINDOW_TOKENS`` whatever they say."""
        if b.tokens >= HARD_WINDOW_TOKENS:
            return True
        ratio = self.ratio(b.model)
        served = sum(b.bytes.values())
        return (
            b.tokens >= MAX_WINDOW_TOKENS
            and ratio / BALANCE * b.tokens <= served <= ratio * BALANCE * b.tokens
        )

    def _add(self, model: str | None, served: float, tokens: float) -> None:
        prior = (PRIOR_TOKENS * self.config.default_bytes_per_token, float(PRIOR_TOKENS))
        old_bytes, old_tokens = self._sums.get(model, prior)
        total_bytes, total_tokens = (1 - DECAY) * old_bytes + served, (1 - DECAY) * old_tokens + tokens
        if total_tokens <= 0:
            return
        low = min(MIN_RATIO, self.config.default_bytes_per_token)
        if total_bytes < low * total_tokens:
            # Tokens from elsewhere: keep the bytes, drop the tokens no byte of ours can explain,
            # so that they weigh nothing once this replica's own prompts are counted again.
            total_tokens = total_bytes / low
        elif total_bytes > MAX_RATIO * total_tokens:
            total_bytes = MAX_RATIO * total_tokens
        self._sums[model] = (total_bytes, total_tokens)
        if total_tokens > 0:
            self.learned[model] = total_bytes / total_tokens
