"""Faults of vLLM units beyond a dead engine (whole ``AsyncLLM`` engines on the CPU, fake executor), as
``test_vllm_engine_failure.py`` sets them up: ``fail_unit``/``recover_unit`` from the control plane, a hung engine
core (SIGSTOP) found by the unit's watchdog and killed, and the dispatcher's pending timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from vllm_units import fake_unit, read_all, wait_until

from agent.engine.live import StallClock
from agent.engine.vllm.unit import VllmUnit
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.requests import ClusterRequest, PendingTimeout, RequestRejected
from agent.runtime.live.restarts import backoff
from agent.service.hub import Hub
from agent.telemetry import Alert, AlertCode, ControlAudit, ErrorReply, FailUnit, OkReply, RecoverUnit, RequestRefused
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES

pytestmark = pytest.mark.vllm

MAX_TOKENS = 48
LONG = 400
"""Output tokens of the requests a fault catches under way (a few hundred ms of steps at least)."""
TOKEN = "t0ken"


def _node(units: list[VllmUnit], **cluster: object) -> tuple[LiveCluster, LiveClusterNode, Hub]:
    c = LiveCluster(units, DISPATCH_POLICIES["round_robin"](), ttft_slo_s=5.0, tpot_slo_s=1.0, **cluster)  # type: ignore[arg-type]
    node = LiveClusterNode(c, [BATCH_POLICIES["vllm"]() for _ in units])
    hub = Hub(node, node_id="test-node", profile="cpu", token=TOKEN, settle_timeout_s=120.0)
    hub.attach()
    return c, node, hub


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _unit_alerts(hub: Hub, unit_id: int) -> list[str]:
    return [e.code for e in hub.replay.since(0).events if isinstance(e, Alert) and e.unit_id == unit_id]


def test_fail_unit_moves_its_requests_keeps_its_engine_and_recover_unit_reopens_it() -> None:
    async def main() -> None:
        units = [fake_unit(i) for i in range(2)]
        for u in units:
            u.start()
        cluster, node, hub = _node(units, restart_delays=lambda: backoff(0.2))
        cluster.start()
        try:
            pid = units[0].engine_pid
            assert pid is not None
            streams = [cluster.submit(ClusterRequest(f"r{i}", [1 + i] * 24, LONG)) for i in range(40)]
            reads = [asyncio.ensure_future(read_all(s)) for s in streams]
            on_0 = [s for s in streams if s.unit_id == 0]
            await wait_until(lambda: sum(len(s.output_token_ids) for s in on_0) >= 2 * len(on_0), 60)
            assert not any(s.done for s in on_0)

            reply = await hub.handle_async(FailUnit(unit_id=0, reason="maintenance", token=TOKEN, control_id="a"),
                                         who="op")
            assert isinstance(reply, OkReply) and isinstance(reply.payload, ControlAudit)
            assert [(s.unit_id, s.mode) for s in reply.payload.new] == [(0, "failed")]
            assert node.unit_modes == ["failed", "active"] and cluster.failed[0] == "failed by op: maintenance"
            assert hub.status().units[0].failure == "failed by op: maintenance"
            assert cluster.num_evacuated == len(on_0)  # none was done: the fail-unit came between two tokens
            assert await asyncio.wait_for(asyncio.gather(*reads), 120) == [LONG] * len(streams)
            assert {(await s.wait()).unit_id for s in on_0} == {1}

            await asyncio.sleep(0.6)  # a failure's backoff would have restarted it by now: this one waits
            assert 0 in cluster.failed and cluster.num_restarts == 0
            assert units[0].engine_pid == pid and _alive(pid) and not units[0].failed

            again = await hub.handle_async(FailUnit(unit_id=0, token=TOKEN, control_id="b"), who="op")
            assert isinstance(again, ErrorReply) and "unit 0 has failed already" in again.message
            active = await hub.handle_async(RecoverUnit(unit_id=1, token=TOKEN, control_id="c"), who="op")
            assert isinstance(active, ErrorReply) and "unit 1 has not failed" in active.message

            back = await hub.handle_async(RecoverUnit(unit_id=0, token=TOKEN, control_id="d"), who="op")
            assert isinstance(back, OkReply) and isinstance(back.payload, ControlAudit)
            assert [(s.unit_id, s.mode) for s in back.payload.new] == [(0, "active")]
            assert node.unit_modes == ["active", "active"] and not cluster.failed
            assert units[0].engine_pid == pid and cluster.num_restarts == 0  # the same engine, not restarted
            after = [cluster.submit(ClusterRequest(f"b{i}", [7 + i] * 16, MAX_TOKENS)) for i in range(4)]
            assert await asyncio.wait_for(asyncio.gather(*(read_all(s) for s in after)), 60) == [MAX_TOKENS] * 4
            assert {(await s.wait()).unit_id for s in after} == {0, 1}
            assert _unit_alerts(hub, 0) == [AlertCode.UNIT_FAILED, AlertCode.UNIT_RESTARTED]
        finally:
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_a_unit_failed_on_request_whose_engine_dies_is_restarted_only_by_recover_unit() -> None:
    async def main() -> None:
        units = [fake_unit(i) for i in range(2)]
        for u in units:
            u.start()
        cluster, node, hub = _node(units, restart_delays=lambda: backoff(0.1))
        cluster.start()
        try:
            old_pid = units[0].engine_pid
            assert old_pid is not None
            assert cluster.fail_unit(0, "drill") == 0
            os.kill(old_pid, signal.SIGKILL)
            await wait_until(lambda: units[0].failed, 5)  # its watchdog saw the death...
            await asyncio.sleep(0.5)
            assert cluster.failed[0] == "drill" and cluster.num_restarts == 0  # ...and nothing restarted it

            # waits for the restart
            back = await hub.handle_async(RecoverUnit(unit_id=0, token=TOKEN, control_id="e"), who="op")
            assert isinstance(back, OkReply), back
            assert node.unit_modes == ["active", "active"] and cluster.num_restarts == 1
            assert units[0].engine_pid not in (None, old_pid) and not units[0].failed
            after = [cluster.submit(ClusterRequest(f"b{i}", [7 + i] * 16, MAX_TOKENS)) for i in range(4)]
            assert await asyncio.wait_for(asyncio.gather(*(read_all(s) for s in after)), 60) == [MAX_TOKENS] * 4
            assert {(await s.wait()).unit_id for s in after} == {0, 1}
            assert _unit_alerts(hub, 0) == [AlertCode.UNIT_FAILED, AlertCode.UNIT_RESTARTED]
        finally:
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_a_hung_engine_core_is_killed_and_its_requests_go_on() -> None:
    async def main() -> None:
        # Unit 1's limit stays long: on a loaded test machine its loop may stall, and it is not the one hung.
        units = [fake_unit(0, hang_s=1.0), fake_unit(1, hang_s=30.0)]
        for u in units:
            u.start()
        cluster, node, hub = _node(units)
        cluster.start()
        pid, proc = units[0].engine_pid, units[0]._engine_process()
        assert pid is not None
        try:
            streams = [cluster.submit(ClusterRequest(f"r{i}", [1 + i % 900] * 24, LONG)) for i in range(100)]
            reads = [asyncio.ensure_future(read_all(s)) for s in streams]
            on_0 = [s for s in streams if s.unit_id == 0]
            await wait_until(lambda: sum(len(s.output_token_ids) for s in on_0) >= 2 * len(on_0), 60)
            assert not any(s.done for s in on_0)
            os.kill(pid, signal.SIGSTOP)  # alive, but it makes no step any more
            took_s = await wait_until(lambda: 0 in cluster.failed, 10)
            assert 0.8 <= took_s < 3.0, f"the hang took {took_s:.2f} s to notice (hang_s 1)"
            assert "engine core hung" in cluster.failed[0] and f"process {pid} killed" in cluster.failed[0]
            assert node.unit_modes == ["failed", "active"] and 1 not in cluster.failed
            moved = {s.request_id for s in on_0 if not s.done}  # those done came out of the pipe before the stop
            assert len(moved) > len(on_0) // 2 and cluster.num_evacuated == len(moved)
            await wait_until(lambda: proc.exitcode == -signal.SIGKILL, 10)

            assert await asyncio.wait_for(asyncio.gather(*reads), 120) == [LONG] * len(streams)
            outcomes = [await s.wait() for s in streams]
            assert all(o.output_tokens == LONG and o.prompt_tokens == 24 for o in outcomes)
            assert all(o.unit_id == 1 for o in outcomes if o.request_id in moved)
            assert _unit_alerts(hub, 0) == [AlertCode.UNIT_FAILED]
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_a_paused_or_idle_unit_is_not_hung_and_a_paused_one_fails_and_recovers() -> None:
    async def main() -> None:
        unit = fake_unit(0, hang_s=0.5)
        unit.start()
        cluster, node, _ = _node([unit])
        cluster.start()
        try:
            await asyncio.sleep(1.0)  # idle: nothing in flight
            stream = cluster.submit(ClusterRequest("p", [3] * 16, 4000))
            await wait_until(lambda: len(stream.output_token_ids) >= 4, 30)
            node.set_unit_mode(0, "paused")
            assert (await node.settle(10.0)).refused == ()
            await asyncio.sleep(1.2)  # in flight on a paused engine: no step, on purpose
            assert not cluster.failed and unit.live and not stream.done
            assert node.fail_unit(0) == 1 and list(cluster.pending) == ["p"]  # nowhere to go: it waits
            assert (await node.settle(10.0)).refused == () and not unit.paused  # the failed unit's engine resumed
            node.recover_unit(0)
            assert node.unit_modes == ["active"] and not cluster.pending and stream.unit_id == 0
            await wait_until(lambda: len(stream.output_token_ids) >= 100, 30)
            assert not cluster.failed and stream.abort()
        finally:
            await cluster.close()
            await unit.stop()

    asyncio.run(main())


def test_requests_no_unit_takes_are_rejected_after_the_pending_timeout() -> None:
    async def main() -> None:
        units = [fake_unit(i) for i in range(2)]
        for u in units:
            u.start()
        cluster, node, hub = _node(units, pending_timeout_s=0.5)  # no restart_delays: --no-restart
        cluster.start()
        try:
            for u in units:
                pid = u.engine_pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
            await wait_until(lambda: len(cluster.failed) == 2, 5)
            t0 = time.monotonic()
            streams = [cluster.submit(ClusterRequest(f"w{i}", [5] * 16, MAX_TOKENS)) for i in range(3)]
            for s in streams:
                with pytest.raises(RequestRejected, match=r"no unit took the request within 0\.5 s") as caught:
                    await asyncio.wait_for(s.wait(), 10)
                assert isinstance(caught.value, PendingTimeout)
            waited_s = time.monotonic() - t0
            assert 0.45 <= waited_s < 2.0, waited_s
            assert cluster.num_rejected == node.num_rejected == 3 and not cluster.pending and not cluster.streams
            refused = [e for e in hub.replay.since(0).events if isinstance(e, RequestRefused)]
            assert [(e.request_id, e.reason, e.unit_id) for e in refused] == [
                (f"w{i}", "pending_timeout", None) for i in range(3)]
        finally:
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_pending_timeout_counts_from_when_a_request_starts_waiting() -> None:
    """Without engines (the units never start) and with the cluster's clock in hand: a request waits at most
    ``pending_timeout_s`` from its arrival; one back from a failed unit from then; None waits for ever."""
    now = [1000.0]

    async def main() -> None:
        units = [fake_unit(i) for i in range(2)]
        cluster = LiveCluster(units, DISPATCH_POLICIES["least_loaded"](), ttft_slo_s=5.0, tpot_slo_s=1.0,
                              clock=lambda: now[0], pending_timeout_s=2.0)
        for uid in (0, 1):
            cluster.fail_unit(uid)
        a = cluster.submit(ClusterRequest("a", [1] * 8, 4))
        now[0] += 1.5
        b = cluster.submit(ClusterRequest("b", [1] * 8, 4))
        assert cluster._next_check == 1002.0  # the timer is set for a's expiry
        now[0] += 0.5
        cluster.dispatch()
        assert a.done and isinstance(a.error, PendingTimeout) and not b.done and list(cluster.pending) == ["b"]
        assert cluster._next_check == 1003.5
        now[0] += 1.5
        cluster.dispatch()
        assert b.done and cluster.num_rejected == 2 and cluster._next_check is None
        cluster.pending_timeout_s = None
        c = cluster.submit(ClusterRequest("c", [1] * 8, 4))
        now[0] += 1e6
        cluster.dispatch()
        assert not c.done and c.abort()
        for u in units:
            await u.stop()

    asyncio.run(main())


def test_stall_clock() -> None:
    clock = StallClock()
    look = clock.stalled_s
    assert look(0.0, steps=0, finished=0, outputs={}, busy=False) == 0.0
    assert look(1.0, steps=0, finished=0, outputs={"a": 0}, busy=True) == 0.0  # work arrived: the clock starts
    assert look(3.0, steps=0, finished=0, outputs={"a": 0, "b": 0}, busy=True) == 2.0  # an arrival is no progress
    assert look(4.0, steps=0, finished=0, outputs={"a": 1, "b": 0}, busy=True) == 0.0  # a token is
    assert look(6.0, steps=0, finished=0, outputs={"b": 0}, busy=True) == 2.0  # a request leaving is not
    assert look(7.0, steps=1, finished=0, outputs={"b": 0}, busy=True) == 0.0  # a step is
    assert look(8.0, steps=1, finished=1, outputs={}, busy=False) == 0.0
    assert look(9.0, steps=1, finished=1, outputs={"c": 0}, busy=True) == 0.0
    assert look(12.0, steps=1, finished=1, outputs={"c": 0}, busy=False) == 0.0  # paused: not hung
    assert look(12.5, steps=1, finished=1, outputs={"c": 0}, busy=True) == 0.0  # resumed: the clock starts again
    assert look(13.0, steps=1, finished=1, outputs={"c": 0}, busy=True) == 0.5
