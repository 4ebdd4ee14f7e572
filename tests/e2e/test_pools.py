"""Length-bucketed pools end to end: real Nginx and sidecar, simulated backends labelled by pool. A
short prompt goes to the short pool, a long one to the long pool, a long one spills to the short
pool while the long pool has no room, and POST /v1/decide explains the rule."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, start_backends

pytestmark = pytest.mark.e2e
POOLS = ("short", "short", "long")
THRESHOLD = 2000  # estimated prompt tokens


def gateway(stack: Supervisor) -> Gateway:
    redis_port = free_port()
    stack.start_redis(redis_port)
    sim = start_backends(stack, 3)
    backends = [
        {"id": f"sim-{i}", "url": f"http://127.0.0.1:{sim + i}", "labels": {"pool": pool}}
        for i, pool in enumerate(POOLS)
    ]
    pools = {
        "rules": [{"pool": "short", "max_prompt_tokens": THRESHOLD}, {"pool": "long"}],
        "spill": {"long": ["short"]},
    }
    # 4 bytes per token as configured, so the test knows each prompt's estimate exactly.
    extra = {"backends": backends, "pools": pools, "tokens": {"learn": False}}
    return Gateway(stack, "gw", redis_port, sim, 3, extra=extra, saturation_prefill_tokens=4096)


def body(words: int, tag: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(f"{tag}{j}" for j in range(words))}],
        "max_tokens": 4,
    }


def test_prompts_go_to_their_pool_and_a_full_pool_spills(stack: Supervisor) -> None:
    gw = gateway(stack)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def route(words: int, tag: str) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(**body(words, tag))
        raw.parse()
        return raw.headers["X-Kvgate-Route"], raw.headers["X-Kvgate-Backend"]

    short_route, short_backend = route(50, "s")  # ~300 bytes: well under 2,000 tokens
    assert short_route.endswith("@short") and short_backend in ("sim-0", "sim-1")
    long_route, long_backend = route(2000, "l")  # ~13 KB: ~3,300 estimated tokens
    assert long_route.endswith("@long") and long_backend == "sim-2"
    # Its end report is on its way: until it lands the long pool counts its 3,300 tokens as backlog,
    # enough at a lower pools.backlog_ratio for a long prompt to spill.
    wait_until(lambda: gw.sidecar.backends()["sim-2"]["inflight_tokens"] == 0, timeout=10, every=0.02)
    status, explained = http_json(
        "POST",
        gw.sidecar.http + "/v1/decide",
        {"body": body(2000, "x")},
        {"Authorization": "Bearer test-token"},
    )
    assert status == 200 and explained["pool"] == "long" and explained["pool_rule"]["pool"] == "long"
    assert explained["estimated_prompt_tokens"] > THRESHOLD

    # While one long prompt awaits its prefill the long pool has no room left (4,096 tokens), so the
    # next long one spills to the short pool. The long backend is slowed so the first stays in flight.
    sim_long = gw.sidecar.backends()["sim-2"]["url"]
    assert http_json("POST", sim_long + "/sim/faults", {"latency_ms": 3000})[0] == 200
    first: list[tuple[str, str]] = []
    holder = threading.Thread(target=lambda: first.append(route(3000, "p0-")))
    holder.start()
    # Over the pool's budget: only the held request does that.
    wait_until(lambda: gw.sidecar.backends()["sim-2"]["inflight_tokens"] >= 4096, timeout=10, every=0.02)
    spilled = route(3000, "p1-")
    holder.join(30)
    assert first and first[0][0].endswith("@long") and first[0][1] == "sim-2", first
    assert spilled[0].endswith("@short") and spilled[1] in ("sim-0", "sim-1"), spilled
    metrics = http_json("GET", gw.sidecar.http + "/metrics")[1]
    assert 'kvgate_pool_spills_total{pool="long",to="short"} 1.0' in metrics
