"""The Docker stack, checked without a Docker engine: the compose files validate (Debian's
docker-compose), Prometheus's config passes promtool, every Grafana panel's query names a metric a live
kvgate and simulator actually export, the images are pinned and unprivileged, and the gateway image's
start renders Nginx from the config the sidecar reads and serves with its keys, run outside Docker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from kvgate.config import hash_key
from kvgate.nginx_conf import worker_identity
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, require_binary, wait_until
from tests.helpers import Gateway, start_backends

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
KVGATE_SERVICES = ("sim", "sidecar", "gateway")


def compose_config(*files: str) -> dict[str, Any]:
    tool = require_binary("docker-compose")
    args = [tool]
    for f in files:
        args += ["-f", str(DOCKER / f)]
    done = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=60, cwd=DOCKER)
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = yaml.safe_load(done.stdout)
    return parsed


def test_the_compose_files_validate_and_every_service_heals_itself() -> None:
    base = compose_config("compose.yaml")
    services = base["services"]
    assert set(services) == {"redis", "sim", "sidecar", "gateway", "prometheus", "grafana"}
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert svc.get("restart") == "unless-stopped", name
        image = svc.get("image")
        if image is not None:  # pinned: a version in the tag, never latest
            tag = image.rsplit(":", 1)[1] if ":" in image else ""
            assert re.search(r"\d+\.\d+", tag) and "latest" not in tag, f"{name}: {image} is not pinned"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"{name} waits on {dep} without its health"
    assert services["gateway"]["ports"][0]["published"] in (8080, "8080")
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_the_gpu_override_swaps_the_simulators_for_vllm_with_prefix_caching() -> None:
    merged = compose_config("compose.yaml", "compose.vllm.yaml")
    services = merged["services"]
    assert services["sim"]["profiles"] == ["sim"]  # not started by default
    for half in ("sidecar", "gateway"):  # one config for both halves
        mounted = next(v for v in services[half]["volumes"] if "/etc/kvgate/kvgate.yaml" in str(v))
        assert "kvgate.vllm.yaml" in str(mounted), half
    # The gateway is not ready until a server has loaded its weights; what waits on its health
    # (Prometheus, Grafana) must not give up first.
    start = services["gateway"]["healthcheck"]["start_period"]
    assert start in ("15m0s", "900s", 900, "15m"), start
    backends = yaml.safe_load((DOCKER / "kvgate.vllm.yaml").read_text())["backends"]
    for b in backends:
        svc = services[b["id"]]
        assert svc["image"].startswith("vllm/vllm-openai:v")
        cmd = svc["command"]
        assert "--enable-prefix-caching" in cmd
        assert cmd[cmd.index("--served-model-name") + 1] == cmd[cmd.index("--model") + 1]
        assert b["url"] == f"http://{b['id']}:{cmd[cmd.index('--port') + 1]}"
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    targets = yaml.safe_load((DOCKER / "prometheus.vllm.yml").read_text())["scrape_configs"][2]
    assert targets["static_configs"][0]["targets"] == [b["url"].removeprefix("http://") for b in backends]


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus.vllm.yml"])
def test_promtool_accepts_the_prometheus_config(name: str) -> None:
    done = subprocess.run(
        [require_binary("promtool"), "check", "config", str(DOCKER / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_kvgate_images_run_unprivileged_on_pinned_bases() -> None:
    for name in ("Dockerfile.gateway", "Dockerfile.python"):
        text = (DOCKER / name).read_text()
        bases = re.findall(r"^FROM (\S+)", text, re.M)
        assert bases and all(re.search(r":\S*\d+\.\d+", b) for b in bases), f"{name}: {bases}"
        final = text.rsplit("\nFROM ", 1)[-1]  # the stage that becomes the image
        users = re.findall(r"^USER (\S+)", final, re.M)
        assert users and users[-1] not in ("root", "0"), f"{name} runs as root"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".run", "bench-results"} <= set(ignored)


def test_the_gateway_containers_start_renders_from_the_sidecars_config_outside_docker(
    stack: Supervisor, tmp_path: Path
) -> None:
    """The pod's container split, run locally: a sidecar on the ConfigMap's config (API keys added
    there and nowhere else, route headers off), and the gateway container's own start script
    (docker/gateway-start.sh: render from the mounted config, then run Nginx) on the same file, its
    container paths moved into a temp dir and Debian's Nginx for the image's OpenResty. The keys
    hold (no key and a wrong key: 401; the key: 200), the route headers stay off, and both halves say
    they run one config."""
    key = "sk-only-in-the-configmap-0123"
    sim = start_backends(stack, 2)
    k8s = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text())
    config = yaml.safe_load(k8s["data"]["kvgate.yaml"])
    config.pop("discovery")
    config["backends"] = [{"id": f"vllm-{i}", "url": f"http://127.0.0.1:{sim + i}"} for i in range(2)]
    config["redis"] = {"url": None}
    config.pop("membership")  # the pod network's; here the listed backends are the members
    config["listen"].update(socket=str(stack.run_dir / "sidecar.sock"), http_port=free_port())
    config["listen"]["metrics_port"] = free_port()
    config["auth"] = {"keys": [{"name": "team", "sha256": hash_key(key)}]}
    config["gateway"] = {"route_headers": False}
    mounted = tmp_path / "etc-kvgate" / "kvgate.yaml"
    mounted.parent.mkdir()
    mounted.write_text(yaml.safe_dump(config))
    env = {"KVGATE_LISTEN_SOCKET_GROUP": worker_identity(None)[1]} if os.geteuid() == 0 else None
    sidecar = launch_replica(stack, "pod", mounted, env=env)
    port = free_port()
    start = subprocess.Popen(
        [str(DOCKER / "gateway-start.sh")],
        env={
            **os.environ,
            "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}:/usr/sbin",
            "GATEWAY_CONFIG": str(mounted),
            "GATEWAY_RUN_DIR": str(tmp_path / "run"),
            "GATEWAY_LUA_DIR": str(ROOT / "lua"),
            "GATEWAY_LISTEN": f"127.0.0.1:{port}",
            "GATEWAY_NGINX": require_binary("nginx"),
            "GATEWAY_RENDER_FLAGS": "",  # Debian's Nginx: the Lua module is loaded, not built in
        },
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: start.poll() is None and _get(url + "/kvgate/health")["config"] == "ok", timeout=20
        )
        assert _get(sidecar.http + "/healthz")["config"] == "ok"
        rendered = (tmp_path / "run" / "nginx" / "nginx.conf").read_text()
        assert "error_log /dev/stderr warn;" in rendered
        assert _chat(url, None)[0] == 401 and _chat(url, "wrong")[0] == 401
        status, headers = _chat(url, key)
        assert status == 200 and "X-Kvgate-Backend" not in headers
    finally:
        os.killpg(start.pid, signal.SIGTERM)
        start.wait(10)


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return json.loads(exc.read())


def _chat(url: str, key: str | None) -> tuple[int, dict[str, str]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers)


def _families(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        # Declared families count, samples or not (a labelled counter has none until first use).
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def _dashboard_metrics() -> dict[str, str]:
    """Metric name -> the panel that queries it, for every query of the provisioned dashboard."""
    dash = json.loads((DOCKER / "grafana" / "dashboards" / "kvgate.json").read_text())
    out: dict[str, str] = {}
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b((?:kvgate_|vllm:)[A-Za-z0-9_:]+)", target["expr"]):
                out[name] = panel["title"]
    return out


def test_the_dashboard_imports_into_any_grafana_and_filters_by_backend_and_model() -> None:
    """A datasource variable (no fixed uid: it imports into any Grafana) and backend and model
    variables that every panel with such a label filters on."""
    dash = json.loads((DOCKER / "grafana" / "dashboards" / "kvgate.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert {"backend", "model"} <= variables.keys()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            for series in re.findall(r"vllm:[A-Za-z0-9_:]+(?:\{[^}]*\})?", target["expr"]):
                assert 'model_name=~"$model"' in series, (panel["title"], series)
            if re.search(r"by \([^)]*backend", target["expr"]) or "kvgate_backend_healthy" in target["expr"]:
                assert 'backend=~"$backend"' in target["expr"], panel["title"]


def test_every_grafana_panel_queries_a_metric_a_live_scrape_exports(tmp_path: Path) -> None:
    """A live gateway (its sidecar's metrics served on the separate listener the compose stack uses)
    and three simulators, after streamed and plain requests: each metric the dashboard names is in
    one of the scrapes Prometheus is configured for."""
    stack = Supervisor(tmp_path / "run")
    try:
        redis_port = free_port()
        stack.start_redis(redis_port)
        sim = start_backends(stack, 3)
        metrics_port = free_port()
        listen = {
            "socket": str(stack.run_dir / "gw.sock"),
            "http_port": free_port(),
            "metrics_host": "127.0.0.1",
            "metrics_port": metrics_port,
        }
        gw = Gateway(stack, "gw", redis_port, sim, 3, extra={"listen": listen, "queue": {"enabled": True}})
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        for i in range(6):
            messages = [{"role": "user", "content": f"dashboard check {i} " * 30}]
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                stream=True,  # type: ignore[arg-type]
            ):
                del chunk
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        # The metrics listener serves metrics and health, and nothing else.
        public = f"http://127.0.0.1:{metrics_port}"
        with urllib.request.urlopen(public + "/healthz", timeout=10) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        for path in ("/v1/backends", "/debug/decisions", "/admin/reload"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(public + path, timeout=10)
            assert err.value.code in (404, 405)
            err.value.close()
        exported = _families(public + "/metrics") | _families(gw.url + "/kvgate/metrics")
        for i in range(3):
            exported |= _families(f"http://127.0.0.1:{sim + i}/metrics")
    finally:
        stack.stop_all()
    wanted = _dashboard_metrics()
    assert len(wanted) >= 12
    missing = {name: panel for name, panel in wanted.items() if name not in exported}
    assert not missing, f"panels query metrics nobody exports: {missing}"
