"""Request features: what a routing decision needs to know about a request, without its body.

Nginx's Lua hook (``lua/kvgate/features.lua``) computes exactly these from the request body and sends
only them to the sidecar; this module is the Python twin used by the benchmark and the tests, and both
are checked against ``tests/golden/features.json``.

* ``text``: the prompt's canonical text. Chat: ``role ":" content "\n"`` per message, content parts of
  type text joined by one space. Completions: the prompt string (a batch: its texts one after
  another). Responses and embeddings: their ``input``, read as chat when it is a list of messages
  or ``instructions`` come with it (as a system message first), else as a prompt.
* ``hashes``: chained hashes of its full ``CHUNK_BYTES`` chunks, ``h_i = md5(h_{i-1} .. chunk_i)``
  (first 16 hex digits; ``h_0 = md5(chunk_0)``), at most ``MAX_CHUNKS``; they feed the prefix index.
  Beyond 128 KB of prompt the session key, not the index, keeps a conversation together, and the
  hashing cost stays bounded (about 0.25 ms in Lua) however long the prompt.
* ``max_tokens`` (``max_completion_tokens`` first, as vLLM reads them) and ``completions`` (``n``
  times the texts of a completions batch): what its completions may write, read by the reserve's
  KV mark and a tenant's service (``kvgate.tenants``). Lua sends them only once its checks passed;
  here a value that is not a whole number in range is read as absent.
* ``key``: the affinity key, in order: the session header (``h:``), the previous response of a
  ``/v1/responses`` conversation (``r:``), the OpenAI ``user`` field (``u:``), else a key derived
  from the prompt's leading content (``p:``). A session value longer than
  ``KEY_VERBATIM`` bytes is kept as its md5 (``h#``/``u#``), so no client can store a megabyte key.
  For chat the derived key hashes the first user message (its first ``KEY_BYTES``), never the
  system prompt, so a system prompt shared by every request cannot collapse all traffic onto one
  node, while a conversation, which resends its history, keeps its key on every turn. For
  completions it is the chain hash at ``KEY_CHUNKS`` chunks (or the last full chunk, or the whole
  prompt when shorter).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 512
MAX_CHUNKS = 256  # 128 KB (~32k tokens): deep enough to tell prompts apart, bounded cost
KEY_BYTES = 1024
KEY_CHUNKS = 16
KEY_VERBATIM = 64  # longer session values become their md5, so Redis keys and local memory stay bounded
MAX_WHOLE = 2**31 - 1  # the largest max_tokens or n the gateway's checks let through


@dataclass(frozen=True, slots=True)
class Features:
    model: str | None
    key: str | None
    key_source: str  # header | user | prefix | none
    hashes: tuple[str, ...]
    prompt_bytes: int
    # For admission (rate limits), not for routing: who asks, and the completion they may get.
    client_key: str | None = None  # the API key's name, when the gateway checks keys
    client_addr: str | None = None
    max_tokens: int | None = None
    priority: int | None = None  # what the client asked for (body ``priority`` or X-Priority)
    completions: int = 1  # ``n`` of each prompt: engine requests in vLLM, up to max_tokens apiece
    # Set by the sidecar from kvgate.tokens (learned per model); 4 is English under BPE tokenizers.
    bytes_per_token: float = 4.0
    # The prompt's token ids as the model's tokenizer gives them (with its chat template), when the
    # sidecar has them: the exact index (``kvgate.exact_index``) is keyed by them.
    token_ids: tuple[int, ...] | None = None
    # The tenant the request's tenant header names (queue.tenant_header), over its key (kvgate.tenants).
    tenant: str | None = None

    @property
    def est_tokens(self) -> int:
        """Prompt tokens, estimated from the prompt's bytes."""
        if self.bytes_per_token == 4.0:
            return self.prompt_bytes // 4  # the exact figure earlier releases used
        return int(self.prompt_bytes / self.bytes_per_token)

    def output_tokens(self, default: int) -> int:
        """Tokens its completions may write: each ``max_tokens``, else ``default``."""
        return self.completions * max(0, self.max_tokens if self.max_tokens is not None else default)


def utf8(text: str) -> bytes:
    """Bytes of client text for hashing; a lone surrogate passes through as the bytes Nginx saw."""
    return text.encode("utf-8", "surrogatepass")


def session_key(kind: str, value: str) -> str:
    """``h:abc`` for a short value, ``h#<md5 hex>`` for a long one."""
    if len(utf8(value)) <= KEY_VERBATIM:
        return f"{kind}:{value}"
    return f"{kind}#" + hashlib.md5(utf8(value), usedforsecurity=False).hexdigest()


def _md5_16(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()[:16]


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p["text"] if isinstance(p.get("text"), str) else ""
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return ""


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping)


def canonical_text(body: Mapping[str, Any]) -> tuple[str, str | None]:
    """(canonical prompt text, text the derived key hashes or None for completions)."""
    messages = body.get("messages")
    given = body.get("input")
    if messages is None and given is not None:
        # /v1/responses and /v1/embeddings: read as chat when the input is a list of messages or
        # instructions come with it, else as a prompt.
        instructions = body.get("instructions")
        if _is_message_list(given) or isinstance(instructions, str):
            messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
            if _is_message_list(given):
                messages += list(given)
            elif isinstance(given, str):
                messages.append({"role": "user", "content": given})
        else:
            body = {"prompt": given}
    if isinstance(messages, list):
        parts: list[str] = []
        first_user: str | None = None
        for m in messages:
            if not isinstance(m, Mapping):
                continue
            text = content_text(m.get("content"))
            role = m.get("role")
            role = role if isinstance(role, str) else ""
            parts.append(f"{role}:{text}\n")
            if first_user is None and role == "user":
                first_user = text
        return "".join(parts), first_user
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        # A batch's texts, one after another: the first is a prefix its backend will hold, and the
        # bytes of all of them are what the backend prefills.
        prompt = "".join(prompt)
    return (prompt if isinstance(prompt, str) else ""), None


def chunk_hashes(data: bytes) -> list[str]:
    out: list[str] = []
    prev = b""
    n = min(len(data) // CHUNK_BYTES, MAX_CHUNKS)
    for i in range(n):
        h = _md5_16(prev + data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])
        out.append(h)
        prev = h.encode()
    return out


def extract(
    body: Mapping[str, Any], headers: Mapping[str, str] | None = None, session_header: str = "X-Session-ID"
) -> Features:
    text, first_user = canonical_text(body)
    data = utf8(text)
    hashes = chunk_hashes(data)
    key: str | None = None
    source = "none"
    header_value = None
    if headers:
        wanted = session_header.lower()
        header_value = next((v for k, v in headers.items() if k.lower() == wanted), None)
    user = body.get("user")
    previous = body.get("previous_response_id")
    if header_value:
        key, source = session_key("h", header_value), "header"
    elif isinstance(previous, str) and previous:
        key, source = session_key("r", previous), "response"
    elif isinstance(user, str) and user:
        key, source = session_key("u", user), "user"
    elif first_user is not None:
        key, source = "p:" + _md5_16(utf8(first_user)[:KEY_BYTES]), "prefix"
    elif hashes:
        key, source = "p:" + hashes[min(len(hashes), KEY_CHUNKS) - 1], "prefix"
    elif data:
        key, source = "p:" + _md5_16(data), "prefix"
    model = body.get("model")
    return Features(
        model=model if isinstance(model, str) and model else None,
        key=key,
        key_source=source,
        hashes=tuple(hashes),
        prompt_bytes=len(data),
        max_tokens=_max_tokens(body),
        completions=_completions(body),
    )


def _whole(value: Any, least: int) -> int | None:
    """A whole number from ``least`` to ``MAX_WHOLE``, else None. The range is tested first: a JSON
    integer of hundreds of digits does not convert to a float (NaN fails it too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not least <= value <= MAX_WHOLE or (isinstance(value, float) and not value.is_integer()):
        return None
    return int(value)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """As Lua's ``checks.max_tokens``: ``max_completion_tokens`` first, else ``max_tokens``."""
    first = _whole(body.get("max_completion_tokens"), 0)
    return first if first is not None else _whole(body.get("max_tokens"), 0)


def _completions(body: Mapping[str, Any]) -> int:
    """As Lua's ``checks.completions``: ``n`` of each prompt of a completions batch."""
    n = _whole(body.get("n"), 1) or 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int | float):
        n *= len(prompt)
    return n
