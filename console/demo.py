"""``trackside demo``'s child processes: simulated agents on loopback.

The console imports no engine (an import-linter contract), so the demo runs each agent of its scenario
(:mod:`console.scenarios`) as a child, ``python -m agent.cli agent ... --listen 127.0.0.1:0 --token-file <temp>``
(the port the system picks), and reads the URL the agent prints from its log. The console itself records what it
receives (:mod:`console.recorder`), so no recorder child is needed. Each agent logs to ``demo-agent-NODE.log``, runs in
its own session (a terminal's Ctrl+C reaches only the console, which stops it), and on Linux is also told to stop
when the console process dies.

Stopping never holds the shell: :meth:`DemoChildren.terminate` sends SIGTERM to every agent (each stops its node and
closes its connections), :func:`demo_children` then waits for them at most ``stop_wait_s`` after it, and leaves any
that is still stopping to finish in the background (:attr:`DemoChildren.left_running`), with a watchdog
(:mod:`console.reaper`) that kills it if it has not exited ``kill_after_s`` later.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

URL_LINE = re.compile(r"trackside agent \S+: (wss?://\S+) \(")
"""The line the agent prints when it listens (``trackside agent NODE: ws://HOST:PORT (4 units, ...``)."""
STOP_WAIT_S = 0.5
"""How long the demo waits for its agents after SIGTERM before it leaves them to stop in the background."""
KILL_AFTER_S = 10.0
"""An agent still running this long after SIGTERM is killed (by the watchdog, in the background)."""


class DemoError(Exception):
    """The demo could not start (printed as one line, exit 2)."""


def data_dir() -> Path:
    """The user's data folder for trackside: ``$XDG_DATA_HOME/trackside``, else ``~/.local/share/trackside``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "trackside"


class AgentCommand(Protocol):
    """What :func:`demo_children` starts: a node's agent, whose log's first line is :data:`URL_LINE`'s."""

    @property
    def node_id(self) -> str: ...

    def argv(self, listen: str, token_file: Path) -> list[str]:
        """The command line, listening on ``listen`` with the control token in ``token_file``."""
        ...


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """What one of the demo's agents runs (``trackside agent``'s options)."""

    node_id: str = "demo"
    workload: str | None = "bursty:n=100000"
    trace: Path | None = None
    units: int = 4
    batch_policy: str = "vllm"
    dispatch: str = "least_loaded"
    params: tuple[str, ...] = ()
    """Policy parameters, ``NAME=VALUE`` or ``POLICY.NAME=VALUE`` (``--param``)."""
    slo_ttft_ms: float | None = None
    """The TTFT target (None: the agent's default)."""
    slo_tpot_ms: float | None = None
    """The TPOT target (None: the agent's default)."""
    speed: float = 1.0

    def argv(self, listen: str, token_file: Path) -> list[str]:
        """The agent's command line, listening on ``listen`` with the control token in ``token_file``."""
        source = ["--trace", str(self.trace)] if self.trace is not None else ["--workload", str(self.workload)]
        slos = [
            *(["--slo-ttft-ms", f"{self.slo_ttft_ms:g}"] if self.slo_ttft_ms is not None else []),
            *(["--slo-tpot-ms", f"{self.slo_tpot_ms:g}"] if self.slo_tpot_ms is not None else []),
        ]
        return [
            sys.executable,
            "-m",
            "agent.cli",
            "agent",
            *source,
            "--units",
            str(self.units),
            "--batch-policy",
            self.batch_policy,
            "--dispatch",
            self.dispatch,
            *(arg for param in self.params for arg in ("--param", param)),
            *slos,
            "--speed",
            f"{self.speed:g}",
            "--node-id",
            self.node_id,
            "--listen",
            listen,
            "--token-file",
            str(token_file),
        ]


@dataclass(frozen=True, slots=True)
class DemoAgent:
    """One running agent child: its process, node, URL and log."""

    proc: subprocess.Popen[bytes]
    node_id: str
    url: str
    log: Path


@dataclass(slots=True)
class DemoChildren:
    """The running agents and their control token; after :func:`demo_children`, which ones are still stopping."""

    agents: tuple[DemoAgent, ...]
    token: str
    terminated_at: float | None = None
    """When :meth:`terminate` sent SIGTERM (``time.monotonic()``; None: not yet)."""
    left_running: tuple[DemoAgent, ...] = field(default=())
    """The agents still stopping in the background when the demo returned (a watchdog kills them later)."""

    @property
    def urls(self) -> dict[str, str]:
        """Each agent's URL by its node id."""
        return {agent.node_id: agent.url for agent in self.agents}

    def terminate(self) -> None:
        """SIGTERM to every agent still running, without waiting (once; :func:`demo_children` waits, bounded)."""
        if self.terminated_at is not None:
            return
        self.terminated_at = time.monotonic()
        for agent in self.agents:
            if agent.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    agent.proc.terminate()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: have the kernel send SIGTERM to this child when the console dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(argv: Sequence[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


def wait_for_url(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> str:
    """The URL the agent printed to its log; raises :class:`DemoError` when it exits or stays silent."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        match = URL_LINE.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            tail = " | ".join(text.strip().splitlines()[-3:]) or "no output"
            raise DemoError(f"the agent exited with status {proc.returncode}: {tail} (log: {log_path})")
        time.sleep(0.05)
    raise DemoError(f"the agent did not start listening within {timeout_s:g} s (log: {log_path})")


def stop(
    procs: Sequence[subprocess.Popen[bytes]], *, wait_s: float, since: float | None = None
) -> list[subprocess.Popen[bytes]]:
    """SIGTERM each of ``procs`` still running (unless sent at ``since``), wait until ``wait_s`` after it for
    them to exit; those still running (they are not killed: see :func:`kill_later`)."""
    if since is None:
        since = time.monotonic()
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
    running = []
    for proc in procs:
        try:
            proc.wait(max(0.0, since + wait_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.append(proc)
    return running


def kill_later(procs: Sequence[subprocess.Popen[bytes]], after_s: float) -> subprocess.Popen[bytes] | None:
    """Start the watchdog that kills each of ``procs`` still running ``after_s`` seconds from now
    (:mod:`console.reaper`; in a session of its own, nothing waits for it); None when there is nothing to kill."""
    pids = [str(proc.pid) for proc in procs if proc.poll() is None]
    if not pids:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "console.reaper", f"{after_s:g}", *pids],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[1],
    )


@contextlib.contextmanager
def demo_children(
    agents: Sequence[AgentCommand],
    *,
    logs: Path,
    start_timeout_s: float = 60.0,
    stop_wait_s: float = STOP_WAIT_S,
    kill_after_s: float = KILL_AFTER_S,
) -> Iterator[DemoChildren]:
    """Start the agents, yield them; whatever happens, SIGTERM them (unless :meth:`DemoChildren.terminate` did),
    wait at most ``stop_wait_s`` after that, and leave those still running to a watchdog that kills them
    ``kill_after_s`` later (:attr:`DemoChildren.left_running`)."""
    logs.mkdir(parents=True, exist_ok=True)
    secrets_dir = Path(tempfile.mkdtemp(prefix="trackside-demo-"))
    token = secrets.token_urlsafe(24)
    token_file = secrets_dir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    started: list[tuple[AgentCommand, subprocess.Popen[bytes], Path]] = []
    children: DemoChildren | None = None
    try:
        for options in agents:
            agent_log = logs / f"demo-agent-{options.node_id}.log"
            with agent_log.open("wb") as log:
                started.append((options, _spawn(options.argv("127.0.0.1:0", token_file), log), agent_log))
        running = tuple(
            DemoAgent(proc, options.node_id, wait_for_url(proc, path, start_timeout_s), path)
            for options, proc, path in started
        )
        children = DemoChildren(running, token)
        yield children
    finally:
        since = children.terminated_at if children is not None else None
        left = stop([proc for _, proc, _ in started], wait_s=stop_wait_s, since=since)
        kill_later(left, kill_after_s)
        if children is not None:
            children.left_running = tuple(a for a in children.agents if a.proc in left)
        shutil.rmtree(secrets_dir, ignore_errors=True)
