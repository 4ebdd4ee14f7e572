"""A blocking client of the sidecar's decision protocol, speaking what ``lua/kvgate/sidecar.lua`` speaks.

For tools, benchmarks and tests (never inside the asyncio sidecar): ``kvgate_bench`` uses it to time
decisions as Nginx sees them.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgate.features import Features, extract


def wire(f: Features) -> dict[str, Any]:
    """Features in the encoding Lua sends."""
    return {"m": f.model, "k": f.key, "ks": f.key_source, "h": list(f.hashes), "b": f.prompt_bytes}


class DecisionClient:
    def __init__(self, path: str | Path, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rwb")

    def call(self, msg: Mapping[str, Any], reply: bool = True) -> Any:
        self.file.write(json.dumps(msg).encode() + b"\n")
        self.file.flush()
        return json.loads(self.file.readline()) if reply else None

    def decide_body(
        self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        return dict(self.call({"op": "decide", "f": wire(extract(body, headers))}))

    def finish(self, decision: Mapping[str, Any], status: int = 200) -> None:
        """Report a decision's request as finished (what the log phase sends)."""
        item = {"i": decision["i"], "b": decision["c"][0], "s": status, "x": True}
        self.call({"op": "report", "o": [item]}, reply=False)

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> DecisionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
