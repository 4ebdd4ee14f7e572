import json
from pathlib import Path

from kvgate.features import CHUNK_BYTES, extract

GOLDEN = json.loads((Path(__file__).parent / "golden" / "features.json").read_text())


def test_python_features_match_the_golden_file() -> None:
    for case in GOLDEN:
        f = extract(case["body"], case.get("headers"))
        got = {
            "model": f.model,
            "key": f.key,
            "key_source": f.key_source,
            "hashes": list(f.hashes),
            "prompt_bytes": f.prompt_bytes,
        }
        assert got == case["expected"], case["name"]


def test_conversation_keeps_its_derived_key_across_turns() -> None:
    system = {"role": "system", "content": "shared system prompt " * 100}
    turn1 = [system, {"role": "user", "content": "plan a trip to Rome"}]
    turn3 = [
        *turn1,
        {"role": "assistant", "content": "sure " * 50},
        {"role": "user", "content": "and Naples?"},
    ]
    a, b = extract({"messages": turn1}), extract({"messages": turn3})
    assert a.key == b.key and a.key_source == "prefix"
    assert b.hashes[: len(a.hashes)] == a.hashes  # the grown conversation extends the same chain


def test_shared_system_prompt_does_not_collapse_derived_keys() -> None:
    system = {"role": "system", "content": "shared system prompt " * 100}
    keys = {
        extract({"messages": [system, {"role": "user", "content": f"question {i}"}]}).key for i in range(50)
    }
    assert len(keys) == 50


def test_key_precedence_header_then_user_then_prefix() -> None:
    body = {"user": "alice", "messages": [{"role": "user", "content": "x"}]}
    assert extract(body, {"x-session-id": "s1"}).key == "h:s1"
    assert extract(body).key == "u:alice"
    assert extract({"messages": [{"role": "user", "content": "x"}]}).key_source == "prefix"


def test_only_full_chunks_are_hashed() -> None:
    f = extract({"prompt": "a" * (CHUNK_BYTES * 3 - 1)})
    assert len(f.hashes) == 2 and f.est_tokens == (CHUNK_BYTES * 3 - 1) // 4


def test_max_tokens_and_completions_are_read_as_the_gateway_reads_them() -> None:
    """As Lua's checks: max_completion_tokens first, then max_tokens; n times a completions batch's
    texts. A value the gateway's checks would refuse (not a whole number in range) reads as absent."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert extract(chat).max_tokens is None and extract(chat).completions == 1
    assert extract({**chat, "max_tokens": 64}).max_tokens == 64
    assert extract({**chat, "max_tokens": 64.0}).max_tokens == 64
    assert extract({**chat, "max_tokens": 64, "max_completion_tokens": 8}).max_tokens == 8
    assert extract({**chat, "max_tokens": 0}).max_tokens == 0
    for hostile in (-1, 1.5, True, "100", None, [1], 2**31, 10**400, float("nan"), float("inf")):
        assert extract({**chat, "max_tokens": hostile}).max_tokens is None, hostile
    assert extract({**chat, "max_completion_tokens": "x", "max_tokens": 7}).max_tokens == 7
    assert extract({**chat, "n": 3}).completions == 3
    for hostile in (0, -2, 2.5, False, "3"):
        assert extract({**chat, "n": hostile}).completions == 1, hostile
    assert extract({"prompt": ["a", "b", "c"], "n": 2}).completions == 6
    assert extract({"prompt": [[1, 2], [3, 4]]}).completions == 2
    assert extract({"prompt": [1, 2, 3], "n": 2}).completions == 2  # one prompt of token ids
