"""A recorder killed with SIGKILL loses nothing it committed, and a new one resumes without gap or duplicate.

Real processes end to end: ``trackside agent`` and two ``trackside record`` runs on loopback, a DuckDB file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from serve_harness import free_port, stored_seqs

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "agent.cli"]


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
    recorders: list[subprocess.Popen[bytes]] = []
    err = ""
    try:
        time.sleep(2.0)
        uri = f"ws://127.0.0.1:{port}"
        first = subprocess.Popen([*CLI, "record", uri, "--db", str(db), "--flush-s", "0.2"], cwd=ROOT, env=env,
                                 stderr=subprocess.DEVNULL)
        recorders.append(first)
        time.sleep(4.0)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        committed = stored_seqs(db)
        assert committed, "the killed recorder had committed events"
        # What a flush committed is a prefix of the stream: no hole, no duplicate.
        assert committed == list(range(1, committed[-1] + 1))
        second = subprocess.Popen([*CLI, "record", uri, "--db", str(db), "--flush-s", "0.2"], cwd=ROOT, env=env,
                                  stderr=subprocess.DEVNULL)
        recorders.append(second)
        _, err = agent.communicate(timeout=120)
        assert agent.returncode == 0, err
        time.sleep(1.5)  # the recorder's last flush after the agent's last frames
        second.send_signal(signal.SIGINT)
        second.wait(20)
    finally:
        for proc in (agent, *recorders):
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
