"""The sidecar's own parts: listeners, Redis (credentials, TLS), scrapes."""

from pathlib import Path

import pytest
from kvgate.config import ConfigError
from kvgate.config.fields import load
from kvgate.config.infra import ListenConfig, RedisConfig, ScrapeConfig


def test_the_api_listens_on_loopback_only() -> None:
    assert load(ListenConfig, {"http_host": "::1"}, "listen").http_host == "::1"
    with pytest.raises(ConfigError, match=r"listen.http_host: '0.0.0.0' is not loopback"):
        load(ListenConfig, {"http_host": "0.0.0.0"}, "listen")
    assert load(ListenConfig, {}, "listen").metrics_port is None
    assert load(ListenConfig, {"metrics_port": 9101}, "listen").metrics_port == 9101


def test_a_password_comes_from_the_file_or_a_file_never_both(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("s3cret\n")
    r = load(RedisConfig, {"password_file": str(f)}, "redis")
    assert r.password == "s3cret" and "s3cret" not in repr(r)
    with pytest.raises(ConfigError, match=r"redis: give password or password_file, not both"):
        load(RedisConfig, {"password": "x", "password_file": str(f)}, "redis")
    with pytest.raises(ConfigError, match=r"redis.password_file: cannot read it"):
        load(RedisConfig, {"password_file": str(tmp_path / "none")}, "redis")


def test_redis_urls_and_ca_files_are_checked(tmp_path: Path) -> None:
    assert load(RedisConfig, {"url": None}, "redis").url is None
    with pytest.raises(ConfigError, match=r"redis.url: 'http://h' must start with redis://"):
        load(RedisConfig, {"url": "http://h"}, "redis")
    with pytest.raises(ConfigError, match=r"redis.tls_ca_file: .* is not a file"):
        load(RedisConfig, {"tls_ca_file": str(tmp_path)}, "redis")


def test_a_scrape_ends_before_the_next_begins() -> None:
    s = load(ScrapeConfig, {"interval_ms": 200, "timeout_ms": 200}, "scrape")
    assert (s.interval_s, s.timeout_s) == (0.2, 0.2)
    with pytest.raises(ConfigError, match=r"scrape.timeout_ms must not exceed scrape.interval_ms"):
        load(ScrapeConfig, {"interval_ms": 200, "timeout_ms": 201}, "scrape")
