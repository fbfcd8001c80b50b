"""The agent's websocket server with real sockets on loopback: hello, subscribe and resume, slow readers,
bad input, /metrics, TLS, batch frames, restarts."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import msgspec
import pytest
from serve_harness import TOKEN, free_port, make_hub, make_server, run, step_events, wait_for
from websockets.asyncio.client import connect

from agent.runtime.node import Node
from agent.service.server import _Connection
from agent.telemetry import (
    JSON,
    MAX_FRAME_BYTES,
    MSGPACK,
    AgentFrame,
    Alert,
    Event,
    EventBatch,
    NodeHello,
    OkReply,
    StepEvent,
    Subscribe,
    Subscribed,
)
from agent.telemetry.client import open_session, stream
from agent.telemetry.stream import Subscription


def test_hello_first_on_every_connection_in_both_formats() -> None:
    async def go() -> None:
        hub = make_hub(units=3)
        async with make_server(hub) as server:
            for fmt in ("msgpack", "json"):
                async with open_session(server.url, fmt=fmt) as session:  # type: ignore[arg-type]
                    hello = session.hello
                    assert isinstance(hello, NodeHello) and hello.seq == 0
                    assert hello.node_id == "test-node" and [u.unit_id for u in hello.units] == [0, 1, 2]
                    assert hello.boot_ns == hub.boot_ns and hello.dispatch_policy == "least_loaded"
                    assert {p.name for p in hello.batch_policies} >= {"vllm", "fairbatching"}

    run(go)


def test_stream_reconnects_with_backoff_and_resumes_without_a_gap() -> None:
    async def go() -> None:
        port = free_port()
        asked: list[float] = []

        def delays():  # type: ignore[no-untyped-def]
            while True:
                asked.append(0.05)
                yield 0.05

        hub = make_hub()
        seqs: list[int] = []
        hellos = 0
        server = make_server(hub, port=port, speed=10.0)

        async def consume() -> None:
            nonlocal hellos
            async for event in stream(f"ws://127.0.0.1:{port}", resume_after_seq=0, delays=delays):
                if isinstance(event, NodeHello):
                    hellos += 1
                elif event.seq:
                    seqs.append(event.seq)

        task = asyncio.create_task(consume())
        await wait_for(lambda: len(asked) >= 2, what="reconnect attempts before the agent is up")
        await server.start()
        try:
            await wait_for(lambda: len(seqs) > 200, what="first events")
            for conn in list(server._connections):  # drop every connection from the agent's side
                await conn.ws.close()
            await wait_for(lambda: hellos >= 2 and len(seqs) > 1500, what="events after the reconnect")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop()
        assert seqs == list(range(1, len(seqs) + 1)), "a gap or a duplicate across the reconnect"

    run(go)


@pytest.mark.parametrize("restarted", [False, True], ids=["same-run", "restarted-agent"])
def test_resume_after_the_buffer_moved_on_announces_the_gap(restarted: bool) -> None:
    """From seq 0 of this run, or from any seq of an earlier run (the agent restarted): the stream starts
    over, and seq 1 is no longer buffered."""

    async def go() -> None:
        hub = make_hub(replay_capacity=50)
        request = Subscribe(resume_after_seq=5000, resume_boot_ns=hub.boot_ns - 1) if restarted else Subscribe(
            resume_after_seq=0)
        async with make_server(hub) as server:
            await wait_for(lambda: hub.sequencer.last_seq > 200, what="events")
            async with open_session(server.url) as session:
                reply = await session.call(request)
                assert isinstance(reply, OkReply) and isinstance(reply.payload, Subscribed)
                assert reply.payload.resumed_after_seq == 0
                gap = await session.next_event()
                assert isinstance(gap, Alert) and gap.code == "gap" and gap.seq == 0
                assert gap.first_seq == 1 and gap.last_seq >= 150
                nxt = await session.next_event()
                assert nxt.seq == gap.last_seq + 1

    run(go)


def test_a_subscriber_that_never_reads_does_not_slow_the_node() -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=3000,rate=80", max_queued=64)
        speed = 5.0
        async with make_server(hub, speed=speed) as server:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            async with connect(server.url, sock=sock, max_queue=1, compression=None) as slow:
                await slow.send(MSGPACK.encode(Subscribe()))
                loop = asyncio.get_running_loop()
                await wait_for(lambda: hub.num_dropped > 1000, what="drops for the slow reader")
                # The reader's queue is full and it reads nothing: the node must go on (and the hub drop for it),
                # not wait for it. A node that waited would stand still; the bound is loose because a loaded machine
                # simulates slower than the clock asks (the pace itself is a benchmark: bench_subscribers.py).
                start, node_start, dropped = loop.time(), hub.node.now_s, hub.num_dropped
                await asyncio.sleep(1.0)
                elapsed = loop.time() - start
                assert hub.node.now_s - node_start >= 0.05 * elapsed * speed
                assert hub.num_dropped > dropped
                # The slow reader, reading at last, is told what it lost.
                num_frames, end = 0, loop.time() + 10.0
                while loop.time() < end:
                    frame = MSGPACK.decode_agent_frame(await slow.recv())  # type: ignore[arg-type]
                    num_frames += 1
                    if isinstance(frame, Alert) and frame.code == "flow_control":
                        assert frame.num_dropped > 0 and frame.first_seq <= frame.last_seq
                        break
                else:
                    pytest.fail(f"no flow_control alert in {num_frames} frames")
                slow.transport.abort()  # no closing handshake behind megabytes of buffered frames

    run(go)


BIG = '{"kind":"status","control_id":"' + "x" * (MAX_FRAME_BYTES + 10) + '"}'
BAD_FRAMES: list[tuple[str | bytes, str]] = [
    ("this is not json{", "malformed_frame"),
    (b"\xc1", "malformed_frame"),
    ("[1, 2, 3]", "not_an_object"),
    ('{"kind": "explode"}', "unknown_kind"),
    ('{"kind": "status", "control_id": 5}', "invalid_field"),
    (json.dumps({"kind": "pause_unit", "unit_id": "one", "token": TOKEN}), "invalid_field"),
    ('{"kind": "set_batch_policy", "policy": "sarathi"}', "unauthorized"),
    ('{"kind": "set_batch_policy", "policy": "sarathi", "token": "wrong"}', "unauthorized"),
    (BIG, "frame_too_large"),
    (json.dumps({"kind": "set_batch_policy", "policy": "nosuch", "token": TOKEN, "control_id": "p"}), "unknown_policy"),
    (json.dumps({"kind": "set_params", "target": "batch", "params": {"max_num_batched_tokens": -1}, "token": TOKEN,
                 "control_id": "q"}), "bad_param"),
    (json.dumps({"kind": "pause_unit", "unit_id": 99, "token": TOKEN, "control_id": "r"}), "unknown_unit"),
    ('{"kind": "subscribe", "kinds": ["nope"]}', "unknown_event_kind"),
]


def test_every_bad_input_gets_its_error_reply_and_the_agent_carries_on() -> None:
    async def go() -> None:
        hub = make_hub()
        async with make_server(hub) as server, connect(server.url, max_size=None, compression=None) as ws:
            assert isinstance(MSGPACK.decode_agent_frame(await ws.recv()), NodeHello)  # type: ignore[arg-type]
            for frame, code in BAD_FRAMES:
                before = hub.sequencer.last_seq
                await ws.send(frame)
                raw = await ws.recv()
                reply = (JSON if isinstance(raw, str) else MSGPACK).decode_agent_frame(raw)
                assert getattr(reply, "code", None) == code, (frame[:80], reply)
                await wait_for(lambda b=before: hub.sequencer.last_seq > b, what="the node going on")  # type: ignore[misc]
            await ws.send('{"kind": "status", "control_id": "last"}')
            reply = JSON.decode_agent_frame(await ws.recv())
            assert isinstance(reply, OkReply) and reply.control_id == "last"
            assert all(u.batch_policy == "vllm" for u in hub.unit_statuses()), "a refused change was applied"

    run(go)


LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse_exposition(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A strict little parser of the text format: every sample after its family's TYPE line."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    typed: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("gauge", "counter", "histogram", "summary", "untyped"), line
            typed[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = LINE.match(line)
        assert m, f"unparseable line {line!r}"
        name = m.group(1)
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in typed else name
        assert family in typed, f"{name} has no TYPE line before it"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        samples.setdefault(name, []).append((labels, float(m.group(4))))
    return samples


def test_metrics_endpoint_serves_parseable_text_with_vllm_names() -> None:
    async def go() -> str:
        hub = make_hub(units=2, batch_policy="fairbatching")
        async with make_server(hub) as server:
            await wait_for(lambda: hub.node.num_finished > 20, what="finished requests")
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            data = await reader.read()
            writer.close()
            return data.decode()

    raw = run(go)
    head, _, body = raw.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200") and "text/plain; version=0.0.4" in head
    samples = parse_exposition(body)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "trackside_batch_policy_info", "trackside_step_duration_seconds_bucket"):
        assert {labels["engine"] for labels, _ in samples[name]} == {"0", "1"}, name
    assert all(0.0 <= v <= 1.0 for _, v in samples["vllm:kv_cache_usage_perc"])
    assert {labels["policy"] for labels, _ in samples["trackside_batch_policy_info"]} == {"fairbatching"}
    assert sum(v for _, v in samples["trackside_slo_attained_total"]) <= sum(
        v for _, v in samples["trackside_requests_finished_total"])
    assert sum(v for _, v in samples["trackside_requests_finished_total"]) > 20
    for name in ("trackside_requests_refused_total", "trackside_telemetry_dropped_total",
                 "trackside_prefill_admission_budget_tokens", "trackside_step_duration_seconds_count"):
        assert name in samples, name
    buckets = [v for labels, v in samples["trackside_step_duration_seconds_bucket"] if labels["engine"] == "0"]
    assert buckets == sorted(buckets), "histogram buckets must be cumulative"


def test_node_request_hooks_report_every_lifecycle_step() -> None:
    hub = make_hub(units=2, batch_policy="fairbatching+pab", workload="poisson:n=300,rate=60")
    node: Node = hub.node
    kinds: dict[str, list[str]] = {}
    node.on_request = lambda kind, state: kinds.setdefault(state.spec.request_id, []).append(kind)
    node.run()
    assert len(kinds) == len(node.arrivals)
    for rid, seen in kinds.items():
        state = node.states[rid]
        assert seen[0] == "arrived"
        if state.rejected:
            assert seen == ["arrived", "refused"], (rid, seen)
        else:
            assert seen == ["arrived", "dispatched", "first_token"], (rid, seen)
            assert state.outcome is not None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    from agent.service.server import server_ssl_context

    async def go() -> None:
        async with make_server(make_hub(), ssl_context=server_ssl_context(str(cert), str(key))) as server:
            assert server.url.startswith("wss://")
            client = ssl.create_default_context(cafile=str(cert))
            async with open_session(server.url, ssl_context=client) as session:
                assert session.hello is not None
                event = None
                await session.call(Subscribe())
                while not isinstance(event, StepEvent):
                    event = await session.next_event()

    run(go)


def test_json_events_follow_the_subscribe_format() -> None:
    async def go() -> None:
        async with make_server(make_hub()) as server, connect(server.url, compression=None) as ws:
            await ws.recv()
            await ws.send(msgspec.json.encode(Subscribe(control_id="s", kinds=("step",))).decode())
            reply = json.loads(await ws.recv())
            assert reply["kind"] == "ok" and reply["payload"]["kind"] == "subscribed"
            event = json.loads(await ws.recv())
            assert event["kind"] == "step" and event["seq"] > 0

    run(go)


# -- batch frames --------------------------------------------------------------------------------------------
def test_a_resume_comes_in_batch_frames_in_order_and_a_resume_mid_batch_continues_after_its_seq() -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=3000,rate=200")
        async with make_server(hub, speed=50.0) as server:
            await wait_for(lambda: hub.sequencer.last_seq > 3000, what="events to resume")
            async with open_session(server.url) as session:
                await session.call(Subscribe(resume_after_seq=0, max_batch=64))
                frames = [await session.next_batch() for _ in range(20)]
            assert all(len(f) == 64 for f in frames), "a resume's backlog fills whole frames"
            seqs = [e.seq for f in frames for e in f]
            assert seqs == list(range(1, 20 * 64 + 1)), "in order, continuous across frame boundaries"
            middle = frames[3][20].seq
            async with open_session(server.url) as session:  # resume in the middle of a batch
                await session.call(Subscribe(resume_after_seq=middle, max_batch=64))
                again = [e.seq for _ in range(5) for e in await session.next_batch()]
            assert again == list(range(middle + 1, middle + 1 + len(again)))

    run(go)


def test_a_version_1_client_gets_one_event_per_frame() -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=3000,rate=200")
        async with make_server(hub, speed=50.0) as server, connect(f"{server.url}?format=json") as ws:
            await wait_for(lambda: hub.sequencer.last_seq > 1000, what="a backlog that would batch")
            assert json.loads(await ws.recv())["kind"] == "hello"
            await ws.send('{"kind": "subscribe", "protocol_version": 1, "resume_after_seq": 0, "control_id": "s"}')
            reply = json.loads(await ws.recv())
            assert reply["kind"] == "ok" and reply["payload"]["last_seq"] > 1000
            frames = [json.loads(await ws.recv()) for _ in range(1000)]
            assert all(isinstance(f, dict) and f["kind"] != "batch" for f in frames)
            assert [f["seq"] for f in frames] == list(range(1, 1001))

    run(go)


def test_a_restarted_agent_is_streamed_from_its_first_event_not_after_the_old_seq() -> None:
    async def go() -> None:
        port = free_port()
        runs: dict[int, list[int]] = {}
        boot = 0

        def delays():  # type: ignore[no-untyped-def]
            while True:
                yield 0.05

        async def consume() -> None:
            nonlocal boot
            async for event in stream(f"ws://127.0.0.1:{port}", resume_after_seq=0, delays=delays):
                if isinstance(event, NodeHello):
                    boot = event.boot_ns
                elif event.seq:
                    runs.setdefault(boot, []).append(event.seq)

        first, second = make_hub(), make_hub()
        assert first.boot_ns != second.boot_ns
        # The first run stands still at 0.5 s of node time (its server's clock starts at 0 and runs at 1/100: the
        # node waits 50 s for its next event), so the client has its whole stream, no more, whatever the machine's
        # speed: live at 20x, a loaded machine let the client take over 3000 events of it before the server stopped.
        first.attach()
        first.node.advance(0.5)
        task = asyncio.create_task(consume())
        try:
            async with make_server(first, port=port, speed=0.01):
                await wait_for(lambda: runs.get(first.boot_ns, [])[-1:] == [first.sequencer.last_seq],
                               what="the first run's events")
            assert len(runs[first.boot_ns]) == first.sequencer.last_seq > 300
            # The restarted agent is further on in its new run than the client was in the old one when the client
            # comes back: resuming after the old run's last seq would skip the new run's first events.
            # (advanced until it is, whatever the client took: one loaded run saw the first run at 3001 events)
            second.attach()
            while second.sequencer.last_seq <= len(runs[first.boot_ns]) + 100:
                second.node.advance(second.node.now_s + 1.0)
            ahead = second.sequencer.last_seq
            assert ahead > len(runs[first.boot_ns]) + 100
            async with make_server(second, port=port):
                await wait_for(lambda: len(runs.get(second.boot_ns, ())) > ahead, what="the second run's events")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert set(runs) == {first.boot_ns, second.boot_ns}
        for seqs in runs.values():
            assert seqs == list(range(1, len(seqs) + 1)), "each run from seq 1, no gap, no duplicate"

    run(go)


def queued_connection(events: list[Event], max_batch: int) -> _Connection:
    sub = Subscription("n", max_batch=max_batch, max_queued=10_000)
    for event in events:
        sub.offer(event)
    return _Connection(None, "msgpack", sub=sub)  # type: ignore[arg-type]  # no socket: next_message only


def frames_of(conn: _Connection) -> list[AgentFrame]:
    out = []
    while (data := conn.next_message()) is not None:
        assert isinstance(data, bytes) and len(data) <= MAX_FRAME_BYTES
        out.append(MSGPACK.decode_agent_frame(data))
    return out


def test_the_sender_sends_what_is_queued_in_one_frame_and_a_lone_event_alone() -> None:
    events = step_events(10)
    frames = frames_of(queued_connection(events, max_batch=4))
    assert [type(f).__name__ for f in frames] == ["EventBatch", "EventBatch", "EventBatch"]
    assert [e for f in frames for e in f.events] == events  # type: ignore[union-attr]
    assert frames_of(queued_connection(events[:1], max_batch=4)) == events[:1], "never waits to fill a batch"
    assert frames_of(queued_connection(events[:3], max_batch=1)) == events[:3], "max_batch 1: the old framing"


def test_the_frame_size_cap_splits_a_batch_and_the_rest_goes_first_in_the_next_frame() -> None:
    events = step_events(30, reasons_size=5000)  # about 80 KB each
    conn = queued_connection(events, max_batch=512)
    frames = frames_of(conn)
    assert len(frames) == 3 and all(isinstance(f, EventBatch) and len(f.events) > 1 for f in frames)
    assert [e.seq for f in frames for e in f.events] == list(range(1, 31))  # type: ignore[union-attr]
