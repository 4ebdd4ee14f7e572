"""vLLM's other OpenAI-server routes, as shapes: Responses, embeddings, score, rerank, audio
transcriptions and render. Pure functions over parsed JSON, like ``vllm_sim.protocol``; the server
runs the prompt through the engine (so these routes load the instance and use its prefix cache as
vLLM's do) and builds the answer here.

Responses follow vLLM's ``serving_responses``: with ``store`` (the default) a response is kept in the
instance's memory, ``previous_response_id`` continues it (its input and output come first in the new
prompt, so a follow-up reuses the prefix cache), and an id this instance does not hold is a 404. That
is why a gateway must send a conversation's later turns where its first went.
"""

from __future__ import annotations

import hashlib
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_sim import tokenizer
from vllm_sim.protocol import ApiError, check_model, require_object

EMBEDDING_DIM = 16
STORED_RESPONSES = 10_000  # vLLM keeps every stored response in memory; the simulator bounds it


def _model(body: Mapping[str, Any], served: str) -> str:
    model = body.get("model") or served
    check_model(model, served)
    return str(model)


def _max_tokens(body: Mapping[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"{name} must be a positive integer", name)
    return value


# -- Responses ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ResponseRequest:
    model: str
    messages: tuple[dict[str, str], ...]  # the whole conversation: previous turns, then this input
    max_tokens: int
    ignore_eos: bool
    stream: bool
    store: bool
    previous_response_id: str | None
    instructions: str | None
    request_id: str


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]
    messages: tuple[dict[str, str], ...]  # input and output, for a follow-up's prompt


class ResponseStore:
    """The responses an instance keeps (``store: true``), oldest dropped first past the bound."""

    def __init__(self, limit: int = STORED_RESPONSES) -> None:
        self.limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse:
        item = self._items.get(response_id)
        if item is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.")
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


def _input_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a string or a non-empty list of input items", "input")
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise ApiError(400, "each input item must be an object", "input")
        content = item.get("content", "")
        if isinstance(content, list):  # input_text parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append({"role": str(item.get("role", "user")), "content": str(content)})
    return out


def parse_response_request(body: Any, served: str, store: ResponseStore) -> ResponseRequest:
    require_object(body)
    model = _model(body, served)
    previous = body.get("previous_response_id")
    messages: list[dict[str, str]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(400, "previous_response_id must be a string", "previous_response_id")
        messages += store.get(previous).messages
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    return ResponseRequest(
        model=model,
        messages=tuple(messages),
        max_tokens=_max_tokens(body, "max_output_tokens", 16),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=bool(body.get("stream", False)),
        store=body.get("store", True) is not False,
        previous_response_id=previous,
        instructions=instructions,
        request_id="resp_" + uuid.uuid4().hex,
    )


def response_body(
    req: ResponseRequest, text: str, status: str, prompt: int, completion: int, cached: int
) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": req.model,
        "status": status,
        "output": [
            {
                "id": "msg_" + req.request_id[5:],
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
            }
        ],
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
        "previous_response_id": req.previous_response_id,
        "instructions": req.instructions,
        "max_output_tokens": req.max_tokens,
        "store": req.store,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "metadata": None,
    }


def response_event(kind: str, seq: int, **fields: Any) -> bytes:
    """One event of a Responses stream: ``event:`` and ``data:`` lines (no ``[DONE]`` at the end)."""
    import json

    data = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# -- embeddings, score, rerank ----------------------------------------------------------------------
def embedding(text: str) -> list[float]:
    """A deterministic unit-length vector for ``text`` (the same text, the same vector)."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    raw = struct.unpack(f"<{EMBEDDING_DIM}h", digest[: EMBEDDING_DIM * 2])
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [round(x / norm, 6) for x in raw]


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [" ".join(f"t{t}" for t in value)]
    raise ApiError(400, f"{name} must be a string or a non-empty list of strings", name)


def parse_embedding_request(body: Any, served: str) -> tuple[str, list[str]]:
    require_object(body)
    model = _model(body, served)
    if "messages" in body:
        return model, [tokenizer.render_chat(body["messages"], False)]
    return model, _texts(body.get("input"), "input")


def embedding_body(model: str, texts: Sequence[str], prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": "embd-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": embedding(t)} for i, t in enumerate(texts)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }


def _similarity(a: str, b: str) -> float:
    return round(sum(x * y for x, y in zip(embedding(a), embedding(b), strict=True)) / 2 + 0.5, 6)


def parse_score_request(body: Any, served: str) -> tuple[str, list[tuple[str, str]]]:
    """``text_1`` against each of ``text_2`` (a string or list; one text_1 for all, or pairwise)."""
    require_object(body)
    model = _model(body, served)
    left, right = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ApiError(400, "text_1 and text_2 must have the same length, or text_1 one item", "text_1")
    return model, list(zip(left, right, strict=True))


def score_body(model: str, pairs: Sequence[tuple[str, str]], prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": "score-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "score", "score": _similarity(a, b)} for i, (a, b) in enumerate(pairs)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }


def parse_rerank_request(body: Any, served: str) -> tuple[str, str, list[str], int | None]:
    require_object(body)
    model = _model(body, served)
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError(400, "query must be a string", "query")
    docs = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ApiError(400, "top_n must be a positive integer", "top_n")
    return model, query, docs, top_n


def rerank_body(
    model: str, query: str, docs: Sequence[str], top_n: int | None, tokens: int
) -> dict[str, Any]:
    results = sorted(
        (
            {"index": i, "document": {"text": d}, "relevance_score": _similarity(query, d)}
            for i, d in enumerate(docs)
        ),
        key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
    )
    return {
        "id": "rerank-" + uuid.uuid4().hex,
        "model": model,
        "usage": {"total_tokens": tokens},
        "results": results[:top_n] if top_n else results,
    }


# -- render ---------------------------------------------------------------------------------------------
def render_body(model: str, prompt_ids: Sequence[int], request_id: str) -> dict[str, Any]:
    """``POST /v1/chat/completions/render`` and ``/v1/completions/render``: the prompt's token ids,
    as a GPU-less front end hands them to an engine (no generation)."""
    return {"request_id": request_id, "model": model, "token_ids": list(prompt_ids), "features": None}
