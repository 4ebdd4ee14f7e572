"""Chat and completions answers as vLLM shapes them (contract §2): a whole answer's body, a stream's
chunks and its usage. Pure: a parsed request and token counts in, dicts out."""

from __future__ import annotations

import time
from typing import Any

from vllm_sim.protocol import Parsed


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseBuilder:
    """Builds the chunks and the final body of one request."""

    def __init__(self, req: Parsed) -> None:
        self.req = req
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], usage_block: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.req.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if self.req.include_usage or self.req.continuous_usage:
            out["usage"] = usage_block
        return out

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        return self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            None,
        )

    def token_chunk(
        self, text: str, finish_reason: str | None, running: dict[str, Any] | None, index: int = 0
    ) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": index,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return self._chunk([choice], running if self.req.continuous_usage else None)

    def usage_chunk(self, usage_block: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.req.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.req.model,
            "choices": [],
            "usage": usage_block,
        }

    def full(
        self,
        outputs: list[tuple[str, str]],
        usage_block: dict[str, Any],
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The whole answer: one choice per (text, finish reason) of ``outputs``."""
        return {
            "id": self.req.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": [self._choice(i, text, reason) for i, (text, reason) in enumerate(outputs)],
            "usage": usage_block,
            "service_tier": None,
            "system_fingerprint": None,
            "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params,
        }

    def _choice(self, index: int, text: str, finish_reason: str) -> dict[str, Any]:
        if not self.chat:
            return {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
        return {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
