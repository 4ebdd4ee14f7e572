"""Nginx's side of kvgate, written into its config by `kvgate render-nginx` and `kvgate up`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.config.fields import custom, flag, number, optional_text, whole
from kvgate.config.parse import ConfigError, integer

# The statuses Nginx's proxy_next_upstream can retry on (http_403 ... http_504).
RETRYABLE = frozenset({403, 404, 429, 500, 502, 503, 504})
RETRY_STATUSES = (429, 500, 502, 503, 504)
FIRST_BYTE_MIN_MS = 5_000


def _body_size(d: Mapping[str, Any], where: str, key: str) -> str:
    size = str(d.get(key, "16m"))
    if not re.fullmatch(r"[0-9]+[kKmMgG]?", size):
        raise ConfigError(f"{where}.{key}: {size!r} is not an Nginx size like 16m or 512k")
    return size


def _statuses(d: Mapping[str, Any], where: str, key: str) -> tuple[int, ...]:
    statuses = d.get(key, list(RETRY_STATUSES))
    if not isinstance(statuses, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v in RETRYABLE for v in statuses
    ):
        raise ConfigError(
            f"{where}.{key}: expected a list of statuses among {sorted(RETRYABLE)}, got {statuses!r}"
        )
    return tuple(sorted(set(statuses)))


def _lua_module(d: Mapping[str, Any], where: str, key: str) -> str | None:
    edge = d.get(key)
    if edge is not None and not (isinstance(edge, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", edge)):
        raise ConfigError(f"{where}.{key}: expected a Lua module name like edge.auth, got {edge!r}")
    return edge


def _first_byte_floor(d: Mapping[str, Any], where: str, key: str) -> int:
    # Unless given, the floor is at most the ceiling (read and checked before it).
    ceiling = d.get("first_byte_timeout_ms", 60_000)
    return integer(d, where, key, min(FIRST_BYTE_MIN_MS, ceiling), 100, 3_600_000)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Nginx's side of kvgate, written into its config by ``kvgate render-nginx`` and ``kvgate up``."""

    route_headers: bool = flag(
        False,
        "X-Kvgate-Backend and X-Kvgate-Route on responses: which backend served, and why. They tell "
        "clients where each session lives (a demo's and a debugger's help, not the public's)",
    )
    decision_timeout_ms: int = whole(
        50, 1, 10_000, "the whole budget of one call to the sidecar, then Nginx routes on its own"
    )
    first_byte_timeout_ms: int = whole(
        60_000,
        100,
        3_600_000,
        "the ceiling of the wait for a response's first byte, per try (streams: also every later "
        "silence). Each try waits the sidecar's budget for the request (margin x the expected time "
        "to first token on that backend) between the floor and this ceiling; requests routed "
        "without the sidecar, and backends without a trusted prediction, get the ceiling",
    )
    first_byte_min_ms: int = custom(
        FIRST_BYTE_MIN_MS, _first_byte_floor, "the floor of that wait (at most the ceiling)"
    )
    first_byte_margin: float = number(4.0, 1.0, 100.0, "the margin over the expected time to first token")
    first_byte_stream_min_ms: int = whole(
        30_000,
        100,
        3_600_000,
        "a stream's try never waits less (at most the ceiling): vLLM sends a stream's headers at "
        "once, so past them the timeout only cuts the stream, and busy real vLLM servers left "
        "streams without a token for 5-7 s (docs/real-vllm.md). A stream cut there is worse than "
        "a slow one",
    )
    token_timeout_ms: int = whole(
        100, 0, 60_000, "JSON responses come whole: each requested token adds this much to the wait"
    )
    max_read_timeout_ms: int = whole(600_000, 100, 86_400_000, "the longest wait of any try")
    client_max_body_size: str = custom("16m", _body_size, "the largest request body, as Nginx writes sizes")
    max_engine_requests: int = whole(
        128,
        1,
        1_000_000,
        "the engine requests one request may ask for: its n completions of each of its prompts (a "
        "completions batch). vLLM runs each as a request of its own, and rate limits count each "
        "one's tokens; past this, a JSON 400 (128: OpenAI's bound on n)",
    )
    retry_statuses: tuple[int, ...] = custom(
        RETRY_STATUSES,
        _statuses,
        "a backend's answers with these statuses go to the next candidate before any byte reaches "
        "the client: a backend that fails every request is skipped, not served to clients until "
        "the outcome reports eject it (generation is stateless: a retry costs only its prefill)",
    )
    worker_user: str | None = custom(
        None,
        optional_text,
        "when Nginx starts as root, its workers run as this user (never root); none: nobody",
    )
    edge_access: str | None = custom(
        None,
        _lua_module,
        "drop-in: a Lua module of the edge whose access() kvgate's routes call first (a location's "
        "own access_by_lua replaces the server's, so the edge's Lua checks are chained explicitly)",
    )

    def check(self, where: str) -> None:
        if self.first_byte_min_ms > self.first_byte_timeout_ms:
            raise ConfigError(
                f"{where}.first_byte_min_ms ({self.first_byte_min_ms}) must not exceed "
                f"{where}.first_byte_timeout_ms"
            )
