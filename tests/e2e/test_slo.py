"""Admission by TTFT objective end to end: the official openai client -> real Nginx with kvgate's Lua
-> the real sidecar -> simulated vLLM backends. Once the sidecar has learned how fast the backends
answer, a request that cannot make its objective is refused with 429, Retry-After and the code
``slo_shed`` when its class may be shed, and served late when it may not."""

from __future__ import annotations

import openai
import pytest
from kvgate.tools.launcher import Supervisor

from tests.conftest import MODEL, wait_until
from tests.e2e.test_queue import gateway, idle, metric

pytestmark = pytest.mark.e2e
WARM = 14  # streams answered before the objective bites: MIN_SAMPLES (5) per backend and more


def test_past_its_objective_a_sheddable_request_gets_429_and_another_is_served(stack: Supervisor) -> None:
    # 1 ms to the first token: no backend makes it once the sidecar knows how fast they answer.
    slo = {"objectives": [{"ttft_ms": 1}], "sheddable_priority": 1}
    gw = gateway(stack, {"slo": slo, "routing": {"policy": "round_robin"}}, client_priority=True)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    messages: list[dict[str, str]] = [{"role": "user", "content": "hello there"}]
    for _ in range(WARM):  # class 0 is never shed: each is served, and teaches the first-byte model
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_headers={"X-Priority": "1"},
        )
    assert refused.value.response.headers["Retry-After"].isdigit()
    assert refused.value.body["code"] == "slo_shed"  # type: ignore[index]
    assert "objective" in refused.value.message
    late = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert late.choices[0].message.content
    assert metric(gw, 'kvgate_slo_verdicts_total{verdict="shed"}') == 1
    assert metric(gw, 'kvgate_slo_requests_total{outcome="shed"}') == 1
    wait_until(idle(gw), timeout=5)
    # Every request routed with an objective ended, met or missed: WARM streams and the late one.
    wait_until(lambda: metric(gw, "kvgate_slo_requests_total") == WARM + 2, timeout=5)
