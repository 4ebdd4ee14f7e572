"""Starts real vLLM servers (``vllm serve``) of the tiny model on free ports, waits for their ``/health``
and stops them: the fleet the real-vLLM tests, ``kvgate up --real-vllm`` and the benchmark run on.

Each server is one process of the CPU build with one OpenMP thread and no thread binding (on a
2-core machine two threads made decode collapse whenever another process held a core), the KV cache
sized in blocks (``num_gpu_blocks``: a small cache makes eviction happen) and the options a test
asks for: the priority scheduler, a ZMQ KV-events publisher, a NixlConnector role. Each server runs
on a core of its own (``pin``; ports, cores and socket directories come from ``vllm_real.host``), as
a GPU server has a device of its own: on shared cores a 60-token prompt to one server took up to
3.6 s to its first token while both decoded (vLLM's own counters put the time in its frontend, not
its queue or prefill), and 45 ms at most with each on its core. Facts behind these choices (block
size 128 on CPU, startup 40-90 s, about 2 GiB per server) were measured on this kind of machine; see
docs/real-vllm.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import last_words, wait_ready

from vllm_real.host import ipc_dir, next_core, on_core, service_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".vllm-venv"
MODEL_DIR = ROOT / ".vllm-model"
MODEL = "kvgate-tiny"  # the name the fleet serves the model under
BLOCK_SIZE = 128  # vLLM's default KV block on CPU (16 on GPUs)
START_TIMEOUT_S = 300.0  # a first start compiles (about 85 s alone; more beside other servers)
START_ATTEMPTS = 2  # a server not healthy in time is killed and started once more, on a fresh port
MAX_MODEL_LEN = 16384


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one server."""

    num_gpu_blocks: int | None = 256  # KV blocks of BLOCK_SIZE tokens (None: VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int = MAX_MODEL_LEN
    # vLLM's defaults on CPU, stated so that a calibration knows them: tokens prefilled per step
    # (chunked prefill) and requests in one batch.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    scheduling_policy: str = "fcfs"  # or "priority"
    kv_events_port: int | None = None  # a ZMQ PUB publisher of KV-cache events on this port
    kv_events_replay_port: int | None = None  # its ROUTER replay socket
    kv_role: str | None = None  # NixlConnector: kv_producer | kv_consumer | kv_both
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache and other dev routes
    extra: tuple[str, ...] = ()

    def argv(self, port: int, venv: Path = VENV, model_dir: Path = MODEL_DIR) -> list[str]:
        out = [
            str(venv / "bin" / "vllm"),
            "serve",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--scheduling-policy",
            self.scheduling_policy,
        ]
        if self.num_gpu_blocks is not None:
            out += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.kv_events_port is not None:
            # vLLM's publisher binds only when the endpoint has a wildcard; with an address it
            # connects out, to a subscriber that would have to bind.
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_events_port}",
                "topic": "kv-events",
            }
            if self.kv_events_replay_port is not None:
                events["replay_endpoint"] = f"tcp://*:{self.kv_events_replay_port}"
            out += ["--kv-events-config", json.dumps(events)]
        if self.kv_role is not None:
            transfer = {"kv_connector": "NixlConnector", "kv_role": self.kv_role, "kv_buffer_device": "cpu"}
            out += ["--kv-transfer-config", json.dumps(transfer)]
        return out + list(self.extra)


def server_env(nixl_port: int | None = None) -> dict[str, str]:
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM keeps /v1/responses (for previous_response_id) only when asked to: off by default.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    }
    if nixl_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(nixl_port)
    return env


def metric(url: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """One series of a server's /metrics, summed over its label sets (those matching ``labels``)."""
    total = 0.0
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and (
            not labels or all(f'{k}="{v}"' in line for k, v in labels.items())
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def health_problem(url: str) -> str | None:
    """None when the server answers /health with 200; otherwise what it did instead, for the error a
    start that never became healthy raises."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return None if resp.status == 200 else f"/health answered {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"/health answered {exc.code}"
    except (OSError, urllib.error.URLError) as exc:
        return f"/health: {exc!r}"


def healthy(url: str) -> bool:
    return health_problem(url) is None


def check_installed(venv: Path = VENV, model_dir: Path = MODEL_DIR) -> None:
    if not (venv / "bin" / "vllm").exists() or not (model_dir / "MANIFEST").exists():
        raise FileNotFoundError(f"no real vLLM at {venv} / {model_dir}: run `make real-vllm`")


@dataclass
class Fleet:
    """Servers started by one supervisor; ``urls`` in start order."""

    sup: Supervisor
    urls: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    commands: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)  # argv, env
    ipc: str = field(default_factory=ipc_dir)  # VLLM_RPC_BASE_PATH of every server it starts
    # Each server's processes (API server, engine core, worker) bound to one core (``next_core``),
    # kept when it is started again; more servers than cores share them in turn.
    pin: bool = True
    cores: dict[int, int | None] = field(default_factory=dict)

    def start(self, specs: Sequence[ServerSpec], prefix: str = "vllm") -> list[str]:
        """Start one server per spec, all at once (each compiles and loads in parallel), and wait
        until every one answers /health. Returns their URLs.

        A server that logged its startup yet never answered /health was seen once in many runs,
        cause unknown: one that is not healthy in time is killed and started again on fresh ports,
        and a second failure raises with what both attempts saw."""
        check_installed()
        first = len(self.names)
        for _ in specs:
            self.names.append(f"{prefix}-{len(self.names)}")
            self.urls.append("")
            self.commands.append(([], {}))
        started = [(first + k, spec, self._spawn(first + k, spec)) for k, spec in enumerate(specs)]
        for i, spec, proc in started:
            problems: list[str] = []
            for attempt in range(START_ATTEMPTS):
                if attempt:
                    self.sup.kill(self.names[i])
                    print(f"{self.names[i]}: {problems[-1]}; starting it again", file=sys.stderr)
                    proc = self._spawn(i, spec)
                try:
                    self._wait_healthy(i, proc)
                    break
                except TimeoutError as exc:
                    problems.append(str(exc))
            else:
                raise TimeoutError(" / ".join(problems))
        return self.urls[first:]

    def _spawn(self, i: int, spec: ServerSpec) -> subprocess.Popen[bytes]:
        port = service_port()
        nixl = service_port() if spec.kv_role is not None else None
        argv, env = spec.argv(port), server_env(nixl)
        if i not in self.cores:
            self.cores[i] = next_core() if self.pin else None
        argv = on_core(argv, self.cores[i])
        env["VLLM_RPC_BASE_PATH"] = self.ipc
        if spec.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        self.urls[i] = f"http://127.0.0.1:{port}"
        self.commands[i] = (argv, env)
        return self.sup.spawn(self.names[i], argv, env)

    def _wait_healthy(self, i: int, proc: subprocess.Popen[bytes]) -> None:
        url = self.urls[i]
        try:
            wait_ready(proc, f"vLLM at {url} is healthy", functools.partial(healthy, url), START_TIMEOUT_S)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}, {health_problem(url)}{last_words(proc.pid)}") from None

    def stop(self, i: int) -> None:
        """Kill server ``i`` (SIGKILL to its process group: API server, engine and worker)."""
        self.sup.kill(self.names[i])

    def restart(self, i: int) -> None:
        """Start server ``i`` again, on its port with its options, and wait until it is healthy."""
        argv, env = self.commands[i]
        self._wait_healthy(i, self.sup.spawn(self.names[i], argv, env))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_real.fleet", description="Run N real vLLM servers until Ctrl-C."
    )
    parser.add_argument("n", type=int, nargs="?", default=2)
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks per server (128 tokens each)")
    parser.add_argument("--priority", action="store_true", help="--scheduling-policy priority")
    parser.add_argument("--run-dir", type=Path, default=Path(".run/vllm"))
    parser.add_argument("--no-pin", action="store_true", help="let the servers share every core")
    args = parser.parse_args(argv)
    sup = Supervisor(args.run_dir)
    fleet = Fleet(sup, pin=not args.no_pin)
    # SIGTERM stops the fleet as Ctrl-C does: its servers never outlive the command.
    signal.signal(signal.SIGTERM, _interrupt)
    spec = ServerSpec(num_gpu_blocks=args.blocks, scheduling_policy="priority" if args.priority else "fcfs")
    t0 = time.monotonic()
    try:
        urls = fleet.start([spec] * args.n)
        print(f"{len(urls)} vLLM server(s) healthy in {time.monotonic() - t0:.0f}s, serving {MODEL}:")
        for url in urls:
            print(f"  {url}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        sup.stop_all()


if __name__ == "__main__":
    main(sys.argv[1:])
