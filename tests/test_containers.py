"""Container tests (testcontainers): the simulator image serving as a mock vLLM backend.

They need a Docker engine, so the default run deselects them (``-m "not docker"`` in pytest's
addopts); ``make test-docker`` runs them where an engine exists. They are not part of ``make test``.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[1]


def docker_engine_or_skip() -> None:
    """Skip, saying why, when no Docker engine answers (the `docker` command alone is a client)."""
    import os
    import socket

    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        # Probed by hand: the Docker SDK leaks its socket when the engine is not there.
        try:
            with socket.socket(socket.AF_UNIX) as probe:
                probe.settimeout(2)
                probe.connect(host[len("unix://") :])
        except OSError as exc:
            pytest.skip(f"no Docker engine at {host}: {exc}")


@pytest.fixture(scope="module")
def sim_container() -> Iterator[str]:
    docker_engine_or_skip()
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.image import DockerImage
    from testcontainers.core.waiting_utils import wait_for_logs

    with DockerImage(
        path=str(ROOT), dockerfile_path="docker/Dockerfile.python", tag="kvgate-python:test"
    ) as image:
        container = (
            DockerContainer(str(image))
            .with_command("vllm-sim --host 0.0.0.0 --port 8001 --model sim-model")
            .with_exposed_ports(8001)
        )
        with container:
            wait_for_logs(container, "vllm-sim: 1 instance", timeout=60)
            yield f"http://{container.get_container_host_ip()}:{container.get_exposed_port(8001)}"


def test_simulator_container_serves_the_openai_api(sim_container: str) -> None:
    with urllib.request.urlopen(sim_container + "/v1/models", timeout=10) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == "sim-model"
    req = urllib.request.Request(
        sim_container + "/v1/completions",
        method="POST",
        data=b'{"prompt": "a b c", "max_tokens": 2, "ignore_eos": true}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 2
