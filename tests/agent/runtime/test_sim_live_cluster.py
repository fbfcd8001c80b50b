"""The live cluster driving simulated units that step on their own (agent/engine/sim_live.py): dispatch, streams,
migration by recompute, engine deaths and restarts, failing and recovering units on request, aborts, pauses, control
messages and the pending timeout, all without vLLM."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator

import pytest
from builders import MoveOne
from node_builders import H100_LIKE, make_unit

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.live import EngineFailed
from agent.engine.sim import SimUnit
from agent.engine.sim_live import WAKE_EARLY_S, SimLiveUnit, token_id
from agent.engine.vllm.messages import SetParams, SetPolicy
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.requests import (
    ClusterRequest,
    PendingTimeout,
    RequestAborted,
    RequestRejected,
    RequestStream,
)
from agent.runtime.records import MigrationRecord
from agent.workload.types import RequestSpec
from policies.cost.step_model import StepCoefficients
from policies.registry import BATCH_POLICIES, make_dispatch_policy

FAST = StepCoefficients(2e-3, 1e-6, 0.0)
"""2 ms a step plus 1 us a token: a 200-token prompt's prefill and a few dozen decodes take a fraction of a second."""


def sim_units(n: int, policy: str = "vllm", cost: StepCoefficients = FAST, *, num_blocks: int = 2_000,
              max_model_len: int | None = None) -> list[SimLiveUnit]:
    def maker(unit_id: int) -> Callable[[], SimUnit]:
        return lambda: make_unit(unit_id, policy, cost=cost, num_blocks=num_blocks, max_num_seqs=32,
                                 max_model_len=max_model_len)

    return [SimLiveUnit(maker(i)) for i in range(n)]


def prompt(n: int) -> list[int]:
    return [1000 + i for i in range(n)]


async def drain(stream: RequestStream) -> list[int]:
    tokens: list[int] = []
    async for delta in stream:
        tokens.extend(delta.token_ids)
    return tokens


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def quick_restarts() -> Iterator[float]:
    return iter([0.01] * 5)


def test_requests_stream_every_token_and_finish_with_their_outcomes() -> None:
    async def main() -> None:
        units = sim_units(2)
        for u in units:
            u.start()
        async with LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1) as cluster:
            streams = [cluster.submit(ClusterRequest(f"r{i}", prompt(50 + 10 * i), 8 + i)) for i in range(6)]
            tokens = await asyncio.gather(*(drain(s) for s in streams))
            outcomes = [await s.wait() for s in streams]
        for i, (toks, out) in enumerate(zip(tokens, outcomes, strict=True)):
            assert toks == [token_id(j) for j in range(8 + i)]
            assert out.output_tokens == 8 + i and out.prompt_tokens == 50 + 10 * i
            assert out.unit_id == i % 2
            assert out.arrival_s < out.first_token_s <= out.finish_s
            assert out.max_tpot_s is not None and out.max_tpot_s > 0
        assert all(u.num_steps > 0 and not u.live for u in units)
        assert not any(u.sim.has_work() for u in units)

    run(main)


@pytest.mark.parametrize("after", [0, 10])
def test_a_migration_by_recompute_keeps_the_stream_whole(after: int) -> None:
    async def main() -> None:
        units = sim_units(2)
        for u in units:
            u.start()
        policy = MoveOne("m", after)
        cluster = LiveCluster(units, policy, ttft_slo_s=1.0, tpot_slo_s=0.1)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units])
        moves: list[MigrationRecord] = []
        node.on_migrate = moves.append
        async with cluster:
            stream = cluster.submit(ClusterRequest("m", prompt(200), 40))
            tokens = await drain(stream)
            outcome = await stream.wait()
        assert policy.asked
        assert tokens == [token_id(j) for j in range(40)]  # no gap, no repeat: ids follow the token's index
        assert outcome.unit_id == 1 and outcome.output_tokens == 40 and outcome.prompt_tokens == 200
        assert stream.num_migrations == 1 and [(m.from_unit_id, m.unit_id) for m in moves] == [(0, 1)]
        assert not units[0].sim.has_request("m") and not units[1].sim.has_request("m")

    run(main)


def restarting(units: list[SimLiveUnit]) -> tuple[LiveCluster[SimLiveUnit], LiveClusterNode, list[tuple[int, str]],
                                                  list[tuple[int, str]]]:
    """The units started, under ``round_robin`` with quick restarts, with the node's faults and recoveries noted."""
    for u in units:
        u.start()
    cluster = LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1,
                          restart_delays=quick_restarts)
    node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units])
    faults: list[tuple[int, str]] = []
    recovered: list[tuple[int, str]] = []
    node.on_fault = lambda uid, why: faults.append((uid, why))
    node.on_recover = lambda uid, how: recovered.append((uid, how))
    return cluster, node, faults, recovered


def test_a_killed_engine_loses_no_request_and_restarts() -> None:
    async def main() -> None:
        units = sim_units(2)
        cluster, node, faults, recovered = restarting(units)
        serving: list[int] = []
        cluster.serving_listeners.append(serving.append)
        async with cluster:
            streams = [cluster.submit(ClusterRequest(f"r{i:02d}", prompt(64), 30)) for i in range(40)]
            await until(lambda: any(units[1].live[r].outputs for r in units[1].live), "tokens on unit 1")
            units[1].kill("engine core process 4242 exited with code -9")
            await until(lambda: serving == [1], "the listeners told of the failure")
            tokens = await asyncio.gather(*(drain(s) for s in streams))
            outcomes = [await s.wait() for s in streams]
            await until(lambda: bool(recovered), "the restart")
        assert all(t == [token_id(j) for j in range(30)] for t in tokens)  # every request whole, none lost
        assert all(o.output_tokens == 30 for o in outcomes)
        assert cluster.num_evacuated > 0 and all(o.unit_id == 0 for o in outcomes[1::2])
        assert faults == [(1, "engine core process 4242 exited with code -9")]
        assert recovered == [(1, "restarted (attempt 1)")]  # no engine process to name
        assert cluster.num_restarts == 1 and not units[1].failed and node.unit_modes == ["active", "active"]
        assert serving == [1, 2]

    run(main)


def test_a_hung_engine_is_found_killed_and_restarted_and_loses_no_request() -> None:
    async def main() -> None:
        units = sim_units(2)
        units[1].hang_s, units[1].watch_interval_s = 0.2, 0.02
        cluster, _, faults, _ = restarting(units)
        async with cluster:
            streams = [cluster.submit(ClusterRequest(f"r{i:02d}", prompt(64), 30)) for i in range(20)]
            await until(lambda: any(units[1].live[r].outputs for r in units[1].live), "tokens on unit 1")
            units[1].hang()  # alive, no progress: nothing fails until the watchdog sees it
            await asyncio.sleep(0.1)
            assert not units[1].failed and not faults
            tokens = await asyncio.gather(*(drain(s) for s in streams))
            await until(lambda: cluster.num_restarts == 1 and not units[1].failed, "the restart")
        assert all(t == [token_id(j) for j in range(30)] for t in tokens)  # every request whole, none lost
        ((uid, why),) = faults
        assert uid == 1 and why.startswith("engine hung: no step for ") and "request(s) in flight" in why
        stalled = float(why.removeprefix("engine hung: no step for ").split(" s ")[0])
        assert 0.2 <= stalled < 2.0
        assert not units[1].hung and units[1].progress()[0] > 0  # restarted: it steps again

    run(main)


def test_an_idle_or_paused_unit_is_no_hang() -> None:
    async def main() -> None:
        (unit,) = sim_units(1)
        unit.hang_s, unit.watch_interval_s = 0.05, 0.01
        unit.start()
        unit.hang()  # no requests: nothing to make progress on
        await asyncio.sleep(0.2)
        assert not unit.failed
        task = unit.submit("p", prompt(16), 4, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
        await unit.pause()  # paused on purpose: no progress expected
        await asyncio.sleep(0.2)
        assert not unit.failed
        await unit.resume()  # now a request waits on an engine that makes no progress
        with pytest.raises(EngineFailed, match="engine hung"):
            await task
        await unit.stop()

    run(main)


def test_a_request_on_a_dead_engine_fails_with_engine_failed() -> None:
    async def main() -> None:
        (unit,) = sim_units(1)
        failed: list[tuple[int, str]] = []
        unit.on_failed = lambda uid, why: failed.append((uid, why))
        unit.start()
        running = unit.submit("w", prompt(10), 1000, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
        await until(lambda: unit.live["w"].outputs > 0, "tokens")
        unit.kill()
        with pytest.raises(EngineFailed):  # the request under way fails with its engine
            await running
        task = unit.submit("x", prompt(10), 4, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
        with pytest.raises(EngineFailed):  # and so does one sent to the dead engine
            await task
        assert failed == [(0, "engine killed")]
        assert unit.check_engine() == "engine killed" and not unit.live
        await unit.restart()
        outcome = await unit.submit("y", prompt(10), 4, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
        assert outcome.output_tokens == 4 and unit.check_engine() is None
        await unit.stop()

    run(main)


def test_fail_and_recover_a_unit_on_request() -> None:
    async def main() -> None:
        units = sim_units(2)
        for u in units:
            u.start()
        async with LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0,
                               tpot_slo_s=0.1) as cluster:
            serving: list[int] = []
            cluster.serving_listeners.append(serving.append)
            streams = [cluster.submit(ClusterRequest(f"r{i}", prompt(64), 40)) for i in range(8)]
            await until(lambda: bool(units[0].live), "requests on unit 0")
            moved = cluster.fail_unit(0)
            assert serving == [1]  # its engine runs, but it serves no more
            assert moved > 0 and not cluster.accepting[0] and 0 in cluster.failed
            assert all(s.unit_id in (None, 1) for s in streams)
            tokens = await asyncio.gather(*(drain(s) for s in streams))
            assert all(t == [token_id(j) for j in range(40)] for t in tokens)
            assert cluster.recover_unit(0) is None  # its engine ran all along: back at once
            assert cluster.accepting[0] and not cluster.failed and serving == [1, 2]
            later = cluster.submit(ClusterRequest("later", prompt(10), 3))
            assert (await later.wait()).output_tokens == 3

    run(main)


def test_an_aborted_request_leaves_its_unit() -> None:
    async def main() -> None:
        units = sim_units(1, cost=StepCoefficients(0.02, 0.0, 0.0))
        units[0].start()
        async with LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1) as cluster:
            stream = cluster.submit(ClusterRequest("a", prompt(20), 1000))
            await until(lambda: units[0].live.get("a") is not None and units[0].live["a"].outputs > 2, "tokens")
            assert cluster.abort("a")
            with pytest.raises(RequestAborted):
                await stream.wait()
            await until(lambda: not units[0].sim.has_request("a"), "the request to leave the unit")
            assert not units[0].live and cluster.num_aborted == 1

    run(main)


def test_a_paused_unit_takes_no_step_until_resumed() -> None:
    async def main() -> None:
        (unit,) = sim_units(1)
        unit.start()
        await unit.pause()
        task = unit.submit("p", prompt(10), 5, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
        await asyncio.sleep(0.1)
        assert unit.num_steps == 0 and not task.done()
        await unit.resume()
        assert (await task).output_tokens == 5 and unit.num_steps >= 5
        await unit.stop()

    run(main)


def test_control_messages_change_the_units_policy_and_a_bad_one_changes_nothing() -> None:
    async def main() -> None:
        (unit,) = sim_units(1)
        unit.start()
        reply = await unit.reply(unit.send_control(SetPolicy(name="sarathi", params={"token_budget": 256})))
        assert reply.ok and reply.policy == "sarathi" and unit.sim.policy.name == "sarathi"
        assert reply.params["token_budget"] == 256
        bad = await unit.reply(unit.send_control(SetPolicy(name="no_such_policy")))
        assert not bad.ok and "no_such_policy" in bad.error and unit.sim.policy.name == "sarathi"
        wrong = await unit.reply(unit.send_control(SetParams(changes={"token_budget": -5})))
        assert not wrong.ok and unit.sim.policy.params["token_budget"] == 256
        fine = await unit.reply(unit.send_control(SetParams(changes={"token_budget": 512})))
        assert fine.ok and fine.old == {"token_budget": 256} and unit.sim.policy.params["token_budget"] == 512
        await unit.stop()

    run(main)


def test_the_nodes_policy_swap_reaches_the_engine_and_survives_a_restart() -> None:
    async def main() -> None:
        units = sim_units(1)
        units[0].start()
        cluster = LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1,
                              restart_delays=quick_restarts)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]()])
        async with cluster:
            node.units[0].set_policy(BATCH_POLICIES["fairbatching"]())
            settled = await node.settle(5.0)
            assert not settled.refused and units[0].sim.policy.name == "fairbatching"
            units[0].kill()
            await until(lambda: node.unit_modes[0] == "active" and not units[0].failed, "the restart")
            await node.settle(5.0)
            # the fresh engine started with the launch policy; the node gave it the current one again
            assert units[0].sim.policy.name == "fairbatching"

    run(main)


def test_a_request_no_unit_takes_is_rejected_after_the_pending_timeout() -> None:
    async def main() -> None:
        units = sim_units(1)
        units[0].start()
        async with LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1,
                               pending_timeout_s=0.05) as cluster:
            cluster.fail_unit(0)
            stream = cluster.submit(ClusterRequest("w", prompt(10), 3))
            with pytest.raises(PendingTimeout):
                await stream.wait()
            assert cluster.num_rejected == 1

    run(main)


def test_the_unit_keeps_its_own_clock() -> None:
    """Steps last what the unit's timer says and run back to back on the unit's clock, as an engine core's do, however
    late the event loop gets to their outputs (here: 20 ms a step, 41 of them for one request)."""
    async def main() -> None:
        (unit,) = sim_units(1, cost=StepCoefficients(0.02, 0.0, 0.0))
        steps: list[StepRecord] = []
        unit.on_step = lambda uid, rec: steps.append(rec)
        unit.start()
        outcome = await unit.submit("t", prompt(10), 41, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
        await unit.stop()
        assert outcome.output_tokens == 41 and len(steps) == 41
        assert all(r.duration_s == pytest.approx(0.02, abs=1e-6) for r in steps)
        assert all(b.start_s == pytest.approx(a.start_s + a.duration_s, abs=1e-6) for a, b in itertools.pairwise(steps))
        assert outcome.first_token_s >= steps[0].start_s + 0.02 and outcome.finish_s >= steps[-1].start_s + 0.02
        assert unit.late_s >= 0 and unit.num_steps == 41

    run(main)


def test_the_live_node_replays_a_workload_and_reports_it_in_node_time() -> None:
    """What the hub hears from a live node over simulated live units: every request finishes once, step records and
    outcomes in node seconds (since the node's origin), and the unit's preemptions under a small KV cache."""
    async def main() -> None:
        units = sim_units(2, num_blocks=40, max_model_len=320)
        for u in units:
            u.start()
        work = [RequestSpec(f"q{i:02d}", 0.005 * i, 120, 60) for i in range(24)]
        cluster = LiveCluster(units, make_dispatch_policy("least_loaded"), ttft_slo_s=1.0, tpot_slo_s=0.1)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units], requests=work)
        finished: list[RequestOutcome] = []
        steps: list[StepRecord] = []
        preempted: list[str] = []
        node.on_finish = finished.append
        node.on_step = steps.append
        node.on_preempt = lambda rec, ids: preempted.extend(ids)
        done = asyncio.Event()
        serving = asyncio.get_running_loop().create_task(node.serve(done))
        await asyncio.wait_for(done.wait(), 20)
        serving.cancel()
        await node.close()
        assert sorted(o.request_id for o in finished) == [s.request_id for s in work]
        assert all(o.output_tokens == 60 and o.prompt_tokens == 120 for o in finished)
        elapsed = node.now_s + WAKE_EARLY_S  # a step's end is on the unit's clock, at most this ahead of the wall's
        assert all(0 <= o.arrival_s < o.first_token_s <= o.finish_s <= elapsed for o in finished)
        assert steps and all(0 <= r.start_s <= elapsed for r in steps)
        assert preempted and set(preempted) <= {s.request_id for s in work}  # 40 blocks of 16 hold 4 of these
        assert node.num_finished == 24 and sum(o.num_preemptions for o in finished) == len(preempted)

    run(main)


def test_the_admission_budget_is_consulted_at_dispatch() -> None:
    """FairBatching+PAB on a live unit: once the unit reported a budget, a burst of long prompts takes it and the
    rest are refused at dispatch (``refused_by``, a retry hint), none lost."""
    async def main() -> None:
        units = sim_units(1, "fairbatching+pab", H100_LIKE, num_blocks=20_000)
        units[0].start()
        cluster = LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=0.5, tpot_slo_s=0.05)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["fairbatching+pab"]()])
        async with cluster:
            first = cluster.submit(ClusterRequest("warm", prompt(100), 200))
            await until(lambda: units[0].num_steps > 0 and units[0].load().prefill_admission_budget is not None,
                        "a reported budget")
            budget = units[0].load().prefill_admission_budget
            assert budget is not None and 0 < budget < 40 * 6000
            burst = [cluster.submit(ClusterRequest(f"b{i:02d}", prompt(6000), 4)) for i in range(40)]
            results = await asyncio.gather(*(s.wait() for s in burst), return_exceptions=True)
            await first.wait()
        refused = [r for r in results if isinstance(r, RequestRejected)]
        served = [r for r in results if isinstance(r, RequestOutcome)]
        assert refused and served and len(refused) + len(served) == 40
        assert all(r.refused_by == 0 and r.retry_after_s == 0.5 for r in refused)
        assert node.num_refused == cluster.num_refused == len(refused)
        assert sum(6000 for _ in served) <= budget + 6000  # no more admitted than the budget held (the last may cross)

    run(main)
