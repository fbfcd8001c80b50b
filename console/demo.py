"""``trackside demo``'s child process: a simulated agent on loopback.

The console imports no engine (an import-linter contract), so the demo runs the agent as a child,
``python -m agent.cli agent ... --listen 127.0.0.1:0 --token-file <temp>`` (the port the system picks), and reads
the URL the agent prints from its log. The console itself records what it receives (:mod:`console.recorder`), so
no recorder child is needed. The agent logs to ``demo-agent.log``, runs in its own session (a terminal's Ctrl+C
reaches only the console, which stops it), and on Linux is also told to stop when the console process dies.

Stopping: SIGTERM to the agent (it stops its node and drains its subscribers); killed if it has not exited after
``stop_timeout_s``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

URL_LINE = re.compile(r"trackside agent \S+: (wss?://\S+) \(")
"""The line the agent prints when it listens (``trackside agent NODE: ws://HOST:PORT (4 units, ...``)."""


class DemoError(Exception):
    """The demo could not start (printed as one line, exit 2)."""


def data_dir() -> Path:
    """The user's data folder for trackside: ``$XDG_DATA_HOME/trackside``, else ``~/.local/share/trackside``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "trackside"


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """What the demo's agent runs (``trackside agent``'s options)."""

    workload: str | None = "bursty:n=100000"
    trace: Path | None = None
    units: int = 4
    batch_policy: str = "vllm"
    dispatch: str = "least_loaded"
    speed: float = 1.0
    node_id: str = "demo"

    def argv(self, listen: str, token_file: Path) -> list[str]:
        source = ["--trace", str(self.trace)] if self.trace is not None else ["--workload", str(self.workload)]
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
class DemoChildren:
    """The running child: the agent, its URL and its control token."""

    agent: subprocess.Popen[bytes]
    url: str
    token: str


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


def stop(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> int | None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit status (None without a process)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def demo_children(
    options: AgentOptions,
    *,
    logs: Path,
    start_timeout_s: float = 60.0,
    stop_timeout_s: float = 10.0,
) -> Iterator[DemoChildren]:
    """Start the agent, yield it, stop it whatever happens."""
    logs.mkdir(parents=True, exist_ok=True)
    secrets_dir = Path(tempfile.mkdtemp(prefix="trackside-demo-"))
    token = secrets.token_urlsafe(24)
    token_file = secrets_dir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    agent: subprocess.Popen[bytes] | None = None
    agent_log = logs / "demo-agent.log"
    try:
        with agent_log.open("wb") as log:
            agent = _spawn(options.argv("127.0.0.1:0", token_file), log)
        url = wait_for_url(agent, agent_log, start_timeout_s)
        yield DemoChildren(agent, url, token)
    finally:
        stop(agent, stop_timeout_s)
        shutil.rmtree(secrets_dir, ignore_errors=True)
