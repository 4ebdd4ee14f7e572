"""One config for both halves: Nginx's settings carry a fingerprint of the config they were rendered
from, the sidecar compares it with its own, and where API keys or rate limits differ Nginx refuses
requests instead of serving them unchecked. Here the fingerprint and the sidecar's side; through real
Nginx, sidecar and simulated backends: ``tests/e2e/test_agreement.py``."""

from __future__ import annotations

from typing import Any

from kvgate.agreement import Agreement, gateway_settings
from kvgate.config import Config, hash_key
from kvgate.nginx_conf import NginxSettings

KEY = "sk-team-a-0123456789"


def cfg(**sections: Any) -> Config:
    return Config.from_mapping({"backends": [{"url": "http://10.0.0.1:8000"}], **sections}, {})


def test_a_render_and_its_sidecar_agree_and_any_gateway_setting_changes_the_fingerprint() -> None:
    base = cfg()
    assert NginxSettings.from_config(base, listen="0.0.0.0:80").fingerprint == Agreement(base).fingerprint
    others = [
        cfg(gateway={"route_headers": True}),
        cfg(auth={"keys": [{"name": "a", "sha256": hash_key(KEY)}]}),
        cfg(limits={"per_key": {"requests_per_minute": 10}}),
        cfg(gateway={"first_byte_timeout_ms": 30_000}),
        cfg(routing={"session_header": "X-Conversation"}),
    ]
    prints = {Agreement(c).fingerprint for c in [base, *others]}
    assert len(prints) == 1 + len(others)
    # A setting overridden at render time is what Nginx runs: the fingerprint says so.
    overridden = NginxSettings.from_config(base, route_headers=True)
    assert overridden.fingerprint == Agreement(others[0]).fingerprint
    # Deployment details (where Nginx listens, its workers) are not the config's.
    assert NginxSettings.from_config(base, workers=8).fingerprint == Agreement(base).fingerprint


def test_the_sidecar_says_mismatch_while_a_gateway_with_other_settings_asks() -> None:
    a = Agreement(cfg())
    assert a.state(0.0) == "unknown"
    assert a.observe(a.fingerprint, 1.0) and a.state(1.0) == "ok"
    assert not a.observe("0123456789abcdef", 2.0) and a.state(2.0) == "mismatch"
    assert a.observe(a.fingerprint, 20.0) and a.state(20.0) == "ok"  # the other one went away


def test_nginx_reads_the_usage_where_the_fair_order_corrects_a_tenant_s_charge_by_it() -> None:
    """The fair order charges a request for the output it asks for and corrects that at its end by
    the usage its backend reports: Nginx must then read it (and ask vLLM for a stream's)."""
    fair = {"enabled": True, "order": "fair"}
    assert gateway_settings(cfg(queue=fair))["usage"] is True
    assert gateway_settings(cfg(queue={**fair, "fair_output_weight": 0}))["usage"] is False
    assert gateway_settings(cfg(queue={"enabled": True}))["usage"] is False  # first come first served
    assert gateway_settings(cfg())["usage"] is False
