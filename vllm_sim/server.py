"""HTTP front end of one simulated vLLM instance (aiohttp), with vLLM 0.11's routes and shapes: the
route table, vLLM's error envelope, and chat and completions (streamed or whole, with the KV-transfer
legs of disaggregation). The other generating routes: ``vllm_sim.other_routes``; the informational
ones, the state and the lifecycle: ``vllm_sim.facts``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_sim import protocol, responses, tokenizer
from vllm_sim.facts import error_response, json_response
from vllm_sim.other_routes import OtherRoutes
from vllm_sim.realtime import INTERNAL_ERROR
from vllm_sim.request import Request, TokenEvent

logger = logging.getLogger(__name__)


class Instance(OtherRoutes):
    """One simulated vLLM server: an engine, its real-time loop, metrics, faults and routes."""

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
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status == 404:
                return json_response({"detail": "Not Found"}, 404)
            if exc.status == 405:
                return json_response({"detail": "Method Not Allowed"}, 405)
            raise
        except ConnectionResetError:
            # The client went away under a response being written: a write found the transport
            # closed before aiohttp's handler cancellation arrived (two writes in one step, the
            # first of which failed). That is the client's abort, as vLLM treats a disconnect, not
            # a server error for aiohttp to log with a traceback.
            raise asyncio.CancelledError from None
        except Exception:
            logger.exception("internal error")
            return error_response(protocol.ApiError(500, "Internal server error"))

    # -- OpenAI API -------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        await self._apply_request_faults()
        body = await self._read_json(request)
        cfg = self.config.engine
        parsed = protocol.parse_request(kind, body, self.config.model, cfg.max_model_len)
        self.priorities[parsed.priority] += 1
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
        # n completions of each prompt (a completions batch has several): vLLM fans them out to
        # engine requests of their own, each counted in its metrics; all but the first of a prompt
        # find its blocks in the prefix cache. Choice k is completion k % n of prompt k // n.
        prompts = [ids for ids in parsed.prompts for _ in range(parsed.n)]
        children = [
            Request(
                request_id=parsed.request_id if len(prompts) == 1 else f"{i}_{parsed.request_id}",
                prompt_ids=ids,
                max_tokens=parsed.max_tokens,
                arrival=arrival,
                ignore_eos=parsed.ignore_eos,
                priority=parsed.priority,
                cache_salt=parsed.cache_salt,
                remote_tokens=remote_tokens,
            )
            for i, ids in enumerate(prompts)
        ]
        runs = [(req, loop.submit(req)) for req in children]
        builder = responses.ResponseBuilder(parsed)
        try:
            if parsed.stream:
                return await self._stream(request, runs, builder)
            return await self._collect(runs, builder)
        finally:
            for req in children:
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

    async def _collect(self, runs: list[Run], builder: responses.ResponseBuilder) -> web.Response:
        outputs = [await self._drain(req, queue, "prompt") for req, queue in runs]
        reqs = [req for req, _ in runs]
        usage = self._usage(reqs, builder.req.n, sum(len(words) for words, _ in outputs))
        kv = builder.req.kv_transfer
        params = self._kv_transfer_params(reqs[0]) if kv is not None and kv.remote_decode else None
        texts = [(tokenizer.decode_words(words), reason) for words, reason in outputs]
        return json_response(builder.full(texts, usage, params))

    @staticmethod
    def _usage(reqs: list[Request], n: int, completion_tokens: int) -> dict[str, Any]:
        """A request's usage: each prompt once, the tokens of all completions; a prompt's cached
        tokens, the most any of its n completions found (vLLM reports the prompt's hit, not the first
        completion's miss)."""
        prompts = [reqs[i : i + n] for i in range(0, len(reqs), n)]
        cached = sum(max(r.cached_tokens or 0 for r in same) for same in prompts)
        return responses.usage(sum(same[0].prompt_len for same in prompts), completion_tokens, cached)

    async def _stream(
        self, request: web.Request, runs: list[Run], builder: responses.ResponseBuilder
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        # Like vLLM (a Starlette StreamingResponse under uvicorn), the status line and headers leave as
        # soon as the request is accepted, before prefill; the first event leaves with the first token.
        await resp.prepare(request)
        reqs = [req for req, _ in runs]
        n = 0
        last: list[float | None] = [None] * len(runs)
        abort_after = self.faults.abort_after_tokens
        if abort_after == 0:
            self._cut(request)  # an engine that dies during prefill, after the headers left
        first = True
        async with contextlib.aclosing(merged(runs)) as events:
            async for i, event in events:
                if first:
                    first = False
                    if builder.chat:  # each completion's role, then their tokens as their steps make them
                        for index in range(len(runs)):
                            await send(builder.role_chunk(index))
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
                    last[i] = self._observe_token(reqs[i], event, last[i])
                    n += 1
                    usage = self._usage(reqs, builder.req.n, n)
                    await send(builder.token_chunk(" " + event.word, event.finish_reason, usage, i))
                    if abort_after is not None and n >= abort_after and event.finish_reason is None:
                        self._cut(request)
                if event.finish_reason is not None:
                    self._finish_metrics(reqs[i])
            else:
                if builder.req.include_usage:
                    await send(builder.usage_chunk(self._usage(reqs, builder.req.n, n)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _cut(request: web.Request) -> None:
        """An engine crash mid-stream: the connection drops without [DONE]."""
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError


Run = tuple[Request, asyncio.Queue[TokenEvent]]


async def merged(runs: list[Run]) -> AsyncGenerator[tuple[int, TokenEvent]]:
    """The token events of a request's completions in the order their steps made them, each with
    its completion's index, until every completion has finished."""
    if len(runs) == 1:  # the common case, without a task in between
        queue = runs[0][1]
        while True:
            event = await queue.get()
            yield 0, event
            if event.finish_reason is not None:
                return
    out: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

    async def pump(i: int, queue: asyncio.Queue[TokenEvent]) -> None:
        while True:
            event = await queue.get()
            out.put_nowait((i, event))
            if event.finish_reason is not None:
                return

    pumps = [asyncio.create_task(pump(i, queue)) for i, (_, queue) in enumerate(runs)]
    running = len(runs)
    try:
        while running:
            i, event = await out.get()
            yield i, event
            running -= event.finish_reason is not None
    finally:
        for task in pumps:
            task.cancel()
