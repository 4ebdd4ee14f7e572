"""In-process routing cores for unit tests: ``kvgate.sidecar.build_sidecar`` over backends that
never listen (or over simulated ones the test serves), their membership, models and load set by hand."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import redis.asyncio as aioredis
from kvgate.config import Config
from kvgate.features import Features, extract
from kvgate.load import Scraped
from kvgate.sidecar import Sidecar, build_sidecar

from tests.conftest import MODEL
from tests.helpers import chat

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def config(
    redis_url: str | None,
    backends: int = 3,
    base_port: int = 1,
    redis_extra: Mapping[str, Any] | None = None,
    **routing: Any,
) -> Config:
    """A sidecar's config over ``backends`` backends b0, b1, ... (on ``base_port`` and up), sessions
    under a prefix of their own in ``redis_url`` (None: process memory only)."""
    redis: dict[str, Any] = {
        "url": redis_url,
        "prefix": f"kvgate-{os.urandom(4).hex()}",
        "retry_after_ms": 50,
    }
    redis.update(redis_extra or {})
    return Config.from_mapping(
        {
            "listen": {"socket": "unused.sock", "http_port": 0, "admin_token": "t0ken"},
            "redis": redis,
            "scrape": {"interval_ms": 100, "timeout_ms": 80, "unhealthy_after": 2, "healthy_after": 2},
            "routing": routing,
            "backends": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{base_port + i}"} for i in range(backends)
            ],
        },
        {},
    )


def ready(cfg: Config, client: aioredis.Redis | None) -> Sidecar:
    """A routing core over ``cfg`` with every backend healthy, serving MODEL, load known and idle."""
    sc = build_sidecar(cfg, client)
    sc.registry.set_membership((b, False) for b in cfg.backends)
    for b in cfg.backends:
        sc.registry.set_models(b.id, frozenset({MODEL}))
        idle(sc, b.id)
    return sc


def core(labels: list[str] | None = None, n: int = 2, **sections: Any) -> Sidecar:
    """A routing core over ``len(labels)`` (else ``n``) idle backends b0, b1, ... serving MODEL, each
    in the pool its label names; sessions in process memory."""
    n = len(labels) if labels else n
    cfg = Config.from_mapping(
        {
            "redis": {"url": None},
            "routing": {"saturation_prefill_tokens": 1000},
            "backends": [
                {
                    "id": f"b{i}",
                    "url": f"http://127.0.0.1:{i + 1}",
                    "labels": {"pool": labels[i]} if labels else {},
                }
                for i in range(n)
            ],
            **sections,
        }
    )
    return ready(cfg, None)


def idle(sc: Sidecar, backend: str, waiting: float = 0.0) -> None:
    """``backend``'s scrape: nothing running, ``waiting`` queued, KV cache 10 % full."""
    sc.registry.scrape_ok(backend, Scraped(0, waiting, 0.1, None, None, time.monotonic()))
    sc.registry.changed()


def features(conversation: int, turns: int = 1, session: str | None = None) -> Features:
    """The features Nginx would send for turn ``turns`` of a chat (``tests.helpers.chat``)."""
    return extract(chat(conversation, turns), {"X-Session-ID": session} if session else None)
