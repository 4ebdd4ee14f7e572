"""The capacity benchmark runs through real gateways: one replica and two on one Redis, the client
spread over both, each level's decisions counted from Nginx's own metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate_bench.capacity import main

pytestmark = pytest.mark.e2e


def test_capacity_measures_one_and_two_replicas(tmp_path: Path) -> None:
    args = ["--sizes", "1024", "--clients", "2", "--seconds", "0.5", "--replicas", "1", "2"]
    code = main([*args, "--no-peers", "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "capacity.json").read_text())["rows"]
    assert [r["target"] for r in rows] == ["kvgate", "kvgate x2"]
    for r in rows:
        assert r["requests"] > 0 and r["errors"] == 0
        # Every request was decided (Nginx counted it) and none fell open at this load.
        assert r["decisions"] >= r["requests"] - r["errors"] and r["failopen"] == 0
        assert r["sidecar_cpu_ms"] > 0 and r["proxy_cpu_ms"] > 0
    assert "| kvgate x2 |" in (tmp_path / "report.md").read_text()
