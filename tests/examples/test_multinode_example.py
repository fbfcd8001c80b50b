"""``examples/multinode/run.py`` as a user runs it, headless: three agents and one recorder on loopback, every node
in the one store, the token file private, and no child left running, after ``--duration`` and after Ctrl+C."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "multinode" / "run.py"
STARTED = re.compile(r"started (\S+) \(pid (\d+)\)")


def free_ports(n: int) -> int:
    """A port p with p..p+n-1 all free now."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free ports")


def argv(workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--dir", str(workdir), "--no-console", "--units", "2", "--base-port",
            str(free_ports(3)), *extra]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def processes_naming(text: str) -> list[str]:
    """Command lines of the running processes that contain ``text`` (a test's own folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{proc.name}: {cmdline}")
    return found


def check_the_run(out: str, workdir: Path) -> None:
    children = STARTED.findall(out)
    assert [name for name, _ in children] == ["node1", "node2", "node3", "recorder"], out
    assert not [name for name, pid in children if alive(int(pid))]
    assert processes_naming(str(workdir)) == []
    assert stat.S_IMODE((workdir / "token").stat().st_mode) == 0o600
    con = duckdb.connect(str(workdir / "telemetry.duckdb"), read_only=True)
    try:
        steps = dict(con.execute("SELECT node_id, count(*) FROM steps GROUP BY node_id").fetchall())
        nodes = {row[0] for row in con.execute("SELECT node_id FROM nodes").fetchall()}
    finally:
        con.close()
    assert nodes == {"node1", "node2", "node3"}
    assert set(steps) == nodes and min(steps.values()) > 0, steps


def test_a_timed_run_records_every_node_and_stops_every_child(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    done = subprocess.run(argv(workdir, "--duration", "1"), cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trackside console ws://127.0.0.1:" in done.stdout and f"--token-file {workdir}/token" in done.stdout
    check_the_run(done.stdout, workdir)


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    proc = subprocess.Popen(argv(workdir), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl+C stops"):
                break
        else:
            raise AssertionError("".join(lines))
        time.sleep(1.0)  # the recorder has every agent's hello; let it receive some steps
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(lines) + out
    check_the_run("".join(lines) + out, workdir)
