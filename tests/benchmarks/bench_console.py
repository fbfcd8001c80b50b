"""The console under load: 64 units streaming about 50 steps per second each into one console (issue #6).

    python tests/benchmarks/bench_console.py [--units 64] [--seconds 20] [--screen overview|heatmap]

Starts a simulated agent as a child process (``python -m agent.cli agent``; 64 H100 8B units on a Poisson
workload sized to keep every unit stepping), runs the console app headless in this process on it for
``--seconds`` (after a warm-up), and prints:

* steps per second received (all units) and per unit, events per second folded;
* screen updates per second (``ConsoleApp.num_refreshes``; target at least 10 with ``--refresh 0.1``);
* the console process's CPU: process time over wall time (target at most one core, 1.0), and, for scale, the
  agent child's.

Headless, Textual still composes every screen update but writes nothing to a terminal: a real terminal adds
the cost of its output. Numbers go to docs/console.md with date and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.telemetry import StepEvent
from console.app import ConsoleApp
from console.feeds import LiveFeed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit("the agent did not start listening")


def child_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running child (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class CountingFeed(LiveFeed):
    """A live feed that also counts the step events it hands over."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.steps = 0
        self.events = 0

    async def updates(self):  # type: ignore[no-untyped-def]
        async for update in super().updates():
            if update.events:
                self.events += len(update.events)
                self.steps += sum(1 for e in update.events if isinstance(e, StepEvent))
            yield update


async def measure(uri: str, screen: str, warmup_s: float, seconds: float, agent_pid: int) -> dict[str, float]:
    feed = CountingFeed(uri)
    app = ConsoleApp([feed], refresh_s=0.1)
    result: dict[str, float] = {}
    async with app.run_test(headless=True, size=(200, 60)) as pilot:
        if screen != "overview":
            await pilot.press("2")
        await asyncio.sleep(warmup_s)
        r0, s0, e0 = app.num_refreshes, feed.steps, feed.events
        cpu0, wall0, agent0 = time.process_time(), time.perf_counter(), child_cpu_s(agent_pid)
        await asyncio.sleep(seconds)
        wall = time.perf_counter() - wall0
        result = {
            "wall_s": wall,
            "refreshes_per_s": (app.num_refreshes - r0) / wall,
            "steps_per_s": (feed.steps - s0) / wall,
            "events_per_s": (feed.events - e0) / wall,
            "console_cpu": (time.process_time() - cpu0) / wall,
            "agent_cpu": (child_cpu_s(agent_pid) - agent0) / wall,
            "units_seen": float(sum(len(n.units) for n in app.state.nodes.values())),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default 3 per unit)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--screen", choices=("overview", "heatmap"), default="overview")
    parser.add_argument(
        "--speed", type=float, default=0.5,
        help="the agent's node seconds per real second (0.5: about 50 steps/s per unit on this workload)",
    )
    args = parser.parse_args()
    rate = args.rate or 3.0 * args.units
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "agent.log", "wb")  # noqa: SIM115 - closed below
        cmd = [
            sys.executable, "-m", "agent.cli", "agent", "--units", str(args.units), "--listen", f"127.0.0.1:{port}",
            "--workload", f"poisson:rate={rate:g},n={int(rate * 600)}", "--node-id", "bench",
            "--speed", str(args.speed),
        ]
        agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_listening(port, agent)
            r = asyncio.run(measure(f"ws://127.0.0.1:{port}", args.screen, args.warmup, args.seconds, agent.pid))
        finally:
            agent.terminate()
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:  # an agent behind the wall clock may not see SIGTERM soon
                agent.kill()
                agent.wait()
            log.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; screen {args.screen}, {args.units} units, {rate:g} req/s of node time, "
        f"agent speed {args.speed:g}"
    )
    print(
        f"  received {r['steps_per_s']:,.0f} steps/s ({r['steps_per_s'] / args.units:.1f} per unit), "
        f"{r['events_per_s']:,.0f} events/s; units seen {r['units_seen']:.0f}"
    )
    print(f"  screen updates {r['refreshes_per_s']:.1f}/s (target >= 10)")
    print(f"  console CPU {r['console_cpu']:.2f} cores (target <= 1.0); agent child {r['agent_cpu']:.2f} cores")
    print(f"  console peak RSS {usage.ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
