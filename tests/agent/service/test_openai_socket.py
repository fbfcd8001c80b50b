"""The OpenAI server's listening socket: its connections have Nagle's algorithm off (``TCP_NODELAY``), as on a
server asyncio binds itself. With Nagle on, the first SSE chunk written right after the response's headers could
wait for the client's delayed ACK (up to 40 ms on Linux): the TTFT tail of docs/vllm.md. Real sockets on loopback."""

from __future__ import annotations

import asyncio
import errno
import socket
import sys

import pytest

pytest.importorskip("vllm")

from agent.service.openai_server import listening_socket

pytestmark = pytest.mark.vllm


async def _nodelay_of_accepted(sock: socket.socket) -> int:
    """Serve on ``sock`` with asyncio, connect once, and read TCP_NODELAY on the server's side of the connection."""
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=sock)
    async with server:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
    return value


def test_connections_to_the_openai_server_have_nagle_off() -> None:
    assert asyncio.run(_nodelay_of_accepted(listening_socket("127.0.0.1", 0))) != 0


def test_a_socket_made_with_protocol_0_leaves_nagle_on() -> None:
    """Why ``listening_socket`` names its protocol: asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    assert asyncio.run(_nodelay_of_accepted(sock)) == 0


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT") or sys.platform != "linux", reason="Linux's SO_REUSEPORT")
def test_agents_share_a_port_only_when_each_asks_and_connections_are_spread() -> None:
    """``--openai-reuse-port``: a second socket binds the port only with ``reuse_port`` on both, a third one without
    it is refused (EADDRINUSE: an agent started without the flag fails to listen), and the kernel spreads the
    connections over the sockets that share it."""
    first = listening_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    second = listening_socket("127.0.0.1", port, reuse_port=True)
    clients: list[socket.socket] = []
    try:
        first.listen(64)
        second.listen(64)
        with pytest.raises(OSError) as refused:
            listening_socket("127.0.0.1", port).listen(1)
        assert refused.value.errno == errno.EADDRINUSE
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        accepted = []
        for sock in (first, second):
            sock.setblocking(False)
            n = 0
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                n += 1
            accepted.append(n)
        assert sum(accepted) == 32 and min(accepted) > 0, accepted  # all 32 on one of two: odds 2 in 2**32
    finally:
        for c in clients:
            c.close()
        first.close()
        second.close()
