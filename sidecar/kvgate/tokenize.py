"""A prompt's token ids for the exact index, from the model's own tokenizer: in the sidecar when
``kv_index.tokenizer_files`` names it (``kvgate.local_tokenizer``), else a backend's /tokenize.

The exact index is keyed by vLLM's block hashes, which are computed over token ids after the chat
template, so only the model's own tokenizer and template give the right ones. vLLM serves both on
``POST /tokenize`` (``messages`` with the chat request's template options, or a ``prompt``), so
the sidecar asks a healthy backend that publishes KV events (one serving the same model), within
``kv_index.tokenize_timeout`` (30 ms by default): a decision never waits longer for it, and a
prompt that could not be tokenized in time is looked up approximately. Nginx sends the request's
body only when the config declares a publisher, and only up to ``kv_index.max_prompt_bytes``.

Requests the hashes cannot describe are not tokenized: a ``cache_salt`` (an extra key of the first
block), images or audio (their hashes are extra keys too), prompts given as token ids or lists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvgate.config import KvIndexConfig
from kvgate.features import Features
from kvgate.local_tokenizer import LocalTokenizer
from kvgate.metrics import SidecarMetrics
from kvgate.registry import Registry

logger = logging.getLogger("kvgate.tokenize")

# What a chat request may say about its template; /tokenize takes the same keys (vLLM 0.32).
CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
MAX_TOKENS = 4_000_000


def tokenize_request(body_text: str) -> dict[str, Any] | None:
    """The /tokenize body for a client's request body, or None when it cannot be looked up exactly."""
    try:
        body = json.loads(body_text)
    except ValueError:
        return None
    if not isinstance(body, Mapping) or body.get("cache_salt") is not None:
        return None
    model = body.get("model")
    out: dict[str, Any] = {} if model is None else {"model": model}
    messages = body.get("messages")
    if isinstance(messages, list):
        if not all(isinstance(m, Mapping) and isinstance(m.get("content"), str | None) for m in messages):
            return None  # parts (images, audio, input_audio, ...) carry hashes of their own
        out.update({k: body[k] for k in CHAT_KEYS if k in body})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        out["prompt"] = prompt
        return out
    return None


def token_ids(answer: Any) -> tuple[int, ...] | None:
    tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        return None
    return tuple(tokens)


class TokenSource:
    def __init__(
        self,
        config: KvIndexConfig,
        registry: Registry,
        metrics: SidecarMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.session = session
        self._turn = itertools.count()
        self.local = {model: LocalTokenizer(d) for model, d in config.tokenizer_files.items()}

    def _backend(self, model: str | None) -> str | None:
        """A healthy backend that publishes events and serves ``model``, in turn."""
        ids = [
            b
            for b, s in self.registry.backends.items()
            if s.eligible
            and s.spec.kv_events is not None
            and (model is None or not s.models or model in s.models)
        ]
        if not ids:
            return None
        return ids[next(self._turn) % len(ids)]

    async def with_tokens(self, f: Features, body_text: str) -> Features:
        """``f`` with the prompt's token ids, or as it is when they did not come in time."""
        ids = await self.tokens(f.model, body_text)
        return dataclasses.replace(f, token_ids=ids) if ids else f

    async def _local(self, local: LocalTokenizer, request: dict[str, Any]) -> tuple[int, ...] | None:
        try:
            async with asyncio.timeout(self.config.tokenize_timeout_s):
                ids = await local.tokens(request)
        except TimeoutError:
            self.metrics.tokenize.labels("timeout").inc()  # the thread finishes; its answer is unused
            return None
        except Exception as exc:  # a template that fails on these messages
            self.metrics.tokenize.labels("error").inc()
            logger.debug("local tokenizer failed: %s", exc)
            return None
        self.metrics.tokenize.labels("ok" if ids else "skipped").inc()
        return ids or None

    async def tokens(self, model: str | None, body_text: str) -> tuple[int, ...] | None:
        if len(body_text) > self.config.max_prompt_bytes:
            self.metrics.tokenize.labels("skipped").inc()
            return None
        request = tokenize_request(body_text)
        local = self.local.get(model) if model is not None else None
        if request is not None and local is not None:
            return await self._local(local, request)
        bid = self._backend(model) if request is not None else None
        if request is None or bid is None:
            self.metrics.tokenize.labels("skipped").inc()
            return None
        url = self.registry.backends[bid].spec.url + "/tokenize"
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.tokenize_timeout_s)
            async with self.session.post(url, json=request, timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                ids = token_ids(await resp.json(content_type=None))
            if ids is None:
                raise ValueError("no token ids in the answer")
        except TimeoutError:
            self.metrics.tokenize.labels("timeout").inc()
            return None
        except (aiohttp.ClientError, ValueError) as exc:
            self.metrics.tokenize.labels("error").inc()
            logger.debug("tokenize on %s failed: %s", bid, exc)
            return None
        self.metrics.tokenize.labels("ok").inc()
        return ids
