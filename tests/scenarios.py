"""Scenarios that run unchanged against any provider of a kvgate stack: local processes
(``tests/e2e/test_gateway.py``) or containers built from ``docker/`` (``tests/deploy/test_containers.py``)."""

from __future__ import annotations

import json
import urllib.request

import openai


def a_client_session(base_url: str, model: str) -> None:
    """What a client does first: probe /health, list models, then a conversation of three turns
    streamed and not, through the official openai client; the conversation stays on one backend when
    the gateway says which (route headers)."""
    with urllib.request.urlopen(base_url + "/health", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        assert model in [m["id"] for m in json.loads(resp.read())["data"]]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse. " * 40}]
    backends = set()
    for turn in range(3):
        messages.append({"role": "user", "content": f"scenario question {turn} " * 10})
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_headers={"X-Session-ID": "scenario-1"},
        )
        reply = raw.parse()
        assert reply.choices[0].message.content and reply.usage is not None
        if raw.headers.get("X-Kvgate-Backend"):
            backends.add(raw.headers["X-Kvgate-Backend"])
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                stream=True,
                extra_headers={"X-Session-ID": "scenario-1"},
            )
        )
        assert chunks and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(backends) <= 1
