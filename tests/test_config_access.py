"""API keys (stored hashed, from the file or a keys file) and rate limits, as configured."""

from pathlib import Path

import pytest
from kvgate.config import ConfigError, hash_key
from kvgate.config.access import AuthConfig, LimitsConfig, Rate
from kvgate.config.fields import load

DIGEST = hash_key("sk-a")


def test_keys_are_hashes_with_names_and_optional_rate_and_priority(tmp_path: Path) -> None:
    more = tmp_path / "keys.yaml"
    more.write_text(f"- {{name: b, sha256: {hash_key('sk-b').upper()}}}\n")
    auth = load(
        AuthConfig,
        {
            "keys": [{"name": "a", "sha256": DIGEST, "rate": {"requests_per_minute": 5}, "priority": -1}],
            "keys_file": str(more),
            "open_routes": ["metrics", "models", "metrics"],
        },
        "auth",
    )
    assert [k.name for k in auth.keys] == ["a", "b"] and auth.enabled
    assert auth.keys[0].rate == Rate(5, 0) and auth.keys[0].priority == -1 and auth.keys[1].rate is None
    assert auth.keys[1].sha256 == hash_key("sk-b")  # hex is read in either case
    assert auth.open_routes == ("metrics", "models")
    assert "sk-a" not in repr(auth) and DIGEST not in repr(auth)


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ([{"name": "a", "sha256": "abc"}], r"auth.keys\[0\].sha256: expected 64 hex digits"),
        ([{"name": "a b", "sha256": DIGEST}], r"auth.keys\[0\].name: expected 1-64 letters"),
        (
            [{"name": "a", "sha256": DIGEST}, {"name": "b", "sha256": DIGEST}],
            "names and keys must be distinct",
        ),
        (["sk-plain"], r"auth.keys\[0\]: expected \{name: team-a"),
    ],
)
def test_a_bad_key_entry_is_named(keys: list[object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(AuthConfig, {"keys": keys}, "auth")


def test_limits_apply_only_when_a_rate_is_set() -> None:
    assert not load(LimitsConfig, {}, "limits").enabled
    limits = load(LimitsConfig, {"per_client": {"tokens_per_minute": 100}, "sync_ms": 200}, "limits")
    assert limits.enabled and limits.sync_s == 0.2 and limits.per_client.tokens_per_minute == 100
    with pytest.raises(ConfigError, match=r"limits.per_key: unknown key\(s\) rpm"):
        load(LimitsConfig, {"per_key": {"rpm": 1}}, "limits")
