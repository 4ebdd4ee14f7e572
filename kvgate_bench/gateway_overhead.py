"""Latency the kvgate gateway adds over a plain Nginx ``proxy_pass`` to the same backend.

The backend is a static Nginx server that answers like vLLM (fixed chat completion, /health,
/metrics, /v1/models), so its own cost is small and identical for every path. Three paths are
measured side by side at a fixed request rate, for each prompt size: plain ``proxy_pass``; the
kvgate gateway (Lua reads and hashes the body, asks the sidecar, balancer applies the pick); and the
gateway with the sidecar stopped (fail-open). Requests alternate between the paths so both see the
same machine. Added latency = gateway percentile - plain percentile.

    python -m kvgate_bench.gateway_overhead --sizes 1024 51200 512000 --requests 1000 --rate 100
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvgate.nginx_conf import DEBIAN_MODULES, NginxSettings, find_nginx
from kvgate.tools.launcher import Supervisor, free_port, launch_replica, wait_listening

from kvgate_bench.report import pct, write_json

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


def _modules() -> str:
    return "\n".join(f"load_module {m};" for m in DEBIAN_MODULES if Path(m).exists())


def static_backend_conf(run: Path, port: int) -> str:
    return f"""{_modules()}
worker_processes 1; daemon off; pid {run}/backend.pid; error_log {run}/backend-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off; client_body_temp_path {run}/nginx-tmp/body; client_max_body_size 16m;
  client_body_buffer_size 4m;
  server {{
    listen 127.0.0.1:{port};
    location = /health {{ return 200 ''; }}
    location = /metrics {{ default_type text/plain; return 200 '{METRICS}'; }}
    location = /v1/models {{ default_type application/json;
      return 200 '{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}'; }}
    location / {{ default_type application/json; return 200 '{COMPLETION}'; }}
  }}
}}
"""


def plain_proxy_conf(run: Path, port: int, backend: int) -> str:
    return f"""{_modules()}
worker_processes 2; daemon off; pid {run}/plain.pid; error_log {run}/plain-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off; client_body_temp_path {run}/nginx-tmp/body; proxy_temp_path {run}/nginx-tmp/proxy;
  client_max_body_size 16m; client_body_buffer_size 4m;
  upstream backend {{ server 127.0.0.1:{backend}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
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


def measure(ports: list[int], size: int, n: int, rate: float) -> list[list[float]]:
    """Latencies per port, requests interleaved (a, b, a, b, ...) at ``rate`` so that every path sees
    the same machine conditions."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for port in ports]
    bodies = [body_of(size, i) for i in range(n)]
    out: list[list[float]] = [[] for _ in ports]
    interval = 1.0 / rate
    start = time.perf_counter()
    for i, body in enumerate(bodies):
        for k, conn in enumerate(conns):
            target = start + (i * len(conns) + k) * interval
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t0 = time.perf_counter()
            conn.request(
                "POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            resp.read()
            out[k].append(time.perf_counter() - t0)
            if resp.status != 200:
                raise RuntimeError(f"status {resp.status} on port {ports[k]}")
    for conn in conns:
        conn.close()
    return out


def ms(values: list[float], q: float) -> float:
    return pct(values, q) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 51_200, 512_000])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (open loop, one client)")
    p.add_argument("--out", default="bench-results/gateway_overhead.json")
    args = p.parse_args()
    sup = Supervisor(Path(args.out).parent / "gateway-overhead-run")
    run = sup.run_dir
    (run / "nginx-tmp" / "body").mkdir(parents=True, exist_ok=True)
    (run / "nginx-tmp" / "proxy").mkdir(parents=True, exist_ok=True)
    nginx = find_nginx()
    results: dict[str, Any] = {"rate": args.rate, "requests": args.requests, "sizes": {}}
    try:
        backend, plain = free_port(), free_port()
        (run / "backend.conf").write_text(static_backend_conf(run, backend))
        (run / "plain.conf").write_text(plain_proxy_conf(run, plain, backend))
        for name, port in (("backend", backend), ("plain", plain)):
            proc = sup.spawn(
                name, [nginx, "-p", str(run), "-c", str(run / f"{name}.conf"), "-e", str(run / f"{name}.log")]
            )
            wait_listening(proc, port=port)
        socket_path = run / "sidecar.sock"
        cfg = {
            "listen": {"socket": str(socket_path), "http_port": free_port()},
            "redis": {"url": None},
            "backends": [{"id": "static", "url": f"http://127.0.0.1:{backend}"}],
        }
        gw = free_port()
        settings = NginxSettings(
            listen=f"127.0.0.1:{gw}", socket=str(socket_path), run_dir=str(run), workers=2
        )
        replica = launch_replica(sup, "gateway", cfg, settings)
        for size in args.sizes:
            measure([plain, gw], size, 50, args.rate)
            plain_t, gw_t = measure([plain, gw], size, args.requests, args.rate)
            row = {
                "plain_p50_ms": ms(plain_t, 0.5),
                "plain_p99_ms": ms(plain_t, 0.99),
                "gateway_p50_ms": ms(gw_t, 0.5),
                "gateway_p99_ms": ms(gw_t, 0.99),
                "added_p50_ms": ms(gw_t, 0.5) - ms(plain_t, 0.5),
                "added_p99_ms": ms(gw_t, 0.99) - ms(plain_t, 0.99),
                "added_mean_ms": (statistics.fmean(gw_t) - statistics.fmean(plain_t)) * 1000,
            }
            results["sizes"][str(size)] = row
            print(
                f"{size / 1024:6.1f} KB: plain p50 {row['plain_p50_ms']:.3f} p99 {row['plain_p99_ms']:.3f} | "
                f"gateway p50 {row['gateway_p50_ms']:.3f} p99 {row['gateway_p99_ms']:.3f} | added p50 "
                f"{row['added_p50_ms']:+.3f} ms p99 {row['added_p99_ms']:+.3f} ms",
                flush=True,
            )
        sup.stop(replica.sidecar_name)
        results["fail_open"] = {}
        for size in args.sizes:
            plain_t, fo_t = measure([plain, gw], size, args.requests, args.rate)
            row = {
                "added_p50_ms": ms(fo_t, 0.5) - ms(plain_t, 0.5),
                "added_p99_ms": ms(fo_t, 0.99) - ms(plain_t, 0.99),
            }
            results["fail_open"][str(size)] = row
            print(
                f"{size / 1024:6.1f} KB, sidecar down (fail-open): added p50 {row['added_p50_ms']:+.3f} ms "
                f"p99 {row['added_p99_ms']:+.3f} ms",
                flush=True,
            )
    finally:
        sup.stop_all()
    write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
