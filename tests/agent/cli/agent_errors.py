"""``trackside agent``'s one-line errors, for the tests of this folder that check what it refuses."""

from __future__ import annotations

import pytest

from agent.cli.serve import main


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``trackside agent ARGV``'s error (it must exit 2 with exactly one), without its prefix."""
    assert main(["agent", *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trackside agent: error:")]
    assert len(lines) == 1, lines
    return lines[0].removeprefix("trackside agent: error: ")
