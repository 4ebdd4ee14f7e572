"""Token ids for the exact index: which bodies can be tokenized, what an answer must look like, and
a real simulator's /tokenize over HTTP within the budget (and past it)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
from kvgate.config import Config
from kvgate.sidecar import build_sidecar
from kvgate.tokenize import TokenSource, token_ids, tokenize_request
from kvgate.tools.readiness import free_port

from vllm_sim import tokenizer
from vllm_sim.facts import InstanceConfig
from vllm_sim.profiles import LLAMA3_8B_H100
from vllm_sim.request import EngineConfig
from vllm_sim.server import Instance

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


def test_which_bodies_are_tokenized() -> None:
    chat = tokenize_request(json.dumps({**CHAT, "add_generation_prompt": True, "stream": True}))
    assert chat == {"model": MODEL, "messages": CHAT["messages"], "add_generation_prompt": True}
    assert tokenize_request(json.dumps({"model": MODEL, "prompt": "once upon"})) == {
        "model": MODEL,
        "prompt": "once upon",
    }
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    for body in (
        {**CHAT, "cache_salt": "tenant-a"},  # an extra key of the first block
        {"model": MODEL, "messages": [image]},  # images are hashed into the blocks too
        {"model": MODEL, "prompt": [1, 2, 3]},
        {"model": MODEL},
        [1, 2],
    ):
        assert tokenize_request(json.dumps(body)) is None
    assert tokenize_request("{not json") is None


def test_an_answer_is_a_list_of_token_ids_or_nothing() -> None:
    assert token_ids({"tokens": [1, 2, 3]}) == (1, 2, 3)
    for bad in ({"tokens": [1, "2"]}, {"tokens": [True]}, {"tokens": [-1]}, {"tokens": "123"}, {}, [1]):
        assert token_ids(bad) is None


def test_a_simulators_tokenize_gives_the_ids_its_engine_uses_and_a_slow_one_is_given_up() -> None:
    async def scenario() -> None:
        port = free_port()
        inst = Instance(InstanceConfig(MODEL, EngineConfig.from_profile(LLAMA3_8B_H100)))
        await inst.start("127.0.0.1", port)
        cfg = Config.from_mapping(
            {
                "redis": {"url": None},
                "kv_index": {"tokenize_timeout_ms": 200},
                "backends": [
                    {"id": "s", "url": f"http://127.0.0.1:{port}", "kv_events": "tcp://127.0.0.1:1"}
                ],
            }
        )
        sc = build_sidecar(cfg, None)
        sc.registry.set_membership((b, False) for b in cfg.backends)
        sc.registry.backends["s"].healthy = True
        try:
            async with aiohttp.ClientSession() as session:
                tok = TokenSource(cfg.kv_index, sc.registry, sc.metrics, session)
                ids = await tok.tokens(MODEL, json.dumps(CHAT))
                assert ids == tuple(tokenizer.encode(tokenizer.render_chat(CHAT["messages"])))
                # A backend that accepts the connection and never answers: given up after 200 ms.
                held: list[asyncio.StreamWriter] = []

                async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                    held.append(writer)

                silent = await asyncio.start_server(hold, "127.0.0.1", 0)
                slow = dataclasses.replace(
                    cfg.backends[0], url=f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
                )
                sc.registry.set_membership([(slow, False)])
                sc.registry.backends["s"].healthy = True
                assert await tok.tokens(MODEL, json.dumps(CHAT)) is None
                for w in held:
                    w.close()
                silent.close()
                await silent.wait_closed()
                assert await tok.tokens(MODEL, "x" * (300 << 10)) is None  # past max_prompt_bytes
                sc.registry.backends["s"].healthy = False
                assert await tok.tokens(MODEL, json.dumps(CHAT)) is None  # nobody to ask
        finally:
            await inst.stop()
        counts = {
            r: sc.metrics.registry.get_sample_value("kvgate_tokenize_total", {"result": r})
            for r in ("ok", "timeout", "skipped")
        }
        assert counts == {"ok": 1.0, "timeout": 1.0, "skipped": 2.0}

    asyncio.run(scenario())
