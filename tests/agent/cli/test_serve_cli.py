"""``trackside ctl`` and ``trackside record`` against a real agent on loopback: control, resume from the store,
refetching dropped events, an agent restart, retention."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from serve_harness import TOKEN, free_port, make_hub, make_server, run, step_events, stored_runs, wait_for

from agent.cli.serve import main, record
from agent.service.hub import Hub
from agent.telemetry import ControlAudit, Event, NodeHello, RequestFinished
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES
from store.writer import StoreWriter


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


async def ctl(*argv: str) -> int:
    """``trackside ctl`` in a thread (it runs its own event loop)."""
    return await asyncio.to_thread(main, ["ctl", *argv])


def test_ctl_exit_codes_and_output(token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> list[int]:
        async with make_server(make_hub()) as server:
            u, t = server.url, str(token_file)
            return [
                await ctl(u, "status"),
                await ctl(u, "--token-file", t, "set-policy", "--unit", "1", "sarathi", "--param", "tbt_target_ms=40"),
                await ctl(u, "--token-file", t, "set-policy", "nosuch"),
                await ctl(u, "set-dispatch", "round_robin"),
                await ctl(u, "--token-file", t, "--dry-run", "set-param", "--unit", "0", "max_num_batched_tokens=-1"),
                await ctl(u, "--token-file", t, "--dry-run", "pause", "--unit", "0"),
                await ctl(u, "--json", "policies"),
                await ctl(f"ws://127.0.0.1:{free_port()}", "status"),
            ]

    codes = run(go)
    out, err = capsys.readouterr()
    assert codes == [0, 0, 2, 2, 2, 2, 0, 1], (codes, err)
    assert "unit 1 [active]" in out and "applied: set_batch_policy: unit 1: sarathi (" in out and '"policy_list"' in out
    errors = [line for line in err.splitlines() if line.startswith("trackside")]
    assert errors[0] == ("trackside ctl: error: unknown_policy: unknown batch policy 'nosuch' (known: "
                         f"{', '.join(sorted(BATCH_POLICIES))})")
    assert errors[1] == "trackside ctl: error: unauthorized: wrong or missing token"
    assert errors[2].startswith("trackside ctl: error: bad_param: max_num_batched_tokens=-1")
    assert errors[3].startswith("trackside ctl: error: --dry-run applies to")
    assert errors[4].startswith("trackside ctl: cannot reach ws://127.0.0.1:")


# -- trackside ctl URI,URI,...: several agents (a node run with --agents N); a change everywhere or nowhere ----------
def policies(hubs: list[Hub]) -> list[list[str]]:
    return [[u.batch_policy for u in hub.status().units] for hub in hubs]


def test_a_change_on_every_agent_or_on_none(token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hubs = [make_hub(units=2), make_hub(units=3)]

    urls: list[str] = []

    async def go() -> list[tuple[int, list[list[str]]]]:
        async with make_server(hubs[0]) as a, make_server(hubs[1]) as b:
            urls.extend((a.url, b.url))
            both, t = f"{a.url},{b.url}", str(token_file)
            steps = []
            for argv in (
                [both, "--token-file", t, "set-policy", "sarathi"],  # both take it
                [both, "--token-file", t, "set-policy", "--unit", "2", "fairbatching"],  # a has no unit 2: nowhere
                [f"{a.url},ws://127.0.0.1:{free_port()}", "--token-file", t, "set-policy", "vllm"],  # one unreachable
                [both, "set-policy", "vllm"],  # no token: refused by both, nothing changes
                [both, "--json", "status"],
            ):
                steps.append((await ctl(*argv), policies(hubs)))
            return steps

    steps = run(go)
    out, err = capsys.readouterr()
    assert [code for code, _ in steps] == [0, 2, 1, 2, 0], err
    assert all(seen == [["sarathi"] * 2, ["sarathi"] * 3] for _, seen in steps), steps
    assert out.count(": applied: set_batch_policy: unit 0: sarathi") == 2  # one line per agent, under its URI
    assert f"trackside ctl: {urls[0]}: error: unknown_unit: no unit 2 (units: 0, 1)" in err
    assert f"{urls[1]}: dry_run: set_batch_policy: unit 2: fairbatching" in out  # b would have taken it
    assert err.count("nothing changed on any of the 2 agents") == 3
    assert "cannot reach ws://127.0.0.1:" in err
    statuses = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [len(s["reply"]["payload"]["units"]) for s in statuses] == [2, 3]
    assert [s["uri"] for s in statuses] == urls


def test_one_uri_is_one_agent_as_before(token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub = make_hub(units=2)

    async def go() -> int:
        async with make_server(hub) as a:
            return await ctl(a.url, "--token-file", str(token_file), "set-policy", "sarathi")

    assert run(go) == 0
    out = capsys.readouterr().out
    assert out.startswith("applied: set_batch_policy: unit 0: sarathi")  # no URI in front of it


def test_ctl_fails_and_recovers_a_unit(token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> tuple[list[int], list[str]]:
        hub = make_hub(units=2)
        async with make_server(hub, speed=1.0) as server:
            u, t = server.url, str(token_file)
            codes = [await ctl(u, "--token-file", t, "fail-unit", "--unit", "1", "--reason", "disk swap")]
            modes = list(hub.node.unit_modes)
            codes += [
                await ctl(u, "--token-file", t, "fail-unit", "--unit", "1"),
                await ctl(u, "status"),
                await ctl(u, "--token-file", t, "recover-unit", "--unit", "1"),
                await ctl(u, "--token-file", t, "recover-unit", "--unit", "1"),
                await ctl(u, "fail-unit", "--unit", "0"),
            ]
            return codes, [*modes, *hub.node.unit_modes]

    codes, modes = run(go)
    out, err = capsys.readouterr()
    assert codes == [0, 2, 0, 0, 2, 2], (codes, err)
    assert modes == ["active", "failed", "active", "active"]
    assert "applied: set_unit_mode: unit 1: failed (failed by ws:127.0.0.1:" in out and ": disk swap)" in out
    assert "unit 1 [failed]" in out and "applied: set_unit_mode: unit 1: active" in out
    errors = [line for line in err.splitlines() if line.startswith("trackside")]
    assert errors == ["trackside ctl: error: bad_request: unit 1 has failed already",
                      "trackside ctl: error: bad_request: unit 1 has not failed",
                      "trackside ctl: error: unauthorized: wrong or missing token"]


def test_hot_swaps_through_ctl_under_load_lose_nothing(token_file: Path) -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=600,rate=60", batch_policy="fairbatching")
        node = hub.node
        finished: list[str] = []
        audits: list[ControlAudit] = []
        server = make_server(hub, speed=8.0, gc_control=True)
        async with server:
            from agent.telemetry.client import stream

            async def watch() -> None:
                async for event in stream(server.url, resume_after_seq=0):
                    if isinstance(event, RequestFinished):
                        finished.append(event.request_id)
                    elif isinstance(event, ControlAudit):
                        audits.append(event)

            watcher = asyncio.create_task(watch())
            t = str(token_file)
            swaps = [["set-policy", name] for name in sorted(BATCH_POLICIES)]
            swaps += [["set-policy", "--unit", "2", "eb"], ["set-dispatch", "round_robin"],
                      ["set-param", "--unit", "0", "token_budget=1024"], ["set-dispatch", "least_loaded"],
                      ["drain", "--unit", "3"], ["resume", "--unit", "3"]]
            swaps += [["set-dispatch", name] for name in sorted(DISPATCH_POLICIES)]
            for argv in swaps:
                if argv[:2] == ["set-param", "--unit"]:
                    assert await ctl(server.url, "--token-file", t, "set-policy", "fairbatching") == 0
                assert await ctl(server.url, "--token-file", t, *argv) == 0, argv
                # request accounting at the swap: arrived = finished + refused + in flight
                assert len(node.states) == node.num_finished + node.num_rejected + len(node.unfinished())
            await asyncio.wait_for(server.workload_done.wait(), 60)
            await wait_for(lambda: len(finished) == node.num_finished, what="every finish streamed")
            # the last swaps may come after the last finish (1.25 s of workload at 8x): their audits too, on the
            # watcher's connection, which ctl's replies do not wait for
            await wait_for(lambda: len([a for a in audits if a.result == "applied"]) >= len(swaps) + 1,
                           what="every swap's audit streamed")
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert node.num_finished + node.num_rejected == len(node.arrivals) and not node.unfinished()
        assert len(finished) == len(set(finished)), "a request finished twice"
        assert len([a for a in audits if a.result == "applied"]) == len(swaps) + 1
        assert all(a.actor.startswith("ws:127.0.0.1:") for a in audits)

    run(go, timeout_s=90)


class FakeWriter:
    """The ``store.writer.StoreWriter`` interface, in memory."""

    def __init__(self, path: Path, start: int = 0) -> None:
        self.path = path
        self.events: list[Event] = []
        self.start = start
        self.num_flushes = 0
        self.closed = False

    def write(self, events: Sequence[Event]) -> None:
        self.events.extend(events)

    def flush(self) -> None:
        self.num_flushes += 1

    def last_seq(self, node_id: str, boot_ns: int | None = None) -> int:
        assert node_id == "test-node" and boot_ns is not None
        return self.start

    def close(self) -> None:
        self.closed = True


def test_record_resumes_from_the_store_and_writes_every_event(tmp_path: Path) -> None:
    writers: list[FakeWriter] = []

    def factory(path: Path) -> FakeWriter:
        writers.append(FakeWriter(path, start=100))
        return writers[-1]

    async def go() -> None:
        hub = make_hub(workload="poisson:n=200,rate=60")
        async with make_server(hub, speed=20.0) as server:
            await wait_for(lambda: hub.sequencer.last_seq > 300, what="events before the recorder starts")
            stop = asyncio.Event()
            task = asyncio.create_task(record([server.url], tmp_path / "db", flush_s=0.2, writer_factory=factory,
                                              stop=stop))
            await asyncio.wait_for(server.workload_done.wait(), 30)
            await wait_for(lambda: bool(writers) and writers[0].events[-1:] != []
                           and writers[0].events[-1].seq == hub.sequencer.last_seq, what="the recorder catching up")
            stop.set()
            assert await task == 0

    run(go)
    writer = writers[0]
    assert isinstance(writer.events[0], NodeHello), "the run's hello is stored first"
    seqs = [e.seq for e in writer.events if not isinstance(e, NodeHello)]
    assert seqs == list(range(101, seqs[-1] + 1)), "resumed after the store's last seq, without gaps"
    assert writer.closed and writer.num_flushes >= 2


class StallingStore:
    """A real ``StoreWriter`` whose first ``stalls`` writes take ``stall_s`` more (a recorder falling behind)."""

    def __init__(self, path: Path, stalls: int = 0, stall_s: float = 0.3) -> None:
        self.inner = StoreWriter(path)
        self.stalls = stalls
        self.stall_s = stall_s

    def write(self, events: Sequence[Event]) -> None:
        if self.stalls:
            self.stalls -= 1
            time.sleep(self.stall_s)
        self.inner.write(events)

    def __getattr__(self, name: str) -> Any:  # flush, last_seq, prune, close
        return getattr(self.inner, name)


class Recording:
    """``record`` into ``db`` in a task (start it in a running loop), through a :class:`StallingStore`."""

    def __init__(self, uris: Sequence[str], db: Path, *, stalls: int = 0, retention_s: float | None = None) -> None:
        self.writers: list[StallingStore] = []
        self._stop = asyncio.Event()
        self._stalls = stalls
        self.task = asyncio.create_task(record(uris, db, flush_s=0.1, writer_factory=self._factory, stop=self._stop,
                                               retention_s=retention_s))

    def _factory(self, path: Path) -> StallingStore:
        self.writers.append(StallingStore(path, self._stalls))
        return self.writers[-1]

    def caught_up(self, hub: Hub) -> bool:
        """Whether the store has committed ``hub``'s stream up to its last event."""
        return bool(self.writers) and self.writers[0].last_seq(hub.node_id, hub.boot_ns) == hub.sequencer.last_seq

    async def finish(self, hub: Hub) -> None:
        """Wait until ``hub``'s workload is done and committed, then stop the recorder."""
        await wait_for(lambda: hub.node.done and self.caught_up(hub), timeout_s=30, what="the recording")
        self._stop.set()
        assert await self.task == 0


def test_record_refetches_what_the_agent_dropped_for_it_and_stores_it_once(tmp_path: Path) -> None:
    db = tmp_path / "refetch.duckdb"
    hub = make_hub(workload="poisson:n=1500,rate=150", max_queued=32)

    async def go() -> None:
        async with make_server(hub, speed=20.0) as server:
            await Recording([server.url], db, stalls=3).finish(hub)

    run(go, timeout_s=60)
    assert hub.num_dropped > 0, "the stalled recorder lost events at the agent"
    assert stored_runs(db) == {hub.boot_ns: list(range(1, hub.sequencer.last_seq + 1))}, "refetched, stored once"


def test_record_across_an_agent_restart_stores_both_runs_whole(tmp_path: Path) -> None:
    db = tmp_path / "restart.duckdb"
    port = free_port()
    first, second = make_hub(workload="poisson:n=50,rate=60"), make_hub(workload="poisson:n=600,rate=100")

    async def go() -> None:
        recording = Recording([f"ws://127.0.0.1:{port}"], db)
        async with make_server(first, port=port):
            await wait_for(lambda: first.node.done and recording.caught_up(first), what="the first run recorded")
        second.attach()
        second.node.advance(5.0)  # the new run is past the old run's last seq when the recorder comes back
        assert second.sequencer.last_seq > first.sequencer.last_seq
        async with make_server(second, port=port):
            await recording.finish(second)

    run(go, timeout_s=90)
    assert stored_runs(db) == {hub.boot_ns: list(range(1, hub.sequencer.last_seq + 1)) for hub in (first, second)}


def test_record_with_retention_deletes_old_events_and_keeps_the_new_run(tmp_path: Path) -> None:
    db = tmp_path / "retention.duckdb"
    old_boot = time.time_ns() - 3 * 86_400 * 10**9
    hub = make_hub(workload="poisson:n=50,rate=60")
    with StoreWriter(db) as writer:
        old_hello = msgspec.structs.replace(hub.hello(), boot_ns=old_boot, time_ns=old_boot)
        old_step = msgspec.structs.replace(step_events(1)[0], node_id=hub.node_id, time_ns=old_boot + 1)
        writer.write([old_hello, old_step])

    async def go() -> None:
        async with make_server(hub) as server:
            await Recording([server.url], db, retention_s=86_400).finish(hub)

    run(go)
    assert stored_runs(db) == {hub.boot_ns: list(range(1, hub.sequencer.last_seq + 1))}, "the old run's step is gone"
    with StoreWriter(db) as writer:
        assert writer.last_seq(hub.node_id, old_boot) == 1, "its hello and position stay"


def test_record_refuses_a_bad_retention(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["record", "ws://127.0.0.1:1", "--db", "x.duckdb", "--retention", "7 days"])
    assert info.value.code == 2
    assert "argument --retention: invalid duration '7 days': give a number and a unit" in capsys.readouterr().err


def test_agent_builds_the_cluster_shape_it_is_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.bench.runner import BenchConfig
    from agent.cli.serve import make_node
    from agent.workload.spec import parse_workload

    node = make_node(BenchConfig(units=4, topology="disaggregated", prefill_units=1, lockstep=True,
                                 dispatch="sbs"), parse_workload("poisson:n=20,rate=50", seed=0))
    assert node.disaggregated and node.lockstep
    assert [u.role for u in node.units] == ["prefill", "decode", "decode", "decode"]
    node.run()
    assert node.num_finished == 20 and node.num_migrations > 0
    code = main(["agent", "--workload", "poisson:n=5", "--units", "2", "--topology", "disaggregated",
                 "--prefill-units", "2", "--listen", "127.0.0.1:0"])
    assert code == 2 and "2 prefill units of 2" in capsys.readouterr().err
    workload = parse_workload("poisson:n=20,rate=50", seed=0)
    node = make_node(BenchConfig(units=4, instance_size=2, dispatch="sbs"), workload)
    assert node.lockstep_groups == ((0, 1), (2, 3))
    node.run()
    assert node.num_finished == 20
    code = main(["agent", "--workload", "poisson:n=5", "--units", "4", "--instance-size", "3",
                 "--listen", "127.0.0.1:0"])
    assert code == 2 and "instance size 3 does not divide 4 units" in capsys.readouterr().err
