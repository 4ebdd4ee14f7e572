"""Live benchmark mode end to end: the streaming client against real simulators and kvgate's gateway."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_ports

from kvgate_bench import decision_latency
from kvgate_bench.cli import main

pytestmark = pytest.mark.e2e


def test_live_against_one_backend_reports_ttft_and_backend_hit_rate(
    stack: Supervisor, tmp_path: Path
) -> None:
    """No --model: the run asks the URL which model it serves (here not the simulators' usual name,
    as a real vLLM's would not be)."""
    port = free_ports(1)
    stack.start_sim(port, 1, "sim", "--model", "served-here", "--time-scale", "2")
    url = f"http://127.0.0.1:{port}"
    code = main(
        [
            "live",
            "--workload",
            "chat",
            "--limit",
            "30",
            "--url",
            url,
            "--backend-urls",
            url,
            "--time-scale",
            "2",
            "--speedup",
            "4",
            "--target",
            "one-sim",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    row = json.loads((tmp_path / "report.json").read_text())["rows"][0]
    assert row["requests"] == 30 and row["errors"] == 0
    assert 0.0 < row["ttft_p50"] < 5.0 and row["itl_mean"] > 0.005
    assert row["hit_rate"] > 0.3  # shared system prompts and growing conversations hit the cache


def test_a_live_run_says_why_its_requests_failed(
    stack: Supervisor, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong --model used to end in 'errors 20' and nothing more: the reasons are printed."""
    port = free_ports(1)
    stack.start_sim(port, 1, "sim", "--model", "served-here")
    url = f"http://127.0.0.1:{port}"
    argv = [
        "live",
        "--workload",
        "chat",
        "--limit",
        "5",
        "--url",
        url,
        "--model",
        "wrong",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "5 x HTTP 404: The model `wrong` does not exist" in err, err


def test_compare_runs_each_kvgate_policy_on_fresh_backends(tmp_path: Path) -> None:
    code = main(
        [
            "compare",
            "--workload",
            "chat-sessions",
            "--limit",
            "30",
            "--backends",
            "2",
            "--time-scale",
            "2",
            "--speedups",
            "4",
            "--no-peers",
            "--targets",
            "kvgate:round_robin",
            "kvgate:kvgate",
            "kvgate:kvgate+queue",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [r["target"] for r in rows] == ["kvgate:round_robin", "kvgate:kvgate", "kvgate:kvgate+queue"]
    assert all(r["errors"] == 0 and r["requests"] == 30 for r in rows)
    # Each gateway's own TTFT prediction error, read off its sidecar's histogram before it stopped.
    assert all(r["predicted"] > 0 and 0 <= r["prediction_p50"] <= r["prediction_p90"] for r in rows), rows
    # The +queue variant ran a gateway with the compute layer on, not a plain kvgate under another name.
    cfg = yaml.safe_load((tmp_path / "run" / "kvgate-kvgate+queue" / "kvgate-sidecar.yaml").read_text())
    assert cfg["queue"]["enabled"] is True and cfg["queue"]["order"] == "shortest"
    assert cfg["routing"]["saturation_prefill_tokens"] == 2048
    assert (tmp_path / "ttft_cdf.png").exists()


def test_load_counts_every_decision_of_every_level_through_a_real_gateway(tmp_path: Path) -> None:
    # Five requests replayed to fill each level's twelve: the levels reuse bodies built once. The
    # pause outlasts Nginx's upstream keep-alive (4 s): the second level opens new connections.
    out = tmp_path / "load.json"
    t0 = time.monotonic()
    code = main(
        [
            "load",
            "--workload",
            "chat",
            "--limit",
            "5",
            "--concurrency",
            "2",
            "4",
            "--requests",
            "12",
            "--pause",
            "5",
            "--backends",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert time.monotonic() - t0 >= 5.0  # the pause was kept
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [2, 4]
    for r in rows:
        assert r["requests"] == 12 and r["errors"] == 0, r
        # Nginx's own count of decision calls, read from its metrics route before and after the level.
        assert r["decisions"] == 12 and r["failopen_other"] == 0, r
        assert 0.0 < r["ttft_p50"] <= r["ttft_p99"] and r["sidecar_decision_p99_ms"] > 0, r
        # The sidecar's loop ran its lag timer through the level, and the kernel's wait was read.
        assert r["sidecar_loop_lag_max_ms"] > 0 and r["sidecar_cpu_wait_ms"] >= 0, r
        # Each process's CPU over the level, read from the kernel: the client, the simulators, the
        # sidecar and both Nginx workers ran.
        ran = {n for n, (run_ms, _, wakeups) in r["cpu_ms"].items() if run_ms > 0 and wakeups > 0}
        assert {"client", "sim", "kvgate-sidecar"} <= ran, r["cpu_ms"]
        assert sum("worker" in n for n in ran) == 2, r["cpu_ms"]


def test_decision_burst_reports_when_the_last_answer_came_and_the_sidecars_cpu(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    args = ["--burst", "16", "--rounds", "3", "--sizes", "1024", "--out", str(out)]
    assert decision_latency.main(args) == 0
    stats = json.loads(out.read_text())["burst"]["1024"]
    assert 0 < stats["p50_ms"] <= stats["last_p50_ms"] <= stats["last_max_ms"], stats
    # The kernel's count of the sidecar's CPU over each burst, divided among its decisions.
    assert stats["sidecar_cpu_per_decision_ms"] > 0, stats


def test_decision_burst_of_trace_prompts_sends_each_burst_new_then_returning(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [  # six requests; the second and third extend the first's prefix, as a conversation does
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 0, "input_length": 2500, "output_length": 10, "hash_ids": [0, 1, 2, 3, 4]},
        {"timestamp": 1, "input_length": 700, "output_length": 10, "hash_ids": [5, 6]},
        {"timestamp": 1, "input_length": 700, "output_length": 10, "hash_ids": [7, 8]},
        {"timestamp": 2, "input_length": 300, "output_length": 10, "hash_ids": [9]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "burst.json"
    args = ["--burst", "3", "--rounds", "2", "--trace", str(trace), "--out", str(out)]
    assert decision_latency.main(args) == 0
    bursts = json.loads(out.read_text())["burst"]
    assert sorted(bursts) == ["trace-new", "trace-returning"], bursts
    for stats in bursts.values():
        assert stats["decisions"] == 6, stats  # two bursts of three, in each pass
        assert 0 < stats["p50_ms"] <= stats["last_p50_ms"] <= stats["last_max_ms"], stats
        assert stats["sidecar_cpu_per_decision_ms"] > 0, stats
