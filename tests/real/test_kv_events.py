"""KV events from real vLLM servers: kvgate's block hashes are the ones vLLM publishes; the
sidecar's own tokenizer gives the ids vLLM's /tokenize gives; a gateway with the exact index finds a
prompt on the server that holds it, though no routing decision ever put it there (it was sent to
that server directly); a server restarted is cleared from the index and filled again; and a context
evicted from one server and cached on the other is followed there."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from kvgate.kv_events import BlockRemoved, BlockStored, decode
from kvgate.kv_hashes import chain
from kvgate.local_tokenizer import LocalTokenizer

from tests.real.conftest import (
    BLOCK_SIZE,
    BLOCKS,
    MODEL,
    Gateway,
    RealFleet,
    Tokens,
    block_floor,
    get_text,
    post,
)
from vllm_real.fleet import MODEL_DIR

pytestmark = pytest.mark.real


def publishing(fleet: RealFleet) -> list[dict[str, Any]]:
    """The fleet's servers as a config's backends, each with its KV-event publisher."""
    return [
        {"id": f"vllm-{i}", "url": url, "kv_events": f"tcp://127.0.0.1:{fleet.specs[i].kv_events_port}"}
        for i, url in enumerate(fleet.urls)
    ]


def messages(context: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": context}, {"role": "user", "content": question}]


def chat_body(msgs: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": msgs, "max_tokens": 1, "temperature": 0}


def test_kvgates_block_hashes_are_the_ones_vllm_publishes(fleet: RealFleet, tokens: Tokens) -> None:
    port = fleet.specs[0].kv_events_port
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(1.0)  # the subscription reaches the publisher (ZMQ's slow joiner)
        msgs = messages(tokens.text(1500, uuid.uuid4().int % 10**9), "why?")
        status, _, answer = post(fleet.urls[0] + "/v1/chat/completions", chat_body(msgs))
        assert status == 200, answer
        stored: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(stored) < 1500 // BLOCK_SIZE:
            if sub.poll(200):
                _, _, payload = sub.recv_multipart()
                for ev in decode(payload).events:
                    if isinstance(ev, BlockStored):
                        assert ev.block_size == BLOCK_SIZE
                        stored.extend(ev.hashes)
                    assert not isinstance(ev, BlockRemoved) or ev.hashes
        status, _, tokenized = post(fleet.urls[0] + "/tokenize", {"model": MODEL, "messages": msgs})
        assert status == 200, tokenized
        expected = chain(tokenized["tokens"], BLOCK_SIZE)
        assert len(expected) >= 1500 // BLOCK_SIZE - 1
        assert stored[: len(expected)] == expected
    finally:
        ctx.destroy(linger=0)


def test_the_exact_index_finds_a_prompt_where_a_real_server_holds_it(
    fleet: RealFleet, tokens: Tokens
) -> None:
    backends = publishing(fleet)
    # The tokenize budget is generous: two CPU servers share this machine's cores with the test.
    gw = Gateway(
        fleet.sup,
        "exact",
        backends,
        kv_index={"tokenize_timeout_ms": 2000},
        gateway={"decision_timeout_ms": 3000},
    )
    try:
        contexts = {}
        for i in range(len(fleet.urls)):
            contexts[f"vllm-{i}"] = context = tokens.text(2000, uuid.uuid4().int % 10**9)
            time.sleep(1.0)  # the sidecar's subscription is up before the events it must see
            status, _, answer = post(
                fleet.urls[i] + "/v1/chat/completions", chat_body(messages(context, "q0"))
            )
            assert status == 200, answer
        deadline = time.monotonic() + 15
        want = len(contexts) * (2000 // BLOCK_SIZE - 1)  # blocks held, summed over the backends
        while time.monotonic() < deadline and gw.sidecar_metric("kvgate_kv_index_blocks") < want:
            time.sleep(0.2)
        for bid, context in contexts.items():
            status, headers, answer = gw.chat(chat_body(messages(context, f"and for {bid}?")))
            assert status == 200, answer
            assert headers["X-Kvgate-Backend"] == bid, headers["X-Kvgate-Route"]
        assert gw.sidecar_metric('kvgate_tokenize_total{result="ok"}') >= len(contexts)
    finally:
        gw.stop()


def test_the_sidecars_own_tokenizer_gives_the_ids_vllm_gives(fleet: RealFleet, tokens: Tokens) -> None:
    local = LocalTokenizer(MODEL_DIR)
    msgs = [
        {"role": "system", "content": tokens.text(300, 7)},
        {"role": "user", "content": "what is " + tokens.text(20, 8) + "?"},
        {"role": "assistant", "content": tokens.text(30, 9)},
        {"role": "user", "content": "and then?"},
    ]
    for request in (
        {"messages": msgs},
        {"messages": msgs, "add_generation_prompt": False},
        {"prompt": "Once upon"},
    ):
        status, _, answer = post(fleet.urls[0] + "/tokenize", {"model": MODEL, **request})
        assert status == 200, answer
        assert local.encode(request) == tuple(answer["tokens"]), request


@pytest.mark.restarts_fleet
def test_a_restarted_server_is_cleared_from_the_index_and_filled_again(
    fleet: RealFleet, tokens: Tokens
) -> None:
    gw = Gateway(fleet.sup, "exact-restart", publishing(fleet))
    held = 'kvgate_kv_index_blocks{backend="vllm-1"}'

    def place(n_tokens: int) -> None:
        context = tokens.text(n_tokens, uuid.uuid4().int % 10**9)
        status, _, answer = post(fleet.urls[1] + "/v1/chat/completions", chat_body(messages(context, "q")))
        assert status == 200, answer

    def wait_for(cond: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = get_text(gw.sidecar + "/metrics").splitlines()
        assert cond(), "\n".join(
            x for x in lines if "kv_" in x and not x.startswith("#") and "_created" not in x
        )

    try:
        time.sleep(1.0)  # the sidecar's subscription is up
        place(2500)
        wait_for(lambda: gw.sidecar_metric(held) >= 2500 // BLOCK_SIZE - 1, 15)
        before = gw.sidecar_metric(held)
        fleet.fleet.stop(1)
        fleet.fleet.restart(1)  # a new engine: its cache is empty, its sequence numbers start again
        time.sleep(2.0)  # the subscription reconnects to the new publisher
        place(600)
        wait_for(
            lambda: (
                gw.sidecar_metric('kvgate_kv_event_messages_total{backend="vllm-1",result="restart"}') >= 1
            ),
            15,
        )
        # The old engine's blocks are gone, the new one's are in (the gauge follows within a second).
        wait_for(lambda: 600 // BLOCK_SIZE - 1 <= gw.sidecar_metric(held) < before, 15)
    finally:
        gw.stop()
        if fleet.sup.procs.get(fleet.fleet.names[1]) is None:
            fleet.fleet.restart(1)


@pytest.mark.restarts_fleet
def test_affinity_follows_a_context_through_eviction(fleet: RealFleet, tokens: Tokens) -> None:
    """A tenant's context served through the gateway on one server, then evicted there by other
    prompts (sent to that server directly) and cached on the other server (directly too): its next
    request goes where the context now is, and the engine delivers the hit. The gateway's own
    decisions only ever put the context on the first server, so an index built from them (the
    approximate one) would have sent it back there, to be prefilled again."""
    # A gateway that joins a publisher's stream late has a partial view of it, where the approximate
    # index fills in (and would keep the context where the gateway sent it). Fresh engines: the
    # gateway sees every event from the first, so its views are full.
    for i in range(len(fleet.urls)):
        fleet.fleet.stop(i)
        fleet.fleet.restart(i)
    gw = Gateway(
        fleet.sup,
        "exact-evict",
        publishing(fleet),
        kv_index={"tokenize_timeout_ms": 2000},
        gateway={"decision_timeout_ms": 3000},
        # The prompts sent around the gateway fill one core, and the other server, which this gateway
        # has not seen serve, then missed three health checks of 150 ms in one run: taken out, it was
        # not there to be chosen. This test is about the index; health has its own.
        scrape={"interval_ms": 500, "timeout_ms": 500, "stale_after_ms": 3000},
    )
    ctx = zmq.Context()
    try:
        time.sleep(1.0)  # the sidecar's subscription is up before the events it must see
        context = tokens.text(2000, uuid.uuid4().int % 10**9)
        status, headers, answer = gw.chat(chat_body(messages(context, "first question?")))
        assert status == 200, answer
        first = headers["X-Kvgate-Backend"]
        x, y = int(first.rsplit("-", 1)[1]), 1 - int(first.rsplit("-", 1)[1])
        status, _, tokenized = post(
            fleet.urls[x] + "/tokenize", {"model": MODEL, "messages": messages(context, "first question?")}
        )
        assert status == 200, tokenized
        head = chain(tokenized["tokens"], BLOCK_SIZE)[0]  # the context's first block
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{fleet.specs[x].kv_events_port}")
        time.sleep(1.0)  # ZMQ's slow joiner
        # More new blocks than the server's whole cache, one prompt at a time: every block it held
        # before, the context's included, is reused for these.
        evicted = False
        for i in range(3):
            other = tokens.text(BLOCKS * BLOCK_SIZE // 3 + 2 * BLOCK_SIZE, uuid.uuid4().int % 10**9)
            status, _, answer = post(
                fleet.urls[x] + "/v1/chat/completions", chat_body(messages(other, f"evict {i}")), timeout=120
            )
            assert status == 200, answer
            while sub.poll(100):
                _, _, payload = sub.recv_multipart()
                evicted |= any(
                    isinstance(e, BlockRemoved) and head in e.hashes for e in decode(payload).events
                )
        assert evicted, "the context's first block was never removed from its server"
        stored = f'kvgate_kv_events_total{{backend="vllm-{y}",type="BlockStored"}}'
        before = gw.sidecar_metric(stored)
        status, _, answer = post(
            fleet.urls[y] + "/v1/chat/completions", chat_body(messages(context, "asked elsewhere?"))
        )
        assert status == 200, answer
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and gw.sidecar_metric(stored) <= before:
            time.sleep(0.2)
        time.sleep(0.5)  # the rest of that request's events
        full = [f'kvgate_kv_index_view{{backend="vllm-{i}",view="full"}}' for i in range(len(fleet.urls))]
        deadline = time.monotonic() + 10  # the gauge follows the view within a second
        while time.monotonic() < deadline and not all(gw.sidecar_metric(m) == 1 for m in full):
            time.sleep(0.2)
        assert all(gw.sidecar_metric(m) == 1 for m in full), get_text(gw.sidecar + "/metrics")
        status, headers, answer = gw.chat(chat_body(messages(context, "and now?")))
        assert status == 200, answer
        assert headers["X-Kvgate-Backend"] == f"vllm-{y}", headers["X-Kvgate-Route"]
        assert headers["X-Kvgate-Route"] == "prefix"
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= block_floor(1500), answer["usage"]
    finally:
        ctx.destroy(linger=0)
        gw.stop()
