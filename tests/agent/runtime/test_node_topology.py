"""Cluster shapes in the node: lockstep steps, the disaggregated hand-over, migrations and unit faults."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from node_builders import make_unit, requests

from agent.engine.base import RequestOutcome, StepRecord
from agent.runtime.node import Node
from agent.runtime.records import MigrationConfig, MigrationRecord
from policies.base import DispatchPolicy
from policies.cost.step_model import StepCoefficients
from policies.registry import make_dispatch_policy
from policies.types import DispatchDecision, Migration, PendingRequest, UnitLoad


class _Scripted(DispatchPolicy):
    """Round robin, plus migrations handed in by the test at given times."""

    name: ClassVar[str] = "scripted"
    rebalances: ClassVar[bool] = True
    needs_requests: ClassVar[bool] = True

    def configure(self) -> None:
        self.moves: list[tuple[float, Migration]] = []
        self.seen: list[Sequence[UnitLoad]] = []
        self._next = 0

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        self.seen.append(units)
        healthy = [u.unit_id for u in units if u.healthy]
        out = []
        for req in pending:
            if not healthy:
                break
            out.append((req.request_id, healthy[self._next % len(healthy)]))
            self._next += 1
        due = [m for t, m in self.moves if t <= now_s]
        self.moves = [(t, m) for t, m in self.moves if t > now_s]
        return DispatchDecision(assignments=tuple(out), migrations=tuple(due))


def _node(units, reqs, dispatcher, **kw) -> tuple[Node, list[StepRecord], list[RequestOutcome], list[MigrationRecord]]:
    steps: list[StepRecord] = []
    done: list[RequestOutcome] = []
    moves: list[MigrationRecord] = []
    node = Node(
        units, dispatcher, reqs, ttft_slo_s=1e9, tpot_slo_s=1e9, on_step=steps.append, on_finish=done.append,
        on_migrate=moves.append, **kw,
    )
    return node, steps, done, moves


def test_lockstep_steps_start_together_and_last_as_long_as_the_slowest() -> None:
    # Step time 1 s + 1 ms per token: a 1,000-token prefill makes unit 0's step 2 s, unit 1's decodes 1.001 s.
    cost = StepCoefficients(1.0, 1e-3, 0.0)
    units = [make_unit(0, cost=cost), make_unit(1, cost=cost)]
    node, steps, done, _ = _node(units, requests([(1000, 2), (1, 3)]), make_dispatch_policy("round_robin"),
                                 lockstep=True)
    node.run()
    assert len(done) == 2
    by_start: dict[float, list[StepRecord]] = {}
    for r in steps:
        by_start.setdefault(r.start_s, []).append(r)
    first = by_start[0.0]
    assert {r.unit_id for r in first} == {0, 1}
    assert all(r.duration_s == pytest.approx(2.0) for r in first)  # the slow unit's step sets the pace
    # Every step start of one unit is a step start of the other while both have work.
    starts0 = [r.start_s for r in steps if r.unit_id == 0]
    starts1 = [r.start_s for r in steps if r.unit_id == 1]
    assert starts1[: len(starts0)] == starts0[: len(starts1)]


def test_a_pass_sync_cost_lengthens_every_lockstep_pass_and_its_tokens_come_out_at_its_end() -> None:
    # The same two units as above with a 0.5 s synchronisation cost per pass (a DP+EP pass's all-to-all):
    # the first pass ends at 2.5 s, the decode-only passes after it last 1.001 + 0.5 s.
    cost = StepCoefficients(1.0, 1e-3, 0.0)
    units = [make_unit(0, cost=cost), make_unit(1, cost=cost)]
    node, steps, done, _ = _node(units, requests([(1000, 2), (1, 3)]), make_dispatch_policy("round_robin"),
                                 lockstep=True, pass_sync_s=0.5)
    node.run()
    first = [r for r in steps if r.start_s == 0.0]
    assert len(first) == 2 and all(r.duration_s == pytest.approx(2.5) for r in first)
    starts = sorted({r.start_s for r in steps})
    assert starts[:3] == [0.0, pytest.approx(2.5), pytest.approx(4.001)]
    assert [o.first_token_s for o in done] == [pytest.approx(2.5)] * 2, "first tokens at the pass's end"
    rr = make_dispatch_policy("round_robin")
    for kw, match in (({"pass_sync_s": 0.5}, "only with lockstep"), ({"pass_sync_s": -1.0, "lockstep": True}, ">= 0")):
        with pytest.raises(ValueError, match=match):
            Node([make_unit(0)], rr, [], ttft_slo_s=1.0, tpot_slo_s=1.0, **kw)


def test_lockstep_a_unit_given_work_during_a_step_joins_the_next_one() -> None:
    # Found by the property test below: unit 1 is idle when the step starts, gets a request during it, and
    # must start with everyone at the step's end (not wait for a step of its own that nobody schedules).
    cost = StepCoefficients(1.0, 0.0, 0.0)
    units = [make_unit(0, cost=cost), make_unit(1, cost=cost)]
    node, steps, done, _ = _node(units, requests([(1, 1), (1, 1)], [0.0, 0.5]), make_dispatch_policy("round_robin"),
                                 lockstep=True)
    node.run()
    assert len(done) == 2
    assert [(r.unit_id, r.start_s) for r in steps] == [(0, 0.0), (1, 1.0)]


def test_lockstep_groups_step_together_inside_and_apart_from_each_other() -> None:
    # Instances {0, 1} and {2, 3}: unit 0's 1,000-token prefill sets its instance's pace (2 s), unit 2's instance
    # runs 1.001 s decode steps and does not wait for the other instance.
    cost = StepCoefficients(1.0, 1e-3, 0.0)
    units = [make_unit(k, cost=cost) for k in range(4)]
    reqs = requests([(1000, 2), (1, 3), (1, 3), (1, 3)])
    node, steps, done, _ = _node(units, reqs, make_dispatch_policy("round_robin"), lockstep_groups=[[0, 1], [2, 3]])
    assert node.lockstep and node.lockstep_groups == ((0, 1), (2, 3))
    assert [node.unit_group(k) for k in range(4)] == [0, 0, 1, 1]
    node.run()
    assert len(done) == 4
    starts = {k: [r.start_s for r in steps if r.unit_id == k] for k in range(4)}
    first = {r.unit_id: r for r in steps if r.start_s == 0.0}
    assert set(first) == {0, 1, 2, 3}
    assert first[1].duration_s == pytest.approx(2.0) and first[3].duration_s == pytest.approx(1.001)
    assert starts[0][:2] == starts[1][:2] == [0.0, pytest.approx(2.0)]
    assert starts[2] == starts[3] == [0.0, pytest.approx(1.001), pytest.approx(2.002)]


def test_lockstep_groups_are_checked_and_shown_to_the_dispatcher() -> None:
    units = [make_unit(k) for k in range(3)]
    rr = make_dispatch_policy("round_robin")
    for groups, match in (([[0, 1], [1, 2]], "two lockstep groups"), ([[0], [7]], "does not have"),
                          ([[0], []], "at least one unit")):
        with pytest.raises(ValueError, match=match):
            Node(units, rr, [], ttft_slo_s=1.0, tpot_slo_s=1.0, lockstep_groups=groups)
    with pytest.raises(ValueError, match="not both"):
        Node(units, rr, [], ttft_slo_s=1.0, tpot_slo_s=1.0, lockstep=True, lockstep_groups=[[0, 1, 2]])
    scripted = _Scripted()
    node, _, done, _ = _node(units, requests([(10, 2)]), scripted, lockstep_groups=[[0, 2]])
    node.run()
    assert len(done) == 1
    # Unit 1 steps on its own; a failed member keeps its instance.
    assert {u.unit_id: u.instance for u in scripted.seen[0]} == {0: 0, 1: None, 2: 0}
    node.fail_unit(2)
    assert {u.unit_id: (u.instance, u.healthy) for u in node._loads(intake=True)}[2] == (0, False)


def test_without_lockstep_the_fast_unit_does_not_wait() -> None:
    cost = StepCoefficients(1.0, 1e-3, 0.0)
    units = [make_unit(0, cost=cost), make_unit(1, cost=cost)]
    node, steps, _, _ = _node(units, requests([(1000, 2), (1, 3)]), make_dispatch_policy("round_robin"))
    node.run()
    assert [r.start_s for r in steps if r.unit_id == 1][1] == pytest.approx(1.001)


def test_disaggregated_prefill_hands_over_with_the_kv_transfer_time() -> None:
    units = [make_unit(0, role="prefill"), make_unit(1, role="decode"), make_unit(2, role="decode")]
    link = MigrationConfig("live", kv_bytes_per_token=1_000_000, bandwidth_gb_s=1.0)  # 1 ms per token
    reqs = requests([(500, 4), (100, 3), (1, 1)])
    node, steps, done, moves = _node(units, reqs, make_dispatch_policy("round_robin"), migration=link)
    node.run()
    assert sorted(o.request_id for o in done) == ["r000", "r001", "r002"]
    outcome = {o.request_id: o for o in done}
    # A one-token request finishes on the prefill unit; the others finish on decode units.
    assert outcome["r002"].unit_id == 0
    assert {outcome["r000"].unit_id, outcome["r001"].unit_id} <= {1, 2}
    handoffs = {m.request_id: m for m in moves}
    assert set(handoffs) == {"r000", "r001"}
    m = handoffs["r000"]
    assert m.reason == "handoff" and m.mechanism == "live" and m.from_unit_id == 0
    assert m.kv_tokens == 500 and m.end_s - m.start_s == pytest.approx(0.5)
    # Decode units never prefill a prompt: their steps are pure decodes (the KV came with the request).
    assert all(r.num_prefill_tokens == 0 for r in steps if r.unit_id != 0)
    assert all(r.num_decode_tokens == 0 for r in steps if r.unit_id == 0)
    assert outcome["r000"].output_tokens == 4


def test_a_disaggregated_node_needs_both_pools() -> None:
    with pytest.raises(ValueError, match="prefill and one decode"):
        Node([make_unit(0, role="prefill"), make_unit(1, role="prefill")], make_dispatch_policy("round_robin"), [],
             ttft_slo_s=1, tpot_slo_s=1)


@pytest.mark.parametrize("mechanism", ["live", "recompute"])
def test_a_migration_moves_a_running_request(mechanism: str) -> None:
    units = [make_unit(0), make_unit(1)]
    disp = _Scripted()
    disp.moves = [(2.5, Migration("r000", 0, 1, "rebalance"))]  # r000 is on unit 0, decoding by then
    link = MigrationConfig(mechanism, kv_bytes_per_token=100_000_000, bandwidth_gb_s=1.0)  # 0.1 s per token
    node, steps, done, moves = _node(units, requests([(3, 8)]), disp, migration=link)
    node.run()
    (outcome,) = done
    assert outcome.unit_id == 1 and outcome.output_tokens == 8
    (m,) = moves
    assert (m.from_unit_id, m.unit_id, m.reason) == (0, 1, "rebalance")
    if mechanism == "live":
        # Asked at the step end at t=3 with 5 tokens in KV: the copy takes 0.5 s, the request decodes on
        # unit 0 meanwhile and switches at the end of unit 0's step at t=4 (its 6 tokens go along).
        assert m.mechanism == "live" and m.start_s == 3.0 and m.end_s == 4.0 and m.kv_tokens == 6
        assert all(r.num_prefill_tokens == 0 for r in steps if r.unit_id == 1)
    else:
        assert m.mechanism == "recompute" and m.kv_tokens == 0 and m.end_s == m.start_s
        # The target recomputes prompt and the outputs produced so far in one prefill.
        first_on_target = next(r for r in steps if r.unit_id == 1)
        assert first_on_target.num_prefill_tokens > 3
    assert node.num_migrations == 1


def test_migration_requests_that_cannot_start_are_counted_not_applied() -> None:
    units = [make_unit(0), make_unit(1)]
    disp = _Scripted()
    disp.moves = [(0.5, Migration("r000", 0, 0)), (0.5, Migration("nope", 0, 1)), (0.5, Migration("r000", 0, 9))]
    node, _, done, moves = _node(units, requests([(3, 4)]), disp)
    node.run()
    assert node.num_migrations_skipped == 3 and not moves and done[0].unit_id == 0


def test_a_failed_unit_loses_nothing_and_comes_back() -> None:
    units = [make_unit(0), make_unit(1)]
    reqs = requests([(8, 10)] * 6)
    node, steps, done, moves = _node(units, reqs, make_dispatch_policy("round_robin"))
    node.advance(3.5)
    on_0 = {rid for rid, s in node.states.items() if s.unit_id == 0}
    assert on_0
    assert node.fail_unit(0) == len(on_0)
    assert all(node.states[r].unit_id == 1 for r in on_0)  # re-dispatched to the healthy unit at once
    assert {m.request_id for m in moves} == on_0 and all(m.mechanism == "lost" for m in moves)
    loads = node._loads(intake=True)
    assert [u.healthy for u in loads] == [False, True]
    with pytest.raises(ValueError, match="failed"):
        node.set_unit_mode(0, "active")
    node.advance(6.0)
    node.recover_unit(0)
    node.run()
    assert sorted(o.request_id for o in done) == sorted(r.request_id for r in reqs)
    assert all(o.output_tokens == 10 for o in done)
    # The recompute after the fault keeps the tokens already produced: none is produced twice.
    first = {o.request_id: o.first_token_s for o in done}
    assert all(first[r] < 3.5 for r in on_0)
    assert not [r for r in steps if r.unit_id == 0 and 3.5 < r.start_s < 6.0]  # a failed unit does not step


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 30), st.floats(0, 20)), min_size=1, max_size=25),
    st.lists(st.tuples(st.floats(0, 30), st.integers(0, 2), st.integers(0, 2), st.integers(0, 24)), max_size=12),
    st.lists(st.tuples(st.floats(0, 30), st.integers(0, 2), st.floats(0.5, 10)), max_size=3),
    st.sampled_from(["live", "recompute"]),
    st.sampled_from(["free", "lockstep", "instances"]),
)
def test_no_request_lost_or_duplicated_across_migrations_and_faults(
    specs: list[tuple[int, int, float]],
    moves: list[tuple[float, int, int, int]],
    faults: list[tuple[float, int, float]],
    mechanism: str,
    shape: str,
) -> None:
    units = [make_unit(k, cost=StepCoefficients(0.05, 1e-4, 0.0), num_blocks=100) for k in range(3)]
    reqs = requests([(p, o) for p, o, _ in specs], [t for _, _, t in specs])
    disp = _Scripted()
    disp.moves = sorted(((t, Migration(f"r{i:03d}", a, b)) for t, a, b, i in moves), key=lambda x: x[0])
    link = MigrationConfig(mechanism, kv_bytes_per_token=10_000_000, bandwidth_gb_s=1.0)  # 10 ms per token
    groups = [[0, 2], [1]] if shape == "instances" else None  # an instance of two, one of one
    node, _, done, _ = _node(units, reqs, disp, migration=link, lockstep=shape == "lockstep", lockstep_groups=groups)
    events = sorted([(t, "fail", u) for t, u, _ in faults] + [(t + d, "recover", u) for t, u, d in faults])
    for t, what, u in events:
        node.advance(t)
        idx = node.unit_index(u)
        if what == "fail" and node.unit_modes[idx] != "failed":
            node.fail_unit(u)
        elif what == "recover" and node.unit_modes[idx] == "failed":
            node.recover_unit(u)
    for u in range(3):
        if node.unit_modes[u] == "failed":
            node.recover_unit(u)
    node.run()
    ids = [o.request_id for o in done]
    assert len(ids) == len(set(ids)) == len(reqs)  # every request finished exactly once
    target = {r.request_id: r.output_tokens for r in reqs}
    assert all(o.output_tokens == target[o.request_id] for o in done)
    assert not node.transfers and not node.pending and not node.unfinished()
