"""Nginx's side of kvgate, written into its config by `kvgate render-nginx` and `kvgate up`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.config.parse import ConfigError, check_keys, integer, num

# The statuses Nginx's proxy_next_upstream can retry on (http_403 ... http_504).
RETRYABLE = frozenset({403, 404, 429, 500, 502, 503, 504})
RETRY_STATUSES = (429, 500, 502, 503, 504)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Nginx's side of kvgate, written into its config by ``kvgate render-nginx`` and ``kvgate up``."""

    # X-Kvgate-Backend and X-Kvgate-Route: which backend served, and why. Off by default: they tell
    # clients where each session lives (useful in a demo and for debugging, not for the public).
    route_headers: bool = False
    decision_timeout_ms: int = 50  # the whole budget of one call to the sidecar, then fail-open
    # The wait for a response's first byte, per try (streams: also every later silence; see
    # lua/kvgate/conf.lua): the sidecar's budget for the request (``kvgate.first_byte``), margin x
    # the expected time to first token on that backend, between the floor and this ceiling. Fail-open
    # requests and backends without a trusted prediction get the ceiling.
    first_byte_timeout_ms: int = 60_000
    first_byte_min_ms: int = 5_000  # (at most the ceiling)
    first_byte_margin: float = 4.0
    # A stream's try never waits less than this (at most the ceiling): vLLM sends a stream's headers
    # at once, so past them the timeout no longer moves the request on, it only cuts the stream: on
    # busy real vLLM servers streams had their headers and no token within a 5-7 s budget
    # (docs/real-vllm.md). A stream cut there is worse than a slow one.
    first_byte_stream_min_ms: int = 30_000
    token_timeout_ms: int = 100  # JSON responses come whole: each requested token adds this much
    max_read_timeout_ms: int = 600_000
    client_max_body_size: str = "16m"
    # A backend's answers with these statuses go to the next candidate, before any byte reaches the
    # client: a backend that fails every request (500) is skipped, not served to clients until the
    # outcome reports eject it. Generation is stateless, so a retried request costs only its prefill.
    retry_statuses: tuple[int, ...] = RETRY_STATUSES
    # When Nginx starts as root, its workers run as this user (and the socket group's members): never
    # root. None: nobody.
    worker_user: str | None = None
    # A Lua module of the edge's whose access() kvgate's routes call first (drop-in: a location's own
    # access_by_lua replaces the server's, so the edge's Lua checks must be chained explicitly).
    edge_access: str | None = None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> GatewayConfig:
        w = "gateway"
        check_keys(
            d,
            w,
            {
                "route_headers",
                "decision_timeout_ms",
                "first_byte_timeout_ms",
                "first_byte_min_ms",
                "first_byte_margin",
                "first_byte_stream_min_ms",
                "token_timeout_ms",
                "max_read_timeout_ms",
                "client_max_body_size",
                "retry_statuses",
                "worker_user",
                "edge_access",
            },
        )
        headers = d.get("route_headers", False)
        if not isinstance(headers, bool):
            raise ConfigError(f"{w}.route_headers: expected true or false, got {headers!r}")
        size = str(d.get("client_max_body_size", "16m"))
        if not re.fullmatch(r"[0-9]+[kKmMgG]?", size):
            raise ConfigError(f"{w}.client_max_body_size: {size!r} is not an Nginx size like 16m or 512k")
        statuses = d.get("retry_statuses", list(RETRY_STATUSES))
        if not isinstance(statuses, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v in RETRYABLE for v in statuses
        ):
            raise ConfigError(
                f"{w}.retry_statuses: expected a list of statuses among {sorted(RETRYABLE)}, got {statuses!r}"
            )
        user = d.get("worker_user")
        edge = d.get("edge_access")
        if edge is not None and not (
            isinstance(edge, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", edge)
        ):
            raise ConfigError(f"{w}.edge_access: expected a Lua module name like edge.auth, got {edge!r}")
        first_byte = integer(d, w, "first_byte_timeout_ms", 60_000, 100, 3_600_000)
        floor = integer(d, w, "first_byte_min_ms", min(5_000, first_byte), 100, 3_600_000)
        if floor > first_byte:
            raise ConfigError(f"{w}.first_byte_min_ms ({floor}) must not exceed {w}.first_byte_timeout_ms")
        return cls(
            route_headers=headers,
            decision_timeout_ms=integer(d, w, "decision_timeout_ms", 50, 1, 10_000),
            first_byte_timeout_ms=first_byte,
            first_byte_min_ms=floor,
            first_byte_margin=num(d, w, "first_byte_margin", 4.0, 1.0, 100.0),
            # Nginx clamps it to the ceiling where it computes each try's timeout (access.lua).
            first_byte_stream_min_ms=integer(d, w, "first_byte_stream_min_ms", 30_000, 100, 3_600_000),
            token_timeout_ms=integer(d, w, "token_timeout_ms", 100, 0, 60_000),
            max_read_timeout_ms=integer(d, w, "max_read_timeout_ms", 600_000, 100, 86_400_000),
            client_max_body_size=size,
            retry_statuses=tuple(sorted(set(statuses))),
            worker_user=None if user is None else str(user),
            edge_access=edge,
        )
