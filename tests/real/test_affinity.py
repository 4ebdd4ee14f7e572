"""Does kvgate keep a conversation where vLLM's own prefix cache holds it? Measured with vLLM's own
counters (``vllm:prefix_cache_hits_total`` deltas over the fleet), on the same fleet as round robin."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from tests.real.conftest import BLOCK_SIZE, BLOCKS, MODEL, Gateway, RealFleet, Tokens, ids, post

pytestmark = pytest.mark.real


def conversation(
    gw: Gateway,
    fleet: RealFleet,
    tokens: Tokens,
    seed: int,
    turns: int = 10,
    headers: Mapping[str, str] | None = None,
    system: str | None = None,
) -> tuple[float, list[str]]:
    """A chat of ``turns`` turns through ``gw``: each turn resends the history. Returns the share of
    the prompt tokens after turn 1 that vLLM served from its prefix cache, and the backend of each
    turn."""
    messages = [{"role": "system", "content": system or tokens.text(3000, seed)}]
    prompt_after_first, hits_after_first, served = 0, 0.0, []
    for turn in range(turns):
        messages.append({"role": "user", "content": tokens.text(100, seed * 100 + turn)})
        before = fleet.hits()
        status, resp_headers, body = gw.chat(
            {"model": MODEL, "messages": messages, "max_tokens": 16, "ignore_eos": True, "temperature": 0},
            headers,
        )
        assert status == 200, body
        served.append(resp_headers["X-Kvgate-Backend"])
        if turn > 0:
            prompt_after_first += body["usage"]["prompt_tokens"]
            hits_after_first += fleet.hits() - before
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return hits_after_first / prompt_after_first, served


def test_a_conversation_is_served_from_vllms_prefix_cache_through_kvgate(
    fleet: RealFleet, kvgate: Gateway, round_robin: Gateway, tokens: Tokens
) -> None:
    """Ten turns with a session id: at least 90 % of the prompt tokens after turn 1 come from vLLM's
    prefix cache (all on one backend), more than round robin gets on the same fleet."""
    share, served = conversation(kvgate, fleet, tokens, 11, headers={"X-Session-ID": "real-conv-11"})
    rr_share, rr_served = conversation(
        round_robin, fleet, tokens, 12, headers={"X-Session-ID": "real-conv-12"}
    )
    print(f"prefix-cache share after turn 1: kvgate {share:.3f}, round robin {rr_share:.3f}")
    assert len(set(served)) == 1 and len(set(rr_served)) == 2
    assert share >= 0.90 and share > rr_share, (share, rr_share)


def test_prefix_routing_without_a_session_id_keeps_a_shared_system_prompt_conversation_together(
    fleet: RealFleet, kvgate: Gateway, tokens: Tokens
) -> None:
    """No session header: two conversations share one long system prompt (the part every request
    has, which is no signal) and each keeps its own history on one backend from the prompt alone."""
    system = tokens.text(3000, 20)
    for seed in (21, 22):
        share, served = conversation(kvgate, fleet, tokens, seed, system=system)
        assert share >= 0.90 and len(set(served)) == 1, (share, served)


def test_eviction_is_survived_and_the_conversation_is_cached_again_where_it_is_routed(
    fleet: RealFleet, kvgate: Gateway, tokens: Tokens
) -> None:
    """A conversation, then prompts from others beyond both caches (their 2 x 20,480 tokens): the
    conversation's blocks are evicted. Its next turn still goes to its backend and is recomputed
    there; the turn after is served from the cache again."""
    headers = {"X-Session-ID": "real-evicted"}
    messages = [{"role": "system", "content": tokens.text(3000, 30)}]

    def turn(i: int) -> tuple[str, int, float]:
        messages.append({"role": "user", "content": tokens.text(100, 3000 + i)})
        before = fleet.hits()
        status, h, body = kvgate.chat(
            {"model": MODEL, "messages": messages, "max_tokens": 8, "ignore_eos": True, "temperature": 0},
            headers,
        )
        assert status == 200, body
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        return h["X-Kvgate-Backend"], body["usage"]["prompt_tokens"], fleet.hits() - before

    home, _, _ = turn(0)
    assert turn(1)[0] == home
    for i in range(6):  # 6 x 12k tokens of other prompts, spread over both servers
        other = {"role": "user", "content": tokens.text(12_000, 4000 + i)}
        status, _, body = kvgate.chat({"model": MODEL, "messages": [other], "max_tokens": 1})
        assert status == 200, body
    back, prompt, hits = turn(2)
    assert back == home and hits < prompt * 0.5, (back, home, hits, prompt)  # evicted: recomputed
    back, prompt, hits = turn(3)
    assert back == home and hits >= prompt * 0.9, (hits, prompt)


def test_the_index_counts_a_context_held_until_the_servers_cache_has_evicted_it(
    fleet: RealFleet, tokens: Tokens
) -> None:
    """The approximate index (no KV events) in front of one server: a context it sent there is
    credited as held while less than the server's cache (its size from ``vllm:cache_config_info``)
    was sent after it, and no longer once more was; each time, the engine's own hit agrees."""
    cache = BLOCKS * BLOCK_SIZE  # 20,480 tokens
    # A decision that misses its budget falls open to Nginx's ring, unseen by the index: not this test.
    gw = Gateway(fleet.sup, "residency", ids(fleet, [0]), gateway={"decision_timeout_ms": 3000})
    context = tokens.text(3000, 91)

    def send(msgs: list[dict[str, str]]) -> float:
        """The share of the prompt the engine served from its cache."""
        hits = fleet.metric(0, "vllm:prefix_cache_hits_total")
        status, _, body = gw.chat({"model": MODEL, "messages": msgs, "max_tokens": 1})
        assert status == 200, body
        return (fleet.metric(0, "vllm:prefix_cache_hits_total") - hits) / body["usage"]["prompt_tokens"]

    def ask(i: int) -> tuple[float, float]:
        """The share of the prompt the gateway would credit the server with holding (a dry run, in
        its own token estimate), then the share the engine served."""
        msgs = [{"role": "system", "content": context}, {"role": "user", "content": f"question {i}?"}]
        _, _, d = post(gw.sidecar + "/v1/decide", {"body": {"model": MODEL, "messages": msgs}})
        print(f"ask {i}: {d['reuse_captured']} of {d['estimated_prompt_tokens']} tokens credited;", end=" ")
        print(f"the model: {gw.backends()['vllm-0']['prefix_cache_model']}")
        return d["reuse_captured"] / d["estimated_prompt_tokens"], send(msgs)

    try:
        ask(0)
        assert min(ask(1)) > 0.8  # credited and served
        send([{"role": "user", "content": tokens.text(cache // 4, 92)}])
        assert min(ask(2)) > 0.8  # 5,120 tokens sent after it: still in the cache
        # 36,720 tokens sent after it: evicted, and the gateway knows. Wide margins both ways: the
        # gateway sizes the cache in chunks at its learned bytes per token, which may be off.
        for i in range(3):
            send([{"role": "user", "content": tokens.text(cache // 2 + 2000, 93 + i)}])
        assert max(ask(3)) < 0.2
    finally:
        gw.stop()
