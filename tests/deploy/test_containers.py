"""Container tests (testcontainers): the simulator image serving as a mock vLLM backend, and the
whole stack from the images in docker/ (Redis, simulators, sidecar, OpenResty gateway) running the
same client scenario as the local-process tests (``tests/scenarios.py``).

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
ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="module")
def gateway_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docker/compose.yaml's services, as testcontainers: one network, the decision socket on a
    shared directory, the gateway image built from docker/Dockerfile.gateway."""
    docker_engine_or_skip()
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.image import DockerImage
    from testcontainers.core.network import Network
    from testcontainers.core.waiting_utils import wait_for_logs

    sock = tmp_path_factory.mktemp("sock")
    sock.chmod(0o777)  # the images' user (uid 10001) creates and opens the socket there
    config = ROOT / "docker" / "kvgate.yaml"
    with (
        DockerImage(
            path=str(ROOT), dockerfile_path="docker/Dockerfile.python", tag="kvgate-python:test"
        ) as py,
        DockerImage(
            path=str(ROOT), dockerfile_path="docker/Dockerfile.gateway", tag="kvgate-gateway:test"
        ) as gw,
        Network() as net,
    ):
        redis = DockerContainer("redis:7.4.1-bookworm").with_network(net).with_network_aliases("redis")
        sim = (
            DockerContainer(str(py))
            .with_network(net)
            .with_network_aliases("sim")
            .with_command(
                "vllm-sim --host 0.0.0.0 --port 8001 --instances 3 --model meta-llama/Llama-3.1-8B-Instruct"
            )
        )
        sidecar = (
            DockerContainer(str(py))
            .with_network(net)
            .with_volume_mapping(str(config), "/etc/kvgate/kvgate.yaml", "ro")
            .with_volume_mapping(str(sock), "/run/kvgate-sock", "rw")
            .with_command("kvgate sidecar --config /etc/kvgate/kvgate.yaml")
        )
        gateway = (
            DockerContainer(str(gw))
            .with_network(net)
            .with_volume_mapping(str(config), "/etc/kvgate/kvgate.yaml", "ro")  # rendered at its start
            .with_volume_mapping(str(sock), "/run/kvgate-sock", "rw")
            .with_exposed_ports(8080)
        )
        with redis, sim:
            wait_for_logs(sim, "vllm-sim: 3 instance", timeout=60)
            with sidecar:
                wait_for_logs(sidecar, "decisions on unix:", timeout=60)
                with gateway:
                    yield f"http://{gateway.get_container_host_ip()}:{gateway.get_exposed_port(8080)}"


def test_the_shared_client_scenario_passes_on_the_container_stack(gateway_stack: str) -> None:
    from tests import scenarios

    scenarios.a_client_session(gateway_stack, "meta-llama/Llama-3.1-8B-Instruct")
