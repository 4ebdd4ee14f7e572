"""What code outside the runtime may use of it: the benchmark (``kvgate_bench``) and the tools import
these names from here and from nowhere else in ``kvgate``, so the runtime's modules can change shape
without breaking them (``tests/test_structure.py`` keeps it so).

The routing core in one process (``build_sidecar``: config in, decisions and outcome reports through
its ``service``), the request features Nginx sends, the wire protocol's messages and codec, the Nginx
settings a gateway is rendered from, and the host measurements the load benchmarks read.
"""

from __future__ import annotations

from kvgate import kv_events, protocol, version
from kvgate.config import Config, PolicyName, hash_key
from kvgate.features import Features, extract
from kvgate.load import Scraped
from kvgate.looplag import SchedStat, read_schedstat
from kvgate.messages import Decide, DecisionReply, Outcome, Report
from kvgate.nginx_conf import DEBIAN_MODULES, LUA_DIR, NginxSettings, configure_lua, find_nginx
from kvgate.policies import Reason, SessionAction
from kvgate.queue import QueueFull, QueueTimeout
from kvgate.registry import Registry
from kvgate.service import Queued, Routed
from kvgate.sidecar import Sidecar, build_sidecar
from kvgate.slo import SloShed

__all__ = [
    "DEBIAN_MODULES",
    "LUA_DIR",
    "Config",
    "Decide",
    "DecisionReply",
    "Features",
    "NginxSettings",
    "Outcome",
    "PolicyName",
    "QueueFull",
    "QueueTimeout",
    "Queued",
    "Reason",
    "Registry",
    "Report",
    "Routed",
    "SchedStat",
    "Scraped",
    "SessionAction",
    "Sidecar",
    "SloShed",
    "build_sidecar",
    "configure_lua",
    "extract",
    "find_nginx",
    "hash_key",
    "kv_events",
    "protocol",
    "read_schedstat",
    "version",
]
