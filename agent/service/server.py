"""The agent's websocket server: a live node, its telemetry stream, control, and ``GET /metrics``.

Thin asyncio over the Sans-I/O parts (``agent.telemetry.stream``, ``agent.service.hub``, ``agent.service.guard``):
one task drives the node on a :class:`~agent.runtime.clock.WallClock` inside the event loop (it processes the events
that are due, yields to the loop every few milliseconds, and sleeps until the next event otherwise, never blocking
the loop), or, for a live node (:class:`~agent.runtime.port.LiveNode`: vLLM units, which step on their own), runs its
``serve()``; each connection has a reader (control frames, answered in order) and one sender task that drains its
own replies and its own bounded :class:`~agent.telemetry.stream.Subscription`. The node never waits for a
subscriber: a slow one loses its oldest events, counted and announced by its subscription. A subscriber that set
``max_batch`` gets whatever is queued for it as one :class:`~agent.telemetry.EventBatch` frame per send (so
under load there are far fewer frames and ``send`` calls; at low load one event still goes alone, at once).

Cost per connection (:class:`~agent.service.guard.ConnectionLimits`): a resume is read from the hub's replay buffer as
the sender sends (nothing copied per subscriber), and each ``send`` waits until websockets' write buffer is below
its limit, so a subscriber that does not read holds at most one encoded frame; a send blocked for the subscriber
timeout closes the connection (1008, "subscriber too slow", counted in the hub's ``num_slow_dropped``). Handshakes:
browsers (an ``Origin`` header) only from allowed origins; a token presented at connect (``Authorization: Bearer``)
must be the agent's (HTTP 401 otherwise) and puts the connection under the token limit instead of the anonymous
one (HTTP 503 beyond either). Refused control tokens are slowed (:class:`~agent.service.guard.AuthThrottle`). Stopping
cuts connections whose peer does not read and gives the others a bounded closing handshake.

Frames: binary frames are MessagePack, text frames JSON; a connection answers in the format of the last
frame it received (before any, in ``?format=json|msgpack`` of its URL, default MessagePack). The first
frame of every connection is a :class:`~agent.telemetry.NodeHello`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from collections import deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response
from websockets.protocol import State

from agent.runtime.clock import WallClock
from agent.runtime.gc_control import GcController
from agent.runtime.node import Node
from agent.runtime.port import LiveNode
from agent.service.guard import AuthThrottle, ConnectionLimits, bearer_token
from agent.service.hub import Hub
from agent.telemetry import (
    CODECS,
    MAX_BATCH_EVENTS,
    MAX_FRAME_BYTES,
    AgentFrame,
    ErrorCode,
    ErrorReply,
    Event,
    Format,
    Subscribe,
)
from agent.telemetry.client import host_port
from agent.telemetry.stream import Subscription, parse_control

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SLOW_REASON = "subscriber too slow"
"""The close reason of a subscriber closed for not reading (code 1008)."""
STALLED_S = 0.1
"""A send blocked this long means the peer is not reading now: stopping and draining do not wait for it."""


@dataclass(slots=True, eq=False)
class _Connection:
    ws: ServerConnection
    fmt: Format
    host: str = ""
    """The peer's address (what the auth throttle counts by)."""
    has_token: bool = False
    """It presented the agent's token at connect (counted under the token limit)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    replies: deque[AgentFrame] = field(default_factory=deque)
    carry: deque[Event] = field(default_factory=deque)
    """Events beyond the last frame's size cap, first in the next frame (at most ``max_batch``)."""
    sub: Subscription | None = None
    max_send_bytes: int = MAX_FRAME_BYTES
    """Batch frames are cut at this size."""
    take: int = 0
    """Events to take for the next frame (0: ``max_batch``): after a frame cut at the size cap, as many as it held, so
    the next one is not encoded twice; doubled after each frame that was not cut."""
    num_auth_failures: int = 0
    send_since: float | None = None
    """Loop time at which the send under way began (None: not sending)."""

    def push(self, frame: AgentFrame) -> None:
        self.replies.append(frame)
        self.wake.set()

    def next_message(self) -> bytes | str | None:
        """The next frame to send, encoded in the connection's format: a reply first, else what the subscriber
        has waiting (a resume's buffered events first), up to its ``max_batch`` events in one frame; None when there
        is nothing to send. Never waits for more events: a lone event goes alone."""
        codec = CODECS[self.fmt]
        if self.replies:
            data = codec.encode(self.replies.popleft())
        else:
            events = self._take()
            if not events:
                return None
            if len(events) == 1:
                data = codec.encode(events[0])
            else:
                data, num = codec.encode_batch(events, self.max_send_bytes)
                self.carry.extendleft(reversed(events[num:]))  # beyond the size cap: first in the next frame
                self.take = num if num < len(events) else min(2 * self.take, MAX_BATCH_EVENTS) if self.take else 0
        return data.decode() if self.fmt == "json" else data

    def _take(self) -> list[Event]:
        if self.sub is None:
            return []
        limit = min(self.take, self.sub.max_batch) if self.take else self.sub.max_batch
        carry = self.carry
        events = [carry.popleft() for _ in range(min(limit, len(carry)))]
        if len(events) < limit:
            events += self.sub.pop_many(limit - len(events))
        return events

    def has_frames(self) -> bool:
        return bool(self.replies or self.carry or (self.sub is not None and len(self.sub)))

    def stalled(self, now: float) -> bool:
        """Its send has been blocked for :data:`STALLED_S` or more: the peer is not reading."""
        return self.send_since is not None and now - self.send_since >= STALLED_S


class AgentServer:
    """Serves one :class:`Hub` (and drives its node) on ``host:port``; use as ``async with``.

    ``port=0`` lets the OS choose (read :attr:`port` after start). ``speed`` is the wall clock's factor
    (node seconds per real second). ``gc_control`` enters a :class:`GcController` around the run. ``limits``: how many
    connections, from where, how long a subscriber may stop reading (:class:`ConnectionLimits`; its defaults).
    """

    def __init__(
        self,
        hub: Hub,
        *,
        host: str = "127.0.0.1",
        port: int = 7700,
        speed: float = 1.0,
        ssl_context: ssl.SSLContext | None = None,
        gc_control: bool = True,
        slice_s: float = 0.005,
        max_frame_bytes: int = 4 * MAX_FRAME_BYTES,
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.hub = hub
        self.host = host
        self._port = port
        self.clock = WallClock(speed)
        self.ssl_context = ssl_context
        self.gc_control = gc_control
        self.slice_s = slice_s
        """Longest stretch of node work between two yields to the event loop (seconds)."""
        self.max_frame_bytes = max_frame_bytes
        """Frames above this close the connection (websockets' limit); between the protocol's limit and this
        one they get a ``frame_too_large`` error reply and the connection carries on."""
        self.limits = limits or ConnectionLimits()
        self.auth = AuthThrottle(self.limits.backoff)
        """Refused tokens per remote address (the backoff that slows the next tries)."""
        self.workload_done = asyncio.Event()
        """Set when every request has finished or been refused and no event is left."""
        self.num_events_processed = 0
        self.num_refused_connections = 0
        """Handshakes refused for a connection limit."""
        self._wake_node = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()
        """Set by :meth:`stop`: ends every backoff wait at once."""
        self._server: Server | None = None
        self._node_task: asyncio.Task[None] | None = None
        self._connections: set[_Connection] = set()
        self._admitted: dict[ServerConnection, bool] = {}
        """Connections past :meth:`_process_request` and not yet ended: whether each presented a token."""

    @property
    def port(self) -> int:
        if self._server is None:
            return self._port
        return int(next(iter(self._server.sockets)).getsockname()[1])

    @property
    def url(self) -> str:
        """The address clients connect to (an IPv6 host in brackets: ``ws://[::1]:7700``)."""
        return f"{'wss' if self.ssl_context else 'ws'}://{host_port(self.host, self.port)}"

    async def start(self) -> None:
        self.hub.attach()
        self._server = await serve(
            self._handle, self.host, self._port, process_request=self._process_request, ssl=self.ssl_context,
            max_size=self.max_frame_bytes, compression=None, origins=self.limits.origins,
            close_timeout=self.limits.close_timeout_s,
        )
        self._node_task = asyncio.create_task(self._run_node(), name="node")
        log.info("agent %s listening on %s", self.hub.node_id, self.url)

    async def stop(self) -> None:
        """Stop listening, close every connection (a peer that does not read is cut at once, the others get
        ``close_timeout_s`` for their closing handshake), then stop the node."""
        self._stopping = True
        self._stopped.set()
        self._wake_node.set()
        if self._server is not None:
            self._server.close(close_connections=False)
            loop = asyncio.get_running_loop()
            closing = []
            for conn in list(self._connections):
                if conn.stalled(loop.time()):
                    conn.ws.transport.abort()  # a close frame would wait behind what it does not read
                else:
                    closing.append(self._close(conn.ws, CloseCode.GOING_AWAY, "agent stopping"))
            await asyncio.gather(*closing)
            await self._server.wait_closed()
        if self._node_task is not None:
            if isinstance(self.hub.node, Node):
                await self._node_task
            else:
                self._node_task.cancel()  # a live node serves until cancelled
                (outcome,) = await asyncio.gather(self._node_task, return_exceptions=True)
                if isinstance(outcome, Exception):
                    raise outcome  # it failed before the stop, as the simulated node's loop would say

    async def __aenter__(self) -> AgentServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def wake_node(self) -> None:
        """Make the node loop look again at its next event (after a control action)."""
        self._wake_node.set()

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every connection has sent what it has queued, but for those whose peer
        does not read (a send blocked for :data:`STALLED_S`)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while (now := loop.time()) < end and any(c.has_frames() and not c.stalled(now) for c in self._connections):
            await asyncio.sleep(0.01)

    # -- the node ---------------------------------------------------------------------------------------------
    async def _run_node(self) -> None:
        node = self.hub.node
        if not isinstance(node, Node):
            if not isinstance(node, LiveNode):
                raise TypeError(f"the server drives a Node or serves a LiveNode, not {type(node).__name__}")
            await node.serve(self.workload_done)
            return
        loop = asyncio.get_running_loop()
        self.clock.wait_until(0.0)  # starts the clock at node time 0; never waits
        gc_cm = GcController() if self.gc_control else contextlib.nullcontext(None)
        with gc_cm as gc:
            slice_end = loop.time() + self.slice_s
            flush = self.hub.flush  # the hub holds the node's events until then (Hub.flush): before every await
            while not self._stopping:
                t = node.next_event_s()
                if t is None:
                    flush()
                    if not node.unfinished():
                        self.workload_done.set()
                    await self._sleep(None)
                    continue
                gap = self.clock.seconds_until(t)
                if gap > 0:
                    flush()
                    if gc is not None:
                        gc.before_wait(gap)
                    await self._sleep(gap)
                    slice_end = loop.time() + self.slice_s
                    continue
                node.advance(t)
                self.num_events_processed += 1
                if loop.time() >= slice_end:
                    flush()
                    await asyncio.sleep(0)  # let connections and senders run
                    slice_end = loop.time() + self.slice_s

    async def _sleep(self, gap_s: float | None) -> None:
        self._wake_node.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake_node.wait(), gap_s)

    # -- handshakes -------------------------------------------------------------------------------------------
    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """``GET /metrics``; otherwise the connection's admission: a token presented at connect checked once its
        address is out of backoff (HTTP 401 when wrong, 429 when the backoff runs too long), then its limit (HTTP
        503). The ``Origin`` check is websockets' own (``serve(origins=...)``, HTTP 403), after this."""
        if urlsplit(request.path).path == "/metrics":
            response = connection.respond(200, self.hub.metrics_text())
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = METRICS_CONTENT_TYPE
            return response
        if self._stopping:
            return connection.respond(503, "the agent is stopping\n")
        token = bearer_token(request.headers)
        if token is not None and not (self.hub.control_enabled or self.hub.reads_need_token):
            token = None  # an agent without tokens: admitted as anonymous, its control answered "disabled"
        if token is not None:
            host = _host(connection)
            refused = await self._handshake_turn(connection, host)
            if refused is not None:
                return refused
            if not self.hub.accepts_token(token):
                self.auth.failed(host)
                who = _peer(connection)
                log.warning("%s: refused a connection: wrong token at connect", who)
                self.hub.audit_refusal("connect", ErrorCode.UNAUTHORIZED, "wrong token presented at connect", who=who)
                return connection.respond(401, "the token presented at connect (Authorization: Bearer) is not this "
                                               "agent's\n")
        return self._admit(connection, has_token=token is not None)

    async def _handshake_turn(self, connection: ServerConnection, host: str) -> Response | None:
        """Wait until ``host`` is out of backoff (another try may extend it meanwhile); HTTP 429 when that would take
        longer than ``Backoff.max_handshake_wait_s`` in all, 503 when the agent stops meanwhile."""
        waited_s = 0.0
        while (wait_s := self.auth.wait_s(host)) > 0:
            if waited_s + wait_s > self.limits.backoff.max_handshake_wait_s:
                response = connection.respond(429, f"too many refused tokens from {host}: retry in "
                                                   f"{math.ceil(wait_s)} s\n")
                response.headers["Retry-After"] = str(math.ceil(wait_s))
                return response
            await self._pause(wait_s)
            waited_s += wait_s
            if self._stopping:
                return connection.respond(503, "the agent is stopping\n")
        return None

    def _admit(self, connection: ServerConnection, *, has_token: bool) -> Response | None:
        admitted = self._admitted
        for gone in [c for c in admitted if c.state is State.CLOSED]:  # handshakes that failed after this check
            del admitted[gone]
        limits = self.limits
        limit = limits.max_token if has_token else limits.max_anonymous
        if sum(1 for t in admitted.values() if t is has_token) >= limit:
            self.num_refused_connections += 1
            if has_token:
                why = f"too many connections with a token ({limit}: --max-token-connections)"
            else:
                why = (f"too many connections without a token ({limit}: --max-anonymous-connections); connect with "
                       "the agent's token (Authorization: Bearer) or retry later")
            log.log(logging.WARNING if self.num_refused_connections == 1 else logging.INFO, "%s: refused: %s",
                    _peer(connection), why)
            return connection.respond(503, why + "\n")
        admitted[connection] = has_token
        return None

    # -- connections ------------------------------------------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        if self._stopping:
            self._admitted.pop(ws, None)
            return
        query = parse_qs(urlsplit(ws.request.path).query) if ws.request is not None else {}
        fmt: Format = "json" if query.get("format", ["msgpack"])[0] == "json" else "msgpack"
        conn = _Connection(ws, fmt, host=_host(ws), has_token=self._admitted.get(ws, False),
                           max_send_bytes=self.limits.max_send_bytes)
        self._connections.add(conn)
        who = _peer(ws)
        conn.push(self.hub.hello())
        sender = asyncio.create_task(self._send_loop(conn, who), name=f"sender {who}")
        try:
            async for frame in ws:
                conn.fmt = "json" if isinstance(frame, str) else "msgpack"
                request = parse_control(frame, fmt=conn.fmt)
                if isinstance(request, ErrorReply):
                    conn.push(request)
                    continue
                if request.needs_token or self.hub.reads_need_token:
                    await self._auth_turn(conn)
                if isinstance(request, Subscribe):
                    if conn.sub is not None:
                        self.hub.unsubscribe(conn.sub)
                    conn.sub, reply, _ = self.hub.subscribe(request, conn.wake.set, who=who)
                    conn.carry.clear()
                else:
                    reply = await self.hub.handle_async(request, who=who)
                    self.wake_node()
                conn.push(reply)
                refused = isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNAUTHORIZED
                if refused and not await self._refused(conn, who):
                    break
        except ConnectionClosed:
            pass
        finally:
            self._connections.discard(conn)
            self._admitted.pop(ws, None)
            if conn.sub is not None:
                self.hub.unsubscribe(conn.sub)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def _auth_turn(self, conn: _Connection) -> None:
        """Wait until the connection's address is out of backoff (another connection's refusal may extend it)."""
        while not self._stopping and (wait_s := self.auth.wait_s(conn.host)) > 0:
            await self._pause(wait_s)

    async def _refused(self, conn: _Connection, who: str) -> bool:
        """After a refused token: wait the backoff before the next frame; False when the connection had too many
        refusals and was closed (1008)."""
        conn.num_auth_failures += 1
        delay_s = self.auth.failed(conn.host, conn.num_auth_failures)
        if not self.auth.closes(conn.num_auth_failures):
            await self._pause(delay_s)
            return True
        log.warning("%s: closed after %d refused tokens", who, conn.num_auth_failures)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.limits.close_timeout_s
        while conn.replies and loop.time() < end:  # the last refusal's reply goes first
            await asyncio.sleep(0.01)
        await self._close(conn.ws, CloseCode.POLICY_VIOLATION, f"too many refused tokens ({conn.num_auth_failures})")
        return False

    async def _pause(self, delay_s: float) -> None:
        """Sleep ``delay_s``, or until :meth:`stop`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), delay_s)

    async def _send_loop(self, conn: _Connection, who: str) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = self.limits.subscriber_timeout_s
        try:
            while True:
                data = conn.next_message()
                if data is None:
                    conn.wake.clear()
                    await conn.wake.wait()
                    continue
                conn.send_since = loop.time()
                try:
                    async with asyncio.timeout(timeout_s):
                        await conn.ws.send(data)  # waits while websockets' write buffer is above its limit
                except TimeoutError:
                    self.hub.num_slow_dropped += 1
                    log.warning("%s: closed: %s (nothing read for %g s)", who, SLOW_REASON, timeout_s)
                    await self._close(conn.ws, CloseCode.POLICY_VIOLATION, SLOW_REASON)
                    return
                conn.send_since = None
        except ConnectionClosed:
            pass

    async def _close(self, ws: ServerConnection, code: int, reason: str) -> None:
        """Close ``ws`` with ``code`` and ``reason``, cutting it when its peer has not finished the closing handshake
        within ``close_timeout_s`` (one that does not read never gets the close frame)."""
        closing = asyncio.ensure_future(_quietly(ws.close(code, reason)))
        try:
            await asyncio.wait({closing}, timeout=self.limits.close_timeout_s)
        finally:
            if not closing.done():
                ws.transport.abort()

    def connections(self) -> Iterator[Subscription | None]:
        """The subscription of each open connection (for tests and status)."""
        return (c.sub for c in self._connections)

    @property
    def num_connections(self) -> tuple[int, int]:
        """Open connections: (without a token, with one)."""
        with_token = sum(1 for c in self._connections if c.has_token)
        return len(self._connections) - with_token, with_token


async def _quietly(closing: Coroutine[Any, Any, None]) -> None:
    with contextlib.suppress(ConnectionClosed, OSError):
        await closing


def _host(ws: ServerConnection) -> str:
    address = ws.remote_address
    if isinstance(address, tuple) and address:
        return str(address[0])
    return "unknown"


def _peer(ws: ServerConnection) -> str:
    address = ws.remote_address
    if isinstance(address, tuple) and len(address) >= 2:
        return f"ws:{address[0]}:{address[1]}"
    return "ws:unknown"


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context
