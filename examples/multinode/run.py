"""Three nodes on one machine: simulated agents with different policies, one recorder, one console.

    python examples/multinode/run.py                       # agents on 7701-7703, the recorder, the console
    python examples/multinode/run.py --no-console          # no console: prints its command, runs until Ctrl+C
    python examples/multinode/run.py --no-console --duration 60

Run it with the Python that has trackside installed (it starts ``python -m agent.cli ...``). Everything it writes
goes to ``--dir`` (default ``./multinode-run``): the control token (``token``, mode 0600, new each run), the
recorder's store (``telemetry.duckdb``) and one log per process. Each child runs in its own session, so a
terminal's Ctrl+C reaches only this script, which then stops the recorder (it flushes) and the agents, waits for
them, and kills any that has not exited after ``--stop-timeout-s``; on Linux each child also gets SIGTERM if this
script dies without stopping it. Quitting the console (or the end of ``--duration``) stops everything the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACKSIDE = [sys.executable, "-m", "agent.cli"]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One simulated node: its agent's policies and workload."""

    node_id: str
    batch_policy: str
    dispatch: str
    workload: str


NODES = (
    NodeSpec("node1", "vllm", "least_loaded", "sharegpt-like:n=200000"),
    NodeSpec("node2", "sarathi", "round_robin", "bursty:n=200000,rate=30"),
    NodeSpec("node3", "fairbatching", "pab", "sharegpt-like:n=200000,rate=60"),
)
"""vLLM's default scheduling, Sarathi's fixed token budget and FairBatching with its balancer, under three loads."""

LISTENING = re.compile(r"trackside agent (\S+): (wss?://\S+) \(")
"""The line an agent prints when it listens (``trackside agent NODE: ws://HOST:PORT (4 units, ...``)."""


class StartError(Exception):
    """A child did not start (printed as one line, exit 2)."""


@dataclass(frozen=True, slots=True)
class Child:
    """A running child process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def write_token(path: Path) -> None:
    """A fresh control token in ``path``, readable by its owner only (created 0600, never world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24) + "\n")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: the kernel sends this child SIGTERM when the script dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def spawn(name: str, argv: Sequence[str], log: Path) -> Child:
    """Start ``argv`` in a session of its own, its output to ``log``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    print(f"started {name} (pid {proc.pid}), log {log}", flush=True)
    return Child(name, proc, log)


def wait_listening(child: Child, timeout_s: float) -> str:
    """The URL the agent printed when it started listening."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        match = LISTENING.search(child.log.read_text(errors="replace"))
        if match:
            return match.group(2)
        if child.proc.poll() is not None:
            raise StartError(f"{child.name} exited with status {child.proc.returncode} (log: {child.log})")
        time.sleep(0.05)
    raise StartError(f"{child.name} did not listen within {timeout_s:g} s (log: {child.log})")


def wait_recording(child: Child, urls: Sequence[str], timeout_s: float) -> None:
    """Wait until the recorder has said hello to every agent (``trackside record: URL: node NODE``)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        text = child.log.read_text(errors="replace")
        if all(f"trackside record: {url}: node " in text for url in urls):
            return
        if child.proc.poll() is not None:
            raise StartError(f"{child.name} exited with status {child.proc.returncode} (log: {child.log})")
        time.sleep(0.05)
    raise StartError(f"{child.name} did not reach every agent within {timeout_s:g} s (log: {child.log})")


def stop(children: Sequence[Child], timeout_s: float) -> None:
    """SIGTERM each child still running, wait up to ``timeout_s`` for them, then SIGKILL what is left and reap it."""
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.terminate()
    end = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{child.name} did not stop within {timeout_s:g} s: killed", file=sys.stderr)
            child.proc.kill()
            child.proc.wait()
        print(f"stopped {child.name} (exit {child.proc.returncode})", flush=True)


@contextlib.contextmanager
def running(args: argparse.Namespace) -> Iterator[tuple[list[str], Path]]:
    """Start the agents and the recorder; yield the agents' URLs and the token file; stop them all whatever
    happens (the recorder first, so it flushes what it has)."""
    workdir: Path = args.dir
    workdir.mkdir(parents=True, exist_ok=True)
    token = workdir / "token"
    write_token(token)
    agents: list[Child] = []
    recorder: list[Child] = []
    urls = [f"ws://127.0.0.1:{args.base_port + i}" for i in range(len(NODES))]
    try:
        for node, url in zip(NODES, urls, strict=True):
            agents.append(spawn(node.node_id, [
                *TRACKSIDE, "agent", "--node-id", node.node_id, "--listen", url.removeprefix("ws://"),
                "--token-file", str(token), "--units", str(args.units), "--batch-policy", node.batch_policy,
                "--dispatch", node.dispatch, "--workload", node.workload, "--speed", f"{args.speed:g}",
            ], workdir / f"{node.node_id}.log"))
        # The recorder starts with them: it retries an agent that is not listening yet, quietly.
        recorder.append(spawn("recorder", [*TRACKSIDE, "record", *urls, "--db", str(workdir / "telemetry.duckdb")],
                              workdir / "recorder.log"))
        for child, url in zip(agents, urls, strict=True):
            listening = wait_listening(child, args.start_timeout_s)
            if listening != url:
                raise StartError(f"{child.name} listens on {listening}, not {url}")
        wait_recording(recorder[0], urls, args.start_timeout_s)
        yield urls, token
    finally:
        stop(recorder, args.stop_timeout_s)
        stop(agents, args.stop_timeout_s)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Three simulated trackside agents (node1-node3, different batch and dispatch policies) on "
        "127.0.0.1, one recorder writing all three to one DuckDB file, and the console on all three. Ctrl+C, "
        "quitting the console or the end of --duration stops everything.",
    )
    parser.add_argument("--dir", type=Path, default=Path("multinode-run"),
                        help="where the token, the store and the logs go (default ./multinode-run)")
    parser.add_argument("--base-port", type=int, default=7701, help="node1's port; node2 and node3 take the next two")
    parser.add_argument("--units", type=int, default=4, help="simulated units of each agent (default 4)")
    parser.add_argument("--speed", type=float, default=1.0, help="node seconds per real second (default 1)")
    parser.add_argument("--duration", type=float, default=0.0, metavar="S",
                        help="stop by itself after S seconds (default 0: run until Ctrl+C)")
    parser.add_argument("--no-console", action="store_true",
                        help="do not open the console: print its command and wait")
    parser.add_argument("--start-timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--stop-timeout-s", type=float, default=10.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (kill, systemd, a CI runner) stops the children as Ctrl+C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    db = args.dir / "telemetry.duckdb"
    try:
        with running(args) as (urls, token):
            console = ["trackside", "console", *urls, "--token-file", str(token)]
            print(f"recording {', '.join(urls)} to {db}", flush=True)
            if args.no_console:
                print(f"the console on all three:\n    {shlex.join(console)}", flush=True)
                print("Ctrl+C stops the agents and the recorder" if not args.duration
                      else f"stopping in {args.duration:g} s", flush=True)
                if args.duration:
                    time.sleep(args.duration)
                else:
                    signal.pause()
            else:
                exit_after = ["--exit-after", f"{args.duration:g}"] if args.duration else []
                subprocess.run([*TRACKSIDE, *console[1:], *exit_after], check=False)
    except StartError as exc:
        print(f"multinode: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    query = "SELECT node_id, count(*) AS steps FROM steps GROUP BY node_id ORDER BY node_id"
    print(f"what was recorded:\n    trackside sql --db {shlex.quote(str(db))} {shlex.quote(query)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
