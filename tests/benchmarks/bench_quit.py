"""How long ``q`` takes to give the shell back: ``trackside demo`` in a real pseudo-terminal (issue #16).

    python tests/benchmarks/bench_quit.py [--repeat 3] [--warmup 8] [--size 160x48] [-- DEMO OPTIONS ...]

Starts ``python -m console demo`` (what ``trackside demo`` hands over to) on a new pseudo-terminal of ``--size``,
in a temporary ``XDG_DATA_HOME`` (its own database and agent logs), lets it run ``--warmup`` seconds (the console
drawing, the agents streaming, the console recording), presses ``q`` and measures the wall time until the process
has exited (``waitpid``), which is when the shell prompt comes back. Also prints what the console wrote after
leaving the alternate screen (where it says what it stopped and how), and whether the agent children were still
running at that moment (stopped in the background) and how long they took to go after it. Prints numbers, asserts
nothing; results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import platform
import pty
import re
import select
import statistics
import struct
import sys
import tempfile
import termios
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT_PID = re.compile(rb"agent pids? ([\d, ]+)")
ALT_SCREEN_OFF = b"\x1b[?1049l"


@dataclass(frozen=True, slots=True)
class QuitRun:
    quit_s: float
    """From the key press to the console process's exit."""
    children_gone_s: float | None
    """From the key press until every agent child had exited (None: some still ran 30 s later)."""
    children_alive_at_exit: int
    said: str
    """What the console printed after leaving the alternate screen."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (its parent, the console, is gone; init reaps it soon) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _drain(fd: int, out: bytearray, wait_s: float) -> bool:
    """Read what the terminal has for at most ``wait_s``; False once the other side has closed."""
    ready, _, _ = select.select([fd], [], [], wait_s)
    if not ready:
        return True
    try:
        data = os.read(fd, 65536)
    except OSError:
        return False
    out.extend(data)
    return bool(data)


def run_once(columns: int, rows: int, warmup_s: float, demo_args: list[str]) -> QuitRun:
    with tempfile.TemporaryDirectory(prefix="bench-quit-") as data:
        env = {**os.environ, "XDG_DATA_HOME": data, "TERM": "xterm-256color", "COLUMNS": str(columns)}
        pid, fd = pty.fork()
        if pid == 0:  # the child: the console on the new terminal
            os.chdir(ROOT)
            os.execvpe(sys.executable, [sys.executable, "-m", "console", "demo", *demo_args], env)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        out = bytearray()
        end = time.monotonic() + warmup_s
        while time.monotonic() < end:
            _drain(fd, out, 0.05)
        match = AGENT_PID.search(bytes(out))
        children = [int(p) for p in match.group(1).replace(b",", b" ").split()] if match else []
        mark = len(out)
        pressed = time.perf_counter()
        os.write(fd, b"q")
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            _drain(fd, out, 0.002)
        quit_s = time.perf_counter() - pressed
        alive = [p for p in children if _alive(p)]
        while _drain(fd, out, 0.05):  # what is left in the terminal's buffer
            pass
        os.close(fd)
        gone_s: float | None = quit_s if not alive else None
        while alive and time.perf_counter() - pressed < 30:
            if not any(_alive(p) for p in alive):
                gone_s = time.perf_counter() - pressed
                break
            time.sleep(0.01)
        tail = bytes(out[mark:])
        tail = tail[tail.rfind(ALT_SCREEN_OFF) + len(ALT_SCREEN_OFF) :] if ALT_SCREEN_OFF in tail else b""
        said = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", tail).decode(errors="replace").strip()
        return QuitRun(quit_s, gone_s, len(alive), said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds the demo runs before q (8)")
    parser.add_argument("--size", default="160x48", help="the terminal's columns x rows (160x48)")
    parser.add_argument("demo_args", nargs="*", help="options for the demo (after --)")
    args = parser.parse_args()
    columns, _, rows = args.size.partition("x")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; trackside demo {' '.join(args.demo_args)} at {args.size}, "
        f"q after {args.warmup:g} s"
    )
    runs = []
    for i in range(args.repeat):
        run = run_once(int(columns), int(rows), args.warmup, args.demo_args)
        runs.append(run)
        gone = "over 30 s" if run.children_gone_s is None else f"{run.children_gone_s:.2f} s"
        print(
            f"  run {i + 1}: q -> shell {run.quit_s:.2f} s; agents alive at that moment {run.children_alive_at_exit}, "
            f"all gone after {gone}"
        )
        for line in run.said.splitlines():
            print(f"    | {line}")
    print(f"  median q -> shell {statistics.median(r.quit_s for r in runs):.2f} s over {len(runs)} runs")


if __name__ == "__main__":
    main()
