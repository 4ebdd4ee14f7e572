"""Prefill/decode disaggregation end to end: the official openai client -> real Nginx with kvgate's
Lua (the prefill leg as a subrequest) -> the real sidecar -> simulated vLLM instances with roles
(one prefill, two decode), and what happens when either leg fails."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, inflight, start_backends

pytestmark = pytest.mark.e2e
ROLES = ("prefill", "decode", "decode")


@dataclass
class PD:
    gw: Gateway
    sim: int
    client: openai.OpenAI

    def fault(self, i: int, **f: Any) -> None:
        assert http_json("POST", f"http://127.0.0.1:{self.sim + i}/sim/faults", f)[0] == 200

    def chat(self, n: int, stream: bool = True) -> tuple[str, str, int]:
        """One request with a prompt no backend has seen: its route, backend and cached tokens."""
        messages: Any = [{"role": "user", "content": " ".join(f"pd{n}-{j}" for j in range(1500))}]
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
        )
        if stream:
            chunks = list(raw.parse())
            usage = chunks[-1].usage
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        return raw.headers["X-Kvgate-Route"], raw.headers["X-Kvgate-Backend"], cached

    def requests(self, i: int) -> float:
        text = http_json("GET", f"http://127.0.0.1:{self.sim + i}/metrics")[1]
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


@pytest.fixture
def pd(stack: Supervisor) -> Iterator[PD]:
    redis_port = free_port()
    stack.start_redis(redis_port)
    sim = start_backends(stack, 3, "--role", ",".join(ROLES))
    backends = [
        {"id": f"sim-{i}", "url": f"http://127.0.0.1:{sim + i}", "labels": {"role": role}}
        for i, role in enumerate(ROLES)
    ]
    gw = Gateway(
        stack, "gw", redis_port, sim, 3, extra={"backends": backends, "disaggregation": {"models": ["*"]}}
    )
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield PD(gw, sim, client)


@pytest.mark.parametrize("stream", [True, False])
def test_the_prefill_leg_runs_on_the_prefiller_and_the_decoder_reads_its_kv(pd: PD, stream: bool) -> None:
    route, backend, cached = pd.chat(1, stream)
    assert route.startswith("pd/") and backend in ("sim-1", "sim-2")
    # A prompt never seen before arrives at the decoder with its KV computed: the prefill leg's.
    assert cached >= 1400  # all but the last partial block
    assert pd.requests(0) == 1  # the prefill leg, one token
    wait_until(lambda: inflight(pd.gw) == (0, 0, 0), timeout=2)


def test_a_failing_prefiller_means_co_located_service_never_an_error(pd: PD) -> None:
    pd.fault(0, fail_rate=1.0, fail_status=503)
    route, backend, cached = pd.chat(2)
    assert route.endswith("/colocated") and backend in ("sim-1", "sim-2")
    assert cached == 0  # the decoder prefilled it all itself
    pd.fault(0, fail_rate=0.0, refuse_for_s=30.0)  # the prefiller is gone altogether
    wait_until(lambda: refuses(pd.sim), timeout=5)
    route, _, cached = pd.chat(3)
    assert route.endswith("/colocated") and cached == 0
    wait_until(lambda: inflight(pd.gw) == (0, 0, 0), timeout=2)


def test_a_decoder_failing_before_its_first_byte_is_retried_on_the_other(pd: PD) -> None:
    pd.fault(2, fail_rate=1.0, fail_status=503)
    backends = {pd.chat(10 + n)[1] for n in range(4)}
    assert backends == {"sim-1"}  # every request whose first choice was sim-2 went on to sim-1


def test_a_client_error_is_the_decoders_to_answer_and_blames_no_backend(pd: PD) -> None:
    with pytest.raises(openai.BadRequestError):
        pd.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x " * 200_000}], max_tokens=4
        )
    assert pd.gw.sidecar.backends()["sim-0"]["errors"] == 0
