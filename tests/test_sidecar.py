"""The routing core's wiring: one registry, store and metrics shared by every part."""

from kvgate.config import Config
from kvgate.sidecar import build_sidecar

BACKENDS = {"backends": [{"id": "b0", "url": "http://127.0.0.1:1", "labels": {"tier": "x"}}]}


def test_the_parts_share_one_registry_and_one_metrics() -> None:
    sc = build_sidecar(Config.from_mapping({**BACKENDS, "pools": {"label": "tier"}}), None)
    assert sc.service.registry is sc.registry and sc.service.metrics is sc.metrics
    assert sc.registry.pool_label == "tier" and sc.sessions.client is None
    assert sc.agreement.fingerprint and not sc.agreement.auth


def test_a_limiter_exists_only_when_a_limit_applies() -> None:
    assert build_sidecar(Config.from_mapping(BACKENDS), None).service.admission.limiter is None
    limited = Config.from_mapping({**BACKENDS, "limits": {"per_client": {"requests_per_minute": 5}}})
    assert build_sidecar(limited, None).service.admission.limiter is not None
