"""An asyncio client of the agent: control calls awaiting their replies, and an event stream that reconnects.

* :func:`open_session` - one connection (no reconnect): ``await session.call(Status())`` sends a request
  (the session's token and a fresh ``control_id``, a random UUID, filled in) and returns its reply; events of a
  subscription arrive through :meth:`AgentSession.next_batch` (a frame's events) or :meth:`AgentSession.next_event`.
* :func:`stream_batches` and :func:`stream` - events with reconnect: ``async for ws in connect(...)`` with
  delays from an injectable generator (``delays``); they subscribe with batch frames on
  (:data:`DEFAULT_MAX_BATCH`) and, after a reconnect, with ``resume_after_seq`` set to the last sequence
  number they saw and ``resume_boot_ns`` to its run, so nothing is missed while the agent's replay buffer
  still holds it (otherwise the agent announces the gap with an ``alert``); an agent that restarted in
  between (new ``boot_ns``, sequence numbers from 1 again) sends its new run from the start.

Agents of protocol 1 (no batch frames, no ``resume_boot_ns``) are refused with a clear :class:`AgentError`.
``wss://`` agents are verified with the system's trust store, or with :func:`client_ssl_context` (a client's
``--ca-file``); :func:`read_token` reads a token file and warns when others may read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl
import stat
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Generator, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import process_exception
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from agent.telemetry import (
    CODECS,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Alert,
    AlertCode,
    ControlRequest,
    ErrorCode,
    ErrorReply,
    Event,
    EventBatch,
    Format,
    NodeHello,
    ProtocolError,
    Reply,
    Subscribe,
    Subscribed,
)

log = logging.getLogger(__name__)

Delays = Callable[[], Generator[float]]
"""A factory of reconnect delays in seconds (a fresh generator after every successful connection)."""
ResumeFrom = int | None | Callable[[NodeHello], int | None]
"""Where a new stream starts: after this seq (None: live only), or asked of the hello (e.g. a store)."""
DEFAULT_MAX_BATCH: Final = 512
"""Events per frame these clients ask for (``Subscribe.max_batch``): batch frames are on by default."""


def backoff(
    initial_s: float = 0.5, factor: float = 2.0, max_s: float = 30.0, jitter: float = 0.1,
    rng: Callable[[], float] = random.random,
) -> Generator[float]:
    """Exponential reconnect delays with a little jitter, capped at ``max_s``."""
    delay = initial_s
    while True:
        yield delay * (1.0 + jitter * rng())
        delay = min(delay * factor, max_s)


class TokenFileError(Exception):
    """A control token file that cannot be read, or is empty."""


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as a URL and ``--listen`` take it: an IPv6 host in brackets (``[::1]:7700``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_token(path: Path | None) -> str:
    """The control token in ``path`` ("" without a file: control disabled, or not sent).

    A file that its group or others may read or write is still used, with a warning (one line: the file, its mode
    and the ``chmod`` that fixes it): the token is a password for every control action.
    """
    if path is None:
        return ""
    try:
        token = path.read_text().strip()
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise TokenFileError(f"token file {path} is empty")
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is open to its group or others (mode %04o): chmod 600 %s", path, mode, path)
    return token


class CaFileError(Exception):
    """A CA file (``--ca-file``) that cannot be read or holds no certificate."""


def client_ssl_context(ca_file: Path | None) -> ssl.SSLContext | None:
    """The TLS context of a client that trusts the CA certificates in ``ca_file`` (PEM) and only them, host names
    checked; None without a file: ``wss://`` then verifies with the system's default trust store."""
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except ssl.SSLError as exc:  # before OSError, its base
        raise CaFileError(f"CA file {ca_file} holds no PEM certificate ({exc.reason or exc})") from None
    except OSError as exc:
        raise CaFileError(f"cannot read CA file {ca_file}: {exc.strerror}") from None


def unreachable(uri: str, exc: BaseException) -> str:
    """Why the agent at ``uri`` could not be reached, in one line; for a certificate that does not verify (an
    untrusted CA, a name it does not hold), also what to do about it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = ("connect by a name or address the certificate holds" if exc.verify_code == _HOSTNAME_MISMATCH
                else "trust the CA that signed it with --ca-file PEM")
        return f"cannot verify {uri}: certificate verify failed: {exc.verify_message} ({hint})"
    if isinstance(exc, InvalidStatus):  # the agent refused the handshake: its reason is the body's first line
        why = exc.response.body.decode(errors="replace").strip().partition("\n")[0] if exc.response.body else ""
        return f"{uri} refused the connection: HTTP {exc.response.status_code}" + (f": {why}" if why else "")
    if isinstance(exc, InvalidURI):
        bare_ipv6 = urlsplit(uri).netloc.count(":") > 1 and "[" not in uri
        return f"bad agent URI {uri!r}: {exc.msg}" + (" (IPv6 goes in brackets: ws://[::1]:7700)" if bare_ipv6 else "")
    return f"cannot reach {uri}: {exc or type(exc).__name__}"


_HOSTNAME_MISMATCH: Final = 62
"""OpenSSL's ``X509_V_ERR_HOSTNAME_MISMATCH``."""


class CertificateError(Exception):
    """A ``wss://`` agent whose certificate does not verify, which :func:`stream_batches` does not retry (it would fail
    the same way); the message (:func:`unreachable`'s) names the agent and what to do."""


def _retrying(uri: str) -> Callable[[Exception], Exception | None]:
    """websockets' rule of what a reconnecting client retries, except a certificate that does not verify: that one
    ends the stream with a :class:`CertificateError`."""

    def retryable(exc: Exception) -> Exception | None:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return CertificateError(unreachable(uri, exc))
        return process_exception(exc)

    return retryable


class AgentError(Exception):
    """The agent answered with an error reply."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply


class AgentSession:
    """One open connection: its hello, replies matched to calls by ``control_id``, and a queue of frames (the
    events of one frame travel together: one queue hop per frame, not per event)."""

    def __init__(self, ws: ClientConnection, *, token: str = "", fmt: Format = "msgpack", max_frames: int = 64):
        self.ws = ws
        self.token = token
        self.fmt: Format = fmt
        self.hello: NodeHello | None = None
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self._frames: asyncio.Queue[Sequence[Event] | None] = asyncio.Queue(max_frames)
        self._unread: deque[Event] = deque()
        """Events of a frame that :meth:`next_event` has not returned yet."""
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
        """Send ``request`` (with this session's token and a fresh ``control_id``) and await its reply.

        The token goes with every request that has none: a change needs the control token, a read the read token
        (or the control token) when the agent has one. The ``control_id`` is a random UUID's hex unless the request
        has one already: the agent refuses a change whose id it has seen (``duplicate_control_id``), so a request
        sent again as it was is refused, not applied twice."""
        cid, future = await self._send(request)
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(cid, None)

    async def send(self, request: ControlRequest) -> asyncio.Future[Reply]:
        """Send ``request`` as :meth:`call` does, without waiting: the returned future gets its reply (events
        sent before the reply may still be queued then)."""
        _, future = await self._send(request)
        return future

    async def _send(self, request: ControlRequest) -> tuple[str, asyncio.Future[Reply]]:
        cid = request.control_id or uuid.uuid4().hex
        changes: dict[str, Any] = {"control_id": cid}
        if self.token and not request.token:
            changes["token"] = self.token
        request = msgspec.structs.replace(request, **changes)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[cid] = future
        data = CODECS[self.fmt].encode(request)
        try:
            await self.ws.send(data.decode() if self.fmt == "json" else data)
        except BaseException:
            self._pending.pop(cid, None)
            raise
        return cid, future

    async def next_batch(self) -> Sequence[Event]:
        """The events of the next frame (one, or an ``EventBatch``'s), in stream order; raises
        ``ConnectionClosed`` when the connection is gone."""
        events: Sequence[Event] | None
        if self._unread:
            events = tuple(self._unread)
            self._unread.clear()
            return events
        if self._frames.empty() and self._reader is not None and self._reader.done():
            raise self._closed()  # the reader could not queue its end marker: the queue was full then
        events = await self._frames.get()
        if events is None:
            self._frames.put_nowait(None)  # keep telling later callers
            raise self._closed()
        return events

    async def next_event(self) -> Event:
        """The next event or notice; raises ``ConnectionClosed`` when the connection is gone."""
        if not self._unread:
            self._unread.extend(await self.next_batch())
        return self._unread.popleft()

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
                if isinstance(message, EventBatch):
                    await self._frames.put(message.events)  # bounded: a slow consumer slows the reads
                elif isinstance(message, Reply):
                    self._reply(message)
                else:
                    await self._frames.put((message,))
        except ConnectionClosed as exc:
            self._close_exc = exc
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(self._closed())
            with contextlib.suppress(asyncio.QueueFull):
                self._frames.put_nowait(None)

    def _reply(self, reply: Reply) -> None:
        future = self._pending.pop(reply.control_id, None)
        if future is not None and not future.done():
            future.set_result(reply)
        elif isinstance(reply, ErrorReply):
            log.warning("agent error without a pending call: %s: %s", reply.code, reply.message)


def _connect(uri: str, fmt: Format, ssl_context: ssl.SSLContext | None, **kwargs: Any) -> connect:
    """websockets' ``connect`` to ``uri``; ``ssl_context`` applies to a ``wss://`` URI only (several agents, some over
    TLS and some not, can share one)."""
    if fmt == "json" and "format=" not in uri:
        uri += ("&" if "?" in uri else "?") + "format=json"
    if ssl_context is not None and urlsplit(uri).scheme == "wss":
        kwargs["ssl"] = ssl_context
    return connect(uri, max_size=4 * MAX_FRAME_BYTES, compression=None, **kwargs)


@contextlib.asynccontextmanager
async def open_session(
    uri: str, *, token: str = "", fmt: Format = "msgpack", ssl_context: ssl.SSLContext | None = None,
    open_timeout_s: float = 10.0,
) -> AsyncIterator[AgentSession]:
    """One connection to an agent (no reconnect), its hello already read. A ``token`` is also presented at connect
    (``Authorization: Bearer``): the agent then counts the connection under its token limit, not the anonymous one,
    and refuses the handshake (HTTP 401) when the token is not its own."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with _connect(uri, fmt, ssl_context, open_timeout=open_timeout_s, additional_headers=headers) as ws:
        session = AgentSession(ws, token=token, fmt=fmt)
        try:
            await session.start(open_timeout_s)
            yield session
        finally:
            await session.close()


async def stream_batches(
    uri: str,
    *,
    resume_after_seq: ResumeFrom = None,
    resume_boot_ns: int | None = None,
    unit_ids: Collection[int] | None = None,
    kinds: Collection[str] | None = None,
    delays: Delays = backoff,
    fmt: Format = "msgpack",
    ssl_context: ssl.SSLContext | None = None,
    open_timeout_s: float = 10.0,
    max_batch: int = DEFAULT_MAX_BATCH,
    refetch_dropped: bool = False,
    token: str = "",
) -> AsyncIterator[Sequence[Event]]:
    """Events of an agent, a frame's worth at a time, for as long as the caller iterates, across reconnects.

    Yields each connection's :class:`NodeHello` (seq 0) alone, then the events and this subscriber's notices
    (``alert`` frames with seq 0: flow control, gaps) of each frame together, in stream order. An integer
    ``resume_after_seq`` counts in the run ``resume_boot_ns`` (None: whichever run the agent is in); one asked
    of the hello counts in the hello's run. After a reconnect the stream resumes after the last sequence number
    it yielded, in the run it came from: an agent that restarted in between sends its new run from the start.

    ``refetch_dropped``: when the agent announces events dropped for this subscriber (``flow_control``), subscribe
    again from the first of them, so a reader that fell behind loses nothing the agent still buffers; events
    after that point then arrive a second time (a consumer that keeps one copy per sequence number, like the
    store, loses and duplicates nothing). ``token``: sent with the subscription (an agent with a read token needs
    it, or its control token). Raises :class:`AgentError` when the agent refuses the subscription
    for another reason than a stale resume position, or speaks an older protocol, and :class:`CertificateError` when a
    ``wss://`` agent's certificate does not verify with ``ssl_context`` (:func:`client_ssl_context`; None: the
    system's trust store).
    """
    last_seq: int | None = None
    boot_ns: int | None = None
    async for ws in _connect(uri, fmt, ssl_context, open_timeout=open_timeout_s, reconnect_delays=delays,
                             process_exception=_retrying(uri)):
        session = AgentSession(ws, token=token, fmt=fmt)
        try:
            hello = await session.start(open_timeout_s)
            _require_version(uri, hello)
            position: int | None
            position_boot: int | None
            if last_seq is not None:
                position, position_boot = last_seq, boot_ns
            elif callable(resume_after_seq):
                position, position_boot = resume_after_seq(hello), hello.boot_ns
            else:
                position, position_boot = resume_after_seq, resume_boot_ns
            boot_ns = hello.boot_ns
            request = Subscribe(resume_after_seq=position, resume_boot_ns=position_boot, max_batch=max_batch,
                                unit_ids=None if unit_ids is None else tuple(unit_ids),
                                kinds=None if kinds is None else tuple(kinds))
            await _subscribe(uri, session, request)
            yield (hello,)
            refetch = _Refetch(session, request, hello.boot_ns) if refetch_dropped else None
            while True:
                events = await session.next_batch()
                if refetch is not None:
                    await refetch.check(events)
                seq = _last_seq(events)
                if seq:
                    last_seq = seq
                yield events
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            log.info("%s: connection lost (%r); reconnecting", uri, exc)
            continue
        finally:
            await session.close()
            await ws.close()  # now, in this task: websockets' iterator would close it only when collected


async def stream(uri: str, **options: Any) -> AsyncIterator[Event]:
    """The events of :func:`stream_batches` (same options) one at a time."""
    async for events in stream_batches(uri, **options):
        for event in events:
            yield event


def _require_version(uri: str, hello: NodeHello) -> None:
    if hello.protocol_version < PROTOCOL_VERSION:
        raise AgentError(ErrorReply(
            code=ErrorCode.UNSUPPORTED_VERSION,
            message=f"{uri} speaks protocol {hello.protocol_version}; this client needs {PROTOCOL_VERSION} "
            "(upgrade the agent)",
        ))


async def _subscribe(uri: str, session: AgentSession, request: Subscribe) -> None:
    """Subscribe; a position ahead of the stream takes everything the agent buffers instead."""
    reply = await session.call(request)
    if isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_RESUME_SEQ:
        log.warning("%s: %s; taking everything it still buffers", uri, reply.message)
        request = msgspec.structs.replace(request, resume_after_seq=0, control_id="")
        reply = await session.call(request)
    if isinstance(reply, ErrorReply):
        raise AgentError(reply)
    payload = reply.payload
    if isinstance(payload, Subscribed) and payload.resumed_after_seq not in (None, request.resume_after_seq):
        log.warning("%s restarted since seq %s of its run %s: taking its new run from the start", uri,
                    request.resume_after_seq, request.resume_boot_ns)


def _last_seq(events: Sequence[Event]) -> int:
    """The sequence number of the last stream event (not a notice) of ``events``; 0 if none."""
    for event in reversed(events):
        if event.seq:
            return event.seq
    return 0


class _Refetch:
    """Subscribes again from the first dropped event whenever the agent announces drops (``flow_control``).

    While a refetch is under way, drops announced by the replaced subscription (frames already on their way)
    are ignored: the refetch's replay covers them. It is under way until its first event (the first dropped
    one) or its ``gap`` alert (that event is no longer buffered) arrives.
    """

    def __init__(self, session: AgentSession, request: Subscribe, boot_ns: int) -> None:
        self._session = session
        self._request = request
        self._boot_ns = boot_ns
        self._awaiting: int | None = None
        """The first sequence number the refetch under way will send."""

    async def check(self, events: Sequence[Event]) -> None:
        for event in events:
            if event.seq:
                if event.seq == self._awaiting:
                    self._awaiting = None
            elif isinstance(event, Alert):
                if event.code == AlertCode.GAP:
                    self._awaiting = None
                elif event.code == AlertCode.FLOW_CONTROL and event.first_seq and self._awaiting is None:
                    await self._refetch(event.first_seq)

    async def _refetch(self, first_seq: int) -> None:
        log.warning("events %d.. were dropped for this subscriber: fetching them again", first_seq)
        self._awaiting = first_seq
        await self._session.send(msgspec.structs.replace(
            self._request, resume_after_seq=first_seq - 1, resume_boot_ns=self._boot_ns, control_id=""))
