"""A token file its group or others may read or write is used with a one-line warning (the file, its mode, the
``chmod`` that fixes it), by the agent and by every client that reads one (``ctl``, the console)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli.serve import main
from agent.telemetry.client import read_token
from console.cli import main as console_main

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


@pytest.fixture(autouse=True)
def _warnings_reach_caplog(caplog: pytest.LogCaptureFixture) -> None:
    """Another test in the same process (vLLM's app, through uvicorn) may leave the root logger at ERROR."""
    caplog.set_level(logging.WARNING, logger="agent.telemetry.client")


def token_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(mode)
    return path


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "token file" in r.getMessage()]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_a_token_file_open_to_others_warns(tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture) -> None:
    path = token_file(tmp_path, mode)
    assert read_token(path) == "s3cret"
    assert warnings_of(caplog) == [
        f"token file {path} is open to its group or others (mode {mode:04o}): chmod 600 {path}"]


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_token_file_does_not_warn(tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture) -> None:
    assert read_token(token_file(tmp_path, mode)) == "s3cret"
    assert warnings_of(caplog) == []


def test_the_agent_and_every_client_warn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(token_file(tmp_path, 0o644))
    assert main(["agent", "--trace", str(tmp_path / "none.jsonl"), "--token-file", path]) == 2
    assert main(["ctl", "ws://127.0.0.1:1", "--token-file", path, "status"]) == 1
    assert console_main(["console", "--replay", str(tmp_path / "none.duckdb"), "--token-file", path]) == 2
    assert len(warnings_of(caplog)) == 3


def test_the_warning_is_one_line_on_stderr(tmp_path: Path) -> None:
    path = token_file(tmp_path, 0o644)
    done = subprocess.run([sys.executable, "-m", "agent.cli", "ctl", "ws://127.0.0.1:1", "--token-file", str(path),
                           "status"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0].endswith(f"token file {path} is open to its group or others (mode 0644): chmod 600 {path}"), lines
    assert lines[1].startswith("trackside ctl: cannot reach ws://127.0.0.1:1") and len(lines) == 2
