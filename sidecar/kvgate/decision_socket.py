"""The decision protocol Nginx speaks over a unix socket: one JSON object per line, both ways.

Requests: ``{"op": "decide", "f": {features}}``, ``{"op": "report", "o": [outcomes]}`` (no answer
line, so the log phase never waits), ``{"op": "peers"}``. Connections are kept alive by Nginx's
cosocket pool, so a decision costs one write and one read on an open socket; no HTTP parsing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any

from kvgate.features import Features
from kvgate.registry import Registry
from kvgate.service import DecisionService, Outcome, UnknownModel

logger = logging.getLogger(__name__)
MAX_LINE = 4 * 1024 * 1024  # features of a 128k-token prompt are ~20 KB; this is a safety bound


class DecisionServer:
    def __init__(self, service: DecisionService, registry: Registry) -> None:
        self.service = service
        self.registry = registry
        self.server: asyncio.Server | None = None

    async def start(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket from a previous run (a local, non-blocking unlink)
        self.server = await asyncio.start_unix_server(self._serve, path=path, limit=MAX_LINE)
        os.chmod(path, 0o660)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "decide":
            f = msg.get("f")
            if not isinstance(f, dict):
                return {"e": "bad_request", "msg": "decide needs f: {features}"}
            try:
                return await self.service.decide(Features.from_wire(f))
            except UnknownModel as exc:
                return {"e": "unknown_model", "msg": f"The model `{exc}` does not exist."}
            except (TypeError, ValueError, OverflowError) as exc:
                return {"e": "bad_request", "msg": f"malformed features: {exc}"}
        if op == "report":
            items = msg.get("o")
            if isinstance(items, list):
                try:
                    self.service.report([Outcome.from_wire(o) for o in items if isinstance(o, dict)])
                except (TypeError, ValueError, OverflowError) as exc:
                    logger.warning("ignoring a malformed outcome report: %s", exc)
            return None
        if op == "peers":
            return self.registry.peers()
        if op == "models":
            return {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "vllm"}
                    for m in self.registry.models()
                ],
            }
        return {"e": "bad_request", "msg": f"unknown op {op!r}"}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    writer.write(b'{"e":"bad_request","msg":"line too long"}\n')
                    break
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes not UTF-8
                    writer.write(b'{"e":"bad_request","msg":"not UTF-8 JSON"}\n')
                    await writer.drain()
                    continue
                answer = await self.handle(msg) if isinstance(msg, dict) else {"e": "bad_request"}
                if answer is not None:
                    writer.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the server is shutting down; the connection closes below
        finally:
            writer.close()
