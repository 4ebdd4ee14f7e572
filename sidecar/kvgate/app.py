"""The sidecar application: wires config, Redis, the registry, the control loops and both APIs.

One cleanup context per resource (aiohttp docs): each is set up before ``yield`` and torn down after,
so teardown runs exactly for what was set up.

Over 300 lines: one cleanup context per resource and one control loop per job, each short;
they share the app's one ``Sidecar``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.config import Config
from kvgate.decision_socket import DecisionServer
from kvgate.discovery import discover_once, discovery_loop
from kvgate.http_api import HttpApi
from kvgate.kv_subscriber import KvSubscriber
from kvgate.limits import RateLimiter
from kvgate.looplag import lag_loop
from kvgate.membership import AddressPolicy, Membership
from kvgate.metrics import SidecarMetrics
from kvgate.redis_client import RedisClient, connect, is_cluster
from kvgate.registry import Registry
from kvgate.replicas import join, replica_id, replicas_loop
from kvgate.scraper import LoadUnknown, Unhealthy, scrape, served_models
from kvgate.service import DecisionService
from kvgate.shared_load import share_loop
from kvgate.sidecar import build_sidecar
from kvgate.tokenize import TokenSource
from kvgate.tokens import TokenEstimator

logger = logging.getLogger(__name__)
MODELS_EVERY = 20  # scrape rounds between /v1/models refreshes
DRAIN_QUIET_S = 1.0  # SIGTERM: stop once no decision connection has been open this long
# Stopping, an HTTP request still in progress gets this long (aiohttp's own default is 60 s, and
# the decision socket keeps serving until the HTTP side has stopped), and so does each background
# task to end once cancelled. A fault test sent SIGINT ("stop at once") and the sidecar was still
# deciding half a minute later, with its HTTP port closed.
STOP_GRACE_S = 2.0

REDIS: web.AppKey[RedisClient] = web.AppKey("redis")
SERVICE = web.AppKey("service", DecisionService)
REGISTRY = web.AppKey("registry", Registry)
MEMBERSHIP = web.AppKey("membership", Membership)
RELOAD: web.AppKey[Callable[[], Awaitable[None]]] = web.AppKey("reload")
METRICS_APP = web.AppKey("metrics_app", web.Application)  # served on listen.metrics_port when set
DECISIONS = web.AppKey("decisions", DecisionServer)  # the decision socket's server, once listening


async def _scrape_round(
    registry: Registry,
    session: aiohttp.ClientSession,
    config: Config,
    n: int,
    metrics: SidecarMetrics,
    tokens: TokenEstimator | None = None,
) -> None:
    sc = config.scrape

    async def one(bid: str, url: str, mode: str, want_models: bool) -> None:
        t0 = time.perf_counter()
        try:
            scraped = await scrape(session, url, sc.timeout_s, mode)
        except Unhealthy as exc:
            registry.failure(bid, str(exc), exc.timeout)
            return
        except LoadUnknown as exc:  # healthy, its load a missing signal
            registry.load_unknown(bid, str(exc))
            return
        finally:
            metrics.scrape_latency.observe(time.perf_counter() - t0)
        registry.scrape_ok(bid, scraped)
        if tokens is not None:
            tokens.counted(
                bid, scraped.prompt_tokens, registry.replicas, registry.ledger.unreported.get(bid, 0)
            )
        if want_models:
            try:
                cards = await served_models(session, url, sc.timeout_s)
                registry.set_models(bid, frozenset(cards), cards)
            except LoadUnknown as exc:  # tried again next round; until then it serves what it served
                registry.note_error(bid, str(exc))

    jobs = [
        one(bid, s.spec.url, s.spec.metrics, n % MODELS_EVERY == 0 or not s.models)
        for bid, s in list(registry.backends.items())
    ]
    await asyncio.gather(*jobs)
    registry.ledger.expire(time.monotonic())
    registry.tick(time.monotonic())
    registry.changed()  # new load figures: decisions rebuild their snapshot once


async def scrape_loop(
    registry: Registry,
    session: aiohttp.ClientSession,
    config: Config,
    metrics: SidecarMetrics,
    service: DecisionService,
) -> None:
    n = 0
    while True:
        started = time.monotonic()
        await _scrape_round(registry, session, config, n, metrics, service.tokens)
        service.kick()  # new load figures may have made room for waiting requests
        n += 1
        await asyncio.sleep(max(0.0, config.scrape.interval_s - (time.monotonic() - started)))


async def limits_loop(limiter: RateLimiter, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await limiter.sync(time.time())  # wall time: replicas must agree on the minute windows


async def membership_loop(membership: Membership, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await membership.refresh()


def create_app(config: Config, config_path: str | Path | None = None) -> web.Application:
    app = web.Application()
    client = connect(config.redis)
    core = build_sidecar(config, client)
    metrics, registry, sessions, service = core.metrics, core.registry, core.sessions, core.service
    policy = AddressPolicy(config.membership, config.backends)
    membership = Membership(
        client, config.redis.prefix, registry, metrics, policy, cluster=is_cluster(config.redis)
    )
    app[SERVICE] = service
    app[REGISTRY] = registry
    app[MEMBERSHIP] = membership

    async def reload() -> None:
        if config_path is None:
            return
        fresh = Config.from_file(config_path)
        await membership.replace(fresh.backends)
        logger.warning("reloaded %d backend(s) from %s", len(fresh.backends), config_path)

    api = HttpApi(config, registry, membership, service, metrics, reload, core.agreement)
    api.routes(app)
    app[RELOAD] = reload
    app[METRICS_APP] = web.Application()
    api.public_routes(app[METRICS_APP])

    async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        if client is not None:
            await client.aclose()

    async def control_ctx(app: web.Application) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=30))
        await membership.seed(config.backends)
        await sessions.warm()  # the pipelines' connections, before a burst has to open them
        # Discovered backends join before the first scrape, so a DNS-only fleet serves from the start.
        owned = [await discover_once(d, membership, set()) for d in config.discovery]
        # One round before serving, so the first decisions see health, load and models.
        await _scrape_round(registry, session, config, 0, metrics, service.tokens)
        tasks = [
            asyncio.create_task(scrape_loop(registry, session, config, metrics, service), name="scrape"),
            asyncio.create_task(
                membership_loop(membership, config.scrape.membership_refresh_s), name="membership"
            ),
            asyncio.create_task(sessions.refresh_loop(), name="session-ttls"),
            asyncio.create_task(lag_loop(metrics.loop_lag), name="loop-lag"),
        ]
        for d, ids in zip(config.discovery, owned, strict=True):
            tasks.append(asyncio.create_task(discovery_loop(d, membership, initial=ids), name=f"dns {d.dns}"))
        if service.queue is not None:
            tasks.append(asyncio.create_task(service.dispatch_loop(), name="gateway-queue"))
        if client is not None:
            me = replica_id()
            await join(client, config.redis.prefix, me)
            tasks.append(
                asyncio.create_task(
                    replicas_loop(client, config.redis.prefix, me, registry, sessions), name="replicas"
                )
            )
            if config.redis.load_share_s > 0:
                registry.shared.me = me
                loop = share_loop(
                    client, config.redis.prefix, registry.shared, registry.ledger, config.redis.load_share_s
                )
                tasks.append(asyncio.create_task(loop, name="load-share"))
        service.tokenizer = TokenSource(config.kv_index, registry, metrics, session)
        subscriber = KvSubscriber(core.exact, metrics, config.kv_index.replay_timeout_s, registry)
        tasks.append(asyncio.create_task(subscriber.run(), name="kv-events"))
        if core.service.limiter is not None:
            tasks.append(
                asyncio.create_task(limits_loop(core.service.limiter, config.limits.sync_s), name="limits")
            )
        yield
        for t in tasks:
            t.cancel()
        # A task caught in a call that does not give way to its cancellation must not hold the exit.
        _, stuck = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for t in stuck:
            logger.warning(
                "stopping: task %s did not end within %.0fs; left behind", t.get_name(), STOP_GRACE_S
            )
        await session.close()

    async def socket_ctx(app: web.Application) -> AsyncIterator[None]:
        server = DecisionServer(service, registry, core.agreement)
        Path(config.listen.socket).parent.mkdir(parents=True, exist_ok=True)
        await server.start(config.listen.socket, config.listen.socket_group)
        app[DECISIONS] = server
        yield
        await server.stop()

    app.cleanup_ctx.extend([redis_ctx, control_ctx, socket_ctx])
    return app


async def serve(config: Config, config_path: str | Path | None = None) -> None:
    """Run the sidecar until SIGINT/SIGTERM; SIGHUP reloads backends from the config file."""
    import signal

    # A full collection walks every tracked object, and the ~50,000 that imports leave (modules,
    # classes, functions, which live as long as the process) cost ~30 ms per full collection on a
    # small core: more than half of Nginx's 50 ms decision budget, paid by whichever decision is
    # waiting. Frozen, they are never walked again; what the sidecar makes from here on is collected
    # as usual. Before the app exists, so no request, task or connection is ever frozen.
    gc.collect()
    gc.freeze()
    app = create_app(config, config_path)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=STOP_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, config.listen.http_host, config.listen.http_port)
    await site.start()
    logger.warning(
        "kvgate sidecar: decisions on unix:%s, HTTP on %s:%d",
        config.listen.socket,
        config.listen.http_host,
        config.listen.http_port,
    )
    runners = [runner]
    if config.listen.metrics_port is not None:
        public = web.AppRunner(app[METRICS_APP], access_log=None, shutdown_timeout=STOP_GRACE_S)
        await public.setup()
        await web.TCPSite(public, config.listen.metrics_host, config.listen.metrics_port).start()
        runners.append(public)
        logger.warning(
            "kvgate sidecar: metrics on %s:%d", config.listen.metrics_host, config.listen.metrics_port
        )
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, drain.set)
    reloads: set[asyncio.Task[None]] = set()

    def on_hup() -> None:
        task = asyncio.create_task(_safe_reload(app))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    try:
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(drain.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if drain.is_set() and not stop.is_set():
            await _drain(app[DECISIONS], config.listen.drain_s, stop)
        for t in waits:
            t.cancel()
    finally:
        for r in reversed(runners):
            await r.cleanup()


async def _drain(server: DecisionServer, limit_s: float, stop: asyncio.Event) -> None:
    """SIGTERM: the Nginx in front may still be finishing its streams and deciding for requests that
    arrive until it is gone (Kubernetes stops the pod's containers together; Nginx drains for its
    own grace period). Keep serving until no connection to the decision socket has been open for
    ``DRAIN_QUIET_S`` (Nginx has exited), at most ``limit_s``; SIGINT ends it at once."""
    logger.warning("SIGTERM: serving decisions until the gateway has gone (at most %.0fs)", limit_s)
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and not stop.is_set():
        if server.connections:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= DRAIN_QUIET_S:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
    logger.warning("drained: stopping")


async def _safe_reload(app: web.Application) -> None:
    from kvgate.config import ConfigError

    try:
        await app[RELOAD]()
    except ConfigError as exc:
        logger.error("reload failed, keeping the running config: %s", exc)
