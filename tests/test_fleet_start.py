"""The real-vLLM fleet's start, with a stand-in server process: a server that never answers /health
is started again on fresh ports, and one that fails twice stops the start with what both attempts
saw. (The real servers take a minute each; the retry's logic does not need them.)"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from kvgate.tools.launcher import Supervisor

from vllm_real import fleet as fleet_mod
from vllm_real.fleet import Fleet, ServerSpec
from vllm_real.host import service_port

# Answers /health with 503 while the marker file holds "bad", then 200; writes "ok" after each start
# so that the next start is good (the first start of a test is bad when the test says so).
STANDIN = textwrap.dedent(
    """
    import http.server, os, sys
    from pathlib import Path
    port, marker = int(sys.argv[1]), Path(sys.argv[2])
    (Path(os.environ["VLLM_RPC_BASE_PATH"]) / f"ipc-{port}").touch()  # where vLLM puts its sockets
    bad = marker.read_text() == "bad"
    marker.write_text("bad" if marker.name.startswith("always") else "ok")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503 if bad else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    print("started on cores", ",".join(map(str, sorted(os.sched_getaffinity(0)))), flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    monkeypatch.setattr(fleet_mod, "check_installed", lambda: None)
    monkeypatch.setattr(fleet_mod, "START_TIMEOUT_S", 3.0)
    return script


def spec_for(script: Path, marker: Path) -> ServerSpec:
    class Standin(ServerSpec):
        def argv(
            self, port: int, venv: Path = fleet_mod.VENV, model_dir: Path = fleet_mod.MODEL_DIR
        ) -> list[str]:
            return [sys.executable, str(script), str(port), str(marker)]

    return Standin()


def test_a_server_never_healthy_is_started_again_on_a_fresh_port(standin: Path, tmp_path: Path) -> None:
    marker = tmp_path / "once"
    marker.write_text("bad")
    good = tmp_path / "good"
    good.write_text("ok")
    sup = Supervisor(tmp_path / "run")
    fleet = Fleet(sup)
    try:
        urls = fleet.start([spec_for(standin, marker), spec_for(standin, good)])
        assert len(urls) == 2 and all(fleet_mod.healthy(u) for u in urls)
        assert fleet.urls == urls
        # The started-again server's command is the one restart() would use.
        assert urls[0].rsplit(":", 1)[1] in fleet.commands[0][0]
        assert (tmp_path / "run" / "vllm-0.log").read_text().count("started") == 2
        assert (tmp_path / "run" / "vllm-1.log").read_text().count("started") == 1
        # Their sockets go to the fleet's own directory, not the system's temporary one.
        assert len(list(Path(fleet.ipc).glob("ipc-*"))) == 3 and Path(fleet.ipc).parent == Path(
            tempfile.gettempdir()
        )
    finally:
        sup.stop_all()


def test_a_server_that_fails_twice_stops_the_start_and_says_why(standin: Path, tmp_path: Path) -> None:
    marker = tmp_path / "always"
    marker.write_text("bad")
    sup = Supervisor(tmp_path / "run")
    try:
        with pytest.raises(TimeoutError) as err:
            Fleet(sup).start([spec_for(standin, marker)])
        assert str(err.value).count("/health answered 503") == 2, err.value
    finally:
        sup.stop_all()


def cores_of(log: Path) -> list[str]:
    return [line.split()[-1] for line in log.read_text().splitlines() if line.startswith("started")]


def test_each_server_runs_on_a_core_of_its_own_and_keeps_it_when_started_again(
    standin: Path, tmp_path: Path
) -> None:
    """Two servers on shared cores stalled each other's first tokens for seconds (real-vllm.md); a
    GPU server has a device of its own. A server started again keeps its core; a second fleet in the
    same process takes the next cores; ``pin=False`` leaves a server every core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        pytest.skip("pinning needs two cores and taskset")  # next_core() says None: nothing to pin
    good = tmp_path / "good"
    good.write_text("ok")
    sup = Supervisor(tmp_path / "run")
    try:
        fleet = Fleet(sup)
        fleet.start([spec_for(standin, good), spec_for(standin, good)])
        fleet.stop(1)
        fleet.restart(1)
        first, second = cores_of(tmp_path / "run" / "vllm-0.log"), cores_of(tmp_path / "run" / "vllm-1.log")
        assert len(first) == 1 and len(second) == 2 and second[0] == second[1]
        assert first[0] != second[0] and {first[0], second[0]} <= {str(c) for c in cores}
        other = Fleet(sup)
        other.start([spec_for(standin, good)], prefix="other")
        assert cores_of(tmp_path / "run" / "other-0.log") == [
            str(cores[(cores.index(int(second[0])) + 1) % len(cores)])
        ]
        free = Fleet(sup, pin=False)
        free.start([spec_for(standin, good)], prefix="free")
        assert cores_of(tmp_path / "run" / "free-0.log") == [",".join(map(str, cores))]
    finally:
        sup.stop_all()


def test_service_ports_are_never_handed_out_twice() -> None:
    ports = [service_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
