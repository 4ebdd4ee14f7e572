"""Backends from DNS: a name resolved every ``interval``, each address one backend.

In Kubernetes a headless Service resolves to the addresses of its ready pods, so vLLM pods that
start, pass their readiness probe, or go away join and leave the ring without a config change.
Resolution runs in the event loop's resolver threads (``getaddrinfo``), under its own timeout; a
failed lookup keeps the backends found last (a DNS hiccup must not empty the fleet).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from kvgate.config import DiscoverySpec
from kvgate.membership import Membership

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(name: str, port: int) -> list[str]:
    """The distinct addresses ``name`` resolves to (IPv4 and IPv6), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def discover_once(
    spec: DiscoverySpec, membership: Membership, owned: set[str], resolver: Resolver = resolve
) -> set[str]:
    """One round; returns the ids this name now owns (unchanged when the lookup failed)."""
    try:
        addresses = await asyncio.wait_for(resolver(spec.dns, spec.port), spec.timeout_s)
    except (OSError, TimeoutError) as exc:
        logger.warning(
            "discovery: resolving %s failed (%s); keeping %d backend(s)", spec.dns, exc, len(owned)
        )
        return owned
    return await membership.sync([spec.spec(a) for a in addresses], owned)


async def discovery_loop(
    spec: DiscoverySpec, membership: Membership, initial: set[str], resolver: Resolver = resolve
) -> None:
    owned = initial
    while True:
        await asyncio.sleep(spec.interval_s)
        owned = await discover_once(spec, membership, owned, resolver)
