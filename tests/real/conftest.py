"""The real-vLLM suite's fleet and gateways: real vLLM servers (``make real-vllm``: the CPU build and
the tiny model) started once per session, and kvgate gateways in front of them, each a real sidecar
and Nginx as everywhere else. ``make test-real`` runs it; ``make test`` leaves it out (marker real).

The fleet: two servers with small KV caches (``BLOCKS`` blocks of 128 tokens, so that a few long
prompts evict), the priority scheduler (equal priorities are first come first served) and a
KV-events publisher each. Disaggregation needs servers with NixlConnector, whose transport polls a
core at 90 % even while idle on this CPU build: the disaggregation test starts its own pair and
stops it. The gateways run at nice -10, as `kvgate up --gateway-nice` runs them on a host whose
cores the servers share.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvgate.config import Config
from kvgate.nginx_conf import NginxSettings
from kvgate.tools.launcher import Replica, Supervisor, launch_replica
from kvgate.tools.readiness import free_port

from vllm_real.fleet import BLOCK_SIZE, MODEL, Fleet, ServerSpec, service_port
from vllm_real.fleet import metric as fleet_metric
from vllm_real.vocabulary import filler_words

BLOCKS = 160  # 20,480 tokens of KV cache per server: more than one 16k prompt, less than a few
GATEWAY_NICE = -10  # ahead of the servers on the shared cores (see kvgate up --gateway-nice)


@dataclass
class RealFleet:
    sup: Supervisor
    fleet: Fleet
    specs: list[ServerSpec]
    urls: list[str] = field(default_factory=list)

    def metric(self, i: int, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The sum of one series of server ``i``'s /metrics over its label sets (matching ``labels``)."""
        return fleet_metric(self.urls[i], name, labels)

    def hits(self) -> float:
        return sum(self.metric(i, "vllm:prefix_cache_hits_total") for i in range(len(self.urls)))


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def post(
    url: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> tuple[int, dict[str, str], Any]:
    """A JSON POST: ``body`` encoded, or bytes sent as they are (duplicate keys, say)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, dict(resp.headers), json.loads(raw) if raw.startswith(b"{") else raw.decode()
    except urllib.error.HTTPError as exc:
        with exc:
            raw = exc.read()
            return exc.code, dict(exc.headers), json.loads(raw) if raw.startswith(b"{") else raw.decode()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that restart the fleet's servers run last: every other test meets the servers (and the
    session's gateways' view of them) as they started."""
    items.sort(key=lambda item: item.get_closest_marker("restarts_fleet") is not None)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    sup = Supervisor(tmp_path_factory.mktemp("real-vllm") / "run")
    specs = [
        ServerSpec(num_gpu_blocks=BLOCKS, scheduling_policy="priority", kv_events_port=service_port())
        for _ in range(2)
    ]
    f = Fleet(sup)
    t0 = time.monotonic()
    try:
        urls = f.start(specs)
        print(f"real vLLM fleet of {len(urls)} healthy in {time.monotonic() - t0:.0f}s")
        yield RealFleet(sup, f, specs, urls)
    finally:
        sup.stop_all()


class Gateway:
    """A kvgate replica (sidecar + Nginx) over some of the fleet's servers, one config for both."""

    def __init__(self, sup: Supervisor, name: str, backends: list[dict[str, Any]], **sections: Any) -> None:
        run = sup.run_dir / name
        run.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "listen": {"socket": str(sup.run_dir / f"{name}.sock"), "http_port": free_port()},
            "redis": {"url": None},
            "scrape": {"interval_ms": 200, "timeout_ms": 150, "stale_after_ms": 1000},
            "backends": backends,
            **sections,
        }
        # The tests read which backend served each answer (off by default: clients could pick one).
        config["gateway"] = {"route_headers": True, **sections.get("gateway", {})}
        settings = NginxSettings.from_config(
            Config.from_mapping(config, {}), listen=f"127.0.0.1:{self.port}", run_dir=str(run), workers=2
        )
        sup.nice.update({f"{name}-sidecar": GATEWAY_NICE, f"{name}-nginx": GATEWAY_NICE})
        self.replica: Replica = launch_replica(sup, name, config, settings)
        self.sidecar = self.replica.http

    def backends(self) -> dict[str, dict[str, Any]]:
        return {b["id"]: b for b in json.loads(get_text(self.sidecar + "/v1/backends"))["backends"]}

    def sidecar_metric(self, name: str) -> float:
        total = 0.0
        for line in get_text(self.sidecar + "/metrics").splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def chat(
        self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        return post(self.url + "/v1/chat/completions", body, headers)

    def stop(self) -> None:
        self.replica.sup.kill(self.replica.nginx_name)
        self.replica.sup.kill(self.replica.sidecar_name)


def ids(fleet: RealFleet, which: list[int] | None = None) -> list[dict[str, Any]]:
    """The fleet's servers (or those in ``which``) as a config's backends: vllm-0, vllm-1, ..."""
    return [
        {"id": f"vllm-{i}", "url": fleet.urls[i]}
        for i in (which if which is not None else range(len(fleet.urls)))
    ]


@pytest.fixture(scope="session")
def kvgate(fleet: RealFleet) -> Iterator[Gateway]:
    """The default policy over the whole fleet, clients allowed to set priorities, forwarded to vLLM."""
    gw = Gateway(fleet.sup, "kvgate", ids(fleet), queue={"client_priority": True, "forward_priority": True})
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def round_robin(fleet: RealFleet) -> Iterator[Gateway]:
    gw = Gateway(fleet.sup, "rr", ids(fleet), routing={"policy": "round_robin"})
    yield gw
    gw.stop()


# -- prompts in the tiny model's tokens -----------------------------------------------------------
class Tokens:
    """Prompts of a wanted length in the served model's tokens, written in the vocabulary its
    tokenizer was trained on (one word, one token: ``vllm_real.vocabulary``). The ratio is measured
    once with a server's /tokenize, so that building a prompt needs no server later (one may be
    down)."""

    def __init__(self, url: str) -> None:
        probe = filler_words("probe", 400)
        status, _, body = post(url + "/tokenize", {"model": MODEL, "prompt": " ".join(probe)})
        assert status == 200, body
        self.per_word = int(body["count"]) / len(probe)
        assert 0.9 < self.per_word < 1.2, self.per_word  # the tokenizer knows the vocabulary

    def text(self, tokens: int, seed: int) -> str:
        """Text of about ``tokens`` tokens, distinct per seed."""
        return " ".join(filler_words(f"real-{seed}", max(1, int(tokens / self.per_word))))


@pytest.fixture(scope="session")
def tokens(fleet: RealFleet) -> Tokens:
    return Tokens(fleet.urls[0])


def block_floor(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


__all__ = ["BLOCKS", "BLOCK_SIZE", "MODEL", "Gateway", "Path", "RealFleet", "block_floor", "post"]
