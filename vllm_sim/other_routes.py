"""vLLM's routes beside chat and completions: prompt rendering, the Responses API, embeddings,
score, rerank and transcriptions. Each runs its prompt through the engine as one non-streaming
request (``_run``), whose tokens are timed into the metrics as the streaming routes' are."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web

from vllm_sim import apis, protocol, tokenizer
from vllm_sim.facts import ServerBase, json_response
from vllm_sim.realtime import INTERNAL_ERROR
from vllm_sim.request import Request, TokenEvent


class OtherRoutes(ServerBase):
    """The engine runs and routes every generating route shares, and the routes beside chat and
    completions (``vllm_sim.server.Instance`` adds those two)."""

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
        parsed = protocol.parse_request("chat", body, self.config.model, self.config.engine.max_model_len)
        return json_response(apis.render_body(parsed.model, parsed.prompt_ids, parsed.request_id))

    async def render_completion(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        parsed = protocol.parse_request(
            "completion", body, self.config.model, self.config.engine.max_model_len
        )
        return json_response(apis.render_body(parsed.model, parsed.prompt_ids, parsed.request_id))

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
            return json_response(out)
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
        return json_response(self.responses_store.get(request.match_info["response_id"]).body)

    async def embeddings(self, request: web.Request) -> web.Response:
        model, texts = apis.parse_embedding_request(await self._read_json(request), self.config.model)
        prompt_ids = [t for text in texts for t in tokenizer.encode(text)]
        run, _, _ = await self._run(prompt_ids, 1, "embd-" + uuid.uuid4().hex)
        return json_response(apis.embedding_body(model, texts, run.prompt_len))

    async def score(self, request: web.Request) -> web.Response:
        model, pairs = apis.parse_score_request(await self._read_json(request), self.config.model)
        prompt_ids = [t for a, b in pairs for t in tokenizer.encode(a + " " + b)]
        run, _, _ = await self._run(prompt_ids, 1, "score-" + uuid.uuid4().hex)
        return json_response(apis.score_body(model, pairs, run.prompt_len))

    async def rerank(self, request: web.Request) -> web.Response:
        model, query, docs, top_n = apis.parse_rerank_request(
            await self._read_json(request), self.config.model
        )
        prompt_ids = [t for d in docs for t in tokenizer.encode(query + " " + d)]
        run, _, _ = await self._run(prompt_ids, 1, "rerank-" + uuid.uuid4().hex)
        return json_response(apis.rerank_body(model, query, docs, top_n, run.prompt_len))

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
        return json_response({"text": tokenizer.decode_words(words)})

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
