"""deploy/kubernetes, checked without a cluster: every manifest passes Kubernetes' own schemas
(kubernetes-validate, strict), and the pieces agree with each other and with the images: the
sidecar's config parses with the Secret's variables, both containers mount it (the gateway renders
Nginx from it at start), the probes name ports and routes that exist, the Service, the disruption
budget, the NetworkPolicy and the PodMonitor select the pods, discovery resolves the headless
Service, and the pods are hardened."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvgate.config import Config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.31.0"


def manifests() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out: dict[str, dict[str, Any]] = {}
    for name in kustomization["resources"]:
        doc = yaml.safe_load((K8S / name).read_text())
        out[doc["kind"] + "/" + doc["metadata"]["name"]] = doc
    return out


AUTOSCALING = K8S / "autoscaling"


@pytest.mark.parametrize(
    "name",
    sorted(
        str(p.relative_to(K8S))
        for folder in (K8S, AUTOSCALING)
        for p in folder.glob("*.yaml")
        if p.name != "kustomization.yaml"
    ),
)
def test_each_manifest_passes_the_kubernetes_schema(name: str) -> None:
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "kubernetes-validate"),
            "--strict",
            "-k",
            KUBERNETES_VERSION,
            str(K8S / name),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "passed" in done.stdout, done.stdout + done.stderr


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_pieces_agree_with_each_other_and_with_the_images() -> None:
    m = manifests()
    deploy = m["Deployment/kvgate"]
    pod = deploy["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    # The sidecar's config parses, with the variables the Secret gives it.
    secret = m["Secret/kvgate-redis"]["stringData"]
    config = Config.from_mapping(yaml.safe_load(m["ConfigMap/kvgate-config"]["data"]["kvgate.yaml"]), secret)
    assert config.redis.url == secret["KVGATE_REDIS_URL"]
    # One config for both halves: both containers mount it where they read it (the gateway renders
    # Nginx from it at every start, docker/gateway-start.sh), and the socket is on a volume both mount.
    mounts = {c: {v["mountPath"]: v["name"] for v in containers[c]["volumeMounts"]} for c in containers}
    assert mounts["gateway"]["/etc/kvgate"] == mounts["sidecar"]["/etc/kvgate"] == "config"
    assert containers["sidecar"]["args"][3] == "/etc/kvgate/kvgate.yaml"
    start = (ROOT / "docker" / "gateway-start.sh").read_text()
    assert "GATEWAY_CONFIG:=/etc/kvgate/kvgate.yaml" in start
    assert all(str(Path(config.listen.socket).parent) in paths for paths in mounts.values())
    # A read-only root: what Nginx writes (its rendered config, pid, temp files) goes to a volume.
    assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in containers.values())
    assert mounts["gateway"]["/var/run/kvgate"] == "nginx-run"
    # Probes: the gateway's on vLLM's /health and Nginx's own; the sidecar's on its metrics listener
    # (the loopback API is unreachable from the kubelet).
    gw = containers["gateway"]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/kvgate/health"
    sc = containers["sidecar"]
    ports = {p["name"]: p["containerPort"] for p in sc["ports"]}
    assert ports[sc["readinessProbe"]["httpGet"]["port"]] == config.listen.metrics_port
    assert sc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(config.listen.metrics_port)
    assert sc["args"][:2] == ["kvgate", "sidecar"]
    # Unprivileged, as the images are built.
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001
    # The Service and the disruption budget select the pods; the budget leaves room to drain a node.
    labels = pod["metadata"]["labels"]
    for kind in ("Service/kvgate", "PodDisruptionBudget/kvgate"):
        spec = m[kind]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert m["PodDisruptionBudget/kvgate"]["spec"]["minAvailable"] < deploy["spec"]["replicas"]
    # Discovery resolves the headless Service, on the port its vLLM pods serve.
    headless = m["Service/vllm-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    (d,) = config.discovery
    assert d.dns == "vllm-headless" and d.port == headless["ports"][0]["port"]
    # Discovered pod addresses are allowed by the membership policy's network.
    assert config.membership.allow


def test_the_pods_are_hardened_and_spread() -> None:
    """No service-account token (kvgate never calls the API), read-only roots, numeric users, no
    privilege escalation, replicas spread over nodes, and a NetworkPolicy that admits the gateway and
    metrics ports only."""
    m = manifests()
    pod = m["Deployment/kvgate"]["spec"]["template"]
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert {c["topologyKey"] for c in spec["topologySpreadConstraints"]} >= {"kubernetes.io/hostname"}
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
    for dockerfile in ("Dockerfile.gateway", "Dockerfile.python"):
        users = [x for x in (ROOT / "docker" / dockerfile).read_text().splitlines() if x.startswith("USER ")]
        assert users[-1].split()[1].split(":")[0].isdigit(), dockerfile
    policy = m["NetworkPolicy/kvgate"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {c["name"]: {p["containerPort"] for p in c.get("ports", [])} for c in spec["containers"]}
    admitted = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert admitted == ports["gateway"] | ports["sidecar"]


def test_the_podmonitor_scrapes_both_halves_on_ports_the_pod_names() -> None:
    monitor = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    pod = manifests()["Deployment/kvgate"]["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    named = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]}
    assert (
        endpoints == {("metrics", "/metrics"), ("http", "/kvgate/metrics")} and {"metrics", "http"} <= named
    )


def test_the_autoscaler_scales_the_gateway_on_the_metric_the_adapter_serves() -> None:
    """The HPA targets the gateway Deployment, never below what the disruption budget keeps; its
    custom metric is the one the adapter rule names, built from a series Nginx exports."""
    kustomization = yaml.safe_load((AUTOSCALING / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in AUTOSCALING.glob("*.yaml")} - {
        "kustomization.yaml"
    }
    hpa = yaml.safe_load((AUTOSCALING / "hpa.yaml").read_text())
    m = manifests()
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert hpa["spec"]["scaleTargetRef"]["name"] == m["Deployment/kvgate"]["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] > m["PodDisruptionBudget/kvgate"]["spec"]["minAvailable"]
    (pods,) = [x["pods"] for x in hpa["spec"]["metrics"] if x["type"] == "Pods"]
    adapter = yaml.safe_load(
        yaml.safe_load((AUTOSCALING / "prometheus-adapter-rules.yaml").read_text())["data"]["config.yaml"]
    )
    (rule,) = adapter["rules"]
    assert rule["name"]["as"] == pods["metric"]["name"]
    series = rule["seriesQuery"].split("{")[0]
    assert series.removesuffix("_count") in (ROOT / "lua" / "kvgate" / "stats.lua").read_text()


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379/kvgate",
        "redis+cluster://redis-cluster-0.redis:6379,redis-cluster-1.redis:6379",
    ],
)
def test_the_config_takes_a_sentinel_or_cluster_url_from_the_secret(url: str) -> None:
    m = manifests()
    secret = {**m["Secret/kvgate-redis"]["stringData"], "KVGATE_REDIS_URL": url}
    config = Config.from_mapping(yaml.safe_load(m["ConfigMap/kvgate-config"]["data"]["kvgate.yaml"]), secret)
    assert config.redis.url == url
