"""A blocking client of the sidecar's socket, speaking ``kvgate.protocol`` as Nginx's Lua does.

For tools, benchmarks and tests (never inside the asyncio sidecar): ``kvgate_bench`` times decisions
with it as Nginx sees them, and tests drive the sidecar through it.
"""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgate import protocol
from kvgate.features import Features, extract
from kvgate.messages import Decide, DecisionReply, Message, Outcome, Reply, Report


class DecisionClient:
    def __init__(self, path: str | Path, timeout: float = 5.0) -> None:
        self._ids = itertools.count(1)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rwb")

    def send_raw(self, obj: Mapping[str, Any], reply: bool = True) -> Any:
        """One message as JSON, and the raw decoded answer when ``reply``."""
        self.file.write(protocol.line(obj))
        self.file.flush()
        return self.read_raw() if reply else None

    def read_raw(self) -> Any:
        """The next answer line, decoded as JSON (for callers that sent without waiting)."""
        return json.loads(self.file.readline())

    def call(self, msg: Message) -> Reply | None:
        raw = self.send_raw(protocol.encode_message(msg), reply=not isinstance(msg, Report))
        return None if raw is None else self.decode(raw)

    @staticmethod
    def decode(raw: Mapping[str, Any]) -> Reply:
        return protocol.decode_reply(raw)

    def next_id(self) -> str:
        return f"client-{id(self):x}-{next(self._ids)}"

    def decide(self, f: Features) -> Reply:
        reply = self.call(Decide(self.next_id(), f))
        assert reply is not None
        return reply

    def decide_body(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> DecisionReply:
        """The decision for a request body, as Nginx would ask for it; raises on an error reply."""
        reply = self.decide(extract(body, headers))
        if not isinstance(reply, DecisionReply):
            raise RuntimeError(f"the sidecar refused: {reply}")
        return reply

    def finish(self, decision: DecisionReply, status: int = 200) -> None:
        """Report a decision's request as finished (what the log phase sends)."""
        self.call(Report((Outcome.end(decision.decision_id, decision.candidates[0].id, status),)))

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> DecisionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
