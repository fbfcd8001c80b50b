"""The agent's connection limits with real sockets on loopback (issue #16): a resume streamed from the replay buffer,
the anonymous connection limit, slow subscribers closed and counted, a stop that does not wait for them, browser
origins, and refused tokens slowed then closed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import pytest
from serve_harness import TOKEN, make_hub, make_server, run, wait_for
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.typing import Origin

from agent.service.guard import AuthThrottle, Backoff, ConnectionLimits
from agent.service.server import SLOW_REASON, AgentServer, _Connection
from agent.telemetry import MSGPACK, NodeHello, OkReply, PauseUnit, Status, StatusInfo, Subscribe
from agent.telemetry.client import open_session


@contextlib.asynccontextmanager
async def non_reader(server: AgentServer, request: Subscribe) -> AsyncIterator[ClientConnection]:
    """A subscriber that sends ``request`` and then reads nothing (a 4 KiB receive buffer, one frame queued). The
    agent's side of the socket gets a 4 KiB send buffer too, as if little were in flight on a network: on loopback
    the kernel would otherwise take megabytes before a send blocks."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    port = sock.getsockname()[1]
    async with connect(server.url, sock=sock, max_queue=1, compression=None) as ws:
        def agent_side() -> list[_Connection]:
            return [c for c in server._connections if c.ws.remote_address[1] == port]

        await wait_for(lambda: bool(agent_side()), what="the agent's side of the connection")
        (conn,) = agent_side()
        conn.ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await ws.send(MSGPACK.encode(request))
        try:
            yield ws
        finally:
            ws.transport.abort()  # no closing handshake behind what it did not read


def stalled(server: AgentServer, num: int) -> bool:
    now = asyncio.get_running_loop().time()
    return sum(1 for c in server._connections if c.stalled(now)) >= num


async def metrics_text(server: AgentServer) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
    data = await reader.read()
    writer.close()
    return data.decode()


def test_a_resume_from_seq_0_is_read_from_the_replay_buffer_as_it_is_sent() -> None:
    """A subscriber that does not read holds a frame's worth at most, not a copy of the buffer it resumes."""

    async def go() -> None:
        hub = make_hub(workload="poisson:n=2000,rate=200", replay_capacity=8000)
        hub.attach()
        hub.node.advance(6.0)  # a full buffer that has wrapped; the server's clock starts at 0, so the node waits
        assert hub.replay.oldest_seq > 1 and len(hub.replay) == 8000
        limits = ConnectionLimits(subscriber_timeout_s=None, max_send_bytes=16 * 1024)
        server = make_server(hub, speed=0.1, limits=limits)
        async with server, non_reader(server, Subscribe(resume_after_seq=0, max_batch=512)):
            await wait_for(lambda: stalled(server, 1), what="the subscriber's send to block")
            (conn,) = server._connections
            sub = conn.sub
            assert sub is not None and sub.replaying, "still in its resume"
            assert len(sub) > 6000, "most of the resume is still the buffer's, not the connection's"
            assert sub.num_queued == 0 and len(conn.carry) <= 512, "events held: a frame's worth at most"
            assert conn.ws.transport.get_write_buffer_size() <= 16 * 1024 + 32 * 1024, "one frame in the buffer"

    run(go)


def test_connections_without_a_token_beyond_the_limit_are_refused_at_the_handshake() -> None:
    async def go() -> None:
        hub = make_hub()
        async with make_server(hub, limits=ConnectionLimits(max_anonymous=2, max_token=1)) as server:
            url = server.url
            async with open_session(url), open_session(url):
                with pytest.raises(InvalidStatus) as info:
                    async with open_session(url):
                        pass
                assert info.value.response.status_code == 503
                assert b"too many connections without a token (2: --max-anonymous-connections)" in (
                    info.value.response.body or b"")
                async with open_session(url, token=TOKEN) as session:  # its token at connect: not anonymous
                    assert server.num_connections == (2, 1)
                    reply = await session.call(Status())
                    assert isinstance(reply, OkReply)
                    with pytest.raises(InvalidStatus) as info:
                        async with open_session(url, token=TOKEN):
                            pass
                    assert info.value.response.status_code == 503
                    assert b"--max-token-connections" in (info.value.response.body or b"")
            await wait_for(lambda: server.num_connections == (0, 0), what="the connections to end")
            async with open_session(url), open_session(url):  # room again
                pass
            with pytest.raises(InvalidStatus) as info:
                async with open_session(url, token="not-the-token"):
                    pass
            assert info.value.response.status_code == 401
            assert server.auth.num_refused == 1
            wait_s = server.auth.wait_s("127.0.0.1")
            start = asyncio.get_running_loop().time()
            async with open_session(url, token=TOKEN):  # the right one right after: it waits the backoff, then is in
                assert asyncio.get_running_loop().time() - start >= wait_s - 0.05

    run(go)


def test_a_subscriber_that_stops_reading_is_closed_with_a_reason_and_counted() -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=3000,rate=100")
        limits = ConnectionLimits(subscriber_timeout_s=1.0, close_timeout_s=30.0)
        async with make_server(hub, speed=5.0, limits=limits) as server:
            await wait_for(lambda: hub.sequencer.last_seq > 3000, what="events to resume")
            async with open_session(server.url) as reader:  # a live subscriber that reads: never closed
                await reader.call(Subscribe(max_batch=512))
                num_read = 0

                async def read() -> None:
                    nonlocal num_read
                    while True:
                        num_read += len(await reader.next_batch())

                reading = asyncio.create_task(read())
                async with non_reader(server, Subscribe(resume_after_seq=0, max_batch=512)) as slow:
                    await wait_for(lambda: hub.num_slow_dropped == 1, timeout_s=30, what="the slow subscriber closed")
                    with pytest.raises(ConnectionClosedError) as info:  # reading at last: what was sent, then the close
                        while True:
                            await slow.recv()
                    assert info.value.rcvd is not None
                    assert (info.value.rcvd.code, info.value.rcvd.reason) == (1008, SLOW_REASON)
                assert not reading.done() and num_read > 0
                reading.cancel()
                status = await reader.call(Status())
            assert isinstance(status, OkReply) and isinstance(status.payload, StatusInfo)
            assert status.payload.num_slow_dropped == 1 and hub.num_slow_dropped == 1
            assert "trackside_telemetry_slow_subscribers_closed_total 1\n" in await metrics_text(server)

    run(go, timeout_s=60)


def test_stopping_does_not_wait_for_subscribers_that_do_not_read() -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=2000,rate=200", replay_capacity=8000)
        hub.attach()
        hub.node.advance(4.0)
        server = make_server(hub, speed=0.1, limits=ConnectionLimits(subscriber_timeout_s=None))
        await server.start()
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(10):
                await stack.enter_async_context(non_reader(server, Subscribe(resume_after_seq=0, max_batch=512)))
            await wait_for(lambda: stalled(server, 10), what="every subscriber's send to block")
            # websockets alone waits 10 s (its close timeout) for each: these peers never take the close frame
            await asyncio.wait_for(server.stop(), 5.0)
            assert not server._connections

    run(go)


def test_browsers_are_refused_unless_their_origin_is_allowed() -> None:
    async def go() -> None:
        async with make_server(make_hub()) as server:
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url, origin=Origin("http://localhost:8080")):
                    pass
            assert info.value.response.status_code == 403
            async with open_session(server.url) as session:  # no Origin: not a browser
                assert session.hello is not None
        limits = ConnectionLimits(allow_origins=("https://dash.example",))
        async with make_server(make_hub(), limits=limits) as server:
            async with connect(server.url, origin=Origin("https://dash.example")) as ws:
                assert isinstance(MSGPACK.decode_agent_frame(await ws.recv()), NodeHello)
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url, origin=Origin("https://evil.example")):
                    pass
            assert info.value.response.status_code == 403

    run(go)


class PausableClock:
    """``time.monotonic``, but it can stand still (``pause``) and go on from there (``resume``)."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._paused_at: float | None = None

    def __call__(self) -> float:
        return self._paused_at if self._paused_at is not None else time.monotonic() - self._offset

    def pause(self) -> None:
        self._paused_at = self()

    def resume(self) -> None:
        assert self._paused_at is not None
        self._offset = time.monotonic() - self._paused_at
        self._paused_at = None


def test_refused_tokens_are_slowed_per_connection_and_address_then_the_connection_is_closed() -> None:
    clock = PausableClock()

    class Throttle(AuthThrottle):
        """The agent's throttle on ``clock``, which stands still from a connection's last refusal (the one that
        closes it) until the test resumes it: the address's 0.8 s backoff is whole when the next handshake comes, on
        a machine however slow (on the real clock a 0.5 s stall before that handshake let its token in)."""

        def failed(self, host: str, num_connection_failures: int = 1) -> float:
            delay_s = super().failed(host, num_connection_failures)
            if self.closes(num_connection_failures):
                clock.pause()
            return delay_s

    async def go() -> None:
        backoff = Backoff(initial_s=0.1, max_s=2.0, max_failures=4, half_life_s=600.0, max_handshake_wait_s=0.3)
        hub = make_hub()
        server = make_server(hub, limits=ConnectionLimits(backoff=backoff))
        server.auth = Throttle(backoff, get_time=clock)
        async with server:
            loop = asyncio.get_running_loop()
            async with connect(f"{server.url}?format=json") as ws:
                await ws.recv()  # hello
                start = loop.time()
                for i in range(6):  # at once: the agent reads them one by one, after each refusal's backoff
                    frame = {"kind": "pause_unit", "unit_id": 0, "token": "guess", "control_id": f"w{i}"}
                    await ws.send(json.dumps(frame))
                replies: list[tuple[float, dict[str, object]]] = []
                with pytest.raises(ConnectionClosedError) as info:
                    while True:
                        reply = json.loads(await ws.recv())
                        replies.append((loop.time() - start, reply))
            assert info.value.rcvd is not None
            assert (info.value.rcvd.code, info.value.rcvd.reason) == (1008, "too many refused tokens (4)")
            assert [r["code"] for _, r in replies] == ["unauthorized"] * 4, "the last two frames were never read"
            assert replies[-1][0] >= 0.1 + 0.2 + 0.4 - 0.05, "waits of 0.1, 0.2 and 0.4 s between the tries"
            assert hub.node.unit_modes[0] == "active"
            # The address is in backoff now (4 refusals: 0.8 s, longer than a handshake waits): a token at connect is
            # not even looked at ...
            with pytest.raises(InvalidStatus) as refused:
                async with open_session(server.url, token=TOKEN):
                    pass
            assert refused.value.response.status_code == 429 and refused.value.response.headers["Retry-After"]
            clock.resume()
            # ... and a new connection's first try waits for it too.
            async with connect(f"{server.url}?format=json") as ws:
                await ws.recv()
                wait_s = server.auth.wait_s("127.0.0.1")
                start = loop.time()
                await ws.send(json.dumps({"kind": "pause_unit", "unit_id": 0, "token": "guess", "control_id": "x"}))
                assert json.loads(await ws.recv())["code"] == "unauthorized"
                assert loop.time() - start >= wait_s - 0.05
            await asyncio.sleep(backoff.max_s)
            async with open_session(server.url, token=TOKEN) as session:  # the right token, once the backoff is over
                assert isinstance(await session.call(PauseUnit(unit_id=0)), OkReply)

    run(go)


def test_a_token_at_connect_to_an_agent_without_tokens_gets_controls_own_answer() -> None:
    """An agent without a token file: a client that presents one at connect is let in (as anonymous) and its change is
    answered ``unauthorized``, "control is disabled", not turned away with HTTP 401 as if the token were wrong."""
    async def go() -> None:
        async with make_server(make_hub(token="")) as server, open_session(server.url, token=TOKEN) as session:
            reply = await session.call(PauseUnit(unit_id=0, control_id="c1"))
            assert not isinstance(reply, OkReply)
            assert reply.code == "unauthorized" and "control is disabled" in reply.message
            assert server.num_connections == (1, 0)

    run(go)
