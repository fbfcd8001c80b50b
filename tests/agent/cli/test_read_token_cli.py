"""``trackside agent --read-token-file`` (issue #16): the flag, its node config key, and a live agent that serves
reads with the read token and changes only with the control token."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import TOKEN, free_port

from agent.cli.common import ServeError, agent_tokens
from agent.cli.node_config import config_argv
from agent.cli.serve import agent_parser, main

ROOT = Path(__file__).resolve().parents[3]
READ_TOKEN = "r3ad-only-for-tests"


def token_files(tmp_path: Path, read: str = READ_TOKEN) -> tuple[Path, Path]:
    control, reads = tmp_path / "token", tmp_path / "read-token"
    control.write_text(TOKEN + "\n")
    reads.write_text(read + "\n")
    for path in (control, reads):
        path.chmod(0o600)
    return control, reads


def test_the_read_token_must_differ_from_the_control_token(tmp_path: Path) -> None:
    control, reads = token_files(tmp_path)
    args = argparse.Namespace(token_file=control, read_token_file=reads)
    assert agent_tokens(args) == (TOKEN, READ_TOKEN)
    assert agent_tokens(argparse.Namespace(token_file=None, read_token_file=None)) == ("", "")
    same = argparse.Namespace(token_file=control, read_token_file=control)
    with pytest.raises(ServeError, match="read-token-file holds the control token"):
        agent_tokens(same)


def test_a_node_config_file_names_the_read_token_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('read_token_file = "/etc/trackside/read-token"\n')
    assert config_argv(path, agent_parser) == ["--read-token-file", "/etc/trackside/read-token"]


def test_an_agent_with_a_read_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    control, reads = token_files(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--units", "2", "--workload", "poisson:n=100000,rate=5",
         "--listen", f"127.0.0.1:{port}", "--token-file", str(control), "--read-token-file", str(reads)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "trackside agent" in line and f":{port}" in line, line
        url = f"ws://127.0.0.1:{port}"
        # refusals last: the server slows an address after one (a token at connect then waits its turn)
        codes = [main(["ctl", url, "--token-file", str(control), "pause", "--unit", "0"]),
                 main(["ctl", url, "--token-file", str(reads), "status"]),
                 main(["ctl", url, "--token-file", str(reads), "pause", "--unit", "1"]),
                 main(["ctl", url, "status"])]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    out, err = capsys.readouterr()
    assert codes == [0, 0, 2, 2], err
    errors = [line for line in err.splitlines() if line.startswith("trackside ctl")]
    assert errors[0].startswith("trackside ctl: error: unauthorized: a read token cannot change anything")
    assert errors[1].startswith("trackside ctl: error: unauthorized: wrong or missing token")
    assert "applied: set_unit_mode: unit 0: paused" in out and "unit 0 [paused]" in out and "unit 1 [active]" in out
