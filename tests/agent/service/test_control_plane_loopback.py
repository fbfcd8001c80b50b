"""The control plane's semantics over real websockets on loopback (issue #16): a control frame applies once, on any
connection; parameters are parsed to their schema's type; a refused token is an audit event and a store row; a
read token streams and reads but changes nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import duckdb
import pytest
from serve_harness import TOKEN, NotingWriters, make_hub, make_server, run, wait_for
from websockets.asyncio.client import ClientConnection, connect

from agent.bench.runner import BenchConfig
from agent.cli.serve import main, make_node, record
from agent.service.hub import Hub
from agent.telemetry import (
    JSON,
    ControlAudit,
    ErrorReply,
    NodeHello,
    OkReply,
    PauseUnit,
    Reply,
    SetParams,
    Status,
    StepEvent,
    Subscribe,
)
from agent.telemetry.client import AgentError, open_session, stream_batches
from agent.workload.spec import parse_workload

READ_TOKEN = "r3ad-only-for-tests"


async def ask(ws: ClientConnection, frame: dict[str, object]) -> Reply:
    """Send one JSON control frame and read frames up to its reply."""
    await ws.send(json.dumps(frame))
    while True:
        message = JSON.decode_agent_frame(await ws.recv())
        if isinstance(message, OkReply | ErrorReply):
            return message


async def connected(url: str) -> ClientConnection:
    ws = await connect(url + "?format=json", compression=None)
    assert isinstance(JSON.decode_agent_frame(await ws.recv()), NodeHello)
    return ws


def test_a_control_frame_sent_again_is_refused_on_the_same_and_a_new_connection() -> None:
    frame = {"kind": "set_params", "target": "dispatch", "params": {"waiting_weight": 2.5}, "token": TOKEN,
             "control_id": "once-7f3a"}

    async def go() -> tuple[list[str], Hub]:
        hub = make_hub()
        async with make_server(hub) as server:
            first = await connected(server.url)
            replies = [await ask(first, frame), await ask(first, frame)]
            await first.close()
            second = await connected(server.url)
            replies.append(await ask(second, {**frame, "params": {"waiting_weight": 7.0}}))
            replies.append(await ask(second, {**frame, "control_id": ""}))
            await second.close()
            # a client's session gives each call a fresh id, so sending the same request twice applies it twice
            async with open_session(server.url, token=TOKEN) as session:
                replies += [await session.call(PauseUnit(unit_id=0)), await session.call(PauseUnit(unit_id=0))]
        return [r.code if isinstance(r, ErrorReply) else "ok" for r in replies], hub

    codes, hub = run(go)
    assert codes == ["ok", "duplicate_control_id", "duplicate_control_id", "invalid_field", "ok", "ok"]
    assert hub.node.dispatcher.params["waiting_weight"] == 2.5
    applied = [a for a in hub.control.audit_log if a.result == "applied" and a.action == "set_params"]
    assert len(applied) == 1, "the repeated frame was applied again"


def test_parameters_are_parsed_to_their_type_and_integers_are_bounded() -> None:
    async def go() -> tuple[Reply, Reply, ControlAudit]:
        hub = make_hub()
        async with make_server(hub) as server, open_session(server.url, token=TOKEN) as session:
            await session.call(Subscribe(kinds=("audit",)))
            coerced = await session.call(SetParams(target="dispatch", params={"waiting_weight": "0.5"}))
            streamed = await session.next_event()
            assert isinstance(streamed, ControlAudit)
            huge = await session.call(SetParams(target="batch", params={"max_num_batched_tokens": 2**63 - 1}))
            return coerced, huge, streamed

    coerced, huge, streamed = run(go)
    assert isinstance(coerced, OkReply) and isinstance(coerced.payload, ControlAudit)
    for audit in (coerced.payload, streamed):
        assert audit.new[0].params == {"waiting_weight": 0.5} and type(audit.new[0].params["waiting_weight"]) is float
    assert isinstance(huge, ErrorReply) and huge.code == "bad_param" and "above the maximum 1048576" in huge.message


def test_a_wrong_token_is_an_audit_event_and_a_store_row(tmp_path: Path) -> None:
    db = tmp_path / "audit.duckdb"
    wrong = "guess-" + "y" * 26

    async def go() -> tuple[Reply, ControlAudit, int]:
        hub = make_hub()
        writers = NotingWriters()
        async with make_server(hub) as server:
            stop = asyncio.Event()
            recorder = asyncio.create_task(record([server.url], db, flush_s=0.1, stop=stop,
                                                  writer_factory=writers.make))
            async with open_session(server.url) as watcher:
                await watcher.call(Subscribe(kinds=("audit",)))
                await wait_for(lambda: len(hub.subscriptions) == 2, what="the recorder's subscription")
                intruder = await connected(server.url)  # the token in the frame (a token at connect: the server's)
                reply = await ask(intruder, {"kind": "pause_unit", "unit_id": 0, "token": wrong, "control_id": "i1"})
                await intruder.close()
                audit = await asyncio.wait_for(watcher.next_event(), 10.0)
                assert isinstance(audit, ControlAudit)
            # the recorder's own connection brings it the audit: wait for it there (a fixed 0.3 s was not always
            # enough on a loaded machine); stopping then writes and commits it
            await wait_for(lambda: writers.wrote(lambda e: isinstance(e, ControlAudit)), what="the audit recorded")
            stop.set()
            return reply, audit, await recorder

    reply, audit, status = run(go)
    assert isinstance(reply, ErrorReply) and reply.code == "unauthorized" and status == 0
    assert (audit.action, audit.result, audit.error_code) == ("pause_unit", "rejected", "unauthorized")
    assert audit.actor.startswith("ws:127.0.0.1:") and audit.control_id == reply.control_id
    assert wrong not in json.dumps(audit.message)
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT actor, action, result, error_code, message FROM audits").fetchall()
    finally:
        con.close()
    assert rows == [(audit.actor, "pause_unit", "rejected", "unauthorized", audit.message)]


def read_token_hub() -> Hub:
    config = BenchConfig(units=2, batch_policy="vllm", dispatch="least_loaded")
    node = make_node(config, parse_workload("poisson:n=400,rate=40", seed=1))
    return Hub(node, node_id="test-node", profile=config.profile, token=TOKEN, read_token=READ_TOKEN)


def test_a_read_token_streams_and_reads_but_changes_nothing(tmp_path: Path) -> None:
    async def go() -> tuple[list[str], list[str]]:
        hub = read_token_hub()
        codes: list[str] = []
        async with make_server(hub, speed=1.0) as server:  # a slow stream: a session closes at once
            async with open_session(server.url, token=READ_TOKEN) as dashboard:
                for request in (Status(), Subscribe(kinds=("step",)), PauseUnit(unit_id=0)):
                    reply = await dashboard.call(request)
                    codes.append(reply.code if isinstance(reply, ErrorReply) else "ok")
                assert isinstance(await asyncio.wait_for(dashboard.next_event(), 10.0), StepEvent)
            async with open_session(server.url) as stranger:
                for request in (Status(), Subscribe()):
                    reply = await stranger.call(request)
                    codes.append(reply.code if isinstance(reply, ErrorReply) else "ok")
            with pytest.raises(AgentError, match="unauthorized"):
                async for _ in stream_batches(server.url, delays=lambda: iter([0.05] * 3)):
                    pass
            async for events in stream_batches(server.url, token=READ_TOKEN, resume_after_seq=0):
                if any(isinstance(e, StepEvent) for e in events):
                    break
            modes = list(hub.node.unit_modes)
        return codes, modes

    codes, modes = run(go)
    assert codes == ["ok", "ok", "unauthorized", "unauthorized", "unauthorized"]
    assert modes == ["active", "active"]


def test_ctl_and_record_take_a_read_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    read_file = tmp_path / "read-token"
    read_file.write_text(READ_TOKEN + "\n")
    read_file.chmod(0o600)
    db = tmp_path / "dash.duckdb"

    async def go() -> list[int]:
        hub = read_token_hub()
        async with make_server(hub) as server:
            u, t = server.url, str(read_file)
            stop = asyncio.Event()
            writers = NotingWriters()
            recorder = asyncio.create_task(record([u], db, flush_s=0.1, stop=stop, token=READ_TOKEN,
                                                  writer_factory=writers.make))
            # the refusals last: the server slows an address after one (a token at connect then waits its turn)
            codes = [await asyncio.to_thread(main, ["ctl", u, "--token-file", t, "status"]),
                     await asyncio.to_thread(main, ["ctl", u, "--token-file", t, "pause", "--unit", "0"]),
                     await asyncio.to_thread(main, ["ctl", u, "status"])]
            await wait_for(lambda: hub.replay.last_seq > 50, what="events")
            await wait_for(lambda: writers.wrote(lambda e: isinstance(e, StepEvent)), what="steps recorded")
            stop.set()
            codes.append(await recorder)
        return codes

    codes = run(go)
    err = capsys.readouterr().err
    assert codes == [0, 2, 2, 0], err
    assert "unauthorized: a read token cannot change anything" in err
    con = duckdb.connect(str(db), read_only=True)
    try:
        (num_steps,) = con.execute("SELECT count(*) FROM steps").fetchone() or (0,)
    finally:
        con.close()
    assert num_steps > 0
