"""Prompt length in tokens, estimated from bytes: a ratio per model, learned from what the backends
count or fixed in the config.

Nginx sends the prompt's canonical text length in bytes, never its tokens (tokenizing at the gateway
would cost more than routing). A fixed 4 bytes per token is right for English under BPE tokenizers and
2x off elsewhere, and the estimate feeds every prefill-cost and saturation figure. So each scrape
compares what a backend counted (``vllm:prompt_tokens_total``, chat template included) with the bytes
this sidecar routed to it since the previous scrape, and the model's ratio follows, smoothed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.config import TokensConfig

MIN_SAMPLE_TOKENS = 2000  # a window this small says little: it waits for more
SMOOTHING = 0.3  # weight of a new window in the ratio


@dataclass(slots=True)
class _Backend:
    counter: float | None = None  # the backend's prompt-token counter at the last scrape
    bytes: dict[str | None, int] = field(default_factory=dict)  # model -> bytes routed since then
    tokens: float = 0.0  # tokens counted since the window began


class TokenEstimator:
    def __init__(self, config: TokensConfig) -> None:
        self.config = config
        self.learned: dict[str | None, float] = {}
        self._backends: dict[str, _Backend] = {}

    def ratio(self, model: str | None) -> float:
        fixed = self.config.ratio(model)
        if fixed is not None:
            return fixed
        return self.learned.get(model, self.config.default_bytes_per_token)

    def routed(self, backend: str, model: str | None, prompt_bytes: int) -> None:
        """A request of ``prompt_bytes`` went to ``backend``."""
        if not self.config.learn:
            return
        b = self._backends.setdefault(backend, _Backend())
        b.bytes[model] = b.bytes.get(model, 0) + prompt_bytes

    def counted(self, backend: str, counter: float | None) -> None:
        """A scrape of ``backend`` read its prompt-token counter."""
        if not self.config.learn or counter is None:
            return
        b = self._backends.setdefault(backend, _Backend())
        previous, b.counter = b.counter, counter
        if previous is None or counter < previous:  # first sight, or the backend restarted
            b.bytes.clear()
            b.tokens = 0.0
            return
        b.tokens += counter - previous
        if b.tokens < MIN_SAMPLE_TOKENS:
            return
        if len(b.bytes) == 1:  # a window that mixed models cannot tell their ratios apart
            ((model, routed),) = b.bytes.items()
            if routed > 0:
                sample = routed / b.tokens
                old = self.learned.get(model)
                self.learned[model] = sample if old is None else old + SMOOTHING * (sample - old)
        b.bytes.clear()
        b.tokens = 0.0
