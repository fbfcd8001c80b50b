"""An asyncio client of the agent: control calls awaiting their replies, and an event stream that reconnects.

* :func:`open_session` - one connection (no reconnect): ``await session.call(Status())`` sends a request
  (token and ``control_id`` filled in) and returns its reply; events of a subscription arrive through
  :meth:`AgentSession.next_event`.
* :func:`stream` - events with reconnect: ``async for ws in connect(...)`` with delays from an injectable
  generator (``delays``); after a reconnect it subscribes again with ``resume_after_seq`` set to the last
  sequence number it saw, so nothing is missed while the agent's replay buffer still holds it (otherwise
  the agent announces the gap with an ``alert``). A restarted agent (new ``boot_ns``) starts a new stream:
  the resume position is then asked again from ``resume_after_seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import ssl
from collections.abc import AsyncIterator, Callable, Collection, Generator
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from agent.protocol import (
    CODECS,
    MAX_FRAME_BYTES,
    ControlRequest,
    ErrorCode,
    ErrorReply,
    Event,
    Format,
    NodeHello,
    ProtocolError,
    Reply,
    Subscribe,
)

log = logging.getLogger(__name__)

Delays = Callable[[], Generator[float]]
"""A factory of reconnect delays in seconds (a fresh generator after every successful connection)."""
ResumeFrom = int | None | Callable[[NodeHello], int | None]
"""Where a new stream starts: after this seq (None: live only), or asked of the hello (e.g. a store)."""


def backoff(
    initial_s: float = 0.5, factor: float = 2.0, max_s: float = 30.0, jitter: float = 0.1,
    rng: Callable[[], float] = random.random,
) -> Generator[float]:
    """Exponential reconnect delays with a little jitter, capped at ``max_s``."""
    delay = initial_s
    while True:
        yield delay * (1.0 + jitter * rng())
        delay = min(delay * factor, max_s)


class AgentError(Exception):
    """The agent answered with an error reply."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply


class AgentSession:
    """One open connection: its hello, replies matched to calls by ``control_id``, and a queue of events."""

    def __init__(self, ws: ClientConnection, *, token: str = "", fmt: Format = "msgpack", max_events: int = 10_000):
        self.ws = ws
        self.token = token
        self.fmt: Format = fmt
        self.hello: NodeHello | None = None
        self._ids = itertools.count(1)
        self._prefix = f"c{random.getrandbits(32):08x}-"
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self._events: asyncio.Queue[Event | None] = asyncio.Queue(max_events)
        self._reader: asyncio.Task[None] | None = None
        self._close_exc: ConnectionClosed | None = None

    async def start(self, timeout_s: float = 10.0) -> NodeHello:
        self._reader = asyncio.create_task(self._read())
        first = await asyncio.wait_for(self.next_event(), timeout_s)
        if not isinstance(first, NodeHello):
            raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"expected a hello first, got {type(first).__name__}")
        self.hello = first
        return first

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def call(self, request: ControlRequest, timeout_s: float = 10.0) -> Reply:
        """Send ``request`` (with this session's token and a fresh ``control_id``) and await its reply."""
        cid = request.control_id or f"{self._prefix}{next(self._ids)}"
        changes: dict[str, Any] = {"control_id": cid}
        if request.needs_token and not request.token:
            changes["token"] = self.token
        request = msgspec.structs.replace(request, **changes)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[cid] = future
        try:
            data = CODECS[self.fmt].encode(request)
            await self.ws.send(data.decode() if self.fmt == "json" else data)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(cid, None)

    async def next_event(self) -> Event:
        """The next event or notice; raises ``ConnectionClosed`` when the connection is gone."""
        event = await self._events.get()
        if event is None:
            self._events.put_nowait(None)  # keep telling later callers
            raise self._closed()
        return event

    def _closed(self) -> ConnectionClosed:
        return self._close_exc or ConnectionClosed(None, None)

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.ws.recv()
                codec = CODECS["json" if isinstance(frame, str) else "msgpack"]
                try:
                    message = codec.decode_agent_frame(frame)
                except ProtocolError as exc:
                    log.warning("undecodable frame from the agent: %s", exc)
                    continue
                if isinstance(message, Reply):
                    future = self._pending.get(message.control_id)
                    if future is not None and not future.done():
                        future.set_result(message)
                    elif isinstance(message, ErrorReply):
                        log.warning("agent error without a pending call: %s: %s", message.code, message.message)
                else:
                    await self._events.put(message)  # bounded: a slow consumer slows the reads, not the agent
        except ConnectionClosed as exc:
            self._close_exc = exc
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(self._closed())
            with contextlib.suppress(asyncio.QueueFull):
                self._events.put_nowait(None)


def _connect(uri: str, fmt: Format, ssl_context: ssl.SSLContext | None, **kwargs: Any) -> connect:
    if fmt == "json" and "format=" not in uri:
        uri += ("&" if "?" in uri else "?") + "format=json"
    if ssl_context is not None:
        kwargs["ssl"] = ssl_context
    return connect(uri, max_size=4 * MAX_FRAME_BYTES, compression=None, **kwargs)


@contextlib.asynccontextmanager
async def open_session(
    uri: str, *, token: str = "", fmt: Format = "msgpack", ssl_context: ssl.SSLContext | None = None,
    open_timeout_s: float = 10.0,
) -> AsyncIterator[AgentSession]:
    """One connection to an agent (no reconnect), its hello already read."""
    async with _connect(uri, fmt, ssl_context, open_timeout=open_timeout_s) as ws:
        session = AgentSession(ws, token=token, fmt=fmt)
        try:
            await session.start(open_timeout_s)
            yield session
        finally:
            await session.close()


async def stream(
    uri: str,
    *,
    resume_after_seq: ResumeFrom = None,
    unit_ids: Collection[int] | None = None,
    kinds: Collection[str] | None = None,
    delays: Delays = backoff,
    fmt: Format = "msgpack",
    ssl_context: ssl.SSLContext | None = None,
    open_timeout_s: float = 10.0,
) -> AsyncIterator[Event]:
    """Events of an agent for as long as the caller iterates, across reconnects.

    Yields each connection's :class:`NodeHello` (seq 0), then the stream's events and this subscriber's
    notices (``alert`` frames with seq 0: flow control, gaps). Raises :class:`AgentError` when the agent
    refuses the subscription for another reason than a stale resume position.
    """
    last_seq: int | None = None
    boot_ns: int | None = None
    async for ws in _connect(uri, fmt, ssl_context, open_timeout=open_timeout_s, reconnect_delays=delays):
        session = AgentSession(ws, fmt=fmt)
        try:
            hello = await session.start(open_timeout_s)
            if boot_ns is not None and hello.boot_ns != boot_ns:
                log.warning("%s restarted: its sequence numbers start again", uri)
                last_seq = None
            boot_ns = hello.boot_ns
            if last_seq is not None:
                position: int | None = last_seq
            else:
                position = resume_after_seq(hello) if callable(resume_after_seq) else resume_after_seq
            request = Subscribe(resume_after_seq=position, unit_ids=None if unit_ids is None else tuple(unit_ids),
                                kinds=None if kinds is None else tuple(kinds))
            reply = await session.call(request)
            if isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_RESUME_SEQ:
                log.warning("%s: %s; taking everything it still buffers", uri, reply.message)
                reply = await session.call(msgspec.structs.replace(request, resume_after_seq=0, control_id=""))
            if isinstance(reply, ErrorReply):
                raise AgentError(reply)
            yield hello
            while True:
                event = await session.next_event()
                if event.seq:
                    last_seq = event.seq
                yield event
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            log.info("%s: connection lost (%r); reconnecting", uri, exc)
            continue
        finally:
            await session.close()
