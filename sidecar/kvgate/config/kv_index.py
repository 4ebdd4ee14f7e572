"""The exact prefix index: what each backend holds, from its KV events (``kvgate.exact_index``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvgate.config.fields import choice, custom, millis, whole
from kvgate.config.parse import ConfigError


class TokenizerSource(str, Enum):
    """Where the sidecar gets a prompt's token ids, which the exact index is keyed by."""

    BACKEND = "backend"  # the model's own tokenizer and chat template: a backend's /tokenize
    NONE = "none"  # never tokenize: the approximate index only


def _files(data: Mapping[str, Any], where: str, key: str) -> dict[str, str]:
    files = data.get(key) or {}
    if not isinstance(files, Mapping) or not all(isinstance(v, str) and v for v in files.values()):
        raise ConfigError(f"{where}.{key}: expected a mapping of model: directory (its tokenizer.json)")
    return {str(k): str(v) for k, v in files.items()}


@dataclass(frozen=True, slots=True)
class KvIndexConfig:
    """Used for backends that declare ``kv_events``; the others are always looked up approximately."""

    tokenizer: TokenizerSource = choice(
        TokenizerSource.BACKEND, "backend: ask a healthy backend's /tokenize; none: no exact lookups"
    )
    tokenizer_files: Mapping[str, str] = custom(
        {},
        _files,
        "model: directory of its tokenizer.json and tokenizer_config.json: tokenized in the sidecar "
        "(pip install 'kvgate[tokenizers]'), no /tokenize round trip",
    )
    tokenize_timeout_s: float = millis(
        30, 1, 5_000, "a decision waits this long for the prompt's token ids, then goes approximate"
    )
    max_prompt_bytes: int = whole(
        256 << 10, 0, 64 << 20, "bodies longer than this are not sent to be tokenized (0: none)"
    )
    max_blocks: int = whole(
        262_144, 1_024, 100_000_000, "block hashes kept per backend (about 100 bytes each)"
    )
    stale_s: float = millis(
        10_000, 100, 3_600_000, "a backend that prefilled and sent no event for this long is stale"
    )
    replay_timeout_s: float = millis(2_000, 10, 60_000, "a replay that fills a gap finishes within this")
