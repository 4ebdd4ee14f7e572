"""A simulated vLLM server's state and lifecycle, and the routes that generate nothing: the model
list, health, version, load, metrics, the tokenizer, the prefix-cache reset, the simulator's own
facts and its fault injection. ``vllm_sim.server.Instance`` adds the routes that generate."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vllm_sim import apis, protocol, tokenizer
from vllm_sim.engine import Engine
from vllm_sim.faults import Faults
from vllm_sim.kv_publisher import KvPublisher
from vllm_sim.metrics import CONTENT_TYPE, InstanceMetrics
from vllm_sim.realtime import EngineLoop
from vllm_sim.request import EngineConfig

logger = logging.getLogger(__name__)
VLLM_VERSION = "0.11.0"


# uvicorn's timeout_keep_alive, which vLLM sets from VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5 s): an
# idle client connection is closed after this long, and a gateway's connection pool must cope.
KEEP_ALIVE_S = 5.0


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    model: str
    engine: EngineConfig
    time_scale: float = 1.0
    faults: Faults = field(default_factory=Faults)
    keep_alive_s: float = KEEP_ALIVE_S
    # Disaggregation (vLLM with a KV connector): "prefill" serves prefill legs (do_remote_decode),
    # "decode" decode legs (do_remote_prefill), "both" either; every role serves plain requests.
    role: str = "both"
    # KV-cache transfer speed from a prefiller, in prompt tokens per second (Llama-3.1-8B holds
    # 128 KiB of KV per token: 200,000 tokens/s is ~26 GB/s, an RDMA link at 200 Gb/s).
    kv_transfer_tokens_per_s: float = 200_000.0
    # KV-cache events (vLLM's --kv-events-config): the publisher's port, its replay port, and the
    # encoding ("map": vLLM 0.32's type-tagged events; "array": older vLLM's positional ones).
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_encoding: str = "map"


ROLES = ("both", "prefill", "decode")


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, separators=(",", ":")))


def error_response(exc: protocol.ApiError) -> web.Response:
    return json_response(exc.body(), exc.status)


class ServerBase:
    """One simulated vLLM server's state, lifecycle and informational routes."""

    def __init__(self, config: InstanceConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine)
        self.faults = config.faults
        self.rng = random.Random(config.engine.seed)
        self.loop: EngineLoop | None = None
        self.metrics = InstanceMetrics(self.engine, config.model, self._lag)
        self.created = int(time.time())
        self.site: web.TCPSite | None = None
        self.runner: web.AppRunner | None = None
        self._reopen: asyncio.Task[None] | None = None
        self._refusing = False
        # Connections that carried requests, to check a client's keep-alive reuse (GET /sim/info).
        self._seen: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()
        self.connections = 0
        self.in_frontend = 0  # completion requests accepted and not yet in the engine (tokenizing)
        # Requests by the priority their body carried (/sim/info): what a gateway forwarded.
        self.priorities: collections.Counter[int] = collections.Counter()
        self.responses_store = apis.ResponseStore()
        self.engine_id = uuid.uuid4().hex  # names this instance's KV blocks to decoders
        self.address = ("127.0.0.1", 0)
        self.kv_publisher: KvPublisher | None = None

    def _lag(self) -> tuple[float, float, float]:
        if self.loop is None:
            return 0.0, 0.0, 0.0
        return self.loop.step_lag(), self.loop.total_lag_s, self.loop.total_step_s

    async def _engine_ctx(self, app: web.Application) -> AsyncIterator[None]:
        cfg = self.config
        publish = None
        if cfg.kv_events_port is not None:
            self.kv_publisher = KvPublisher(
                self.address[0],
                cfg.kv_events_port,
                cfg.kv_events_replay_port,
                encoding=cfg.kv_events_encoding,
            )
            self.kv_publisher.start()
            self.engine.pool.take_events()  # from now on the pool records its events
            pool, publisher = self.engine.pool, self.kv_publisher

            def publish() -> None:
                publisher.publish(pool.take_events())

        self.loop = EngineLoop(self.engine, cfg.time_scale, publish)
        task = asyncio.create_task(self.loop.run(), name=f"engine-{cfg.model}")
        yield
        task.cancel()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        if self._reopen:
            self._reopen.cancel()

    async def start(self, host: str, port: int) -> None:
        self.address = (host, port)  # the KV-event publisher binds on this host while the app starts
        self.runner = web.AppRunner(
            self.app(),
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=self.config.keep_alive_s,
        )
        await self.runner.setup()
        await self._listen(host, port)

    async def _listen(self, host: str, port: int) -> None:
        assert self.runner is not None
        self.address = (host, port)
        self.site = web.TCPSite(self.runner, host, port, reuse_address=True)
        await self.site.start()

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    async def _apply_request_faults(self) -> None:
        f = self.faults
        if f.hang:
            await asyncio.Event().wait()  # until the client gives up (handler cancellation)
        if f.latency_ms:
            await asyncio.sleep(f.latency_ms / 1000.0)

    async def _read_json(self, request: web.Request) -> Any:
        ctype = request.headers.get("Content-Type", "")
        if "application/json" not in ctype:
            raise protocol.ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        return protocol.parse_json(await request.read())

    async def models(self, request: web.Request) -> web.Response:
        m = self.config.model
        card = {
            "id": m,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": m,
            "parent": None,
            "max_model_len": self.config.engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{m}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.hang:
            await asyncio.Event().wait()
        if self.faults.health_delay_ms:
            await asyncio.sleep(self.faults.health_delay_ms / 1000.0)
        return web.Response(status=503 if self.faults.unhealthy else 200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return json_response({"server_load": 0})  # vLLM leaves it 0 without --enable-server-load-tracking

    async def prom(self, request: web.Request) -> web.Response:
        mode = self.faults.metrics
        if mode == "slow":
            await asyncio.sleep(self.faults.metrics_delay_ms / 1000.0)
        if mode == "garbage":
            return web.Response(body=b"\x00\xffnot{prometheus text\n", content_type="text/plain")
        if mode == "empty":
            return web.Response(body=b"", headers={"Content-Type": CONTENT_TYPE})
        if mode == "absent":  # a server that has no metrics at all (SGLang without --enable-metrics)
            raise web.HTTPNotFound()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        protocol.require_object(body)
        if "messages" in body:
            text = tokenizer.render_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise protocol.ApiError(400, "prompt (a string) or messages is required", "prompt")
        ids = tokenizer.encode(text)
        strs = text.split() if body.get("return_token_strs") else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.config.engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        raise protocol.ApiError(501, "The simulator's token ids are hashes and cannot be detokenized.")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.pool.reset_prefix_cache()
        if self.kv_publisher is not None:  # no step may follow: AllBlocksCleared goes out now
            self.kv_publisher.publish(self.engine.pool.take_events())
        return web.Response(status=200 if ok else 400)

    async def info(self, request: web.Request) -> web.Response:
        """Simulator-only facts for tests and benchmarks: the TCP connections clients opened so far,
        the requests in the frontend (accepted, not yet in the engine), the prefill backlog and the
        chat and completion requests by the priority their body carried."""
        running, waiting = self.engine.prefill_backlog()
        in_step = self.loop.step_prefill_tokens if self.loop is not None else 0
        return json_response(
            {
                "connections": self.connections,
                "frontend": self.in_frontend,
                "running": self.engine.num_running,
                "waiting": self.engine.num_waiting,
                # prompt tokens still to prefill before their first token reaches the client: of
                # the running requests (the step in progress included), and of the waiting ones
                "prefill_backlog_running": running + in_step,
                "prefill_backlog_waiting": waiting,
                "priorities": {str(p): n for p, n in sorted(self.priorities.items())},
            }
        )

    # -- fault injection ----------------------------------------------------------------------------
    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.to_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise protocol.ApiError(400, "faults must be a JSON object")
        try:
            faults = Faults.from_mapping(body, self.faults)
        except (ValueError, TypeError) as exc:
            raise protocol.ApiError(400, str(exc)) from None
        self.faults = faults
        if faults.refuse_for_s > 0:
            self._reopen = asyncio.create_task(self._refuse(faults.refuse_for_s))
            self.faults = Faults.from_mapping({"refuse_for_s": 0.0}, faults)
        return json_response(self.faults.to_dict())

    async def clear_faults(self, request: web.Request) -> web.Response:
        self.faults = Faults()
        return json_response(self.faults.to_dict())

    async def _refuse(self, seconds: float) -> None:
        site = self.site
        if site is None:
            return
        host, port = site._host, site._port  # the address this instance was started on
        await asyncio.sleep(0.05)  # let the admin response leave first
        self._refusing = True
        await site.stop()
        await asyncio.sleep(seconds)
        assert host is not None
        self._refusing = False
        await self._listen(host, port)

    def app(self) -> web.Application:
        raise NotImplementedError  # the route table: vllm_sim.server.Instance
