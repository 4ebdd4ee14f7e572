"""HTTP front end of one simulated vLLM instance (aiohttp), with vLLM 0.11's routes and shapes."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vllm_sim import apis, protocol, tokenizer
from vllm_sim.engine import Engine
from vllm_sim.faults import Faults
from vllm_sim.metrics import CONTENT_TYPE, InstanceMetrics
from vllm_sim.realtime import INTERNAL_ERROR, EngineLoop
from vllm_sim.request import EngineConfig, Request, SchedulingPolicy, TokenEvent

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


ROLES = ("both", "prefill", "decode")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, separators=(",", ":")))


def _error(exc: protocol.ApiError) -> web.Response:
    return _json(exc.body(), exc.status)


class Instance:
    """One simulated vLLM server: an engine, its real-time loop, metrics, faults and routes."""

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
        self.responses_store = apis.ResponseStore()
        self.engine_id = uuid.uuid4().hex  # names this instance's KV blocks to decoders
        self.address = ("127.0.0.1", 0)

    def _lag(self) -> tuple[float, float, float]:
        if self.loop is None:
            return 0.0, 0.0, 0.0
        return self.loop.step_lag(), self.loop.total_lag_s, self.loop.total_step_s

    # -- lifecycle --------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors])
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/load", self.load)
        r.add_get("/metrics", self.prom)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        r.add_post("/v1/completions/render", self.render_completion)
        r.add_post("/v1/responses", self.responses)
        r.add_get("/v1/responses/{response_id}", self.get_response)
        r.add_post("/v1/embeddings", self.embeddings)
        for path in ("/score", "/v1/score"):
            r.add_post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, self.rerank)
        r.add_post("/v1/audio/transcriptions", self.transcriptions)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/sim/info", self.info)
        r.add_get("/sim/faults", self.get_faults)
        r.add_post("/sim/faults", self.set_faults)
        r.add_delete("/sim/faults", self.clear_faults)
        app.cleanup_ctx.append(self._engine_ctx)
        return app

    async def _engine_ctx(self, app: web.Application) -> AsyncIterator[None]:
        self.loop = EngineLoop(self.engine, self.config.time_scale)
        task = asyncio.create_task(self.loop.run(), name=f"engine-{self.config.model}")
        yield
        task.cancel()
        if self._reopen:
            self._reopen.cancel()

    async def start(self, host: str, port: int) -> None:
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

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self._refusing and request.transport is not None:
            # A dead server also drops the keep-alive connections it already had.
            request.transport.abort()
            return web.Response(status=503)
        if request.transport is not None and request.transport not in self._seen:
            self._seen.add(request.transport)
            self.connections += 1
        # vLLM never answers with a stack trace: unexpected failures become a 500 envelope.
        try:
            return await handler(request)
        except protocol.ApiError as exc:
            return _error(exc)
        except web.HTTPException as exc:
            if exc.status == 404:
                return _json({"detail": "Not Found"}, 404)
            if exc.status == 405:
                return _json({"detail": "Method Not Allowed"}, 405)
            raise
        except ConnectionResetError:
            # The client went away under a response being written: a write found the transport
            # closed before aiohttp's handler cancellation arrived (two writes in one step, the
            # first of which failed). That is the client's abort, as vLLM treats a disconnect, not
            # a server error for aiohttp to log with a traceback.
            raise asyncio.CancelledError from None
        except Exception:
            logger.exception("internal error")
            return _error(protocol.ApiError(500, "Internal server error"))

    async def _apply_request_faults(self) -> None:
        f = self.faults
        if f.hang:
            await asyncio.Event().wait()  # until the client gives up (handler cancellation)
        if f.latency_ms:
            await asyncio.sleep(f.latency_ms / 1000.0)

    # -- OpenAI API -------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _read_json(self, request: web.Request) -> Any:
        ctype = request.headers.get("Content-Type", "")
        if "application/json" not in ctype:
            raise protocol.ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        raw = await request.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise protocol.ApiError(400, f"JSON decode error: {exc}") from None

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        await self._apply_request_faults()
        body = await self._read_json(request)
        cfg = self.config.engine
        parsed = protocol.parse_request(
            kind, body, self.config.model, cfg.max_model_len, cfg.policy is SchedulingPolicy.PRIORITY
        )
        f = self.faults
        if f.fail_rate and self.rng.random() < f.fail_rate:
            raise protocol.ApiError(f.fail_status, "Injected failure")
        kv = parsed.kv_transfer
        remote_tokens = self._check_kv_transfer(kv, len(parsed.prompt_ids))
        assert self.loop is not None
        loop = self.loop
        arrival = loop.sim_now()
        # Frontend work (API, tokenization) happens before the engine sees the request; a decode leg
        # then waits while the prefiller's KV blocks are read (vLLM: WAITING_FOR_REMOTE_KVS).
        transfer_s = remote_tokens / self.config.kv_transfer_tokens_per_s
        self.in_frontend += 1
        try:
            await asyncio.sleep(loop.to_wall(cfg.profile.frontend_s + transfer_s))
        finally:
            self.in_frontend -= 1
        req = Request(
            request_id=parsed.request_id,
            prompt_ids=parsed.prompt_ids,
            max_tokens=parsed.max_tokens,
            arrival=arrival,
            ignore_eos=parsed.ignore_eos,
            priority=parsed.priority,
            cache_salt=parsed.cache_salt,
            remote_tokens=remote_tokens,
        )
        queue = loop.submit(req)
        builder = protocol.ResponseBuilder(parsed)
        try:
            if parsed.stream:
                return await self._stream(request, req, queue, builder)
            return await self._collect(req, queue, builder)
        finally:
            if req.finish_reason is None:
                loop.abort(req.request_id)

    def _check_kv_transfer(self, kv: protocol.KvTransfer | None, prompt_len: int) -> int:
        """Whether this instance's role takes this leg; the prompt tokens whose KV arrives remotely."""
        if kv is None:
            return 0
        role = self.config.role
        if kv.remote_decode and role == "decode":
            raise protocol.ApiError(
                400, "This is a decode instance: it does not prefill for a remote decoder."
            )
        if kv.remote_prefill and role == "prefill":
            raise protocol.ApiError(400, "This is a prefill instance: it does not decode a remote prefill.")
        if not kv.remote_prefill:
            return 0
        held = kv.remote_num_tokens
        if held is None:  # older prefillers name only their blocks
            held = kv.remote_blocks * self.engine.block_size
        return min(held, prompt_len)

    def _kv_transfer_params(self, req: Request) -> dict[str, Any]:
        """What vLLM's NixlConnector returns when a prefill leg finishes: where the decoder reads the
        prompt's KV blocks (pinned here until read, or until the abort timeout)."""
        host, port = self.address
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(1, req.prompt_len // self.engine.block_size + 1)),
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "remote_request_id": req.request_id,
            "remote_num_tokens": req.prompt_len,
        }

    # -- vLLM's other routes (shapes in vllm_sim.apis) -----------------------------------------------
    async def _run(
        self, prompt_ids: list[int], max_tokens: int, request_id: str, ignore_eos: bool = True
    ) -> tuple[Request, list[str], str]:
        """Run one prompt through the engine as a non-streaming request: the request, its words and
        its finish reason. Pooling routes (embeddings, score, rerank) run a prefill and one step."""
        await self._apply_request_faults()
        if not prompt_ids:
            raise protocol.ApiError(400, "The prompt is empty.", "input")
        cfg = self.config.engine
        if len(prompt_ids) + max_tokens > cfg.max_model_len:
            raise protocol.ApiError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens.",
                "input",
            )
        assert self.loop is not None
        loop = self.loop
        arrival = loop.sim_now()
        await asyncio.sleep(loop.to_wall(cfg.profile.frontend_s))
        req = Request(request_id, prompt_ids, max_tokens, arrival, ignore_eos=ignore_eos)
        queue = loop.submit(req)
        try:
            words, reason = await self._drain(req, queue, "input")
        finally:
            if req.finish_reason is None:
                loop.abort(req.request_id)
        return req, words, reason

    async def _drain(self, req: Request, queue: asyncio.Queue[Any], param: str) -> tuple[list[str], str]:
        """A non-streaming request's words and finish reason, its metrics recorded; an engine failure
        is vLLM's error (``param`` names the field a prompt too large for the cache came in)."""
        words: list[str] = []
        last: float | None = None
        while True:
            event = await queue.get()
            if event.word is not None:
                last = self._observe_token(req, event, last)
                words.append(event.word)
            if event.finish_reason is not None:
                break
        if event.finish_reason == INTERNAL_ERROR:
            raise protocol.ApiError(500, "The engine failed while running this request.")
        if event.finish_reason == "error":
            raise protocol.ApiError(400, "The prompt does not fit in the KV cache.", param)
        self._finish_metrics(req)
        return words, event.finish_reason

    async def render_chat(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        parsed = protocol.parse_request(
            "chat", body, self.config.model, self.config.engine.max_model_len, True
        )
        return _json(apis.render_body(parsed.model, parsed.prompt_ids, parsed.request_id))

    async def render_completion(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        parsed = protocol.parse_request(
            "completion", body, self.config.model, self.config.engine.max_model_len, True
        )
        return _json(apis.render_body(parsed.model, parsed.prompt_ids, parsed.request_id))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        req = apis.parse_response_request(body, self.config.model, self.responses_store)
        prompt_ids = tokenizer.encode(tokenizer.render_chat(list(req.messages), True))
        if not req.stream:
            run, words, finish = await self._run(prompt_ids, req.max_tokens, req.request_id, req.ignore_eos)
            text = tokenizer.decode_words(words)
            status = "completed" if finish == "stop" else "incomplete"
            out = apis.response_body(req, text, status, run.prompt_len, len(words), run.cached_tokens or 0)
            self._store_response(req, out, text)
            return _json(out)
        return await self._stream_response(request, req, prompt_ids)

    async def _stream_response(
        self, request: web.Request, req: apis.ResponseRequest, prompt_ids: list[int]
    ) -> web.StreamResponse:
        """A Responses stream as vLLM sends it: typed events, each with its sequence number."""
        await self._apply_request_faults()
        assert self.loop is not None
        loop = self.loop
        run = Request(req.request_id, prompt_ids, req.max_tokens, loop.sim_now(), ignore_eos=req.ignore_eos)
        await asyncio.sleep(loop.to_wall(self.config.engine.profile.frontend_s))
        queue = loop.submit(run)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        seq = 0

        async def send(kind: str, **fields: Any) -> None:
            nonlocal seq
            await resp.write(apis.response_event(kind, seq, **fields))
            seq += 1

        started = apis.response_body(req, "", "in_progress", len(prompt_ids), 0, 0)
        item_id = started["output"][0]["id"]
        await send("response.created", response=started)
        await send("response.in_progress", response=started)
        words: list[str] = []
        last: float | None = None
        try:
            while True:
                event = await queue.get()
                if not words and event.word is not None:
                    await send("response.output_item.added", output_index=0, item=started["output"][0])
                    part = {"type": "output_text", "text": "", "annotations": []}
                    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
                    await send("response.content_part.added", part=part, **where)
                if event.finish_reason in ("error", INTERNAL_ERROR):
                    await send("error", message="The engine failed while running this request.", code=500)
                    break
                if event.word is not None:
                    last = self._observe_token(run, event, last)
                    words.append(event.word)
                    delta = (" " if len(words) > 1 else "") + event.word
                    await send("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                               delta=delta)  # fmt: skip
                if event.finish_reason is not None:
                    self._finish_metrics(run)
                    text = tokenizer.decode_words(words)
                    status = "completed" if event.finish_reason == "stop" else "incomplete"
                    done = apis.response_body(
                        req, text, status, run.prompt_len, len(words), run.cached_tokens or 0
                    )
                    await send(
                        "response.output_text.done",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        text=text,
                    )
                    await send("response.completed", response=done)
                    self._store_response(req, done, text)
                    break
        finally:
            if run.finish_reason is None:
                loop.abort(run.request_id)
        await resp.write_eof()
        return resp

    def _store_response(self, req: apis.ResponseRequest, body: dict[str, Any], text: str) -> None:
        if req.store:
            messages = (*req.messages, {"role": "assistant", "content": text})
            self.responses_store.put(req.request_id, apis.StoredResponse(body, messages))

    async def get_response(self, request: web.Request) -> web.Response:
        return _json(self.responses_store.get(request.match_info["response_id"]).body)

    async def embeddings(self, request: web.Request) -> web.Response:
        model, texts = apis.parse_embedding_request(await self._read_json(request), self.config.model)
        prompt_ids = [t for text in texts for t in tokenizer.encode(text)]
        run, _, _ = await self._run(prompt_ids, 1, "embd-" + uuid.uuid4().hex)
        return _json(apis.embedding_body(model, texts, run.prompt_len))

    async def score(self, request: web.Request) -> web.Response:
        model, pairs = apis.parse_score_request(await self._read_json(request), self.config.model)
        prompt_ids = [t for a, b in pairs for t in tokenizer.encode(a + " " + b)]
        run, _, _ = await self._run(prompt_ids, 1, "score-" + uuid.uuid4().hex)
        return _json(apis.score_body(model, pairs, run.prompt_len))

    async def rerank(self, request: web.Request) -> web.Response:
        model, query, docs, top_n = apis.parse_rerank_request(
            await self._read_json(request), self.config.model
        )
        prompt_ids = [t for d in docs for t in tokenizer.encode(query + " " + d)]
        run, _, _ = await self._run(prompt_ids, 1, "rerank-" + uuid.uuid4().hex)
        return _json(apis.rerank_body(model, query, docs, top_n, run.prompt_len))

    async def transcriptions(self, request: web.Request) -> web.Response:
        """Multipart: ``file`` (the audio) and ``model``. One prompt token per 100 bytes of audio
        stands in for the encoder; the transcript is 16 words."""
        if not request.content_type.startswith("multipart/"):
            raise protocol.ApiError(400, "Expected a multipart/form-data body with a file.", "file")
        form = await request.post()
        audio = form.get("file")
        if audio is None or not hasattr(audio, "file"):
            raise protocol.ApiError(400, "file is required", "file")
        size = len(audio.file.read())
        model = form.get("model") or self.config.model
        if not isinstance(model, str):
            raise protocol.ApiError(400, "model must be a form field, not a file", "model")
        protocol.check_model(model, self.config.model)
        prompt_ids = tokenizer.encode(" ".join(f"a{i}" for i in range(max(1, size // 100))))
        _, words, _ = await self._run(prompt_ids, 16, "trsc-" + uuid.uuid4().hex)
        return _json({"text": tokenizer.decode_words(words)})

    def _observe_token(self, req: Request, event: TokenEvent, last: float | None) -> float:
        """Record a token's TTFT or gap at the time its step produced it (as vLLM stamps outputs in
        the engine); the request's ``last_token_time`` may already be the next step's. Returns it."""
        if last is None:
            self.metrics.ttft.observe(event.at - req.arrival)
        else:
            self.metrics.observe_token_gap(event.at - last)
        return event.at

    def _finish_metrics(self, req: Request) -> None:
        if req.finish_time is not None:
            self.metrics.e2e.observe(req.finish_time - req.arrival)

    async def _collect(
        self, req: Request, queue: asyncio.Queue[Any], builder: protocol.ResponseBuilder
    ) -> web.Response:
        words, reason = await self._drain(req, queue, "prompt")
        usage = protocol.usage(req.prompt_len, len(words), req.cached_tokens or 0)
        kv = builder.req.kv_transfer
        params = self._kv_transfer_params(req) if kv is not None and kv.remote_decode else None
        return _json(builder.full(tokenizer.decode_words(words), reason, usage, params))

    async def _stream(
        self, request: web.Request, req: Request, queue: asyncio.Queue[Any], builder: protocol.ResponseBuilder
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        # Like vLLM (a Starlette StreamingResponse under uvicorn), the status line and headers leave as
        # soon as the request is accepted, before prefill; the first event leaves with the first token.
        await resp.prepare(request)
        n = 0
        last: float | None = None
        abort_after = self.faults.abort_after_tokens
        if abort_after == 0:
            self._cut(request)  # an engine that dies during prefill, after the headers left
        first = True
        while True:
            event = await queue.get()
            if first:
                first = False
                if builder.chat:
                    await send(builder.role_chunk())
            if event.finish_reason in ("error", INTERNAL_ERROR):
                # vLLM reports failures after the stream started as an error event, then [DONE].
                err = (
                    protocol.ApiError(500, "The engine failed while running this request.")
                    if event.finish_reason == INTERNAL_ERROR
                    else protocol.ApiError(400, "The prompt does not fit in the KV cache.")
                )
                await send(err.body())
                break
            if event.word is not None:
                last = self._observe_token(req, event, last)
                n += 1
                running = protocol.usage(req.prompt_len, n, req.cached_tokens or 0)
                await send(builder.token_chunk(" " + event.word, event.finish_reason, running))
                if abort_after is not None and n >= abort_after and event.finish_reason is None:
                    self._cut(request)
            if event.finish_reason is not None:
                self._finish_metrics(req)
                if builder.req.include_usage:
                    await send(builder.usage_chunk(protocol.usage(req.prompt_len, n, req.cached_tokens or 0)))
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _cut(request: web.Request) -> None:
        """An engine crash mid-stream: the connection drops without [DONE]."""
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError

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
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.hang:
            await asyncio.Event().wait()
        if self.faults.health_delay_ms:
            await asyncio.sleep(self.faults.health_delay_ms / 1000.0)
        return web.Response(status=503 if self.faults.unhealthy else 200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return _json({"server_load": 0})  # vLLM leaves it 0 without --enable-server-load-tracking

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
        if not isinstance(body, dict):
            raise protocol.ApiError(400, "The request body must be a JSON object.")
        if "messages" in body:
            text = tokenizer.render_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise protocol.ApiError(400, "prompt (a string) or messages is required", "prompt")
        ids = tokenizer.encode(text)
        strs = text.split() if body.get("return_token_strs") else None
        return _json(
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
        return web.Response(status=200 if ok else 400)

    async def info(self, request: web.Request) -> web.Response:
        """Simulator-only facts for tests and benchmarks: the TCP connections clients opened so far,
        the requests in the frontend (accepted, not yet in the engine) and the prefill backlog."""
        running, waiting = self.engine.prefill_backlog()
        in_step = self.loop.step_prefill_tokens if self.loop is not None else 0
        return _json(
            {
                "connections": self.connections,
                "frontend": self.in_frontend,
                "running": self.engine.num_running,
                "waiting": self.engine.num_waiting,
                # prompt tokens still to prefill before their first token reaches the client: of
                # the running requests (the step in progress included), and of the waiting ones
                "prefill_backlog_running": running + in_step,
                "prefill_backlog_waiting": waiting,
            }
        )

    # -- fault injection ----------------------------------------------------------------------------
    async def get_faults(self, request: web.Request) -> web.Response:
        return _json(self.faults.to_dict())

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
        return _json(self.faults.to_dict())

    async def clear_faults(self, request: web.Request) -> web.Response:
        self.faults = Faults()
        return _json(self.faults.to_dict())

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
