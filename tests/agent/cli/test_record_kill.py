"""A recorder killed with SIGKILL loses nothing it committed, and a new one resumes without gap or duplicate.

Real processes end to end: ``trackside agent`` and two ``trackside record`` runs on loopback, a DuckDB file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest
from serve_harness import free_port, stored_seqs

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "agent.cli"]
RECORD = [sys.executable, "-c", "import logging, sys; logging.basicConfig(level=logging.INFO); "
          "from agent.cli.main import main; sys.exit(main())", "record"]
"""``trackside record`` logging at INFO too: it says when its connection is lost (after the frames before)."""


class Recorder:
    """``trackside record`` as a child process, its stderr read line by line in a thread."""

    def __init__(self, uri: str, db: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([*RECORD, uri, "--db", str(db), "--flush-s", "0.2"], cwd=ROOT, env=env,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        """Until a line contains ``text``; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in list(self.lines)):
            assert time.monotonic() < deadline, f"no {text!r} from the recorder: {''.join(self.lines)[-2000:]}"
            time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_recorder_then_resume(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "t.duckdb"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(
        [*CLI, "agent", "--units", "2", "--workload", "sharegpt-like:rate=20,n=1500", "--speed", "4",
         "--listen", f"127.0.0.1:{port}", "--replay-events", "1000000"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )
    recorders: list[Recorder] = []
    err = ""
    try:
        time.sleep(2.0)
        uri = f"ws://127.0.0.1:{port}"
        first = Recorder(uri, db, env)
        recorders.append(first)
        # from its hello on, ten flushes (4 s from its start included the start itself, slow on a loaded machine)
        first.wait_for(f"trackside record: {uri}: node ")
        time.sleep(2.0)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        committed = stored_seqs(db)
        assert committed, "the killed recorder had committed events"
        # What a flush committed is a prefix of the stream: no hole, no duplicate.
        assert committed == list(range(1, committed[-1] + 1))
        second = Recorder(uri, db, env)
        recorders.append(second)
        second.wait_for(f"trackside record: {uri}: node ")
        _, err = agent.communicate(timeout=120)
        assert agent.returncode == 0, err
        # the connection lost once the recorder has taken every frame before it (1.5 s was a guess: a recorder
        # behind on a loaded machine had not); stopped then, it writes and commits them
        second.wait_for("connection lost")
        second.proc.send_signal(signal.SIGINT)
        second.proc.wait(20)
    finally:
        for proc in (agent, *(r.proc for r in recorders)):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seqs = stored_seqs(db)
    con = duckdb.connect(str(db), read_only=True)
    try:
        finished = con.execute("SELECT count(*) FROM requests WHERE NOT refused").fetchone()
    finally:
        con.close()
    # The two recorders together hold every event of the run exactly once, the first one's commits included.
    assert seqs == list(range(1, seqs[-1] + 1)) and set(committed) <= set(seqs)
    assert finished is not None and finished[0] == 1500
    last = re.search(r"(\d+) events", err)
    assert last is not None and seqs[-1] == int(last.group(1)), "the store ends where the agent's stream ended"
