"""Where kvgate's per-request time goes, phase by phase.

Two halves, each with the project's real code:

- Nginx side (``phases.lua`` inside a real Nginx, with the gateway's Lua modules): JSON decode of the
  body, feature extraction (canonical text, chunk hashes, key), the decision message's encoding, the
  round trip to a running sidecar over its unix socket (encode, send, the sidecar's whole work,
  receive, decode), and an outcome report's encoding.
- Sidecar side (in process, no socket): decoding a decide line, the decision itself
  (``DecisionService.decide``: prefix index, session, policy, in-flight start, metrics), encoding the
  reply, and decoding + handling the request's outcome report.

The live sidecar's own decision time during the Lua runs comes from its ``kvgate_decision_seconds``
histogram (sum / count); the rest of a round trip (socket, both event loops, process wake-ups) is the
round trip minus that and the sidecar's decode and encode.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvgate.public import (
    DEBIAN_MODULES,
    LUA_DIR,
    Config,
    Decide,
    DecisionReply,
    NginxSettings,
    Outcome,
    Report,
    Scraped,
    build_sidecar,
    configure_lua,
    extract,
    find_nginx,
    protocol,
)
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port, wait_listening

MODEL = "bench-model"
PHASES_LUA = Path(__file__).resolve().parent / "phases.lua"


def chat_body(size: int, i: int) -> dict[str, Any]:
    text = (f"request {i} " + "lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


def lua_conf(run: Path, port: int, socket: str) -> str:
    modules = "\n".join(f"load_module {m};" for m in DEBIAN_MODULES if Path(m).exists())
    return f"""{modules}
worker_processes 1; daemon off; pid {run}/phases.pid; error_log {run}/phases-error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log off; client_body_temp_path {run}/nginx-tmp/body;
  lua_package_path "{run}/?.lua;{LUA_DIR}/?.lua;;";
  init_by_lua_block {{ {configure_lua(NginxSettings(socket=socket))} }}
  server {{
    listen 127.0.0.1:{port};
    location = /phases {{ content_by_lua_block {{ require("phases").run() }} }}
  }}
}}
"""


def _decisions(metrics_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the sidecar's decision-time histogram."""
    total = count = 0.0
    for line in urllib.request.urlopen(metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith("kvgate_decision_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("kvgate_decision_seconds_count"):
            count = float(line.split()[-1])
    return total, count


def lua_phases(
    sup: Supervisor, socket: str, metrics_url: str, sizes: list[int], n: int
) -> dict[str, dict[str, float]]:
    """Median microseconds of each Nginx-side phase, per body size, against the sidecar at ``socket``,
    and the live sidecar's mean decision time over the same calls (``live_decide``)."""
    run = sup.run_dir
    (run / "nginx-tmp" / "body").mkdir(parents=True, exist_ok=True)
    shutil.copy(PHASES_LUA, run / "phases.lua")
    port = free_port()
    (run / "phases.conf").write_text(lua_conf(run, port, socket))
    proc = sup.spawn(
        "phases-nginx",
        [find_nginx(), "-p", str(run), "-c", str(run / "phases.conf"), "-e", str(run / "p.log")],
    )
    wait_listening(proc, port=port)
    out: dict[str, dict[str, float]] = {}
    try:
        for size in sizes:
            url = f"http://127.0.0.1:{port}/phases?size={size}&n={n}"
            urllib.request.urlopen(url.replace(f"n={n}", "n=20"), timeout=60).read()  # warm-up (JIT)
            before = _decisions(metrics_url)
            out[str(size)] = json.loads(urllib.request.urlopen(url, timeout=300).read())
            after = _decisions(metrics_url)
            calls = after[1] - before[1]
            out[str(size)]["live_decide"] = (after[0] - before[0]) / calls * 1e6 if calls else float("nan")
    finally:
        sup.stop("phases-nginx")
    return out


async def _sidecar_phases(sizes: list[int], n: int) -> dict[str, dict[str, float]]:
    cfg = Config.from_mapping(
        {
            "listen": {"socket": "unused.sock", "http_port": 0},
            "redis": {"url": None},
            "backends": [{"id": "static", "url": "http://127.0.0.1:1"}],
        },
        {},
    )
    sc = build_sidecar(cfg, None)
    sc.registry.set_membership((b, False) for b in cfg.backends)
    sc.registry.set_models("static", frozenset({MODEL}))
    sc.registry.scrape_ok("static", Scraped(0, 0, 0.1, None, None, asyncio.get_running_loop().time()))
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        times: dict[str, list[float]] = {"decode": [], "decide": [], "encode": [], "report": []}
        for i in range(n + 20):
            f = extract(chat_body(size, i), None)
            line = protocol.line(protocol.encode_message(Decide(f"p.{size}.{i}", f)))
            t0 = time.perf_counter()
            msg = protocol.decode_message(line)
            t1 = time.perf_counter()
            assert isinstance(msg, Decide)
            routed = await sc.service.route(msg.features, msg.decision_id)
            t2 = time.perf_counter()
            protocol.line(
                protocol.encode_reply(
                    DecisionReply(routed.decision_id, routed.candidates, routed.decision.label)
                )
            )
            t3 = time.perf_counter()
            ended = Outcome.end(msg.decision_id, "static", 200, True, None, 0.01)
            report_line = protocol.line(protocol.encode_message(Report((ended,))))
            t4 = time.perf_counter()
            rep = protocol.decode_message(report_line)
            assert isinstance(rep, Report)
            sc.service.report(rep.outcomes)
            t5 = time.perf_counter()
            if i >= 20:  # the first ones warm caches up
                for k, v in (
                    ("decode", t1 - t0),
                    ("decide", t2 - t1),
                    ("encode", t3 - t2),
                    ("report", t5 - t4),
                ):
                    times[k].append(v * 1e6)
        out[str(size)] = {k: statistics.median(v) for k, v in times.items()}
        out[str(size)]["line_bytes"] = len(line)
    return out


def sidecar_phases(sizes: list[int], n: int) -> dict[str, dict[str, float]]:
    """Median microseconds of each sidecar-side phase, per prompt size."""
    return asyncio.run(_sidecar_phases(sizes, n))


def markdown(lua: dict[str, dict[str, float]], py: dict[str, dict[str, float]]) -> str:
    lines = [
        "| size | Lua: JSON decode | Lua: features | Lua: message encode | round trip to the sidecar | "
        "sidecar: decode | sidecar: decide (live) | sidecar: encode | rest of the round trip | "
        "Lua: report encode | sidecar: report |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, lp in lua.items():
        sp = py[size]
        rest = lp["round_trip"] - sp["decode"] - lp["live_decide"] - sp["encode"]
        lines.append(
            f"| {int(size) / 1024:g} KB | {lp['decode']:.0f} | {lp['features']:.0f} | {lp['encode']:.0f} | "
            f"{lp['round_trip']:.0f} | {sp['decode']:.0f} | {lp['live_decide']:.0f} | {sp['encode']:.0f} | "
            f"{rest:.0f} | {lp['report_encode']:.0f} | {sp['report']:.0f} |"
        )
    return "\n".join(lines) + "\n"
