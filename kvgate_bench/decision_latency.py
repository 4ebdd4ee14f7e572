"""Decision latency of the sidecar as Nginx sees it: one line over the unix socket and back.

Starts redis-server, simulated backends and one sidecar; optionally registers many backends (ids
sharing the simulators' URLs) and preloads many sessions into Redis; then sends the features Nginx's
Lua would send for chat prompts of several sizes, over one keepalive connection, and reports the
round-trip p50 / p99 (client side) per size. Each decision's request is reported finished right
after (untimed), as Nginx's log phase would. Each request carries a session key (half of them bound
already), so every decision pays its Redis round trip.

    python -m kvgate_bench.decision_latency --sizes 1024 51200 512000
    python -m kvgate_bench.decision_latency --backends 1000 --sessions 1000000
    python -m kvgate_bench.decision_latency --burst 64    # 64 decisions at once, as a client burst
    python -m kvgate_bench.decision_latency --exact       # bodies tokenized for the exact index
    python -m kvgate_bench.decision_latency --burst 64 \
        --trace kvgate_bench/traces/mooncake_conversation_trace.jsonl  # the trace prompts, new, returning

With ``--burst N``, N connections each send one decision, all written before any answer is read (new
session keys, so every one claims its key in Redis), as N clients starting together would through
Nginx's workers; repeated, it reports when the last of each burst was answered (the budget a burst
must fit in) and the sidecar's CPU per decision in a burst: the sidecar decides one line at a time,
so a burst of N needs about N times that of one core before its last answer. With ``--trace``, the
bursts are the trace's requests in order, sent twice over: new prompts, then the same ones returning
(what a load level meets when it repeats the previous level's requests).

With ``--exact`` the simulators publish KV events and the backends declare them, so each decision
carries its request's body as Nginx sends it then: the sidecar has a simulator's /tokenize give the
token ids and computes vLLM's block hashes (sequential mode). Half the prompts are sent to a
simulator first (untimed), so their lookups hash the whole held prompt, the worst case.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from kvgate.public import Decide, DecisionReply, extract, protocol, read_schedstat
from kvgate.tools.decision_client import DecisionClient
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port, free_ports

from kvgate_bench.report import pct, write_json
from kvgate_bench.workloads import BenchRequest, load_trace


def preload_sessions(port: int, n: int, backends: int) -> float:
    t0 = time.perf_counter()
    r = redis.Redis(port=port, socket_timeout=30)
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.set(f"kvgate:s:h:preloaded-{i}", f"b-{i % backends}", ex=3600)
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()
    r.close()
    return time.perf_counter() - t0


def place(url: str, body: dict[str, Any]) -> None:
    """Send ``body`` to a simulator directly, so that it holds the prompt (and says so in events)."""
    data = json.dumps({**body, "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def prompt(i: int, size: int) -> dict[str, Any]:
    text = (f"conversation {i} " + "lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    return {"model": "bench-model", "messages": [{"role": "user", "content": text}]}


def _burst_round(clients: list[DecisionClient], msgs: list[dict[str, Any]]) -> list[float]:
    """Write one message on every client, all before reading any answer, as a burst reaches the
    sidecar from Nginx's workers; the time from the first write to each answer. One thread: the
    writes take microseconds, so the client is never what the burst waits for. Nor is its garbage
    collector: with a trace's bodies in memory, one young-generation collection in this process took
    over 100 ms, and would be counted as the sidecar's."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for c, msg in zip(clients, msgs, strict=True):
            c.send_raw(msg, reply=False)
        got = []
        replies = []
        for c in clients:
            replies.append(c.read_raw())
            got.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    for c, raw in zip(clients, replies, strict=True):
        reply = c.decode(raw)
        assert isinstance(reply, DecisionReply) and reply.candidates, reply
        c.finish(reply)
    return got


Burst = list[tuple[dict[str, Any], dict[str, str]]]  # one burst's request bodies and headers


def synthetic_bursts(size: int, n: int, rounds: int) -> Iterator[Burst]:
    """``rounds`` bursts of ``n`` new chat prompts of ``size`` bytes, each a new session."""
    for r in range(rounds):
        yield [(prompt(r * n + k, size), {"X-Session-ID": f"b{size}-{r}-{k}"}) for k in range(n)]


def trace_bursts(reqs: Sequence[BenchRequest], n: int, rounds: int) -> Iterator[Burst]:
    """The trace's first ``n * rounds`` requests in order, ``n`` at a time, as Nginx would send them."""
    for r in range(rounds):
        batch = reqs[r * n : (r + 1) * n]
        if not batch:
            return  # a trace shorter than the bursts asked for
        yield [(q.body(), q.headers) for q in batch]


def burst(socket_path: Path, label: str, bursts: Iterable[Burst], sidecar_pid: int) -> dict[str, float]:
    """Each burst's decisions sent at once, one per connection: the latency of each, and the
    sidecar's CPU per decision (the kernel's count for its loop thread over each burst)."""
    clients: list[DecisionClient] = []
    latencies: list[float] = []
    lasts: list[float] = []
    cpu: list[float] = []
    for bodies in bursts:
        n = len(bodies)
        clients += [DecisionClient(socket_path) for _ in range(n - len(clients))]
        used = clients[:n]
        msgs = [
            protocol.encode_message(Decide(c.next_id(), extract(body, headers)))
            for c, (body, headers) in zip(used, bodies, strict=True)
        ]
        before = read_schedstat(f"/proc/{sidecar_pid}/schedstat")
        got = _burst_round(used, msgs)
        time.sleep(0.05)  # the claims' replies from Redis, which the burst's decisions did not wait for
        after = read_schedstat(f"/proc/{sidecar_pid}/schedstat")
        if before is not None and after is not None:
            cpu.append((after.run_s - before.run_s) / n)
        latencies.extend(got)
        lasts.append(max(got))
    for c in clients:
        c.close()
    stats = {
        "decisions": len(latencies),
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "last_p50_ms": pct(lasts, 0.5) * 1000,
        "last_max_ms": max(lasts) * 1000,
        "over_50ms": sum(1 for x in latencies if x > 0.05) / len(latencies),
        "sidecar_cpu_per_decision_ms": statistics.median(cpu) * 1000 if cpu else 0.0,
    }
    print(
        f"burst of {len(clients)}, {label}: each p50 {stats['p50_ms']:.2f} ms "
        f"p99 {stats['p99_ms']:.2f} ms; last of a burst p50 {stats['last_p50_ms']:.2f} ms "
        f"max {stats['last_max_ms']:.2f} ms; over 50 ms {stats['over_50ms']:.2%}; "
        f"sidecar CPU {stats['sidecar_cpu_per_decision_ms']:.3f} ms per decision",
        flush=True,
    )
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 51_200, 512_000], help="prompt bytes")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--sessions", type=int, default=0, help="sessions preloaded into Redis")
    p.add_argument("--burst", type=int, default=0, help="N simultaneous decisions per round (0: sequential)")
    p.add_argument("--rounds", type=int, default=30, help="bursts per prompt size")
    p.add_argument(
        "--trace",
        type=Path,
        help="with --burst: the trace's requests in order instead of --sizes, every burst sent twice "
        "over (new prompts, then the same ones returning)",
    )
    p.add_argument(
        "--event-loop", choices=("asyncio", "uvloop"), default="asyncio", help="the sidecar's loop"
    )
    p.add_argument("--exact", action="store_true", help="exact index: bodies tokenized, hashes looked up")
    p.add_argument("--out", default="bench-results/decision_latency.json")
    args = p.parse_args(argv)
    out_dir = Path(args.out).parent
    sup = Supervisor(out_dir / "decision-latency-run", sidecar_args=("--event-loop", args.event_loop))
    results: dict[str, Any] = {
        "backends": args.backends,
        "sessions": args.sessions,
        "event_loop": args.event_loop,
        "sizes": {},
    }
    try:
        redis_port = free_port()
        sup.start_redis(redis_port)
        sims = min(args.backends, 8)
        sim_port = free_ports(sims)
        events = free_ports(sims) if args.exact else None
        publish = ("--kv-events-port", str(events)) if events is not None else ()
        sup.start_sim(sim_port, sims, "sim", "--model", "bench-model", *publish)
        if args.sessions:
            took = preload_sessions(redis_port, args.sessions, args.backends)
            print(f"preloaded {args.sessions:,} sessions in {took:.1f}s")
        socket_path = sup.run_dir / "sidecar.sock"
        config = {
            "listen": {"socket": str(socket_path), "http_port": free_port()},
            "redis": {"url": f"redis://127.0.0.1:{redis_port}/0", "prefix": "kvgate"},
            # Scrape rarely: the benchmark measures decisions, not 1,000 scrapes a second.
            "scrape": {"interval_ms": 60_000, "timeout_ms": 5_000, "stale_after_ms": 600_000},
            "backends": [
                {"id": f"b-{i}", "url": f"http://127.0.0.1:{sim_port + i % sims}"}
                | ({} if events is None else {"kv_events": f"tcp://127.0.0.1:{events + i % sims}"})
                for i in range(args.backends)
            ],
            # The default 30 ms budget, said out loud: a decision never waits longer for token ids.
            "kv_index": {"tokenize_timeout_ms": 30},
        }
        replica = launch_replica(sup, "bench", config)
        pid = sup.procs[replica.sidecar_name].pid
        if args.burst and args.trace:
            # Twice over, as a load level that repeats the previous level's requests: the second
            # pass's prompts return to what the index and Redis already hold.
            reqs = load_trace(args.trace, limit=args.burst * args.rounds, model="bench-model")
            results["burst"] = {
                f"trace-{seen}": burst(
                    socket_path, f"trace prompts, {seen}", trace_bursts(reqs, args.burst, args.rounds), pid
                )
                for seen in ("new", "returning")
            }
        elif args.burst:
            results["burst"] = {
                str(size): burst(
                    socket_path,
                    f"prompt {size / 1024:.1f} KB",
                    synthetic_bursts(size, args.burst, args.rounds),
                    pid,
                )
                for size in args.sizes
            }
        client = DecisionClient(socket_path)
        for size in [] if args.burst else args.sizes:
            words = max(1, size // 8)
            samples: list[float] = []
            for i in range(args.requests):
                text = (f"conversation {i} " + "lorem ipsum dolor sit amet " * (words // 5 + 1))[:size]
                body = {"model": "bench-model", "messages": [{"role": "user", "content": text}]}
                key = f"preloaded-{i}" if args.sessions and i % 2 == 0 else f"new-{size}-{i}"
                sent = None
                if args.exact:
                    sent = json.dumps(body)
                    if i % 2 == 1:  # held by a backend: its lookup hashes the whole prompt
                        place(f"http://127.0.0.1:{sim_port + i % sims}", body)
                msg = protocol.encode_message(
                    Decide(client.next_id(), extract(body, {"X-Session-ID": key}), sent)
                )
                t0 = time.perf_counter()
                raw = client.send_raw(msg)
                samples.append(time.perf_counter() - t0)
                reply = client.decode(raw)
                assert isinstance(reply, DecisionReply) and reply.candidates, reply
                # Untimed: the request ends, as Nginx's log phase reports it, so in-flight load
                # stays realistic instead of piling up until every backend looks saturated.
                client.finish(reply)
            line_bytes = len(json.dumps(msg))
            stats = {
                "p50_ms": pct(samples, 0.5) * 1000,
                "p99_ms": pct(samples, 0.99) * 1000,
                "mean_ms": statistics.fmean(samples) * 1000,
                "line_bytes": line_bytes,
            }
            results["sizes"][str(size)] = stats
            print(
                f"prompt {size / 1024:7.1f} KB (features line {line_bytes / 1024:5.1f} KB): "
                f"p50 {stats['p50_ms']:.3f} ms  p99 {stats['p99_ms']:.3f} ms  mean {stats['mean_ms']:.3f} ms",
                flush=True,
            )
        client.close()
    finally:
        sup.stop_all()
    write_json(Path(args.out), results)

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
