"""The sidecar process's assembly: its Redis client's budgets, and a reload that re-reads the file."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvgate.app import MEMBERSHIP, RELOAD, create_app
from kvgate.config import Config
from kvgate.redis_client import connect

from tests.cores import run

ONE = "backends: [{id: a, url: 'http://127.0.0.1:1'}]\nredis: {url: null}\n"


def test_the_redis_client_has_kvgates_budgets_not_the_librarys() -> None:
    assert (
        connect(Config.from_mapping({"redis": {"url": None}, "backends": [{"url": "http://h:1"}]}).redis)
        is None
    )
    config = Config.from_mapping(
        {"redis": {"timeout_ms": 15, "connect_timeout_ms": 40}, "backends": [{"url": "http://h:1"}]}
    )
    client = connect(config.redis)
    assert client is not None
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.015 and kwargs["socket_connect_timeout"] == 0.04
    assert kwargs["retry_on_timeout"] is False and kwargs["retry"]._retries == 0
    asyncio.run(client.aclose())


def test_a_reload_routes_over_the_backends_the_file_now_lists(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(ONE)
    app = create_app(Config.from_file(path), path)

    async def go() -> set[str]:
        await app[MEMBERSHIP].seed(Config.from_file(path).backends)
        path.write_text(ONE.replace("[{id: a,", "[{id: b, url: 'http://127.0.0.1:2'}, {id: a,"))
        await app[RELOAD]()
        return set(app[MEMBERSHIP].local)

    assert run(go()) == {"a", "b"}
