"""``trackside ctl`` and ``trackside record`` against a real agent on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from serve_harness import TOKEN, free_port, make_hub, make_server, run, wait_for

from agent.cli_serve import main, record
from agent.protocol import ControlAudit, Event, NodeHello, RequestFinished
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES


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


def test_hot_swaps_through_ctl_under_load_lose_nothing(token_file: Path) -> None:
    async def go() -> None:
        hub = make_hub(workload="poisson:n=600,rate=60", batch_policy="fairbatching")
        node = hub.node
        finished: list[str] = []
        audits: list[ControlAudit] = []
        server = make_server(hub, speed=8.0, gc_control=True)
        async with server:
            from agent.client import stream

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
