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


@pytest.fixture(scope="module")
def sim_container() -> Iterator[str]:
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
