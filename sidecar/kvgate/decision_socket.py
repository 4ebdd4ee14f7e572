"""The sidecar's unix socket: serves the line protocol of ``kvgate.protocol`` to Nginx's Lua hook.

Connections are kept alive by Nginx's cosocket pool, so a decision costs one write and one read on an
open socket; no HTTP parsing. A malformed line gets an error line, never a dropped connection or a
traceback: the socket faces bytes that came from clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import time

from kvgate import protocol
from kvgate.agreement import Agreement
from kvgate.messages import (
    Decide,
    DecisionReply,
    ErrorCode,
    ErrorReply,
    KeysQuery,
    Message,
    ModelsQuery,
    ModelsReply,
    PeersQuery,
    PeersReply,
    QueuedReply,
    Reply,
    Report,
)
from kvgate.protocol import ProtocolError
from kvgate.queue import QueueFull, QueueTimeout
from kvgate.registry import Registry
from kvgate.service import DecisionService, Queued, RateLimited, Routed, UnknownModel
from kvgate.slo import SloShed

logger = logging.getLogger(__name__)
MAX_LINE = 4 * 1024 * 1024  # features of a 128k-token prompt are ~20 KB; this is a safety bound
# Connections waiting to be accepted. Nginx's workers open one per concurrent decision (then keep
# them), so a cold burst of a few hundred clients opens a few hundred at once; past the backlog a
# unix socket refuses at once (EAGAIN), and each refused request falls open. asyncio's default is
# 100; the kernel caps this at net.core.somaxconn.
BACKLOG = 1024
VERSION_LOG_EVERY_S = 10.0  # a version mismatch is logged loudly, but not once per request


class DecisionServer:
    def __init__(self, service: DecisionService, registry: Registry, agreement: Agreement) -> None:
        self.service = service
        self.registry = registry
        self.agreement = agreement
        self.server: asyncio.Server | None = None
        self._socket: tuple[str, int] | None = None  # (path, inode) of the socket this server made
        self._version_logged = 0.0
        self.connections = 0  # open connections from Nginx (the drain on SIGTERM waits for none)

    async def start(self, path: str, group: str | None = None) -> None:
        """Listen on ``path``: readable and writable by the sidecar's user and ``group`` only."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket from a previous run (a local, non-blocking unlink)
        self.server = await asyncio.start_unix_server(self._serve, path=path, limit=MAX_LINE, backlog=BACKLOG)
        os.chmod(path, 0o660)
        if group is not None:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        self._socket = (path, os.stat(path).st_ino)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        if self._socket is not None:
            # Python before 3.13 leaves the file behind. Removed only while it is still this server's:
            # a sidecar started while this one drained has put its own socket at the same path.
            path, inode = self._socket
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
            self._socket = None

    async def handle(self, msg: Message) -> Reply | Queued | None:
        if isinstance(msg, Decide):
            try:
                routed = await self.service.decide(msg.features, msg.decision_id, body=msg.body)
            except UnknownModel as exc:
                return ErrorReply(ErrorCode.UNKNOWN_MODEL, str(exc))
            except RateLimited as exc:
                return ErrorReply(
                    ErrorCode.RATE_LIMITED, "Rate limit reached; retry later.", int(exc.retry_after)
                )
            except QueueFull as exc:
                full = (
                    "the gateway queue is full"
                    if exc.key is None
                    else "this API key (or tenant) already holds its share of the gateway queue"
                )
                return ErrorReply(
                    ErrorCode.QUEUE_FULL, f"Every backend is busy and {full}; retry later.", exc.retry_after
                )
            except SloShed as exc:
                return self._shed(exc)
            if isinstance(routed, Queued):
                return routed
            return self._decision(routed)
        if isinstance(msg, Report):
            self.service.report(msg.outcomes)
            return None
        if isinstance(msg, PeersQuery):
            agreed = self.agreement.observe(msg.fingerprint)
            self.service.metrics.config_mismatch.set(0.0 if agreed else 1.0)
            version, peers = self.registry.peers()
            a = self.agreement
            return PeersReply(version, peers, len(self.registry.backends), a.fingerprint, a.auth, a.limits)
        if isinstance(msg, KeysQuery):
            return self.service.admission.keys()
        assert isinstance(msg, ModelsQuery)
        return ModelsReply(tuple(self.registry.model_cards()))

    def _decision(self, routed: Routed) -> DecisionReply:
        forward = self.service.config.queue.forward_priority and routed.priority != 0
        return DecisionReply(
            routed.decision_id,
            routed.candidates,
            routed.label,
            routed.priority if forward else None,
            routed.prefill,
            routed.first_byte_ms,
            self.service.admission.given_max_tokens(routed.decision_id),
        )

    async def _wait(self, queued: Queued, writer: asyncio.StreamWriter) -> Reply:
        """A queued request: say so, then a heartbeat line every ``heartbeat_s`` (Nginx falls open
        when they stop: a dead or stopped sidecar never strands a waiting request), then its
        decision or its refusal. A connection that breaks takes the request out of the queue."""
        future = queued.waiting.future
        assert future is not None
        beat = protocol.line(protocol.encode_reply(QueuedReply(queued.decision_id)))
        heartbeat = self.service.config.queue.heartbeat_s
        try:
            while True:
                writer.write(beat)
                await writer.drain()
                try:
                    result = await asyncio.wait_for(asyncio.shield(future), heartbeat)
                except TimeoutError:
                    continue
                assert isinstance(result, Routed)
                return self._decision(result)
        except QueueTimeout as exc:
            return ErrorReply(
                ErrorCode.QUEUE_TIMEOUT,
                "Every backend stayed busy for the gateway queue's longest wait; retry later.",
                exc.retry_after,
            )
        except SloShed as exc:
            return self._shed(exc)
        except (ConnectionError, asyncio.CancelledError):
            self.service.abandon(queued.decision_id)
            raise

    @staticmethod
    def _shed(exc: SloShed) -> ErrorReply:
        return ErrorReply(
            ErrorCode.SLO_SHED, f"Every backend is too busy: {exc}; retry later.", exc.retry_after
        )

    def _refused(self, exc: ProtocolError) -> ErrorReply:
        if exc.code is ErrorCode.PROTOCOL_VERSION:
            now = time.monotonic()
            if now - self._version_logged >= VERSION_LOG_EVERY_S:
                self._version_logged = now
                logger.error(
                    "Nginx's Lua speaks another protocol version than this sidecar (%s); every request "
                    "routes fail-open until both come from the same kvgate release",
                    exc,
                )
        else:
            logger.debug("refused a line: %s", exc)
        return ErrorReply(exc.code, str(exc))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    raw = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    writer.write(
                        protocol.line(
                            protocol.encode_reply(ErrorReply(ErrorCode.BAD_REQUEST, "line too long"))
                        )
                    )
                    break
                if not raw:
                    break
                reply: Reply | Queued | None
                try:
                    reply = await self.handle(protocol.decode_message(raw))
                except ProtocolError as exc:
                    refusal = self._refused(exc)
                    reply = refusal if exc.answered else None
                if isinstance(reply, Queued):
                    reply = await self._wait(reply, writer)
                if reply is not None:
                    writer.write(protocol.line(protocol.encode_reply(reply)))
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the server is shutting down; the connection closes below
        finally:
            self.connections -= 1
            writer.close()
