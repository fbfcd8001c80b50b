"""``examples/whatif/run.py`` as a user runs it: a simulated node recorded, what-if on the store, the recommendation
applied to the running agent, and the agent stopped at the end."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "whatif" / "run.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_session_records_asks_and_applies(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--record-s", "5", "--speed", "40", "--port",
         str(free_port()), "--compare", "sarathi,eb", "--apply"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )
    out = done.stdout
    assert done.returncode == 0, (out, done.stderr)
    assert "$ trackside record ws://127.0.0.1:" in out and "$ trackside whatif --db" in out
    assert "recommendation: " in " ".join(out.split())
    report = json.loads((tmp_path / "whatif.json").read_text())
    assert report["window"]["node_id"] == "whatif-demo" and report["window"]["requests"] > 50
    assert report["runs"][0]["role"] == "replay" and report["runs"][0]["batch_policy"] == "vllm"
    applied = report["recommendation"]["action"] == "switch"
    after = [line for line in out.splitlines() if line.startswith("  unit ")]
    assert len(after) == 4  # ctl status after --apply
    expected = report["recommendation"]["batch_policy"] if applied else "vllm"
    assert all(f"] {expected} (" in line for line in after), after
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
