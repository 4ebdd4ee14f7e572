"""The gateway queue end to end: the official openai client -> real Nginx with kvgate's Lua -> the
real sidecar with the queue on -> simulated vLLM backends. Backends saturate after one request
awaiting prefill, so a burst waits at the gateway and is bound to a backend as one frees up."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import openai
import pytest
from kvgate.config import hash_key
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, inflight, priorities, start_backends

pytestmark = pytest.mark.e2e
BURST = 12


def gateway(stack: Supervisor, extra: dict[str, Any] | None = None, **queue: Any) -> Gateway:
    redis_port = free_port()
    stack.start_redis(redis_port)
    sim = start_backends(stack, 2)
    return Gateway(
        stack,
        "gw",
        redis_port,
        sim,
        2,
        extra={"queue": {"enabled": True, "heartbeat_ms": 100, **queue}, **(extra or {})},
        # One request awaiting prefill saturates a backend: a burst must wait at the gateway.
        saturation_prefill_tokens=512,
    )


def prompt(i: int) -> str:
    return " ".join(f"q{i}-w{j}" for j in range(700))  # ~5 KB: above the 512-token budget alone


def burst(url: str, n: int, stream: bool = True, key: str = "unused") -> list[Any]:
    """``n`` chat requests at once through the openai client; each result is the text or the error."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    results: list[Any] = [None] * n

    def one(i: int) -> None:
        try:
            messages: Any = [{"role": "user", "content": prompt(i)}]
            if stream:
                chunks = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=8, stream=True
                )
                results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                results[i] = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        except openai.APIError as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def metric(gw: Gateway, name: str) -> float:
    text = http_json("GET", gw.sidecar.http + "/metrics")[1]
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def idle(gw: Gateway) -> Callable[[], bool]:
    return lambda: inflight(gw) == (0, 0, 0) and metric(gw, "kvgate_queue_depth") == 0


def test_a_burst_waits_at_the_gateway_and_every_request_is_served(stack: Supervisor) -> None:
    gw = gateway(stack)
    results = burst(gw.url, BURST)
    assert all(isinstance(r, str) and r for r in results), results
    waited = metric(gw, "kvgate_queue_wait_seconds_count")
    assert waited >= BURST // 2, waited  # two backends, one prefill each: most of the burst queued
    assert metric(gw, "kvgate_queue_rejected_total") == 0
    wait_until(idle(gw), timeout=2)


def test_past_the_queue_bound_clients_get_429_with_retry_after(stack: Supervisor) -> None:
    gw = gateway(stack, max_size=2)
    results = burst(gw.url, BURST, stream=False)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert refused and served and len(refused) + len(served) == BURST, results
    for r in refused:
        assert r.response.headers["Retry-After"].isdigit()
        assert r.body["code"] == "queue_full"  # type: ignore[index]
    assert metric(gw, "kvgate_queue_rejected_total") == len(refused)
    wait_until(idle(gw), timeout=2)


def test_a_sidecar_killed_while_requests_wait_never_strands_them(stack: Supervisor) -> None:
    gw = gateway(stack, max_wait_ms=30_000)
    # Every decision waits: a backend saturates at once, and the burst outnumbers them.
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(burst(gw.url, BURST)))
    runner.start()
    wait_until(lambda: metric(gw, "kvgate_queue_depth") > 0, timeout=10, every=0.01)
    os.kill(stack.procs[gw.sidecar.name].pid, signal.SIGKILL)
    t0 = time.monotonic()
    runner.join(60)
    assert all(isinstance(r, str) and r for r in results), results
    assert time.monotonic() - t0 < 20


def test_the_clients_priority_is_forwarded_to_the_backend(stack: Supervisor) -> None:
    """client_priority + forward_priority: X-Priority reaches vLLM as the body's priority (the
    backends count the requests by the priority they carried; an FCFS server takes and ignores it)."""
    gw = gateway(stack, client_priority=True, forward_priority=True)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = priorities(gw)
    for header in ({"X-Priority": "3"}, {"X-Priority": "0"}, {}):
        status, answer = http_json("POST", gw.url + "/v1/chat/completions", body, header)
        assert status == 200, (header, answer)
    # class 0 is vLLM's default: nothing to forward, and the body names none
    assert priorities(gw) - before == Counter({3: 1, 0: 2})


@pytest.mark.parametrize("client_priority", [True, False])
def test_with_the_sidecar_gone_the_priority_is_still_forwarded(
    stack: Supervisor, client_priority: bool
) -> None:
    """Nginx routing on its own (the sidecar killed) writes the priority the sidecar would have: the
    client's where clients may set it, else its key's class, over a priority the body names; none for
    class 0. (The backends count the requests by the priority they carried.)"""
    classed, plain = "sk-priority-class-0001", "sk-default-class-00002"
    keys = {
        "keys": [
            {"name": "classed", "sha256": hash_key(classed), "priority": 2},
            {"name": "plain", "sha256": hash_key(plain)},
        ]
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    gw = gateway(stack, {"auth": keys}, client_priority=client_priority, forward_priority=True)
    chat = gw.url + "/v1/chat/completions"
    wait_until(lambda: http_json("POST", chat, body, bearer(plain))[0] == 200, timeout=10)
    stack.kill(gw.sidecar.name)
    # (the headers, the body's own priority, what the backend gets where clients choose, where not)
    cases = (
        ({**bearer(plain), "X-Priority": "3"}, None, 3, 0),  # the client may not choose: class 0
        (bearer(classed), None, 2, 2),
        (bearer(classed), 0, 0, 2),
        (bearer(plain), 3, 3, 0),  # its key's class 0 replaces the 3 it wrote
    )
    for headers, asked, if_chosen, if_not in cases:
        before = priorities(gw)
        status, answer = http_json(
            "POST", chat, body if asked is None else {**body, "priority": asked}, headers
        )
        assert status == 200, answer
        got = if_chosen if client_priority else if_not
        assert priorities(gw) - before == Counter({got: 1}), (headers, asked)
    text = http_json("GET", gw.url + "/kvgate/metrics", None, bearer(plain))[1]
    fell_open = re.findall(r'^kvgate_gateway_failopen_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    assert sum(float(n) for _, n in fell_open) == 4, fell_open


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_one_key_flooding_the_queue_leaves_the_other_keys_their_room(stack: Supervisor) -> None:
    """One key sent all its requests at once and held every slot; another key's requests all got
    429 queue_full. Now a key holds at most its share (here half of 8): the flood's excess is
    refused by name, the other key's requests wait their turn and are all served."""
    flood_key, quiet_key = "sk-flooding-tenant-0001", "sk-quiet-tenant-000002"
    keys = {
        "keys": [
            {"name": "flood", "sha256": hash_key(flood_key)},
            {"name": "quiet", "sha256": hash_key(quiet_key)},
        ]
    }
    gw = gateway(stack, {"auth": keys}, max_size=8, max_key_share=0.5, max_wait_ms=30_000)
    results: dict[str, list[Any]] = {}
    flood = threading.Thread(target=lambda: results.setdefault("flood", burst(gw.url, 16, False, flood_key)))
    flood.start()
    wait_until(lambda: metric(gw, "kvgate_queue_depth") >= 4, timeout=10, every=0.01)
    results["quiet"] = burst(gw.url, 4, False, quiet_key)
    flood.join(60)
    assert all(not isinstance(r, Exception) for r in results["quiet"]), results["quiet"]
    refused = [r for r in results["flood"] if isinstance(r, openai.RateLimitError)]
    assert refused and all("share of the gateway queue" in r.message for r in refused), results["flood"]
    assert metric(gw, "kvgate_queue_rejected_total") == len(refused)
    wait_until(idle(gw), timeout=2)


def test_a_long_prompt_waits_its_gather_time_and_a_short_one_does_not(stack: Supervisor) -> None:
    """``queue.gather_ms`` through Nginx: a prompt over the prefill budget waits that long at the
    gateway before it is placed (the dispatcher is woken when the wait ends, long before its next
    tick), so a short one arriving with it goes first; the short one is not held."""
    gw = gateway(stack, order="shortest", gather_ms=400)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def first_token(content: str) -> float:
        t0 = time.monotonic()
        messages: Any = [{"role": "user", "content": content}]
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                return time.monotonic() - t0
        raise AssertionError("no token")

    waited_before = metric(gw, "kvgate_queue_wait_seconds_count")
    assert first_token("hello there") < 0.35  # short: placed at once
    assert metric(gw, "kvgate_queue_wait_seconds_count") == waited_before
    long = first_token(prompt(1))  # ~5 KB: over the 512-token budget
    assert 0.4 <= long < 2.0, long
    wait_until(lambda: metric(gw, "kvgate_queue_wait_seconds_count") == waited_before + 1, timeout=5)
    wait_until(idle(gw), timeout=10)


def test_the_fair_order_charges_a_tenant_what_its_streams_wrote_not_what_they_asked(
    stack: Supervisor,
) -> None:
    """Streams asking for 2,000 tokens each that stop at their end of sequence (the simulator draws
    it near 128): Nginx asks the backend for each stream's usage, strips it from what the client
    gets (the client did not ask), and reports it; the fair order's count of the tenant
    (``kvgate_tenant_attained_tokens``) is then its prompts plus the output written, not the output
    asked for (``kvgate_tenant_service_tokens``, the charges when routed)."""
    gw = gateway(stack, order="fair", fair_output_weight=4)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    written = 0
    for i in range(4):
        messages: Any = [{"role": "user", "content": f"tell me a story, number {i}"}]
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2000, stream=True)
        )
        assert all(c.usage is None for c in chunks)  # not asked for, not sent
        written += sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
        wait_until(idle(gw), timeout=2)  # its end (with the usage) has reached the sidecar
    assert 0 < written < 4 * 1000  # they stopped well short of what they asked for
    prompts = metric(gw, "kvgate_tenant_routed_tokens_total")
    # The first was charged, when routed, for all it asked; the next for the share the first wrote.
    charged = metric(gw, "kvgate_tenant_service_tokens_total")
    assert prompts + 4 * 2000 < charged < prompts + 4 * 2000 + 3 * 4 * 2000 / 4, charged
    counted = metric(gw, "kvgate_tenant_attained_tokens")
    # Decayed over the test's seconds (a 60 s half-life), else exact.
    assert 0.9 * (prompts + 4 * written) <= counted <= prompts + 4 * written + 1, (counted, prompts, written)
    # A request its backend refuses (prompt and answer past the model's context) wrote nothing: its
    # charge keeps its prompt and gives its output back (charged when routed at ~60,000 x 4 tokens).
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10**6)
    wait_until(idle(gw), timeout=2)
    refused = metric(gw, "kvgate_tenant_routed_tokens_total") - prompts
    assert metric(gw, "kvgate_tenant_service_tokens_total") - charged > 10**5
    after = metric(gw, "kvgate_tenant_attained_tokens")
    assert 0.99 * counted < after <= counted + refused + 1, (after, counted, refused)


def test_a_tenant_header_an_edge_sets_names_the_tenant_even_for_what_nginx_routes_alone(
    stack: Supervisor,
) -> None:
    """Behind an edge that authenticates clients and names their tenant in a header
    (``queue.tenant_header``), the fair order counts that tenant: decided requests when routed, and
    one Nginx routed on its own while the sidecar was away at its end, once the sidecar is back. A
    value that is not one short name is refused with a JSON 400, never counted as a tenant."""
    gw = gateway(stack, order="fair", tenant_header="X-Tenant-ID")

    def served(tenant: str, name: str = "kvgate_tenant_service_tokens_total") -> float:
        text = http_json("GET", gw.sidecar.http + "/metrics")[1]
        found = re.search(rf'^{name}{{tenant="{re.escape(tenant)}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=gw.url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=30,
            default_headers={"X-Tenant-ID": tenant},
        )

    messages: Any = [{"role": "user", "content": "hello"}]
    for tenant in ("acme.eu:prod-1", "globex"):
        client(tenant).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert served("acme.eu:prod-1") > 0 and served("globex") > 0 and served("anonymous") == 0
    for bad in ("acme corp", "a" * 65, "acme/corp"):
        with pytest.raises(openai.BadRequestError) as refused:
            client(bad).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert "X-Tenant-ID header" in refused.value.message
    stack.kill(gw.sidecar.name)
    answer = client("globex").chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    assert answer.headers["X-Kvgate-Route"] == "fail-open"
    gw.sidecar.start()
    wait_until(lambda: served("globex", "kvgate_failopen_ends_total") == 1, timeout=10)
    assert served("anonymous", "kvgate_failopen_ends_total") == 0
