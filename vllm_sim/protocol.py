"""OpenAI requests as vLLM reads them (contract §2; its errors as vLLM 0.32 answers them, measured on
a real server: docs/real-vllm.md): the schema's lenient reading and its 400s of type "Bad Request",
then vLLM's own checks. Pure: a parsed JSON body in, a ``Parsed`` request or an ``ApiError`` out.
The answers' shapes: ``vllm_sim.responses``; the HTTP layer (``vllm_sim.server``) only moves bytes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_sim import tokenizer


class ApiError(Exception):
    """An error answered in vLLM's envelope ``{"error": {message, type, param, code}}``."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        501: "NotImplementedError",
        503: "ServiceUnavailableError",
        429: "RateLimitError",
        502: "BadGatewayError",
    }

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or self.TYPES.get(status, "Error")

    @classmethod
    def invalid(cls, field: str | int | None, kind: str, msg: str, value: Any) -> ApiError:
        """A body the API's schema refuses (pydantic, before vLLM's own checks): vLLM 0.32 answers 400
        of type "Bad Request" (the status's phrase, not ``BadRequestError``), its param the field's
        location in the body."""
        loc = "body" if field is None else f"body.{field}"
        shown = f"<{type(value).__name__} of {len(value)} items>" if isinstance(value, list | dict) else value
        detail = {"type": kind, "loc": loc, "msg": msg, "input": str(shown)}
        return cls(400, f"1 validation error:\n  {detail}", loc, "Bad Request")

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
NOT_AN_OBJECT = "Input should be a valid dictionary or object to extract fields from"


def require_object(body: Any, field: str | None = None) -> None:
    """vLLM's answer to a body (or a field) that is not a JSON object."""
    if not isinstance(body, dict):
        raise ApiError.invalid(field, "model_attributes_type", NOT_AN_OBJECT, body)


def parse_json(raw: bytes) -> Any:
    """A request body; one that is not JSON is a schema error at its first bad byte, as in vLLM."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        at = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
        raise ApiError.invalid(at, "json_invalid", "JSON decode error", {}) from None


def check_model(model: object, served: str) -> None:
    """vLLM's answer to a model it does not serve (0.32: it names the models it does)."""
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served}.", "model")


@dataclass(frozen=True, slots=True)
class Parsed:
    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int
    cache_salt: str | None
    request_id: str
    kv_transfer: KvTransfer | None = None
    n: int = 1  # completions of the prompt: vLLM runs each as an engine request of its own
    more_prompts: tuple[list[int], ...] = ()  # a completions batch's prompts after the first

    @property
    def prompts(self) -> tuple[list[int], ...]:
        return (self.prompt_ids, *self.more_prompts)


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """``kv_transfer_params`` of a disaggregated request (vLLM's NixlConnector, ~0.11): the prefill
    leg asks ``do_remote_decode`` (prefill here, keep the KV for a decoder to read); the decode leg
    carries what the prefill answered, ``do_remote_prefill`` with where the KV blocks are."""

    remote_decode: bool
    remote_prefill: bool
    remote_engine_id: str | None = None
    remote_num_tokens: int | None = None  # prompt tokens whose KV the prefiller holds
    remote_blocks: int = 0  # its KV blocks (the count, when remote_num_tokens is absent)


def parse_kv_transfer(raw: Any) -> KvTransfer | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    decode, prefill = raw.get("do_remote_decode", False), raw.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool) or (decode and prefill):
        raise ApiError(
            400, "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive booleans"
        )
    if not prefill:
        return KvTransfer(decode, False)
    engine, blocks, num = (
        raw.get("remote_engine_id"),
        raw.get("remote_block_ids"),
        raw.get("remote_num_tokens"),
    )
    if not isinstance(engine, str) or not isinstance(blocks, list):
        raise ApiError(
            400, "kv_transfer_params: a remote prefill needs remote_engine_id and remote_block_ids"
        )
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 0):
        raise ApiError(400, "kv_transfer_params.remote_num_tokens must be a count of tokens")
    return KvTransfer(False, True, engine, num, len(blocks))


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    """An integer field as vLLM's schema reads it (pydantic's lax mode: a whole float, a boolean or a
    string holding a whole number count too), then vLLM's own lower bound."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and not value.is_integer():
        raise ApiError.invalid(
            name,
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
            value,
        )
    if isinstance(value, str):
        try:
            number = float(value.strip())
            if not number.is_integer():
                raise ValueError(value)
        except ValueError:
            raise ApiError.invalid(
                name,
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
                value,
            ) from None
        value = number
    if not isinstance(value, int | float):
        raise ApiError.invalid(name, "int_type", "Input should be a valid integer", value)
    value = int(value)
    if value < minimum:
        raise ApiError(
            400, f"{name} must be at least {minimum}, got {value}. (parameter={name}, value={value})", name
        )
    return value


def _prompt_texts(prompt: Any) -> list[str]:
    """A completions prompt's texts: one, or each of a batch (a list of texts, or of lists of token
    ids), which vLLM serves as a request of its own each."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise ApiError.invalid("prompt", "list_type", "Input should be a valid list", prompt)
    if not prompt:
        raise ApiError(400, "You must pass at least one prompt")
    if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
        bad = next((i for i, t in enumerate(prompt) if not isinstance(t, int)), None)
        if bad is not None:
            raise ApiError.invalid(
                f"prompt.{bad}", "int_parsing", "Input should be a valid integer", prompt[bad]
            )
        return [" ".join(f"t{t}" for t in prompt)]  # token ids map to words one to one
    texts = []
    for item in prompt:
        if isinstance(item, list) and not item:
            raise ApiError(400, "The decoder prompt cannot be empty")
        if not isinstance(item, str | list):
            raise ApiError.invalid("prompt", "list_type", "Input should be a valid list", prompt)
        texts += _prompt_texts(item)
    return texts


def parse_request(kind: str, body: Any, served_model: str, max_model_len: int) -> Parsed:
    require_object(body)
    model = body.get("model") or served_model
    if not isinstance(model, str):
        raise ApiError.invalid("model", "string_type", "Input should be a valid string", model)
    check_model(model, served_model)
    batch: list[str] = []
    if kind == "chat":
        messages = body.get("messages")
        if messages is None:
            raise ApiError.invalid("messages", "missing", "Field required", body)
        if not isinstance(messages, list):
            raise ApiError.invalid("messages", "list_type", "Input should be a valid list", messages)
        if not messages:
            raise ApiError(
                400, "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "each message must be an object with role and content", "messages")
        try:
            text = tokenizer.render_chat(messages, bool(body.get("add_generation_prompt", True)))
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
    else:
        if body.get("prompt") in (None, ""):
            raise ApiError(400, NO_PROMPT, "prompt")
        texts = _prompt_texts(body["prompt"])
        text, batch = texts[0], texts[1:]
    prompt_ids = tokenizer.encode(text)
    more = tuple(tokenizer.encode(t) for t in batch)
    if not prompt_ids or not all(more):
        raise ApiError(400, "The prompt is empty.", "messages" if kind == "chat" else "prompt")

    t = body.get("temperature")
    if isinstance(t, int | float) and not isinstance(t, bool) and t < 0:  # vLLM's sampling check
        got = f"{float(t)}. (parameter=temperature, value={float(t)})"
        raise ApiError(400, f"temperature must be non-negative, got {got}", "temperature")
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    n = _int_field(body, "n", -(2**31))
    if n is not None and n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.")
    p = max(len(ids) for ids in (prompt_ids, *more))  # the longest of a batch decides
    if max_tokens is None:
        # vLLM: chat defaults to "up to max_model_len"; completions default to 16 tokens.
        max_tokens = max(1, max_model_len - p) if kind == "chat" else 16
    if p + max_tokens > max_model_len:
        where = "in the messages" if kind == "chat" else "in the prompt"
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{p + max_tokens} tokens ({p} {where}, {max_tokens} in the completion). Please reduce the "
            "length of the messages or completion.",
            "messages" if kind == "chat" else "prompt",
        )
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options is not None:
        require_object(options, "stream_options")
        if not stream:
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                "stream_options",
            )
    options = options or {}
    # vLLM 0.32 takes a priority whatever its scheduling policy; an FCFS server ignores it (older
    # releases refused a non-zero one with 400 "Priority scheduling is not enabled").
    priority = _int_field(body, "priority", -(2**31)) or 0
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
            "cache_salt",
        )
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    rid = body.get("request_id")
    return Parsed(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        continuous_usage=bool(options.get("continuous_usage_stats", False)),
        priority=priority,
        cache_salt=salt,
        request_id=prefix + (rid if isinstance(rid, str) and rid else uuid.uuid4().hex),
        kv_transfer=parse_kv_transfer(body.get("kv_transfer_params")),
        n=n or 1,
        more_prompts=more,
    )
