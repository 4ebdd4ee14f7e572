"""The subscriber on real ZMQ sockets: the simulator's publisher (vLLM's wire format) on TCP ports,
kvgate's subscriber feeding the exact index. A late join and a gap are filled from the replay
socket; without one the view turns partial; a restarted publisher clears the backend; garbage and
floods are counted and bounded, and events keep flowing after them."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from kvgate.config import Config
from kvgate.exact_index import View
from kvgate.kv_subscriber import KvSubscriber
from kvgate.sidecar import Sidecar, build_sidecar
from kvgate.tools.readiness import free_ports

from vllm_sim.kv_cache import Removed, Stored
from vllm_sim.kv_publisher import KvPublisher


def stored(*hashes: int) -> Stored:
    return Stored(hashes, None, (), 16)


async def until(cond: Callable[[], bool]) -> None:
    """Wait (5 s at most) for ``cond``: the subscriber works on its own task meanwhile."""
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    assert cond()


def core(port: int, replay: int | None, max_blocks: int = 262_144) -> Sidecar:
    backend = {"id": "sim-0", "url": "http://127.0.0.1:1", "kv_events": f"tcp://127.0.0.1:{port}"}
    if replay is not None:
        backend["kv_events_replay"] = f"tcp://127.0.0.1:{replay}"
    cfg = Config.from_mapping(
        {"redis": {"url": None}, "backends": [backend], "kv_index": {"max_blocks": max_blocks}}
    )
    sc = build_sidecar(cfg, None)
    sc.registry.set_membership((b, False) for b in cfg.backends)
    return sc


@contextlib.asynccontextmanager
async def subscribed(sc: Sidecar) -> AsyncIterator[KvSubscriber]:
    """The sidecar's subscriber on a task of its own, as the app runs it; cancelled on the way out."""
    sub = KvSubscriber(sc.exact, sc.metrics, 2.0, sc.registry)
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def run(case: Callable[[int], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(case(free_ports(2)))


def count(sc: Sidecar, name: str, *labels: str) -> float:
    value = sc.metrics.registry.get_sample_value(name, dict(zip(_LABELS[name], labels, strict=True)))
    return value or 0.0


_LABELS = {
    "kvgate_kv_event_messages_total": ("backend", "result"),
    "kvgate_kv_event_replays_total": ("backend", "result"),
    "kvgate_kv_events_total": ("backend", "type"),
}


def test_a_late_join_and_a_gap_are_filled_from_the_replay_socket() -> None:
    run(_a_late_join_and_a_gap_are_filled_from_the_replay_socket)


async def _a_late_join_and_a_gap_are_filled_from_the_replay_socket(ports: int) -> None:
    pub = KvPublisher("127.0.0.1", ports, ports + 1)
    pub.start()
    pub.publish([stored(1, 2)])  # before anyone listens: only the replay has it
    sc = core(ports, ports + 1)
    try:
        async with subscribed(sc):
            # ZMQ's subscription takes a moment to reach the publisher: publish until one arrives.
            n = 10
            while sc.exact.next_seq("sim-0") is None:
                pub.publish([stored(n)])
                n += 1
                await asyncio.sleep(0.05)
            await until(lambda: sc.exact.next_seq("sim-0") == pub.seq)
            assert sc.exact.view("sim-0") is View.FULL  # the replay brought everything from seq 0
            assert sc.exact.depth("sim-0", [1, 2]) == 2
            assert count(sc, "kvgate_kv_event_replays_total", "sim-0", "filled") == 1

            pub.skip_next = 2  # two messages never reach the live stream
            pub.publish([stored(100)])
            pub.publish([Removed((1,))])
            pub.publish([stored(101)])
            await until(lambda: sc.exact.next_seq("sim-0") == pub.seq)
            assert sc.exact.view("sim-0") is View.FULL
            assert sc.exact.depth("sim-0", [100]) == 1 and sc.exact.depth("sim-0", [1]) == 0
            assert count(sc, "kvgate_kv_event_replays_total", "sim-0", "filled") == 2
            assert count(sc, "kvgate_kv_events_total", "sim-0", "BlockRemoved") == 1
    finally:
        await pub.close()


def test_without_a_replay_socket_a_gap_leaves_the_view_partial_and_a_restart_clears_it() -> None:
    run(_without_a_replay_socket_a_gap_leaves_the_view_partial_and_a_restart_clears_it)


async def _without_a_replay_socket_a_gap_leaves_the_view_partial_and_a_restart_clears_it(ports: int) -> None:
    sc = core(ports, None)
    pub = KvPublisher("127.0.0.1", ports)
    try:
        async with subscribed(sc):
            while sc.exact.next_seq("sim-0") is None:
                pub.publish([stored(1)])
                await asyncio.sleep(0.05)
            pub.skip_next = 1
            pub.publish([stored(2)])
            pub.publish([stored(3)])
            await until(lambda: sc.exact.next_seq("sim-0") == pub.seq)
            assert sc.exact.view("sim-0") is View.PARTIAL
            assert sc.exact.depth("sim-0", [1]) == 1 and sc.exact.depth("sim-0", [2]) == 0
            assert count(sc, "kvgate_kv_event_messages_total", "sim-0", "gap") >= 1

            await pub.close()  # the engine restarts: a new publisher on the same port, from seq 0
            pub = KvPublisher("127.0.0.1", ports)
            while count(sc, "kvgate_kv_event_messages_total", "sim-0", "restart") == 0:
                pub.publish([stored(7)])
                await asyncio.sleep(0.05)
            await until(lambda: sc.exact.next_seq("sim-0") == pub.seq)
            assert sc.exact.depth("sim-0", [1]) == 0 and sc.exact.depth("sim-0", [7]) == 1
    finally:
        await pub.close()


def test_garbage_is_counted_and_a_flood_stays_within_the_bound() -> None:
    run(_garbage_is_counted_and_a_flood_stays_within_the_bound)


async def _garbage_is_counted_and_a_flood_stays_within_the_bound(ports: int) -> None:
    sc = core(ports, None, max_blocks=1024)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(f"tcp://127.0.0.1:{ports}")
    good = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [5], "block_size": 16}], None])
    try:
        async with subscribed(sc) as sub:
            while sc.exact.next_seq("sim-0") is None:
                await raw.send_multipart([b"t", (0).to_bytes(8, "big"), good])
                await asyncio.sleep(0.05)
            garbage = [
                [b"t", b"\x00", good],  # a short sequence frame
                [b"t", (1).to_bytes(8, "big"), b"\xc1\xc1"],  # not msgpack
                [b"t", (1).to_bytes(8, "big"), msgpack.packb({"ts": "x"})],
                [b"only one frame"],
            ]
            for frames in garbage:
                await raw.send_multipart(frames)
            await until(lambda: count(sc, "kvgate_kv_event_messages_total", "sim-0", "malformed") == 4)
            seq = sc.exact.next_seq("sim-0") or 0
            for i in range(200):  # 200 messages of 100 blocks: 20,000 hashes against a bound of 1,024
                blocks = list(range(1000 + i * 100, 1100 + i * 100))
                payload = msgpack.packb(
                    [0.0, [{"type": "BlockStored", "block_hashes": blocks, "block_size": 16}]]
                )
                await raw.send_multipart([b"t", (seq + i).to_bytes(8, "big"), payload])
            await until(lambda: sc.exact.next_seq("sim-0") == seq + 200)
            assert sc.exact.size("sim-0") == 1024
            assert sc.exact.depth("sim-0", [20999]) == 1  # the newest are kept
            assert sc.exact.view("sim-0") is View.FULL  # the garbage did not break the sequence
            sub.check()
            assert (
                sc.metrics.registry.get_sample_value("kvgate_kv_index_blocks", {"backend": "sim-0"}) == 1024
            )
    finally:
        ctx.destroy(linger=0)


def test_a_backend_that_leaves_is_unsubscribed_and_forgotten() -> None:
    run(_a_backend_that_leaves_is_unsubscribed_and_forgotten)


async def _a_backend_that_leaves_is_unsubscribed_and_forgotten(ports: int) -> None:
    sc = core(ports, None)
    pub = KvPublisher("127.0.0.1", ports)
    try:
        async with subscribed(sc) as sub:
            while sc.exact.next_seq("sim-0") is None:
                pub.publish([stored(1)])
                await asyncio.sleep(0.05)
            sc.registry.set_membership([])
            sub.sync({})
            assert sc.exact.view("sim-0") is View.NONE
            assert (
                sc.metrics.registry.get_sample_value("kvgate_kv_index_blocks", {"backend": "sim-0"}) is None
            )
    finally:
        await pub.close()
