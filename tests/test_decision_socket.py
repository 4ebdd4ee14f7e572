"""The decision socket in process: a real unix socket, lines in and out, as Nginx speaks them."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Callable
from pathlib import Path

from kvgate import protocol
from kvgate.decision_socket import DecisionServer
from kvgate.messages import Decide, DecisionReply, ErrorCode, ErrorReply, ModelsQuery, Outcome, Report

from tests.cores import core, features, run


async def settled(done: Callable[[], bool]) -> bool:
    """Whether ``done`` holds within a second (the server works on its own tasks meanwhile)."""
    for _ in range(100):
        if done():
            return True
        await asyncio.sleep(0.01)
    return done()


def test_decisions_errors_and_reports_on_one_connection(tmp_path: Path) -> None:
    sc = core(n=2)
    path = str(tmp_path / "d.sock")

    async def go() -> None:
        server = DecisionServer(sc.service, sc.registry, sc.agreement)
        await server.start(path)
        mode = (await asyncio.to_thread(Path(path).stat)).st_mode
        assert stat.S_IMODE(mode) == 0o660
        reader, writer = await asyncio.open_unix_connection(path)

        async def ask(obj: object) -> object:
            writer.write(obj if isinstance(obj, bytes) else protocol.line(obj))  # type: ignore[arg-type]
            await writer.drain()
            return protocol.decode_reply(json.loads(await reader.readline()))

        reply = await ask(protocol.encode_message(Decide("d1", features(1))))
        assert isinstance(reply, DecisionReply) and reply.candidates[0].id in ("b0", "b1")
        assert len(sc.registry.ledger) == 1 and server.connections == 1
        # A line that is no message is refused on the same connection, which stays usable.
        refused = await ask(b'{"pv":4,"op":"decide","i":""}\n')
        assert isinstance(refused, ErrorReply) and refused.code is ErrorCode.BAD_REQUEST
        models = await ask(protocol.encode_message(ModelsQuery()))
        assert models is not None
        end = Outcome.end("d1", reply.candidates[0].id, 200)
        writer.write(protocol.line(protocol.encode_message(Report((end,)))))  # no answer to a report
        await writer.drain()
        assert await settled(lambda: len(sc.registry.ledger) == 0)
        writer.close()
        await writer.wait_closed()
        assert await settled(lambda: server.connections == 0)
        await server.stop()

    run(go())


def test_a_stopped_server_removes_its_socket_but_not_a_successor_s(tmp_path: Path) -> None:
    sc = core(n=2)
    path = tmp_path / "d.sock"

    async def go() -> None:
        server = DecisionServer(sc.service, sc.registry, sc.agreement)
        await server.start(str(path))
        await server.stop()
        assert not path.exists()  # nothing for the next sidecar, or a reader of the directory, to trip on
        # A new sidecar takes the path while the old one still drains: the old one's stop leaves it.
        old, new = (DecisionServer(sc.service, sc.registry, sc.agreement) for _ in range(2))
        await old.start(str(path))
        await new.start(str(path))
        await old.stop()
        assert path.is_socket()
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(protocol.line(protocol.encode_message(ModelsQuery())))
        await writer.drain()
        assert await reader.readline()  # the successor still answers there
        writer.close()
        await writer.wait_closed()
        await new.stop()
        assert not path.exists()

    run(go())
