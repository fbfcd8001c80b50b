"""The agent's websocket server: a live node, its telemetry stream, control, and ``GET /metrics``.

Thin asyncio over the Sans-I/O parts (``agent.telemetry.stream``, ``agent.service.hub``): one task drives the node on a
:class:`~agent.runtime.clock.WallClock` inside the event loop (it processes the events that are due, yields to the
loop every few milliseconds, and sleeps until the next event otherwise, never blocking the loop), or, for a
live node (:class:`~agent.runtime.port.LiveNode`: vLLM units, which step on their own), runs its ``serve()``; each
connection has a reader (control frames, answered in order) and one sender task that drains its own
replies and its own bounded :class:`~agent.telemetry.stream.Subscription`. The node never waits for a subscriber: a
slow one loses its oldest events, counted and announced by its subscription. A subscriber that set
``max_batch`` gets whatever is queued for it as one :class:`~agent.telemetry.EventBatch` frame per send (so
under load there are far fewer frames and ``send`` calls; at low load one event still goes alone, at once).

Frames: binary frames are MessagePack, text frames JSON; a connection answers in the format of the last
frame it received (before any, in ``?format=json|msgpack`` of its URL, default MessagePack). The first
frame of every connection is a :class:`~agent.telemetry.NodeHello`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from agent.runtime.clock import WallClock
from agent.runtime.gc_control import GcController
from agent.runtime.node import Node
from agent.runtime.port import LiveNode
from agent.service.hub import Hub
from agent.telemetry import CODECS, MAX_FRAME_BYTES, AgentFrame, ErrorReply, Event, Format, Subscribe
from agent.telemetry.stream import Subscription, parse_control

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True, eq=False)
class _Connection:
    ws: ServerConnection
    fmt: Format
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    replies: deque[AgentFrame] = field(default_factory=deque)
    backlog: deque[Event] = field(default_factory=deque)
    """A resume's buffered events, sent before the subscription's live queue."""
    sub: Subscription | None = None

    def push(self, frame: AgentFrame) -> None:
        self.replies.append(frame)
        self.wake.set()

    def next_message(self) -> bytes | str | None:
        """The next frame to send, encoded in the connection's format: a reply first, else what the subscriber
        has waiting (the resume's backlog first), up to its ``max_batch`` events in one frame; None when there is
        nothing to send. Never waits for more events: a lone event goes alone."""
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
                data, num = codec.encode_batch(events)
                self.backlog.extendleft(reversed(events[num:]))  # beyond the size cap: first in the next frame
        return data.decode() if self.fmt == "json" else data

    def _take(self) -> list[Event]:
        if self.sub is None:
            return []
        limit = self.sub.max_batch
        backlog = self.backlog
        events = [backlog.popleft() for _ in range(min(limit, len(backlog)))]
        if len(events) < limit:
            events += self.sub.pop_many(limit - len(events))
        return events

    def has_frames(self) -> bool:
        return bool(self.replies or self.backlog or (self.sub is not None and len(self.sub)))


class AgentServer:
    """Serves one :class:`Hub` (and drives its node) on ``host:port``; use as ``async with``.

    ``port=0`` lets the OS choose (read :attr:`port` after start). ``speed`` is the wall clock's factor
    (node seconds per real second). ``gc_control`` enters a :class:`GcController` around the run.
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
        self.workload_done = asyncio.Event()
        """Set when every request has finished or been refused and no event is left."""
        self.num_events_processed = 0
        self._wake_node = asyncio.Event()
        self._stopping = False
        self._server: Server | None = None
        self._node_task: asyncio.Task[None] | None = None
        self._connections: set[_Connection] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            return self._port
        return int(next(iter(self._server.sockets)).getsockname()[1])

    @property
    def url(self) -> str:
        return f"{'wss' if self.ssl_context else 'ws'}://{self.host}:{self.port}"

    async def start(self) -> None:
        self.hub.attach()
        self._server = await serve(
            self._handle, self.host, self._port, process_request=self._process_request, ssl=self.ssl_context,
            max_size=self.max_frame_bytes, compression=None,
        )
        self._node_task = asyncio.create_task(self._run_node(), name="node")
        log.info("agent %s listening on %s", self.hub.node_id, self.url)

    async def stop(self) -> None:
        self._stopping = True
        self._wake_node.set()
        if self._server is not None:
            self._server.close()
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
        """Wait (at most ``timeout_s``) until every connection has sent what it has queued."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end and any(c.has_frames() for c in self._connections):
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
            while not self._stopping:
                t = node.next_event_s()
                if t is None:
                    if not node.unfinished():
                        self.workload_done.set()
                    await self._sleep(None)
                    continue
                gap = self.clock.seconds_until(t)
                if gap > 0:
                    if gc is not None:
                        gc.before_wait(gap)
                    await self._sleep(gap)
                    slice_end = loop.time() + self.slice_s
                    continue
                node.advance(t)
                self.num_events_processed += 1
                if loop.time() >= slice_end:
                    await asyncio.sleep(0)  # let connections and senders run
                    slice_end = loop.time() + self.slice_s

    async def _sleep(self, gap_s: float | None) -> None:
        self._wake_node.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake_node.wait(), gap_s)

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if urlsplit(request.path).path != "/metrics":
            return None
        response = connection.respond(200, self.hub.metrics_text())
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return response

    # -- connections ------------------------------------------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        query = parse_qs(urlsplit(ws.request.path).query) if ws.request is not None else {}
        fmt: Format = "json" if query.get("format", ["msgpack"])[0] == "json" else "msgpack"
        conn = _Connection(ws, fmt)
        self._connections.add(conn)
        who = _peer(ws)
        conn.push(self.hub.hello())
        sender = asyncio.create_task(self._send_loop(conn), name=f"sender {who}")
        try:
            async for frame in ws:
                conn.fmt = "json" if isinstance(frame, str) else "msgpack"
                request = parse_control(frame, fmt=conn.fmt)
                if isinstance(request, ErrorReply):
                    conn.push(request)
                elif isinstance(request, Subscribe):
                    if conn.sub is not None:
                        self.hub.unsubscribe(conn.sub)
                    conn.sub, reply, backlog = self.hub.subscribe(request, conn.wake.set)
                    conn.backlog = deque(backlog)
                    conn.push(reply)
                else:
                    conn.push(await self.hub.handle_async(request, who=who))
                    self.wake_node()
        except ConnectionClosed:
            pass
        finally:
            self._connections.discard(conn)
            if conn.sub is not None:
                self.hub.unsubscribe(conn.sub)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def _send_loop(self, conn: _Connection) -> None:
        try:
            while True:
                data = conn.next_message()
                if data is None:
                    conn.wake.clear()
                    await conn.wake.wait()
                    continue
                await conn.ws.send(data)
        except ConnectionClosed:
            pass

    def connections(self) -> Iterator[Subscription | None]:
        """The subscription of each open connection (for tests and status)."""
        return (c.sub for c in self._connections)


def _peer(ws: ServerConnection) -> str:
    address = ws.remote_address
    if isinstance(address, tuple) and len(address) >= 2:
        return f"ws:{address[0]}:{address[1]}"
    return "ws:unknown"


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context
