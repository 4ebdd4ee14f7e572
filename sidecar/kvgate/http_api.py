"""The sidecar's loopback HTTP API: backends, models, health, metrics, admin and a body-level decide.

Admin routes need ``Authorization: Bearer <listen.admin_token>``; without a configured token they are
disabled (403), never open.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import hmac
import inspect
import os
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate import backend_view
from kvgate import features as feats
from kvgate.agreement import Agreement
from kvgate.config import BackendSpec, Config, ConfigError
from kvgate.membership import Membership
from kvgate.metrics import SidecarMetrics
from kvgate.registry import Registry
from kvgate.service import DecisionService, UnknownModel

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, typ: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": typ, "param": None, "code": status}}, status=status
    )


def _rss_kb() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None  # not Linux


class HttpApi:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        membership: Membership,
        service: DecisionService,
        metrics: SidecarMetrics,
        reload: Callable[[], Awaitable[None]],
        agreement: Agreement,
    ) -> None:
        self.agreement = agreement
        self.config = config
        self.registry = registry
        self.membership = membership
        self.service = service
        self.metrics = metrics
        self.reload = reload

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.prom)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/backends", self.backends)
        r.add_get("/peers", self.peers)
        r.add_post("/v1/decide", self.decide)
        r.add_post("/admin/backends", self._admin(self.add_backend))
        r.add_post("/admin/backends/{id}/drain", self._admin(self.drain))
        r.add_post("/admin/backends/{id}/undrain", self._admin(self.undrain))
        r.add_delete("/admin/backends/{id}", self._admin(self.remove_backend))
        r.add_post("/admin/reload", self._admin(self.admin_reload))
        r.add_get("/debug/decisions", self._admin(self.recent))
        r.add_get("/debug/memory", self._admin(self.memory))

    def public_routes(self, app: web.Application) -> None:
        """The routes of the non-loopback metrics listener (``listen.metrics_port``): read-only
        health and metrics, nothing that decides, reveals a client's data or changes state."""
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.prom)

    def _admin(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self.config.listen.admin_token
            if not token:
                return _error(
                    403,
                    "admin API disabled: set listen.admin_token or KVGATE_ADMIN_TOKEN",
                    "permission_error",
                )
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token", "authentication_error")
            return await handler(request)

        return guarded

    async def healthz(self, request: web.Request) -> web.Response:
        eligible = sum(1 for s in self.registry.backends.values() if s.eligible)
        config = self.agreement.state()
        body = {
            "status": "ok" if eligible and config != "mismatch" else "degraded",
            "eligible_backends": eligible,
            # Whether the Nginx in front was rendered from this config (unknown: none asked lately).
            "config": config,
            "config_fingerprint": self.agreement.fingerprint,
            # off: no Redis configured (one replica, sessions in memory), not a failure
            "redis": "off"
            if self.service.sessions.client is None
            else "ok"
            if self.service.sessions.redis_ok
            else "down",
            "pid": os.getpid(),  # lets a launcher tell its own sidecar from a foreign one on the port
        }
        return web.json_response(body, status=200)

    async def prom(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        for bid, s in self.registry.backends.items():
            load = self.registry.load_of(s, now, 0.0)
            self.metrics.backend_load.labels(bid).set(load.requests)
            self.metrics.backend_inflight.labels(bid).set(self.registry.ledger.counts.get(bid, 0))
            if s.scraped is not None:
                self.metrics.scrape_age.labels(bid).set(now - s.scraped.at)
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.registry.model_cards()})

    async def backends(self, request: web.Request) -> web.Response:
        described = backend_view.describe(self.registry, self.service, time.monotonic())
        return web.json_response({"backends": described, "peers_version": self.registry.peers_version})

    async def peers(self, request: web.Request) -> web.Response:
        version, peers = self.registry.peers()
        return web.json_response({"version": version, "peers": [p._asdict() for p in peers]})

    async def decide(self, request: web.Request) -> web.Response:
        """What would be decided for a whole request body (explain, tests): a dry run, which writes
        no binding and counts nothing, so this unauthenticated route cannot move any state."""
        try:
            data = await request.json()
        except ValueError:
            return _error(400, 'body must be JSON: {"body": {...}, "headers": {...}}')
        if not isinstance(data, dict) or not isinstance(data.get("body"), dict):
            return _error(400, 'body must be JSON: {"body": {...}, "headers": {...}}')
        headers = data.get("headers") if isinstance(data.get("headers"), dict) else {}
        f = feats.extract(data["body"], headers, self.config.routing.session_header)
        try:
            routed = await self.service.explain(f)
        except UnknownModel as exc:
            return _error(404, str(exc), "NotFoundError")
        d = routed.decision
        estimate = self.service.calibrated(f)
        rule = self.config.pools.pick(f.model, estimate.est_tokens)
        return web.json_response(
            {
                "decision_id": routed.decision_id,
                "policy": routed.policy.value,
                "candidates": [c._asdict() for c in routed.candidates],
                "reason": d.reason.value,
                "session": d.session.value,
                "rebind_cause": None if d.rebind_cause is None else d.rebind_cause.value,
                "route": routed.label,
                "key_source": f.key_source,
                "estimated_prompt_tokens": estimate.est_tokens,
                "bytes_per_token": estimate.bytes_per_token,
                "pool_rule": None if rule is None else dataclasses.asdict(rule),
                "pool": routed.pool,
                "priority": routed.priority,
                "disaggregated": bool(routed.prefill),
                "prefill_candidates": [c._asdict() for c in routed.prefill],
                "first_byte_timeout_ms": list(routed.first_byte_ms),
                "reuse_available": routed.reuse[0],  # prompt tokens held on the best eligible backend
                "reuse_captured": routed.reuse[1],  # ... on the chosen one, as the index says
            }
        )

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="body must be JSON") from None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text="body must be a JSON object")
        return data

    async def add_backend(self, request: web.Request) -> web.Response:
        try:
            spec = BackendSpec.from_mapping(await self._json_body(request), "backend")
        except ConfigError as exc:
            return _error(400, str(exc))
        if not self.membership.allowed(spec):
            return _error(
                400,
                f"backend address of {spec.url} is not in membership.allow (without it, only the "
                "configured and discovered backends' addresses are)",
                "invalid_request_error",
            )
        await self.membership.put(spec, False)
        return web.json_response({"added": spec.id}, status=201)

    async def _set_drain(self, request: web.Request, draining: bool) -> web.Response:
        bid = request.match_info["id"]
        entry = self.membership.local.get(bid)
        if entry is None:
            return _error(404, f"no backend {bid!r}")
        await self.membership.put(entry[0], draining)
        return web.json_response({"id": bid, "draining": draining})

    async def drain(self, request: web.Request) -> web.Response:
        return await self._set_drain(request, True)

    async def undrain(self, request: web.Request) -> web.Response:
        return await self._set_drain(request, False)

    async def remove_backend(self, request: web.Request) -> web.Response:
        bid = request.match_info["id"]
        if not await self.membership.remove(bid):
            return _error(404, f"no backend {bid!r}")
        return web.json_response({"removed": bid})

    async def admin_reload(self, request: web.Request) -> web.Response:
        try:
            await self.reload()
        except ConfigError as exc:
            return _error(400, f"reload failed, keeping the running config: {exc}")
        return web.json_response({"reloaded": True, "backends": sorted(self.registry.backends)})

    async def memory(self, request: web.Request) -> web.Response:
        """Resident memory, the fill of every bounded structure, and with ``?objects=1`` (a garbage
        collection, then a full heap walk: slow, for diagnosis only) the most numerous live object
        types and where suspended coroutines wait. With the sidecar
        started under ``PYTHONTRACEMALLOC``, the allocation sites holding the most memory."""
        body: dict[str, Any] = {"rss_kb": _rss_kb(), "structures": self.service.sizes()}
        if request.query.get("objects") == "1":
            # Collect first: uncollected cyclic garbage (closed connections, exceptions with their
            # tracebacks) would otherwise count as live objects.
            body["collected"] = gc.collect()
            # What imports left is frozen at startup (``app.serve``) and not listed: the objects
            # here are the ones made since, where a leak would show.
            body["frozen"] = gc.get_freeze_count()
            live = gc.get_objects()
            counts = collections.Counter(type(o).__name__ for o in live)
            body["objects"] = dict(counts.most_common(25))
            # Where suspended coroutines wait: a pile-up at one line is a stuck await.
            waits = collections.Counter(
                f"{o.cr_code.co_qualname} line {o.cr_frame.f_lineno}"
                for o in live
                if inspect.iscoroutine(o) and o.cr_frame is not None
            )
            body["coroutines"] = dict(waits.most_common(10))
        if tracemalloc.is_tracing():
            stats = tracemalloc.take_snapshot().statistics("lineno")[:25]
            body["allocations"] = [
                {"site": str(s.traceback), "kb": round(s.size / 1024, 1), "blocks": s.count} for s in stats
            ]
        return web.json_response(body)

    async def recent(self, request: web.Request) -> web.Response:
        """The last decisions, oldest first."""
        decisions = [
            {
                "id": r.decision_id,
                "policy": r.policy.value,
                "route": r.decision.label,
                "candidates": list(r.decision.candidates),
                "model": f.model,
                "key": f.key,
                "key_source": f.key_source,
                "hashes": list(f.hashes[:64]),
                "chunks": len(f.hashes),
                "prompt_bytes": f.prompt_bytes,
                "reuse_available": r.reuse[0],  # prompt tokens held on the best eligible backend
                "reuse_captured": r.reuse[1],  # ... on the chosen one, as the index said
                "predicted_ttft_s": r.predicted_ttft_s,  # expected seconds to the first byte
            }
            for r, f in self.service.recent
        ]
        return web.json_response({"decisions": decisions})
