"""What subscribers that never read cost the agent (issue #16): its memory, and the time it takes to stop.

    python tests/benchmarks/bench_subscribers.py [--subscribers 1000] [--tree DIR] [--speed 10] [--repeat 1]

A simulated agent (``python -m agent.cli.serve agent``, run from ``--tree``: this checkout by default, or another one,
say a ``git worktree`` of an older commit, to compare) replays a workload at ``--speed`` until its replay buffer
(``--replay-events``) is full. Then ``--subscribers`` clients connect one after another, each with a 4 KiB receive
buffer, subscribe with ``resume_after_seq`` 0 and batch frames of 512 (as ``agent.telemetry.client`` does), and never
read again (raw sockets: websockets' Sans-I/O client writes the handshake and the subscribe frame; each announces an
Ethernet MSS, so the kernel's socket buffers grow as on a network, not by loopback's 64 KiB segments). The agent's
resident memory (``VmRSS``) is sampled before the subscribers and after them (the peak of 3 s), then SIGTERM is sent
and the time until the process has exited is measured.

The agent is started with a connection limit above ``--subscribers`` and without the subscriber timeout where its
tree has those flags (``--max-anonymous-connections``, ``--subscriber-timeout-s 0``), so every subscriber stays
connected and what is measured is the cost of one that does not read. Talks only the wire protocol, so any tree
that speaks it can be measured. Prints numbers; asserts nothing. Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.protocol import State
from websockets.uri import parse_uri

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_agent(tree: Path, args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    help_text = subprocess.run([sys.executable, "-m", "agent.cli.serve", "agent", "--help"], cwd=tree,
                               capture_output=True, text=True, check=True).stdout
    extra: list[str] = []
    if "--max-anonymous-connections" in help_text:
        extra += ["--max-anonymous-connections", str(args.subscribers + 16)]
    if "--subscriber-timeout-s" in help_text:
        extra += ["--subscriber-timeout-s", "0"]
    cmd = [sys.executable, "-m", "agent.cli.serve", "agent", "--workload", args.workload, "--speed", str(args.speed),
           "--listen", f"127.0.0.1:{port}", "--replay-events", str(args.replay_events), "--node-id", "bench", *extra]
    return subprocess.Popen(cmd, cwd=tree, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


async def status(url: str) -> dict[str, object]:
    async with connect(url + "?format=json", open_timeout=30) as ws:
        await ws.recv()  # hello
        await ws.send(json.dumps({"kind": "status", "control_id": "bench"}))
        while True:
            reply = json.loads(await ws.recv())
            if reply.get("control_id") == "bench":
                payload: dict[str, object] = reply["payload"]
                return payload


def wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError("the agent did not start")


def non_reader(url: str) -> socket.socket | None:
    """A connection that subscribes from seq 0 and never reads again; None when the agent refused it."""
    protocol = ClientProtocol(parse_uri(url))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1448)  # an Ethernet MSS, not loopback's 64 KiB
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    protocol.send_request(protocol.connect())
    sock.sendall(b"".join(protocol.data_to_send()))
    while protocol.state is State.CONNECTING:
        data = sock.recv(4096)
        if not data:
            break
        protocol.receive_data(data)
    if protocol.state is not State.OPEN:
        sock.close()
        return None
    frame = msgspec.msgpack.encode({"kind": "subscribe", "resume_after_seq": 0, "max_batch": 512, "control_id": "s"})
    protocol.send_binary(frame)
    sock.sendall(b"".join(protocol.data_to_send()))
    return sock


def measure(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"ws://127.0.0.1:{port}"
    agent = start_agent(tree, args, port)
    socks: list[socket.socket] = []
    try:
        wait_for_port(port)
        end = time.monotonic() + 300
        while True:
            info = asyncio.run(status(url))
            if int(str(info["last_seq"])) >= args.replay_events + 1000:  # the ring is full and has wrapped
                break
            if time.monotonic() > end or agent.poll() is not None:
                raise RuntimeError("the replay buffer did not fill (a longer workload or a higher speed)")
            time.sleep(0.5)
        base = 0.0
        for _ in range(5):
            base = max(base, rss_mib(agent.pid))
            time.sleep(0.1)
        t = time.monotonic()
        refused = 0
        for _ in range(args.subscribers):
            sock = non_reader(url)
            if sock is None:
                refused += 1
            else:
                socks.append(sock)
        connect_s = time.monotonic() - t
        peak = base
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            peak = max(peak, rss_mib(agent.pid))
            time.sleep(0.1)
        info = asyncio.run(status(url))
        if agent.poll() is not None:
            raise RuntimeError("the agent ended before the stop (workload too short)")
        t = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(args.stop_timeout_s)
            stop_s = time.monotonic() - t
        except subprocess.TimeoutExpired:
            stop_s = float("inf")  # killed below
    finally:
        for sock in socks:
            sock.close()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    return {"base_mib": base, "peak_mib": peak, "connect_s": connect_s, "stop_s": stop_s, "refused": refused,
            "subscribers": float(str(info["num_subscribers"])), "last_seq": float(str(info["last_seq"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose agent runs (default this one)")
    parser.add_argument("--workload", default="poisson:n=150000,rate=60")
    parser.add_argument("--speed", type=float, default=10.0)
    parser.add_argument("--replay-events", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--stop-timeout-s", type=float, default=300.0, help="kill the agent after this long")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; tree {args.tree}; "
          f"{args.subscribers} non-reading subscribers resuming from seq 0 of a full {args.replay_events}-event buffer")
    print(f"{'run':>3} {'base MiB':>9} {'with MiB':>9} {'per sub KiB':>11} {'connected':>9} {'refused':>7} "
          f"{'connect s':>9} {'stop s':>7}")
    for i in range(args.repeat):
        r = measure(args.tree.resolve(), args)
        per_sub_kib = (r["peak_mib"] - r["base_mib"]) * 1024 / max(1, args.subscribers - r["refused"])
        print(f"{i + 1:>3} {r['base_mib']:>9.1f} {r['peak_mib']:>9.1f} {per_sub_kib:>11.1f} "
              f"{r['subscribers']:>9.0f} {r['refused']:>7.0f} {r['connect_s']:>9.1f} {r['stop_s']:>7.2f}")


if __name__ == "__main__":
    main()
