"""vLLM's routes through the gateway, answered by a real vLLM as they are without it."""

from __future__ import annotations

import json

import openai
import pytest

from tests.real.conftest import MODEL, Gateway, RealFleet, get_text, post

pytestmark = pytest.mark.real


def test_generation_routes_answer_through_the_gateway(kvgate: Gateway) -> None:
    """Chat and completions (streamed and not) through the official openai client."""
    client = openai.OpenAI(base_url=kvgate.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "question answer"}], max_tokens=5
    )
    assert chat.choices[0].message.content is not None and chat.usage is not None
    assert chat.usage.completion_tokens >= 1
    pieces = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "question"}],
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert sum(1 for p in pieces if p.choices and p.choices[0].delta.content) >= 1
    text = client.completions.create(model=MODEL, prompt="the answer of", max_tokens=5)
    assert text.choices[0].text is not None and text.usage is not None
    streamed = list(client.completions.create(model=MODEL, prompt="the question", max_tokens=3, stream=True))
    assert streamed
    # n completions (each an engine request in vLLM), whole and streamed by index; a bound past 128
    several = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "three answers"}], max_tokens=4, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in several.choices] == [0, 1, 2] and several.usage is not None
    assert several.usage.completion_tokens == 12
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two answers"}], max_tokens=3, n=2,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    tokens = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.content]
    assert sorted(set(tokens)) == [0, 1], tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, n=129
        )
    assert refused.value.body["param"] == "n", refused.value.body  # type: ignore[index]


def test_responses_answer_and_a_follow_up_goes_back_to_the_backend_that_stored_it(
    fleet: RealFleet, kvgate: Gateway
) -> None:
    """vLLM 0.32 serves /v1/responses and stores each response on its server: the next turn's
    previous_response_id must reach that server, whichever backend the gateway would pick."""
    status, headers, first = post(
        kvgate.url + "/v1/responses", {"model": MODEL, "input": "question", "max_output_tokens": 4}
    )
    assert status == 200 and first["id"].startswith("resp_"), first
    home = headers["X-Kvgate-Backend"]
    for _ in range(4):
        status, headers, nxt = post(
            kvgate.url + "/v1/responses",
            {
                "model": MODEL,
                "input": "and then",
                "previous_response_id": first["id"],
                "max_output_tokens": 4,
            },
        )
        assert status == 200 and headers["X-Kvgate-Backend"] == home, (status, headers, nxt)


def test_tokenize_detokenize_and_models_answer_as_vllm_does(fleet: RealFleet, kvgate: Gateway) -> None:
    status, _, tokens = post(kvgate.url + "/tokenize", {"model": MODEL, "prompt": "the question of answer"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    direct = post(fleet.urls[0] + "/tokenize", {"model": MODEL, "prompt": "the question of answer"})[2]
    assert tokens["tokens"] == direct["tokens"]
    status, _, text = post(kvgate.url + "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"] == "the question of answer"
    through = json.loads(get_text(kvgate.url + "/v1/models"))
    vllm = json.loads(get_text(fleet.urls[0] + "/v1/models"))
    assert [m["id"] for m in through["data"]] == [MODEL]
    card, own = through["data"][0], vllm["data"][0]
    # The fields a client reads from vLLM's card are all there, with vLLM's values.
    for field in ("id", "object", "owned_by", "root", "max_model_len"):
        assert card[field] == own[field], field
    assert card["created"] > 0
