"""The words the real fleet's tiny model tokenizes one to one.

The simulator counts one token per word; a real tokenizer cuts the benchmark's usual filler words
(``w`` and six hex digits) into about seven tokens each, so the same prompt is seven times longer on a
real server. The tiny model's tokenizer is trained on these words (``vllm_real/model.py``), and the
benchmark can write its prompts with them (``--words vocab``): then a prompt has about as many tokens
on a real server as on a simulated one, and one KV block of 128 tokens holds 128 words on both.

Pure standard library: ``model.py`` imports it from the fleet's own virtualenv.
"""

from __future__ import annotations

import random

SIZE = 2048
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "de",
    "fa",
    "gu",
    "shi",
    "zen",
    "vor",
    "bel",
    "tam",
)


def _words() -> tuple[str, ...]:
    rng = random.Random("kvgate-vocabulary")
    out: dict[str, None] = {}
    while len(out) < SIZE:
        out["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))] = None
    return tuple(out)


WORDS = _words()


def filler_words(key: int | str, n: int) -> list[str]:
    """``n`` deterministic words from ``WORDS``: same key, same text (as the simulator's filler)."""
    rng = random.Random(f"filler:{key}")
    return [WORDS[rng.getrandbits(11)] for _ in range(n)]
