"""The kvgate command: its subcommands in process (main(argv)), and the installed entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvgate.cli import main
from kvgate.config import Config, hash_key, reference

KEY = "sk-cli-test-key-0001"


def test_hash_key_reads_the_key_from_stdin() -> None:
    kvgate = str(Path(sys.executable).parent / "kvgate")
    out = subprocess.run([kvgate, "hash-key"], input=KEY + "\n", capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == hash_key(KEY)
    assert subprocess.run([kvgate, "hash-key"], input="", capture_output=True, timeout=30).returncode == 2


def test_config_reference_prints_the_declarations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == reference(Config)


def test_render_nginx_writes_the_files_or_names_the_bad_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("backends: [{url: http://127.0.0.1:9}]\ngateway: {decision_timeout_ms: 40}\n")
    out = tmp_path / "conf"
    argv = ["render-nginx", "--config", str(good), "--out", str(out), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--openresty"]) == 0
    assert "decision_timeout_ms = 40," in (out / "kvgate-http.conf").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [{url: http://127.0.0.1:9}]\ngateway: {decision_timeout_ms: 0}\n")
    assert main(["render-nginx", "--config", str(bad), "--out", str(out)]) == 2
    assert "gateway.decision_timeout_ms: 0 is out of range; use 1..10000" in capsys.readouterr().err


def test_a_drop_in_needs_the_edges_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("backends: [{url: http://127.0.0.1:9}]\n")
    assert main(["render-nginx", "--config", str(cfg), "--out", str(tmp_path / "o"), "--drop-in"]) == 2
    assert "--drop-in needs --edge-conf" in capsys.readouterr().err
