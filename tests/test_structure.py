"""The shape of the code: the runtime package stands apart from the tools, the import graph has no
cycle, and an installed wheel renders a working Nginx config on its own."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kvgate": ROOT / "sidecar" / "kvgate",
    "kvgate_bench": ROOT / "kvgate_bench",
    "vllm_sim": ROOT / "vllm_sim",
    "vllm_real": ROOT / "vllm_real",
}
OURS = tuple(PACKAGES)


def modules() -> dict[str, Path]:
    out = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def imports(path: Path, name: str) -> set[str]:
    """Project modules ``path`` imports, at any level (a lazy import is still a dependency)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith(OURS)}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports(path, name) if m in mods and m != name} for name, path in mods.items()}


def runtime(name: str) -> bool:
    return name.startswith("kvgate.") and not name.startswith(("kvgate.tools", "kvgate.cli"))


def test_modules_stay_small_enough_to_read() -> None:
    """A Python module (runtime, tools, benchmark, simulator) over 300 lines says why in its
    docstring, and none passes 400; no Lua module passes 250. A newcomer reads one concept per
    module."""
    too_long = []
    for name, path in modules().items():
        n = len(path.read_text().splitlines())
        reason = ast.get_docstring(ast.parse(path.read_text())) or ""
        if n > 400 or (n > 300 and "Over 300 lines" not in reason):
            too_long.append(f"{name}: {n} lines")
    for path in (ROOT / "lua").rglob("*.lua"):
        n = len(path.read_text().splitlines())
        if n > 250:
            too_long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not too_long, too_long


def unit_test_file(name: str) -> Path:
    """Where a runtime module's own tests live: kvgate.sessions -> tests/test_sessions.py,
    kvgate.config.routing -> tests/test_config_routing.py."""
    return ROOT / "tests" / ("test_" + "_".join(name.split(".")[1:]) + ".py")


def test_every_runtime_module_has_a_unit_test_file_of_its_name() -> None:
    missing = [
        name
        for name in modules()
        if (runtime(name) or name == "kvgate.cli") and name != "kvgate.__main__"
        if not unit_test_file(name).exists()
    ]
    assert not missing, missing


def test_end_to_end_tests_live_apart() -> None:
    """A test that starts Nginx, a gateway stack or containers lives in tests/e2e (or tests/real)."""
    starts = re.compile(r"\b(Gateway|Stack|launch_replica|start_backends|lua_harness|DockerCompose)\b")
    mixed = [
        path.name
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != "test_structure.py" and starts.search(path.read_text())
    ]
    assert not mixed, mixed


def test_the_runtime_imports_no_tool_no_benchmark_and_no_simulator() -> None:
    for name, deps in graph().items():
        if runtime(name):
            bad = {d for d in deps if not runtime(d) and d != "kvgate"}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_benchmark_uses_the_runtime_through_its_public_module() -> None:
    """The benchmark, the simulator and the real-vLLM tooling import the runtime only through
    ``kvgate.public`` (the tools in ``kvgate.tools`` are not runtime and may be imported)."""
    allowed = {"kvgate", "kvgate.public"}
    reached = {
        name: sorted(
            m
            for m in imports(path, name)
            if runtime(m) and m not in allowed and not m.startswith("kvgate.public.")
        )
        for name, path in modules().items()
        if name.startswith(("kvgate_bench", "vllm_sim", "vllm_real"))
    }
    assert not {k: v for k, v in reached.items() if v}


def test_the_import_graph_has_no_cycle() -> None:
    g = graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])


def test_an_installed_wheel_renders_nginx_that_nginx_accepts(tmp_path: Path) -> None:
    """``pip install .`` (what the Docker image does) carries the Lua code and templates."""
    nginx = require_binary("nginx")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    wheel = next(wheels.glob("kvgate-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    config = tmp_path / "kvgate.yaml"
    config.write_text(
        f"listen: {{socket: {tmp_path}/s.sock}}\nbackends: [{{url: 'http://127.0.0.1:8001'}}]\n"
    )
    out = tmp_path / "nginx"
    # The wheel's own code, with this environment's third-party packages (PyYAML) after it.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_path("purelib")}
    py = venv / "bin" / "python"
    script = "import sys; from kvgate.cli import main; sys.exit(main(sys.argv[1:]))"
    where = subprocess.run(
        [str(py), "-c", "import kvgate.nginx_conf as n; print(n.LUA_DIR)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    lua_dir = Path(where.stdout.strip())
    assert lua_dir.is_relative_to(site) and (lua_dir / "kvgate" / "gateway.lua").exists()
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            str(py),
            "-c",
            script,
            "render-nginx",
            "--config",
            str(config),
            "--out",
            str(out),
            "--run-dir",
            str(run_dir),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    text = (out / "kvgate-http.conf").read_text()
    assert str(lua_dir) in text and str(ROOT) not in text
    check = subprocess.run(
        [nginx, "-t", "-p", str(run_dir), "-c", str(out / "nginx.conf"), "-e", str(tmp_path / "t.log")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr
    assert "syntax is ok" in check.stderr


@pytest.mark.parametrize("name", ["kvgate.app", "kvgate.service", "kvgate.policies"])
def test_runtime_modules_never_name_the_checkout(name: str) -> None:
    source = modules()[name].read_text()
    assert "parents[" not in source and "shared/" not in source


def test_every_test_runs_the_scenario_it_defines() -> None:
    """A test that defines ``async def scenario()`` and never runs it passes without testing
    anything (two such tests once sat here unnoticed)."""
    idle = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for fn in ast.parse(path.read_text()).body:
            if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test_"):
                continue
            defined = {n.name for n in fn.body if isinstance(n, ast.AsyncFunctionDef)}
            called = {
                n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            }
            referenced = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
            # A coroutine function handed to a server or client as a callback is referenced, not called.
            idle += [f"{path.name}::{fn.name}" for name in defined if name not in called | referenced]
    assert idle == []
