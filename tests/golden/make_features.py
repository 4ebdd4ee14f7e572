"""Regenerates features.json: request bodies and the features both twins must compute for them.

Run only when the feature definition changes on purpose (both features.py and features.lua), then
review the diff: ``python tests/golden/make_features.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvgate.features import extract

LONG = " ".join(f"word{i}" for i in range(900))
SYSTEM = "You are a careful assistant. " * 40

CASES = [
    {
        "name": "chat, system + user, several chunks",
        "body": {
            "model": "m",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}],
        },
    },
    {
        "name": "chat, multi-turn",
        "body": {
            "model": "m",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "hi " * 300},
                {"role": "assistant", "content": "hello " * 200},
                {"role": "user", "content": "more " * 100},
            ],
        },
    },
    {
        "name": "chat, content parts and unicode",
        "body": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "héllo wörld ✓ " * 60},
                        {"type": "image_url", "image_url": {"url": "x"}},
                        {"type": "text", "text": "second part"},
                    ],
                }
            ]
        },
    },
    {
        "name": "chat, odd roles",
        "body": {"model": "m", "messages": [{"content": "no role " * 80}, {"role": 5, "content": "x"}]},
    },
    {
        "name": "session header wins",
        "headers": {"X-Session-ID": "abc-123"},
        "body": {"model": "m", "user": "u1", "messages": [{"role": "user", "content": "x"}]},
    },
    {
        "name": "long session header is hashed",
        "headers": {"X-Session-ID": "s" * 65},
        "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    },
    {
        "name": "long user is hashed",
        "body": {"model": "m", "user": "ü" * 40, "messages": [{"role": "user", "content": "x"}]},
    },
    {
        "name": "user field",
        "body": {"model": "m", "user": "alice", "messages": [{"role": "user", "content": "x"}]},
    },
    {
        "name": "completions, long prompt",
        "body": {"model": "m", "prompt": LONG + " " + LONG, "max_tokens": 5},
    },
    {"name": "completions, short prompt", "body": {"model": "m", "prompt": "short prompt", "max_tokens": 5}},
    {"name": "completions, list of one", "body": {"model": "m", "prompt": [LONG]}},
    {"name": "completions, a batch of texts", "body": {"model": "m", "prompt": [LONG, "short", LONG]}},
    {"name": "completions, a batch of token ids", "body": {"model": "m", "prompt": [[1, 2], [3, 4]]}},
    {"name": "empty", "body": {"model": "m", "messages": []}},
    {
        "name": "responses, instructions and a message list",
        "body": {
            "model": "m",
            "instructions": SYSTEM,
            "input": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "ok"}],
        },
    },
    {"name": "responses, string input", "body": {"model": "m", "input": LONG}},
    {
        "name": "responses, previous response is the session",
        "body": {"model": "m", "input": "and then?", "previous_response_id": "resp_0123abc", "user": "u1"},
    },
    {"name": "embeddings, list of strings", "body": {"model": "m", "input": ["one", "two"]}},
    {"name": "longer than the hashed window", "body": {"model": "m", "prompt": " ".join([LONG] * 30)}},
]


def main() -> None:
    out = []
    for case in CASES:
        f = extract(case["body"], case.get("headers"))
        out.append(
            {
                **case,
                "expected": {
                    "model": f.model,
                    "key": f.key,
                    "key_source": f.key_source,
                    "hashes": list(f.hashes),
                    "prompt_bytes": f.prompt_bytes,
                },
            }
        )
    path = Path(__file__).with_name("features.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} cases to {path}")


if __name__ == "__main__":
    main()
