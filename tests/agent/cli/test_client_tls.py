"""Every client of a ``wss://`` agent verifies it with ``--ca-file`` (``trackside ctl``, ``trackside record``, the
console's feeds and control): a private CA and the agent's certificate made here with the ``openssl`` command, a real
agent on loopback. Without the CA the certificate does not verify: one line, exit 1, no retrying."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from serve_harness import TOKEN, NotingWriters, make_hub, make_server, run, stored_seqs, wait_for

from agent.cli.serve import main, record
from agent.service.server import AgentServer, server_ssl_context
from agent.telemetry import Status
from agent.telemetry.client import client_ssl_context
from console import cli as console_cli
from console.control import send_control
from console.feeds import LiveFeed
from console.model.records import Connection

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@dataclass(frozen=True)
class Pki:
    ca: Path
    """The private CA's certificate (what ``--ca-file`` names)."""
    cert: Path
    """The agent's certificate, signed by the CA, for 127.0.0.1 only."""
    key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    tmp = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (tmp / "node.ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                                  "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                                  "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    for argv in (
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=trackside test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
         "-extfile", "node.ext", "-out", "node.pem"],
    ):
        subprocess.run(["openssl", *argv], cwd=tmp, check=True, capture_output=True, timeout=60)
    return Pki(tmp / "ca.pem", tmp / "node.pem", tmp / "node.key")


def tls_server(pki: Pki) -> AgentServer:
    return make_server(make_hub(units=2), ssl_context=server_ssl_context(str(pki.cert), str(pki.key)))


async def ctl(*argv: str) -> int:
    return await asyncio.to_thread(main, ["ctl", *argv])


def one_line(err: str, prefix: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0]


def test_ctl_verifies_the_agent_with_ca_file(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> tuple[str, list[int], list[str]]:
        async with tls_server(pki) as server:
            url, ca = server.url, str(pki.ca)
            codes, errors = [], []
            for argv in ([url, "--ca-file", ca, "status"], [url, "status"],
                         [f"wss://localhost:{server.port}", "--ca-file", ca, "status"]):
                codes.append(await ctl(*argv))
                errors.append(capsys.readouterr().err)
            return url, codes, errors

    url, codes, errors = run(go)
    assert url.startswith("wss://127.0.0.1:")
    assert codes == [0, 1, 1], errors
    assert errors[0] == ""
    untrusted = one_line(errors[1], "trackside ctl:")
    assert untrusted.startswith(f"trackside ctl: cannot verify {url}: certificate verify failed: ")
    assert untrusted.endswith("(trust the CA that signed it with --ca-file PEM)")
    mismatch = one_line(errors[2], "trackside ctl:")
    assert "certificate verify failed: Hostname mismatch" in mismatch
    assert mismatch.endswith("(connect by a name or address the certificate holds)")


def test_a_bad_ca_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.pem").write_text("")
    empty = tmp_path / "empty.pem"
    assert main(["ctl", "wss://127.0.0.1:1", "--ca-file", str(empty), "status"]) == 2
    assert one_line(capsys.readouterr().err, "trackside") == (
        f"trackside ctl: error: CA file {empty} holds no PEM certificate (NO_CERTIFICATE_OR_CRL_FOUND)")
    assert main(["record", "wss://127.0.0.1:1", "--db", str(tmp_path / "x.duckdb"), "--ca-file",
                 str(tmp_path / "none.pem")]) == 2
    assert one_line(capsys.readouterr().err, "trackside") == (
        f"trackside record: error: cannot read CA file {tmp_path / 'none.pem'}: No such file or directory")
    assert not (tmp_path / "x.duckdb").exists()


def test_record_passes_its_ca_file_on(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def fake_record(uris: list[str], db: Path, **options: Any) -> int:
        seen.update(options)
        return 0

    monkeypatch.setattr("agent.cli.serve.record", fake_record)
    assert main(["record", "wss://127.0.0.1:1", "--db", str(tmp_path / "x.duckdb"), "--ca-file", str(pki.ca)]) == 0
    context = seen["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "trackside test CA"),),)]


def test_record_with_and_without_ca_file(pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "tls.duckdb"

    async def go() -> tuple[int, int]:
        async with tls_server(pki) as server:
            refused = await record([server.url], tmp_path / "refused.duckdb", flush_s=0.1)  # returns: no retrying
            stop = asyncio.Event()
            writers = NotingWriters()
            task = asyncio.create_task(record([server.url], db, flush_s=0.1, stop=stop, writer_factory=writers.make,
                                              ssl_context=client_ssl_context(pki.ca)))
            # until events are written (the file alone, then 0.5 s, could be too little on a loaded machine)
            await wait_for(lambda: writers.wrote(lambda e: e.seq > 0) or task.done(), what="events recorded")
            stop.set()
            return refused, await task

    refused, recorded = run(go)
    assert (refused, recorded) == (1, 0)
    line = one_line(capsys.readouterr().err, "trackside record: cannot")
    assert line.startswith("trackside record: cannot verify wss://127.0.0.1:") and "--ca-file PEM" in line
    assert stored_seqs(db)


def test_console_feeds_and_control_verify_with_ca_file(pki: Pki) -> None:
    context = client_ssl_context(pki.ca)

    async def first_state(feed: LiveFeed) -> tuple[Connection | None, str]:
        async for update in feed.updates():
            if update.connection not in (None, Connection.CONNECTING):
                return update.connection, update.detail
        raise AssertionError("the feed ended")

    async def go() -> None:
        async with tls_server(pki) as server:
            assert await first_state(LiveFeed(server.url, ssl_context=context)) == (Connection.LIVE, "")
            state, detail = await first_state(LiveFeed(server.url))
            assert state == Connection.OFFLINE and detail.startswith(f"cannot verify {server.url}: "), detail
            assert (await send_control(server.url, TOKEN, Status(), ssl_context=context)).ok
            refused = await send_control(server.url, TOKEN, Status())
            assert not refused.ok and refused.message.startswith(f"cannot verify {server.url}: ")

    run(go)


def test_console_ca_file_reaches_feeds_and_control(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    apps: list[Any] = []
    monkeypatch.setattr(console_cli, "run_app", lambda app, headless: apps.append(app) or 0)
    assert console_cli.main(["console", "wss://127.0.0.1:1", "--ca-file", str(pki.ca), "--no-record"]) == 0
    (app,) = apps
    assert isinstance(app.ssl_context, ssl.SSLContext)
    assert [feed.ssl_context for feed in app.feeds] == [app.ssl_context]
    assert console_cli.main(["console", "--replay", "x.duckdb", "--ca-file", str(pki.ca)]) == 2
    assert one_line(capsys.readouterr().err, "trackside") == (
        "trackside console: error: --ca-file verifies live wss:// agents; a replay connects to none")
