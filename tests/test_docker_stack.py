"""The Docker stack, checked without a Docker engine: the compose files validate (Debian's
docker-compose), Prometheus's config passes promtool, every Grafana panel's query names a metric a live
kvgate and simulator actually export, the images are pinned and unprivileged, and the gateway image's
render step runs outside Docker and gives a config Nginx accepts."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from kvgate.nginx_conf import DEBIAN_MODULES
from kvgate.tools.launcher import Supervisor, free_port
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, require_binary
from tests.helpers import Gateway, start_backends

ROOT = Path(__file__).resolve().parents[1]
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
    sidecar_config = next(v for v in services["sidecar"]["volumes"] if "/etc/kvgate/kvgate.yaml" in str(v))
    assert "kvgate.vllm.yaml" in str(sidecar_config)
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


def test_the_gateway_images_render_step_runs_outside_docker(tmp_path: Path) -> None:
    """The exact `kvgate render-nginx` line of Dockerfile.gateway, its container paths moved into a
    temp dir: it succeeds, logs to stderr, and Nginx accepts what it wrote (given the Lua module, which
    the OpenResty image has built in)."""
    text = (DOCKER / "Dockerfile.gateway").read_text().replace("\\\n", " ")
    line = re.search(r"RUN (kvgate render-nginx [^\n]*)", text)
    assert line is not None
    args = shlex.split(line.group(1))
    moved = {"/out": tmp_path / "out", "/var/run/kvgate": tmp_path / "run", "/opt/kvgate/lua": ROOT / "lua"}
    args = [str(moved.get(a, a)) for a in args]
    args[args.index("--config") + 1] = str(DOCKER / "kvgate.yaml")
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "kvgate"), *args[1:]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    conf = (tmp_path / "out" / "nginx.conf").read_text()
    assert "error_log /dev/stderr warn;" in conf and "load_module" not in conf
    # Debian's Nginx loads the Lua module dynamically; the image's OpenResty needs no such line.
    modules = "".join(f"load_module {m};\n" for m in DEBIAN_MODULES if Path(m).exists())
    (tmp_path / "out" / "nginx.conf").write_text(modules + conf)
    check = subprocess.run(
        [
            require_binary("nginx"),
            "-t",
            "-p",
            str(tmp_path / "run"),
            "-c",
            str(tmp_path / "out" / "nginx.conf"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr


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
