"""``--listen`` with IPv6: ``[::1]:PORT`` is served and the agent prints a URL that ``ctl``, ``record`` and the console
can use (``ws://[::1]:PORT``); an unbracketed IPv6 address or a port out of range is refused in one line."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import make_hub, make_server, run

from agent.cli.common import ServeError, parse_listen
from agent.cli.serve import main
from console.cli import check_uri
from console.demo import URL_LINE

ROOT = Path(__file__).resolve().parents[3]


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback")


@pytest.mark.parametrize(("text", "expected"), [
    ("[::1]:0", ("::1", 0)), ("[::1]:7700", ("::1", 7700)), ("[::]:7700", ("::", 7700)),
    ("127.0.0.1:0", ("127.0.0.1", 0)), (":7700", ("127.0.0.1", 7700)), ("localhost:65535", ("localhost", 65535)),
])
def test_listen_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(("text", "says"), [
    ("::1:7700", "takes an IPv6 address in brackets, then its port ([::1]:7700), not '::1:7700'"),
    ("::1", "takes an IPv6 address in brackets"), ("[::1:7700", "takes an IPv6 address in brackets"),
    ("[::1]", "takes HOST:PORT"), ("127.0.0.1:65536", "takes HOST:PORT (port 0-65535"), ("7700", "takes HOST:PORT"),
])
def test_listen_refuses(text: str, says: str) -> None:
    with pytest.raises(ServeError, match=r"^--listen " + says.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        parse_listen(text)


def test_a_refused_listen_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent", "--workload", "poisson:n=10", "--listen", "127.0.0.1:70000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trackside agent: error: --listen takes HOST:PORT") and err.count("\n") == 1, err


def test_an_unbracketed_ipv6_uri_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = "bad agent URI 'ws://::1:7700': hostname isn't provided (IPv6 goes in brackets: ws://[::1]:7700)"
    assert main(["record", "ws://::1:7700", "--db", str(tmp_path / "x.duckdb")]) == 2
    assert capsys.readouterr().err == f"trackside record: error: {said}\n"
    assert main(["ctl", "ws://::1:7700", "status"]) == 1
    assert capsys.readouterr().err == f"trackside ctl: {said}\n"


@needs_ipv6
def test_server_url_brackets_an_ipv6_host() -> None:
    async def go() -> tuple[str, int]:
        async with make_server(make_hub(units=1), host="::1") as server:
            code = await asyncio.to_thread(main, ["ctl", server.url, "status"])
            return server.url, code

    url, code = run(go)
    assert url.startswith("ws://[::1]:") and code == 0


@needs_ipv6
def test_the_agent_prints_a_url_ctl_and_the_console_can_use(capsys: pytest.CaptureFixture[str]) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--units", "1", "--workload", "poisson:n=100000,rate=5",
         "--listen", "[::1]:0"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert agent.stderr is not None
        lines = [agent.stderr.readline(), agent.stderr.readline()]  # the read-only notice, then the URL
        match = next((m for m in map(URL_LINE.search, lines) if m), None)
        assert match is not None, lines
        url = match.group(1)
        assert url.startswith("ws://[::1]:"), url
        assert check_uri(url) == url
        assert main(["ctl", url, "status"]) == 0, capsys.readouterr().err
        assert "node " in capsys.readouterr().out
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
