"""Deterministic word tokenizer and chat template.

The rule is simple on purpose, so that a benchmark can build prompts of an exact token count:

* one whitespace-separated word is one token; a word's id is ``mmh3(word) % VOCAB_SIZE`` (ids are only
  used for prefix-cache hashing, so collisions between different words do not matter in practice);
* identical text up to a word boundary therefore gives identical leading token ids;
* the chat template renders each message as ``<|ROLE|> CONTENT <|end|>`` and, with the generation prompt,
  appends ``<|assistant|>``: a message costs ``2 + words(content)`` tokens, the generation prompt 1;
* generated text is a sequence of words, each emitted with a leading space, so a completion of N tokens
  re-tokenizes to exactly N tokens when a client sends it back in the next turn.

No BOS token is added, which keeps ``tokens(a + " " + b) == tokens(a) + tokens(b)``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import mmh3

VOCAB_SIZE = 128_000
END_MARK = "<|end|>"
GENERATION_PROMPT = "<|assistant|>"

# Words the simulator "generates"; fixed so outputs are identical across machines.
_OUTPUT_WORDS: tuple[str, ...] = tuple(
    "the of and to in is that it for on was with as by at be this from or an are not "
    "have had were but can all will one would there their what so up out if about who "
    "get which go me when make like time no just him know take people into year your "
    "good some could them see other than then now look only come its over think also "
    "back after use two how our work first well way even new want because any these "
    "give day most us model token cache prefix block route node load".split()
)


def utf8(text: str) -> bytes:
    """Bytes of client text for hashing. JSON lets a client send a lone surrogate; mmh3 crashes the
    process on such a str, so every hash takes bytes (identical values for valid text)."""
    return text.encode("utf-8", "surrogatepass")


def word_id(word: str) -> int:
    """Id of one word (the one rule every other id here goes through)."""
    return mmh3.hash(word.encode("utf-8", "surrogatepass"), 0, False) % VOCAB_SIZE  # utf8(), inlined: hot


@lru_cache(maxsize=1 << 16)
def token_id(word: str) -> int:
    """``word_id`` cached, for the few words that recur (generated output words)."""
    return word_id(word)


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per whitespace-separated word.

    Uncached on purpose: a long prompt's words are mostly seen once, and a cache miss costs 3x a plain
    hash (a 100,000-token prompt took 107 ms through the cache, a stall of every engine in the process;
    vLLM tokenizes in its API server, never in the engine's step loop)."""
    return [word_id(w) for w in text.split()]


def count(text: str) -> int:
    return len(text.split())


def content_text(content: Any) -> str:
    """Text of an OpenAI message ``content``: a string or a list of parts (text parts are joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return " ".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render chat messages to prompt text with the simulator's chat template."""
    out: list[str] = []
    for m in messages:
        role = str(m.get("role", "user"))
        out.append(f"<|{role}|> {content_text(m.get('content'))} {END_MARK}")
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return " ".join(out)


def chat_overhead_tokens(num_messages: int) -> int:
    """Template tokens added around ``num_messages`` messages plus the generation prompt."""
    return 2 * num_messages + 1


def output_words(seed: int, n: int) -> list[str]:
    """``n`` generated words, determined by ``seed`` alone."""
    rng = random.Random(seed)
    return [rng.choice(_OUTPUT_WORDS) for _ in range(n)]


def filler_words(key: int | str, n: int) -> list[str]:
    """``n`` deterministic words for synthetic prompts: same key, same text (benchmark blocks)."""
    rng = random.Random(f"filler:{key}")
    return [f"w{rng.getrandbits(24):x}" for _ in range(n)]


def decode_words(words: Sequence[str]) -> str:
    return "".join(" " + w for w in words)
