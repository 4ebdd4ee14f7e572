"""The exact prefix index end to end: real Nginx and sidecar, three simulators publishing KV events
on ZMQ (with replay sockets), the official openai client. A prompt placed on a backend behind the
gateway's back (sent to it directly, so no routing decision ever recorded it) is found there: the
gateway sends the prompt's body with its decision, the sidecar tokenizes it with a backend's
/tokenize, computes vLLM's block hashes and asks the index the events built. A prefix-cache reset
empties that backend's view."""

from __future__ import annotations

import re

import openai
import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port, free_ports

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, inflight, start_backends

pytestmark = pytest.mark.e2e
N = 3


def gateway(stack: Supervisor) -> tuple[Gateway, int]:
    """The gateway, and the first simulator's port."""
    redis_port = free_port()
    stack.start_redis(redis_port)
    events, replay = free_ports(N), free_ports(N)
    sim = start_backends(stack, N, "--kv-events-port", str(events), "--kv-events-replay-port", str(replay))
    backends = [
        {
            "id": f"sim-{i}",
            "url": f"http://127.0.0.1:{sim + i}",
            "kv_events": f"tcp://127.0.0.1:{events + i}",
            "kv_events_replay": f"tcp://127.0.0.1:{replay + i}",
        }
        for i in range(N)
    ]
    # A generous tokenize budget: the point here is the lookup, not the machine's speed.
    extra = {"backends": backends, "kv_index": {"tokenize_timeout_ms": 2000}}
    return Gateway(stack, "gw", redis_port, sim, N, extra=extra, decision_timeout_ms=3000), sim


def messages(context: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": context}, {"role": "user", "content": question}]


def sample(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_prompt_a_backend_holds_is_routed_there_though_no_decision_put_it_there(stack: Supervisor) -> None:
    gw, sim = gateway(stack)
    metrics = gw.sidecar.http + "/metrics"
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    contexts = {f"sim-{i}": " ".join(f"tenant{i}word{j}" for j in range(1500)) for i in range(N)}
    for i, (bid, context) in enumerate(contexts.items()):
        direct = openai.OpenAI(base_url=f"http://127.0.0.1:{sim + i}/v1", api_key="unused", max_retries=0)
        direct.chat.completions.create(model=MODEL, messages=messages(context, "first?"), max_tokens=1)  # type: ignore[arg-type]

        def held(bid: str = bid) -> bool:
            text = http_json("GET", metrics)[1]
            return sample(text, "kvgate_kv_index_blocks", f'backend="{bid}"') >= 90

        wait_until(held, timeout=10)
    for bid, context in contexts.items():
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages(context, f"a question for {bid}?"),  # type: ignore[arg-type]
            max_tokens=2,
        )
        raw.parse()
        assert raw.headers["X-Kvgate-Backend"] == bid, raw.headers["X-Kvgate-Route"]
    # A stream: the gateway asks the backend for its usage (to read the cached tokens) and strips it.
    # First the sidecar must have seen the last answers end (their reports and a scrape): a holder
    # still counted busy is over its load bound with so little traffic and is passed over (route
    # "load"), which is not what this tests.
    scraped_idle = lambda: all(b["load"]["requests"] == 0 for b in gw.sidecar.backends().values())  # noqa: E731
    wait_until(lambda: inflight(gw)[0] == 0 and scraped_idle(), timeout=10)
    context = contexts["sim-1"]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(context, "streamed?"),  # type: ignore[arg-type]
        max_tokens=3,
        stream=True,
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)

    # Each routed prompt's context was held where it went: the index predicted those tokens, and
    # the engines' usage (prompt_tokens_details.cached_tokens) says they were served from cache
    # (the reports reach the sidecar within Nginx's 100 ms flush).
    def reuse() -> dict[str, float]:
        text = http_json("GET", metrics)[1]
        return {
            k: sample(text, "kvgate_route_reuse_tokens_total", f'kind="{k}"')
            for k in ("captured", "delivered")
        }

    wait_until(lambda: reuse()["delivered"] >= (N + 1) * 1400, timeout=15)
    assert reuse()["captured"] >= (N + 1) * 1400, reuse()
    text = http_json("GET", metrics)[1]
    assert sample(text, "kvgate_tokenize_total", 'result="ok"') >= N + 1
    assert sample(text, "kvgate_kv_index_view", 'backend="sim-0",view="full"') == 1.0

    # A prefix-cache reset sends AllBlocksCleared: the index forgets what sim-0 held.
    status, _ = http_json("POST", f"http://127.0.0.1:{sim}/reset_prefix_cache")
    assert status == 200

    def emptied() -> bool:
        return sample(http_json("GET", metrics)[1], "kvgate_kv_index_blocks", 'backend="sim-0"') == 0

    wait_until(emptied, timeout=10)
