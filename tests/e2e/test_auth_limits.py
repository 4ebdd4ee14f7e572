"""API keys at the gateway and rate limits by requests and tokens, through real Nginx, sidecars and
Redis: keys stored hashed and checked by Nginx even without its sidecar (fail closed), 429 with
Retry-After as OpenAI-style JSON, limits shared by replicas."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kvgate.config import hash_key
from kvgate.limits import WINDOW_S
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, chat, inflight, start_backends

pytestmark = pytest.mark.e2e
KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-9876543210"
# Limits are counted by the sidecar's decisions; a request whose decision misses Nginx's budget falls
# open and is served at once (routing must not stop for a slow sidecar), counted only at its end. The
# tests that count give the sidecar a budget a loaded machine cannot miss, so that every request is
# a decision counted before it runs.
COUNTED_MS = 3000


def call(url: str, key: str | None, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body or chat(1, 1)).encode(),
        method="POST",
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, dict(exc.headers), json.loads(exc.read())
        finally:
            exc.close()


def inside_one_window(seconds: float) -> None:
    """Limits count per wall-clock minute (fixed windows): a test that counts must not straddle an
    edge, where a fresh window would admit a whole new allowance. Wait for the next one if needed."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < seconds:
        time.sleep(left + 0.05)


def keyed(**limits: Any) -> dict[str, Any]:
    return {
        "auth": {
            "keys": [
                {"name": "team-a", "sha256": hash_key(KEY_A)},
                {"name": "team-b", "sha256": hash_key(KEY_B), "rate": {"requests_per_minute": 3}},
            ]
        },
        "limits": limits,
    }


def test_keys_are_checked_by_nginx_even_while_the_sidecar_is_away(stack: Supervisor) -> None:
    sim = start_backends(stack, 2)
    gw = Gateway(stack, "gw", None, sim, 2, extra=keyed())
    assert call(gw.url, KEY_A)[0] == 200
    status, headers, body = call(gw.url, None)
    assert (
        status == 401
        and body["error"]["code"] == "invalid_api_key"
        and "Bearer" in headers["WWW-Authenticate"]
    )
    assert call(gw.url, "sk-wrong")[0] == 401
    stack.kill(gw.sidecar.name)  # fail-open routing, but auth still holds
    assert call(gw.url, "sk-wrong")[0] == 401
    status, headers, _ = call(gw.url, KEY_A)
    assert status == 200 and headers["X-Kvgate-Route"] == "fail-open"


def get(url: str, key: str | None, scheme: str = "Bearer") -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"{scheme} {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code)


def test_with_keys_on_the_model_list_and_metrics_need_one_too_unless_opened(stack: Supervisor) -> None:
    """/v1/models and /kvgate/metrics answered anyone once keys were on; now they need a key unless
    auth.open_routes names them. /health and /kvgate/health stay open for probes. The scheme is
    case-insensitive (BEARER and bearer are Bearer)."""
    sim = start_backends(stack, 1)
    gw = Gateway(stack, "gw", None, sim, 1, extra=keyed())
    for path in ("/v1/models", "/kvgate/metrics"):
        assert get(gw.url + path, None) == 401 and get(gw.url + path, "sk-wrong") == 401
        assert get(gw.url + path, KEY_A) == 200
    assert get(gw.url + "/health", None) == 200 and get(gw.url + "/kvgate/health", None) == 200
    for scheme in ("BEARER", "bearer", "BeArEr"):
        assert get(gw.url + "/v1/models", KEY_A, scheme) == 200, scheme
    assert get(gw.url + "/v1/models", KEY_A, "Basic") == 401
    opened = Gateway(
        stack,
        "open",
        None,
        sim,
        1,
        extra={**keyed(), "auth": {**keyed()["auth"], "open_routes": ["metrics"]}},
    )
    assert get(opened.url + "/kvgate/metrics", None) == 200 and get(opened.url + "/v1/models", None) == 401


def test_route_headers_are_off_unless_the_config_turns_them_on(stack: Supervisor) -> None:
    """They name the backend that serves each session: off by default (the example config always said
    so; the code did not)."""
    sim = start_backends(stack, 1)
    gw = Gateway(stack, "gw", None, sim, 1, route_headers=None)
    status, headers, _ = call(gw.url, None)
    assert status == 200 and "X-Kvgate-Backend" not in headers and "X-Kvgate-Route" not in headers


def test_the_backend_never_sees_the_gateway_key(stack: Supervisor) -> None:
    """vLLM started with its own --api-key would refuse the gateway's key; it is not forwarded."""
    sim = start_backends(stack, 1)
    gw = Gateway(stack, "gw", None, sim, 1, extra=keyed())
    conf = stack.run_dir / "gw-nginx-conf" / "kvgate-proxy.conf"
    assert 'proxy_set_header Authorization "";' in conf.read_text()
    assert call(gw.url, KEY_A)[0] == 200


def test_a_key_over_its_rate_gets_429_with_retry_after_and_others_go_on(stack: Supervisor) -> None:
    sim = start_backends(stack, 2)
    gw = Gateway(stack, "gw", None, sim, 2, decision_timeout_ms=COUNTED_MS, extra=keyed())
    inside_one_window(10.0)
    assert [call(gw.url, KEY_B)[0] for _ in range(3)] == [200, 200, 200]
    status, headers, body = call(gw.url, KEY_B)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["type"] == "RateLimitError" and 1 <= int(headers["Retry-After"]) <= 60
    assert call(gw.url, KEY_A)[0] == 200  # team-a has no limit


def test_token_limits_count_prompt_and_max_tokens_then_the_real_usage(stack: Supervisor) -> None:
    sim = start_backends(stack, 1)
    gw = Gateway(
        stack,
        "gw",
        None,
        sim,
        1,
        decision_timeout_ms=COUNTED_MS,
        extra=keyed(per_key={"tokens_per_minute": 2000}),
    )
    small = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    inside_one_window(10.0)
    statuses = [call(gw.url, KEY_A, small)[0] for _ in range(12)]
    assert statuses == [200] * 12  # ~ 10 tokens each, counted at admission as prompt + 2
    big = {**small, "max_tokens": 1900}
    assert call(gw.url, KEY_A, big)[0] == 200  # admitted: counted as ~1900
    status, _, _ = call(gw.url, KEY_A, big)
    assert status == 429


def stream(url: str, key: str, body: dict[str, Any]) -> tuple[int, int, str]:
    """(status, tokens received, the raw stream) of one streamed chat through the gateway."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, 0, exc.read().decode()
    tokens = 0
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                tokens += len((choice.get("delta", {}).get("content") or "").split())
    return 200, tokens, text


def streaming_gateway(stack: Supervisor, **sections: Any) -> Gateway:
    """A gateway whose keys may use 1,500 tokens a minute, over a backend that decodes 20x fast;
    ``sections``: more of its config."""
    sim = start_backends(stack, 1, "--max-model-len", "4096", "--time-scale", "20")
    return Gateway(
        stack,
        "gw",
        None,
        sim,
        1,
        decision_timeout_ms=COUNTED_MS,
        extra={**keyed(per_key={"tokens_per_minute": 1500}), **sections},
    )


def test_a_stream_is_counted_by_what_it_generated_and_never_outruns_its_keys_budget(
    stack: Supervisor,
) -> None:
    """A plain stream sends no usage, and one without max_tokens generates up to the model's length:
    a key limited to 1,500 tokens a minute once streamed thousands. Now the gateway gives such a
    request the key's remaining budget as max_tokens, asks vLLM for the stream's usage (and strips it
    when the client did not ask), and counts what was generated."""
    gw = streaming_gateway(stack)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell a long story"}],
        "ignore_eos": True,
    }
    inside_one_window(15.0)
    status, tokens, text = stream(gw.url, KEY_A, body)
    assert status == 200 and 1000 < tokens <= 1500, (status, tokens)
    assert '"usage"' not in text and text.rstrip().endswith("data: [DONE]")  # the client did not ask
    status, _, text = stream(gw.url, KEY_A, body)
    assert status == 429, (status, text[:300])  # the budget is spent: what was generated counted
    # A client that asks for the usage gets it, as vLLM sends it.
    status, tokens, text = stream(
        gw.url, KEY_B, {**body, "max_tokens": 5, "stream_options": {"include_usage": True}}
    )
    assert status == 200 and tokens == 5 and '"completion_tokens":5' in text.replace(" ", ""), text[-400:]


def test_n_completions_share_what_the_key_has_left(stack: Supervisor) -> None:
    """vLLM generates up to max_tokens for each of a request's n completions. The gateway gave a
    request without max_tokens the key's whole remaining budget, so n = 4 generated four times what
    the key had left; now the budget is shared among them, and all four are counted."""
    gw = streaming_gateway(stack)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "four stories"}], "ignore_eos": True}
    inside_one_window(15.0)
    status, tokens, text = stream(gw.url, KEY_A, {**body, "n": 4})
    assert status == 200 and 1000 < tokens <= 1500, (status, tokens, text[-300:])
    assert {json.loads(x[6:])["choices"][0]["index"] for x in text.splitlines() if '"choices":[{' in x} == {
        0,
        1,
        2,
        3,
    }
    status, _, text = stream(gw.url, KEY_A, {**body, "max_tokens": 20})
    assert status == 429, (status, text[:300])  # the four completions' tokens were all counted
    wait_until(lambda: inflight(gw) == (0, 0, 0), timeout=5)  # the four it counted in flight came down


def sidecar_sample(gw: Gateway, name: str, **labels: str) -> float:
    """One sample of the gateway's sidecar metrics (0 when absent)."""
    text = http_json("GET", gw.sidecar.http + "/metrics")[1]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def test_what_nginx_routes_while_the_sidecar_is_away_counts_against_the_key_once_it_is_back(
    stack: Supervisor,
) -> None:
    """Nginx routes on its own while its sidecar is away, and no decision counts those requests: a
    key could use far past its limit, and its fair share, whenever the sidecar was down or slow, and
    go on as if it had not. Now their ends carry the key, wait in Nginx's outbox, and count by their
    usage once the sidecar is back (streams too: the gateway asks for their usage, and strips it)."""
    gw = streaming_gateway(stack, queue={"enabled": True, "order": "fair", "fair_output_weight": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell a story"}], "ignore_eos": True}
    inside_one_window(30.0)
    stack.kill(gw.sidecar.name)
    status, headers, answer = call(gw.url, KEY_A, {**body, "max_tokens": 400})
    assert status == 200 and headers["X-Kvgate-Route"] == "fail-open"
    used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    for _ in range(2):
        status, tokens, text = stream(gw.url, KEY_A, {**body, "max_tokens": 400})
        assert status == 200 and tokens == 400 and '"usage"' not in text, text[-300:]
        used += answer["usage"]["prompt_tokens"] + 400  # the same prompt
    assert 1200 < used <= 1500  # under the key's 1,500 a minute, but not by another 400
    gw.sidecar.start()
    wait_until(lambda: sidecar_sample(gw, "kvgate_failopen_ends_total", tenant="team-a") == 3, timeout=10)
    assert sidecar_sample(gw, "kvgate_tenant_service_tokens_total", tenant="team-a") == used
    status, _, refused = call(gw.url, KEY_A, {**body, "max_tokens": 400})
    assert status == 429 and refused["error"]["code"] == "rate_limit_exceeded", refused
    assert call(gw.url, KEY_B, {**body, "max_tokens": 400})[0] == 200  # another key's budget is whole


def nginx_sample(gw: Gateway, key: str, name: str, **labels: str) -> float:
    """One sample of Nginx's own counters (/kvgate/metrics; 0 when absent)."""
    req = urllib.request.Request(gw.url + "/kvgate/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def test_while_the_sidecar_is_away_nginx_holds_each_key_and_address_to_its_rate(stack: Supervisor) -> None:
    """Counted only at their ends, the requests Nginx routes on its own were never held back: a
    client able to make the sidecar slow could use past its limits for as long as it stayed slow.
    Now Nginx counts them itself against each key's rate (from the keys reply) and the address's,
    and refuses the one over with the same 429 the sidecar gives."""
    sim = start_backends(stack, 2)
    extra = keyed(per_key={"requests_per_minute": 2}, per_client={"requests_per_minute": 4})
    gw = Gateway(stack, "gw", None, sim, 2, extra=extra)
    inside_one_window(30.0)
    stack.kill(gw.sidecar.name)
    answers = [call(gw.url, KEY_A) for _ in range(3)]
    assert [(s, h.get("X-Kvgate-Route")) for s, h, _ in answers[:2]] == [(200, "fail-open")] * 2
    status, headers, body = answers[2]
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body  # the key's 2
    assert 1 <= int(headers["Retry-After"]) <= 60
    # team-b's own rate is 3 a minute, but the address has had its 4 (a refused request is not one).
    assert [call(gw.url, KEY_B)[0] for _ in range(3)] == [200, 200, 429]
    assert nginx_sample(gw, KEY_B, "kvgate_gateway_failopen_limited_total", by="key") == 1
    assert nginx_sample(gw, KEY_B, "kvgate_gateway_failopen_limited_total", by="address") == 1


def test_a_paused_sidecar_counts_each_request_nginx_routed_meanwhile_once(stack: Supervisor) -> None:
    """A sidecar stopped for a while (starved of CPU, paused) answers every decision too late: Nginx
    routes each request on its own and reports the decision dropped, and that drop may reach the
    sidecar before or after the decide it drops. Either way each request counts once, at its end:
    the late decisions give back what they counted, and nothing waits for an end that will not come."""
    gw = streaming_gateway(stack, queue={"enabled": True, "order": "fair", "fair_output_weight": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell a story"}], "ignore_eos": True}
    inside_one_window(40.0)
    pid = stack.procs[gw.sidecar.name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool:  # each waits out the decision budget, then falls open
            answers = list(pool.map(lambda _: call(gw.url, KEY_A, {**body, "max_tokens": 300}), range(4)))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [(s, h["X-Kvgate-Route"]) for s, h, _ in answers] == [(200, "fail-open")] * 4
    prompt = answers[0][2]["usage"]["prompt_tokens"]
    used = 4 * (prompt + 300)
    wait_until(lambda: sidecar_sample(gw, "kvgate_failopen_ends_total", tenant="team-a") == 4, timeout=10)
    left = 1500 - used
    status, _, refused = call(gw.url, KEY_A, {**body, "max_tokens": left + 50})
    assert status == 429 and refused["error"]["code"] == "rate_limit_exceeded", refused  # counted
    status, _, answer = call(gw.url, KEY_A, {**body, "max_tokens": left - prompt - 20})
    assert status == 200, answer  # counted once: the late decisions gave their count back

    def awaiting() -> tuple[int, int]:  # the decided one's end arrives within an outbox flush
        structures = gw.sidecar.admin("GET", "/debug/memory")[1]["structures"]
        return structures["admitted_awaiting_usage"], structures["tenant_charges_awaiting_end"]

    wait_until(lambda: awaiting() == (0, 0) and inflight(gw) == (0, 0, 0), timeout=5)


def test_replicas_share_a_limit_through_redis(stack: Supervisor) -> None:
    redis_port = free_port()
    stack.start_redis(redis_port)
    sim = start_backends(stack, 2)
    extra = keyed(per_client={"requests_per_minute": 8}, sync_ms=100)
    a = Gateway(stack, "a", redis_port, sim, 2, decision_timeout_ms=COUNTED_MS, extra=extra)
    b = Gateway(stack, "b", redis_port, sim, 2, decision_timeout_ms=COUNTED_MS, extra=extra)
    got = []
    inside_one_window(15.0)
    for i in range(12):
        got.append(call((a if i % 2 else b).url, KEY_A)[0])
        # Two sync intervals and a margin: one replica's next sync pushes the count, the other's next
        # one pulls it, so the other replica has heard of this request before the next is sent.
        time.sleep(0.3)
    # Apart, the two replicas would admit all 12.
    assert got == [200] * 8 + [429] * 4, got
