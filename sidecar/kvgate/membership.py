"""Backend membership shared through Redis, so every sidecar routes over the same set of backends.

Redis holds a hash ``<prefix>:backends`` (id -> JSON spec with its drain flag) and a version counter
``<prefix>:backends:v``. Writers (admin API, config reload) update both; every sidecar polls the counter
each ``membership_refresh`` and reloads the hash when it moved, so replicas converge within one refresh
interval. Without Redis, the sidecar keeps the membership it has and applies local changes alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from kvgate.config import BackendSpec, ConfigError, MembershipConfig
from kvgate.metrics import SidecarMetrics
from kvgate.redis_client import REDIS_ERRORS, RedisClient
from kvgate.registry import Registry

logger = logging.getLogger(__name__)


def _address(spec: BackendSpec) -> tuple[str, int]:
    host, _, port = spec.address.rpartition(":")
    return host.lower(), int(port)


class AddressPolicy:
    """Which backend addresses (host and port) may be routed to (``MembershipConfig``): the
    ``allow`` rules, or without them exactly the config's backends; and the addresses this
    sidecar's own discovery resolved, which are as trusted as the config that names them."""

    def __init__(self, config: MembershipConfig, configured: Iterable[BackendSpec]) -> None:
        self.rules = config.allow
        self.configured = {_address(b) for b in configured}
        self.discovered: set[tuple[str, int]] = set()

    def describe(self) -> str:
        return "membership.allow" if self.rules else "the configured and discovered backends"

    def allows(self, spec: BackendSpec) -> bool:
        host, port = _address(spec)
        if (host, port) in self.discovered:
            return True
        if not self.rules:
            return (host, port) in self.configured
        return any(rule.admits(host, port) for rule in self.rules)


def _encode(spec: BackendSpec, draining: bool) -> str:
    return json.dumps(
        {
            "id": spec.id,
            "url": spec.url,
            "weight": spec.weight,
            "labels": dict(spec.labels),
            "kv_events": spec.kv_events,
            "kv_events_replay": spec.kv_events_replay,
            "draining": draining,
        },
        sort_keys=True,
    )


def _decode(raw: str | bytes) -> tuple[BackendSpec, bool]:
    data = json.loads(raw)
    draining = bool(data.pop("draining", False))
    return BackendSpec.from_mapping(data, "redis backend"), draining


class Membership:
    def __init__(
        self,
        client: RedisClient | None,
        prefix: str,
        registry: Registry,
        metrics: SidecarMetrics,
        policy: AddressPolicy | None = None,
        cluster: bool = False,
    ) -> None:
        self.policy = policy
        self.client = client
        # Written together in one MULTI: on a Redis Cluster both keys must hash to one slot (a tag).
        tag = f"{{{prefix}}}" if cluster else prefix
        self.hash_key = f"{tag}:backends"
        self.version_key = f"{tag}:backends:v"
        self.registry = registry
        self.metrics = metrics
        self.local: dict[str, tuple[BackendSpec, bool]] = {}
        self.version: int | None = None
        self.discovered: set[str] = set()  # ids found through DNS (kvgate.discovery), by any source
        self._found: dict[str, tuple[str, int]] = {}  # their addresses

    def _apply(self) -> None:
        self.registry.set_membership(self.local.values())

    async def seed(self, specs: Iterable[BackendSpec]) -> None:
        """Start from the config's backends, joining what other sidecars already registered."""
        for spec in specs:
            self.local.setdefault(spec.id, (spec, False))
        self._apply()
        if self.client is None:
            return
        try:
            added = 0
            for spec, draining in self.local.values():
                added += int(await self.client.hsetnx(self.hash_key, spec.id, _encode(spec, draining)))
            if added:
                await self.client.incr(self.version_key)
            await self.refresh()
        except REDIS_ERRORS as exc:
            self._failed("seed", exc)

    def _failed(self, op: str, exc: Exception) -> None:
        self.metrics.redis_errors.labels(f"membership_{op}").inc()
        logger.debug("membership %s failed: %s", op, exc)

    async def refresh(self) -> None:
        if self.client is None:
            return
        try:
            raw_version = await self.client.get(self.version_key)
            if raw_version is None and self.local:
                # Redis lost its data (a restart without persistence): publish what we route over
                # rather than adopt an empty membership.
                await self._publish()
                return
            version = int(raw_version or 0)
            if version == self.version:
                return
            entries = await self.client.hgetall(self.hash_key)
        except REDIS_ERRORS as exc:
            self._failed("refresh", exc)
            return
        fresh: dict[str, tuple[BackendSpec, bool]] = {}
        for raw in entries.values():
            try:
                spec, draining = _decode(raw)
            except (ValueError, ConfigError) as exc:
                logger.warning("ignoring a malformed backend entry in Redis: %s", exc)
                continue
            if not self.allowed(spec):
                logger.error(
                    "ignoring backend %s at %s from Redis: its address is not among %s",
                    spec.id,
                    spec.url,
                    self.policy.describe() if self.policy else "",
                )
                self.metrics.membership_rejected.inc()
                continue
            fresh[spec.id] = (spec, draining)
        self.local = fresh
        self.version = version
        self._apply()

    async def _publish(self) -> None:
        assert self.client is not None
        async with self.client.pipeline(transaction=True) as pipe:
            for spec, draining in self.local.values():
                pipe.hsetnx(self.hash_key, spec.id, _encode(spec, draining))
            pipe.incr(self.version_key)
            await pipe.execute()
        logger.warning("membership was missing from Redis; republished %d backend(s)", len(self.local))
        self.version = None  # adopt the merged view on the next refresh

    def allowed(self, spec: BackendSpec) -> bool:
        return self.policy is None or self.policy.allows(spec)

    async def put(self, spec: BackendSpec, draining: bool = False) -> None:
        self.local[spec.id] = (spec, draining)
        self._apply()
        await self._write(lambda p: p.hset(self.hash_key, spec.id, _encode(spec, draining)))

    async def remove(self, bid: str) -> bool:
        if self.local.pop(bid, None) is None:
            return False
        self._apply()
        await self._write(lambda p: p.hdel(self.hash_key, bid))
        return True

    async def sync(self, found: Iterable[BackendSpec], owned: set[str]) -> set[str]:
        """A discovery round: add the backends it found that are not members yet, remove those of
        ``owned`` (what this source found last time) that it no longer finds; returns the ids it
        now owns. Backends from the config or the admin API are never touched."""
        found_by_id = {s.id: s for s in found}
        self.discovered = (self.discovered - owned) | found_by_id.keys()
        self._found = {b: a for b, a in self._found.items() if b not in owned}
        self._found.update({b: _address(s) for b, s in found_by_id.items()})
        if self.policy is not None:  # what every discovery source found, trusted as the config is
            self.policy.discovered = set(self._found.values())
        for bid in sorted(owned - found_by_id.keys()):
            logger.warning("backend %s is gone from DNS: removed", bid)
            await self.remove(bid)
        for bid, spec in found_by_id.items():
            if bid not in self.local:
                logger.warning("backend %s found in DNS: added", bid)
                await self.put(spec)
        return set(found_by_id)

    async def replace(self, specs: Iterable[BackendSpec]) -> None:
        """Config reload: exactly these backends (and those found through DNS, which the discovery
        rounds own), keeping the drain flag of those that stay."""
        new = {s.id: (s, self.local.get(s.id, (s, False))[1]) for s in specs}
        for bid in self.discovered & self.local.keys():
            new.setdefault(bid, self.local[bid])
        gone = [b for b in self.local if b not in new]
        self.local = new
        self._apply()
        if self.client is None:
            return
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                if gone:
                    pipe.hdel(self.hash_key, *gone)
                for spec, draining in new.values():
                    pipe.hset(self.hash_key, spec.id, _encode(spec, draining))
                pipe.incr(self.version_key)
                await pipe.execute()
        except REDIS_ERRORS as exc:
            self._failed("replace", exc)

    async def _write(self, op: object) -> None:
        if self.client is None:
            return
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                op(pipe)  # type: ignore[operator]
                pipe.incr(self.version_key)
                results = await pipe.execute()
            self.version = int(results[-1])
        except REDIS_ERRORS as exc:
            self._failed("write", exc)
