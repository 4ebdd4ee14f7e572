"""What the overhead benchmark measures through: a static Nginx backend that answers like vLLM,
a plain proxy in front of it, a peer router, and each target's processes and their CPU time."""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.public import DEBIAN_MODULES
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port, process_tree, wait_listening

from kvgate_bench.targets import PEER_VENV

MODEL = "bench-model"


COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1},
    }
)


METRICS = (
    'vllm:num_requests_running{model_name="bench-model",engine="0"} 0\\n'
    'vllm:num_requests_waiting{model_name="bench-model",engine="0"} 0\\n'
    'vllm:kv_cache_usage_perc{model_name="bench-model",engine="0"} 0.1\\n'
)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _modules() -> str:
    return "\n".join(f"load_module {m};" for m in DEBIAN_MODULES if Path(m).exists())


# vLLM's render answers the prompt's token ids (and its features, none for text). One id per 4 bytes
# of body stands in for the tokenizer; the answer is cached per length, so the backend stays cheap.
RENDER_LUA = """
local cache = {}
return function()
  ngx.req.read_body()
  local body = ngx.req.get_body_data()
  if not body then
    local f = io.open(ngx.req.get_body_file(), "rb"); body = f:read("*a"); f:close()
  end
  local n = math.max(1, math.floor(#body / 4))
  local out = cache[n]
  if not out then
    local ids = {}
    for i = 1, n do ids[i] = tostring(1000 + i % 30000) end
    out = '{"request_id":"render-bench","token_ids":[' .. table.concat(ids, ",")
          .. '],"features":null,"model":"bench-model"}'
    cache[n] = out
  end
  ngx.header["Content-Type"] = "application/json"
  ngx.print(out)
end
"""


def static_backend_conf(run: Path, port: int, more_ports: Sequence[int] = ()) -> str:
    """The static backend's config, listening on ``port`` (and ``more_ports``: several backends'
    addresses served by one process)."""
    (run / "render.lua").write_text(RENDER_LUA)
    more = "".join(f"\n    listen 127.0.0.1:{p} backlog=4096;" for p in more_ports)
    return f"""{_modules()}
worker_processes 1; daemon off; pid {run}/backend.pid; error_log {run}/backend-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; client_body_temp_path {run}/nginx-tmp/body; client_max_body_size 16m;
  client_body_buffer_size 4m; keepalive_requests 1000000;
  init_by_lua_block {{ render = dofile("{run}/render.lua") }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;{more}
    location = /health {{ return 200 ''; }}
    location = /metrics {{ default_type text/plain; return 200 '{METRICS}'; }}
    location = /v1/models {{ default_type application/json;
      return 200 '{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}'; }}
    location ~ /render$ {{ content_by_lua_block {{ render() }} }}
    location / {{ default_type application/json; return 200 '{COMPLETION}'; }}
  }}
}}
"""


def plain_proxy_conf(run: Path, port: int, backend: int) -> str:
    return f"""{_modules()}
worker_processes 2; daemon off; pid {run}/plain.pid; error_log {run}/plain-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; client_body_temp_path {run}/nginx-tmp/body; proxy_temp_path {run}/nginx-tmp/proxy;
  client_max_body_size 16m; client_body_buffer_size 1m; keepalive_requests 1000000;
  upstream backend {{ server 127.0.0.1:{backend}; keepalive 256; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{ proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection "";
                 proxy_buffering off; }}
  }}
}}
"""


def body_of(size: int, i: int) -> bytes:
    text = (f"request {i} " + "lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    ).encode()


@dataclass
class Target:
    name: str
    port: int
    pids: Callable[[], list[int]]
    latencies: list[float] = field(default_factory=list)
    parts: dict[str, Callable[[], list[int]]] = field(default_factory=dict)  # CPU shown per part too


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system time of ``pids`` (threads, dead ones included, count in their process)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / CLK_TCK


def post(conn: http.client.HTTPConnection, body: bytes, name: str) -> float:
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    elapsed = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"{name}: status {resp.status}")
    return elapsed


def start_peer(sup: Supervisor, target: str, backend: int, more: Sequence[int] = ()) -> Target:
    """A peer router over the static backend on ``backend`` (and ``more`` ports)."""
    kind, _, policy = target.partition(":")
    port = free_port()
    argv = [
        str(PEER_VENV / "bin" / kind),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *(f"http://127.0.0.1:{b}" for b in (backend, *more)),
        "--policy", policy,
        "--prometheus-port", str(free_port()),
        "--log-level", "warning",  # no log line per request, as kvgate's access log is off here
    ]  # fmt: skip
    proc = sup.spawn(target.replace(":", "-"), argv)
    wait_listening(proc, port=port, timeout=60)
    deadline = time.monotonic() + 60
    while True:  # routes once its worker passed the health check
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            post(conn, body_of(64, 0), target)
            conn.close()
            break
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    return Target(target, port, lambda: process_tree(proc.pid))
