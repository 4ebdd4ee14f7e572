"""The bare-metal units (deploy/systemd): both halves read one config and one socket, the sidecar runs
ahead of other work, and the Nginx unit's render line, its paths moved into a temp dir, gives a
config Nginx accepts."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"


def unit(name: str) -> dict[str, list[str]]:
    """A unit file's settings (key -> its values, continuation lines joined)."""
    text = (UNITS / name).read_text().replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2).strip())
    return out


def test_both_units_read_one_config_and_one_socket() -> None:
    sidecar, nginx = unit("kvgate-sidecar.service"), unit("kvgate-nginx.service")
    config = "/etc/kvgate/kvgate.yaml"
    assert (
        f"--config {config}" in sidecar["ExecStart"][0] and f"--config {config}" in nginx["ExecStartPre"][0]
    )
    sock = [e for e in sidecar["Environment"] if e.startswith("KVGATE_LISTEN_SOCKET=")]
    assert sock and sock[0] in nginx["Environment"]
    assert int(sidecar["Nice"][0]) < 0 and int(sidecar["CPUWeight"][0]) > 100
    assert nginx["KillSignal"] == ["SIGQUIT"] and "kvgate-sidecar.service" in nginx["After"][0]


def test_the_nginx_units_render_line_gives_a_config_nginx_accepts(tmp_path: Path) -> None:
    pre = shlex.split(unit("kvgate-nginx.service")["ExecStartPre"][0])
    moved = {
        "/opt/kvgate/venv/bin/kvgate": str(ROOT / ".venv" / "bin" / "kvgate"),
        "/etc/kvgate/kvgate.yaml": str(tmp_path / "kvgate.yaml"),
        "/run/kvgate-nginx/conf": str(tmp_path / "conf"),
        "/run/kvgate-nginx": str(tmp_path / "run"),
    }
    (tmp_path / "kvgate.yaml").write_text(yaml.safe_dump({"backends": [{"url": "http://10.0.0.5:8000"}]}))
    args = [moved.get(a, a) for a in pre]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=60,
        env={"KVGATE_LISTEN_SOCKET": str(tmp_path / "sidecar.sock"), "PATH": "/usr/bin:/usr/sbin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    check = subprocess.run(
        [
            require_binary("nginx"),
            "-t",
            "-p",
            str(tmp_path / "run"),
            "-c",
            str(tmp_path / "conf" / "nginx.conf"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr
