"""``vllm-sim``: serve simulated vLLM instances, or check a profile's calibration."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from vllm_sim.calibrate import calibrate, report
from vllm_sim.facts import KEEP_ALIVE_S, ROLES, VLLM_VERSION, InstanceConfig
from vllm_sim.faults import Faults
from vllm_sim.profiles import PROFILES, get_profile
from vllm_sim.request import EngineConfig, SchedulingPolicy
from vllm_sim.server import Instance

PROFILE_HELP = (
    f"one of {', '.join(sorted(PROFILES))}, or a calibration's JSON file (python -m vllm_real.calibrate)"
)


def _profile(name: str) -> str:
    """The name, once it names a profile that loads (argparse turns the error into a usage line)."""
    try:
        get_profile(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-sim", description="Simulated vLLM OpenAI-compatible servers.")
    p.add_argument("--version", action="version", version=f"vllm-sim {_version()} (vLLM {VLLM_VERSION})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--instances", type=int, default=1, help="serve N instances on port..port+N-1")
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--profile", default="llama3-8b-h100", type=_profile, help=PROFILE_HELP)
    p.add_argument("--time-scale", type=float, default=1.0, help="divide every simulated duration by S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--scheduling-policy", choices=[s.value for s in SchedulingPolicy], default="fcfs")
    p.add_argument(
        "--keep-alive-s",
        type=float,
        default=KEEP_ALIVE_S,
        help="close idle client connections after this long (vLLM/uvicorn: 5 s)",
    )
    p.add_argument(
        "--role",
        default="both",
        help="prefill|decode|both, or a comma list taken in turn by the instances (disaggregation)",
    )
    p.add_argument(
        "--kv-transfer-tokens-per-s",
        type=float,
        default=200_000.0,
        help="speed of a decode instance's KV read from its prefiller, in prompt tokens per second",
    )
    k = p.add_argument_group("KV-cache events (vLLM's --kv-events-config)")
    k.add_argument("--kv-events-port", type=int, help="publish on tcp://HOST:PORT (instance i: PORT+i)")
    k.add_argument("--kv-events-replay-port", type=int, help="serve replays on this port (instance i: +i)")
    k.add_argument(
        "--kv-events-encoding",
        choices=["map", "array"],
        default="map",
        help="map: type-tagged events (vLLM 0.32); array: positional events (older vLLM)",
    )
    f = p.add_argument_group("fault injection (also settable at run time: POST /sim/faults)")
    f.add_argument("--fault-unhealthy", action="store_true")
    f.add_argument("--fault-latency-ms", type=float, default=0.0)
    f.add_argument("--fault-hang", action="store_true")
    f.add_argument("--fault-fail-rate", type=float, default=0.0)
    f.add_argument("--fault-fail-status", type=int, default=500)
    f.add_argument("--fault-abort-after-tokens", type=int)
    f.add_argument("--fault-metrics", default="ok", choices=["ok", "garbage", "slow", "empty"])
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default="WARNING",
    )
    return p


def _configs(args: argparse.Namespace) -> list[InstanceConfig]:
    profile = get_profile(args.profile)
    faults = Faults.from_mapping(
        {
            "unhealthy": args.fault_unhealthy,
            "latency_ms": args.fault_latency_ms,
            "hang": args.fault_hang,
            "fail_rate": args.fault_fail_rate,
            "fail_status": args.fault_fail_status,
            "abort_after_tokens": args.fault_abort_after_tokens,
            "metrics": args.fault_metrics,
        }
    )
    roles = [r.strip() for r in args.role.split(",")]
    if not all(r in ROLES for r in roles):
        raise SystemExit(f"vllm-sim: --role takes {', '.join(ROLES)} (or a comma list of them)")
    out = []
    for i in range(args.instances):
        engine = EngineConfig.from_profile(
            profile,
            num_gpu_blocks=args.num_gpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            policy=SchedulingPolicy(args.scheduling_policy),
            seed=args.seed + i,
        )
        out.append(
            InstanceConfig(
                model=args.model,
                engine=engine,
                time_scale=args.time_scale,
                faults=faults,
                keep_alive_s=args.keep_alive_s,
                role=roles[i % len(roles)],
                kv_transfer_tokens_per_s=args.kv_transfer_tokens_per_s,
                kv_events_port=None if args.kv_events_port is None else args.kv_events_port + i,
                kv_events_replay_port=(
                    None if args.kv_events_replay_port is None else args.kv_events_replay_port + i
                ),
                kv_events_encoding=args.kv_events_encoding,
            )
        )
    return out


async def _serve(args: argparse.Namespace) -> None:
    instances = [Instance(c) for c in _configs(args)]
    for i, inst in enumerate(instances):
        await inst.start(args.host, args.port + i)
    ports = f"{args.port}..{args.port + len(instances) - 1}" if len(instances) > 1 else str(args.port)
    print(
        f"vllm-sim: {len(instances)} instance(s) of {args.model} ({args.profile}, time-scale "
        f"{args.time_scale}) on {args.host}:{ports}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for inst in instances:
        await inst.stop()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvgate")  # the simulator ships in kvgate's distribution
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        p = argparse.ArgumentParser(prog="vllm-sim calibrate")
        p.add_argument("--profile", default="llama3-8b-h100", type=_profile, help=PROFILE_HELP)
        a = p.parse_args(argv[1:])
        profile = get_profile(a.profile)
        checks = calibrate(profile)
        print(report(profile, checks))
        return 0 if all(c.ok for c in checks) else 1
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.instances < 1:
        print("vllm-sim: --instances must be at least 1", file=sys.stderr)
        return 2
    try:
        _configs(args)
    except ValueError as exc:
        print(f"vllm-sim: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
