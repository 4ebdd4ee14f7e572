"""Whether Nginx and the sidecar run the same configuration.

Nginx's settings are rendered into its config once (``kvgate render-nginx``, ``kvgate up``, or the
gateway container's start), from a kvgate config file; the sidecar reads that file itself. Nothing
else ties the two halves: an image rendered from another file, a drop-in rendered before the config
changed, a ConfigMap that reaches only the sidecar. Then API keys or rate limits the sidecar enforces
are silently off in Nginx. So the render writes a fingerprint of the settings it took from the config
into Nginx, Nginx sends it with every peer refresh (once a second), and the sidecar compares it with
its own: a mismatch is logged as an error, shown in ``/healthz`` and ``kvgate_config_mismatch``, and
answered with the sidecar's own fingerprint and auth and limits switches, from which Nginx shows the
mismatch in ``/kvgate/health`` and, where auth or limits differ, refuses requests (fails closed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from kvgate.config import Config, TokenizerSource

logger = logging.getLogger(__name__)
SEEN_S = 10.0  # a gateway that sent its fingerprint this recently is still there
LOG_EVERY_S = 60.0  # a mismatch that persists is logged again this often


def gateway_settings(config: Config) -> dict[str, Any]:
    """What Nginx takes from a kvgate config (``NginxSettings.from_config``), without the socket path
    (a container or ``kvgate up`` may resolve it differently, and a wrong one cannot go unnoticed)."""
    g = config.gateway
    body_bytes = tokenize_bytes(config)
    return {
        "session_header": config.routing.session_header,
        "max_tries": config.routing.max_candidates,
        "retry_statuses": g.retry_statuses,
        "route_headers": g.route_headers,
        "decision_timeout_ms": g.decision_timeout_ms,
        "first_byte_timeout_ms": g.first_byte_timeout_ms,
        "first_byte_stream_min_ms": g.first_byte_stream_min_ms,
        "token_timeout_ms": g.token_timeout_ms,
        "max_read_timeout_ms": g.max_read_timeout_ms,
        "client_max_body_size": g.client_max_body_size,
        "max_engine_requests": g.max_engine_requests,
        "worker_user": g.worker_user,
        "auth": config.auth.enabled,
        "open_routes": config.auth.open_routes,
        "limits": config.limited,
        # Nginx routing on its own holds each client address to its rate (each key: the keys reply).
        "client_requests_per_minute": config.limits.per_client.requests_per_minute,
        "client_tokens_per_minute": config.limits.per_client.tokens_per_minute,
        "queue": config.queue.enabled,
        "queue_heartbeat_ms": round(config.queue.heartbeat_s * 1000),
        # Nginx routing on its own forwards the priority the sidecar would have (priority_of).
        "client_priority": config.queue.client_priority,
        "tenant_header": config.queue.tenant_header or "",
        "forward_priority": config.queue.forward_priority,
        "edge_access": g.edge_access or "",
        "tokenize_bytes": body_bytes,
        # Nginx reads each response's usage: rate limits count its tokens, the exact index its
        # cached tokens (what the engine delivered against what the index predicted), the fair order
        # the output a tenant had (GatewayQueue.settle).
        "usage": config.limited or body_bytes > 0 or config.queue.charges_output,
    }


def tokenize_bytes(config: Config) -> int:
    """Up to how many bytes of a request's body Nginx sends with its decision, for the exact index
    to tokenize (``kvgate.tokenize``): 0 unless a backend or discovery declares a KV-event publisher."""
    publishes = any(b.kv_events for b in config.backends) or any(d.kv_events_port for d in config.discovery)
    if not publishes or config.kv_index.tokenizer is TokenizerSource.NONE:
        return 0
    return config.kv_index.max_prompt_bytes


def fingerprint(settings: Mapping[str, Any]) -> str:
    """16 hex digits naming ``settings`` (the same on both halves when they agree)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Agreement:
    """The sidecar's side: the fingerprints gateways sent lately against its own."""

    def __init__(self, config: Config) -> None:
        self.settings = gateway_settings(config)
        self.fingerprint = fingerprint(self.settings)
        self.auth = bool(self.settings["auth"])
        self.limits = bool(self.settings["limits"])
        self._seen: dict[str, float] = {}  # a gateway's fingerprint -> when it was last sent
        self._logged = -LOG_EVERY_S

    def observe(self, theirs: str | None, now: float | None = None) -> bool:
        """A gateway's peer refresh carried ``theirs``; True when it agrees with ours."""
        now = time.monotonic() if now is None else now
        if theirs is None:
            return True  # a tool, not a gateway
        self._seen[theirs] = now
        for fp in [fp for fp, at in self._seen.items() if now - at > SEEN_S]:
            del self._seen[fp]
        if theirs == self.fingerprint:
            return True
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            logger.error(
                "config mismatch: a gateway's Nginx was rendered from other settings (fingerprint %s) "
                "than this sidecar runs (%s; auth %s, rate limits %s). Render Nginx from this config "
                "(kvgate render-nginx, or restart the gateway container); until then Nginx refuses "
                "requests where auth or limits differ",
                theirs,
                self.fingerprint,
                "on" if self.auth else "off",
                "on" if self.limits else "off",
            )
        return False

    def state(self, now: float | None = None) -> str:
        """ok (every gateway seen lately agrees), mismatch, or unknown (no gateway seen lately)."""
        now = time.monotonic() if now is None else now
        recent = [fp for fp, at in self._seen.items() if now - at <= SEEN_S]
        if not recent:
            return "unknown"
        return "ok" if all(fp == self.fingerprint for fp in recent) else "mismatch"
