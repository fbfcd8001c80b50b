"""The trackside scheduler inside real vLLM 0.26.0 schedulers (CPU, fake model outputs).

* Under the ``vllm`` policy the enforced plan is exactly vLLM's own schedule, step by step (same tokens per
  request, same admissions, same preemptions), sync and async, on randomized request streams.
* Every other policy's plan is enforced: the scheduled tokens are the plan's, budgets hold, held-back decodes
  stay running without being preempted, exclusive steps have one kind of work, chunk caps hold.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm_harness import Arrival, Shape, drive, make_scheduler, random_stream

from agent.engine.vllm.channel import ControlSender
from agent.engine.vllm.config import KEY, UnitSettings, unit_settings
from agent.engine.vllm.messages import ControlReply, SetParams, SetPolicy, StepMessage
from agent.engine.vllm.scheduler import PolicyAsyncScheduler, PolicyScheduler
from policies.types import StepPlan

pytestmark = pytest.mark.vllm


def _ours(shape: Shape, policy: str = "vllm", params: dict[str, object] | None = None, *,
          native: bool = False) -> Scheduler:
    """Our scheduler with ``policy``. The ``vllm`` policy's own plans decide unless ``native`` (the agent's default:
    vLLM's scheduler decides that policy's steps), so that these tests check the policy, not vLLM against itself."""
    cls = PolicyAsyncScheduler if shape.async_scheduling else PolicyScheduler
    sched = make_scheduler(cls, shape, {KEY: UnitSettings(policy=policy, params=params or {}).as_config()})
    sched.ts_native_steps = native
    return sched


def _theirs(shape: Shape) -> Scheduler:
    return make_scheduler(AsyncScheduler if shape.async_scheduling else Scheduler, shape)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_vllm_policy_reproduces_vllm_step_by_step(async_scheduling: bool, seed: int) -> None:
    # Half the seeds with a KV cache small enough to preempt.
    shape = Shape(async_scheduling=async_scheduling, num_blocks=60 if seed % 2 else 200)
    stream = random_stream(seed)
    lag = int(async_scheduling)
    theirs = drive(_theirs(shape), stream, lag=lag)
    ours = drive(_ours(shape), stream, lag=lag)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert a == b, f"step {i} differs"
    if seed % 2:
        assert any(t.preempted for t in theirs), "the small cache should preempt"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    budget=st.sampled_from([64, 128, 512]),
    seqs=st.integers(2, 24),
    blocks=st.integers(40, 300),
    threshold=st.sampled_from([0, 48]),
    async_scheduling=st.booleans(),
)
def test_vllm_policy_equality_property(seed: int, budget: int, seqs: int, blocks: int, threshold: int,
                                       async_scheduling: bool) -> None:
    shape = Shape(max_num_batched_tokens=budget, max_num_seqs=seqs, num_blocks=blocks,
                  async_scheduling=async_scheduling, long_prefill_token_threshold=threshold)
    stream = random_stream(seed, n=25, steps=20, max_prompt=500, max_out=30)
    lag = int(async_scheduling)
    params = {"long_prefill_token_threshold": threshold}
    assert drive(_ours(shape, params=params), stream, lag=lag) == drive(_theirs(shape), stream, lag=lag)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["vllm", "sarathi", "eb", "static"])
@pytest.mark.parametrize("seed", range(3))
def test_steps_that_skip_the_per_request_cap_hook_schedule_what_the_hook_would(async_scheduling: bool, policy: str,
                                                                                seed: int) -> None:
    """The cap hook is skipped in a step where it would change nothing (every running request decodes and is
    planned, no admission possible: ``_ts_caps_bind``). Driven with the hook always on, the same requests give the
    same steps, and the skip happened (few sequences, so that the running set fills)."""
    shape = Shape(async_scheduling=async_scheduling, max_num_seqs=4, num_blocks=60 if seed % 2 else 400)
    stream = random_stream(seed, n=30, max_prompt=300, max_out=30)
    lag = int(async_scheduling)
    gated, always = _ours(shape, policy), _ours(shape, policy)
    skipped: list[bool] = []
    bind = gated._ts_caps_bind

    def counted(caps: dict[str, int], num_running: int) -> bool:
        need = bind(caps, num_running)
        skipped.append(not need)
        return need

    gated._ts_caps_bind = counted  # type: ignore[method-assign]
    always._ts_caps_bind = lambda caps, num_running: True  # type: ignore[method-assign]
    assert drive(gated, stream, lag=lag) == drive(always, stream, lag=lag)
    assert any(skipped) and not all(skipped)


def test_vllm_requests_compare_by_identity() -> None:
    """``_ts_waiting`` keeps the waiting views while a tuple of the queue's requests compares equal to the last one:
    that is an identity check only while vLLM's ``Request`` defines no ``__eq__`` of its own."""
    from vllm.v1.request import Request

    assert Request.__eq__ is object.__eq__


_RECORD_FIELDS = ("step_id", "mode", "policy", "num_prefill_tokens", "num_decode_tokens", "num_prefill_reqs",
                  "num_decode_reqs", "context_tokens", "budget_tokens", "kv_used_blocks", "num_running",
                  "num_waiting", "num_preempted", "num_finished", "preempted", "admission_budget",
                  "queued_prefill_tokens")
"""A step record's fields that do not depend on the clock."""


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("blocks", "threshold"), [(400, 0), (400, 48), (60, 0)])
@pytest.mark.parametrize("seed", range(3))
def test_native_steps_decide_and_record_what_the_vllm_policy_would(async_scheduling: bool, blocks: int,
                                                                   threshold: int, seed: int) -> None:
    """The ``vllm`` policy with its defaults lets vLLM's own scheduler decide (no view, plan or caps on the
    critical path): the same steps as the policy's own plans and the same step records, reasons included while
    KV blocks suffice. Where they run out (60 blocks) vLLM may not take an admission the policy planned: the
    scheduled tokens still agree, and a native step's reasons count what vLLM admitted."""
    shape = Shape(async_scheduling=async_scheduling, num_blocks=blocks, long_prefill_token_threshold=threshold)
    stream = random_stream(seed, n=30, max_prompt=500, max_out=30)
    lag = int(async_scheduling)
    params = {"long_prefill_token_threshold": threshold}
    native, planned = _ours(shape, params=params, native=True), _ours(shape, params=params)
    assert native._ts_native() and not planned._ts_native()
    planned_plans = _Recorder(planned)
    trace_native, trace_planned = drive(native, stream, lag=lag), drive(planned, stream, lag=lag)
    assert trace_native == trace_planned
    assert planned_plans.plans, "the planned side asked its policy"
    records = [[r for r in s.ts_sink.records if isinstance(r, StepMessage)] for s in (native, planned)]
    assert len(records[0]) == len(records[1]) == sum(1 for t in trace_native if t.scheduled)
    for a, b in zip(*records, strict=True):
        assert [getattr(a, f) for f in _RECORD_FIELDS] == [getattr(b, f) for f in _RECORD_FIELDS]
        assert set(a.reasons) == set(b.reasons) and a.reasons["budget_tokens"] == b.reasons["budget_tokens"]
        if blocks == 400:
            assert a.reasons == b.reasons
    if blocks == 60:
        assert any(t.preempted for t in trace_native), "the small cache should preempt"
        # vLLM admitted what the native reasons say: running after = running before + admitted - preempted.
        for a in records[0]:
            assert 0 <= a.reasons["admitted"] <= a.num_prefill_reqs


def test_the_default_vllm_policy_on_an_engine_with_a_prefill_threshold_schedules_as_vllm() -> None:
    """vLLM caps every prefill chunk at the engine's ``long_prefill_token_threshold``. The ``vllm`` policy with its
    default threshold (0, no cap of its own) is native there, so it schedules exactly as vLLM's scheduler: planned
    by the policy itself, the uncapped chunks left budget unused and admitted fewer requests."""
    shape = Shape(long_prefill_token_threshold=48, num_blocks=400)
    stream = random_stream(0, n=30, max_prompt=500, max_out=30)
    theirs = drive(_theirs(shape), stream)
    assert drive(_ours(shape, native=True), stream) == theirs
    assert drive(_ours(shape, native=False), stream) != theirs  # what the policy's own plans did


def test_a_vllm_policy_that_differs_from_the_engines_defaults_plans_its_own_steps() -> None:
    """Only the ``vllm`` policy as vLLM itself would run it is native: a token cap or a prefill threshold other
    than the engine's, or any other policy, plans every step."""
    shape = Shape(long_prefill_token_threshold=48)
    assert _ours(shape, params={"long_prefill_token_threshold": 48}, native=True)._ts_native()
    assert _ours(shape, native=True)._ts_native()  # 0, "no cap": the engine caps at its 48 anyway
    assert not _ours(shape, params={"long_prefill_token_threshold": 32}, native=True)._ts_native()
    assert not _ours(Shape(), params={"max_num_batched_tokens": 128}, native=True)._ts_native()
    assert not _ours(Shape(), "sarathi", native=True)._ts_native()
    sched = _ours(Shape(), native=True)
    assert sched._ts_native()
    sched._ts_control(SetParams(changes={"max_num_batched_tokens": 64}, id="1"))
    assert not sched._ts_native()
    recorder = _Recorder(sched)
    drive(sched, random_stream(2, n=6, max_prompt=200, max_out=5))
    assert recorder.plans and all(p.token_budget == 64 for p in recorder.plans)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_per_request_state_leaves_with_the_request(native: bool, async_scheduling: bool) -> None:
    """The scheduler's per-request state (SLOs, first-token times) is dropped when vLLM frees a request, finished
    or aborted, so an engine that serves for months holds only what is in flight."""
    shape = Shape(async_scheduling=async_scheduling, num_blocks=400)
    sched = _ours(shape, "fairbatching" if not native else "vllm", native=native)
    stream = random_stream(3, n=20, max_prompt=300, max_out=10)
    aborted: list[str] = []

    def abort_one(step: int) -> None:
        if step == 4:
            victim = next(iter(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.append(victim)

    trace = drive(sched, stream, lag=int(async_scheduling), before_step=abort_one)
    assert aborted and any(t.finished for t in trace)
    assert not sched.requests
    assert sched.ts_slo == {} and sched.ts_first_token == {}


class _Recorder:
    """Wraps a scheduler's policy to capture each plan next to what vLLM scheduled."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.plans: list[StepPlan] = []
        inner = sched.ts_policy.plan

        def plan(view, now):  # type: ignore[no-untyped-def]
            p = inner(view, now)
            self.plans.append(p)
            return p

        sched.ts_policy.plan = plan  # type: ignore[method-assign]


POLICIES = [
    ("sarathi", {"token_budget": 128}),
    ("fairbatching", {}),
    ("eb", {}),
    ("eb+", {}),
    ("static", {}),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("policy", "params"), POLICIES, ids=[p for p, _ in POLICIES])
def test_plans_are_enforced(policy: str, params: dict[str, object], async_scheduling: bool) -> None:
    # KV never binds here (4,000 blocks): vLLM may refuse an admission the policy's KV estimate allowed, which is
    # vLLM's check and not the plan's enforcement.
    shape = Shape(max_num_batched_tokens=512, max_num_seqs=16, num_blocks=4000, async_scheduling=async_scheduling)
    sched = _ours(shape, policy, params)
    rec = _Recorder(sched)
    stream = [Arrival(a.step, a.request_id, a.prompt_tokens, a.max_tokens,
                      {"ttft_slo_s": 0.5, "tpot_slo_s": 0.05}) for a in random_stream(3, n=30, max_prompt=900)]
    trace = drive(sched, stream, lag=int(async_scheduling))
    assert len(rec.plans) == len(trace)
    checked = 0
    for plan, step in zip(rec.plans, trace, strict=True):
        planned = dict(plan.entries)
        # vLLM never schedules a request the plan left out, nor more tokens than planned.
        assert set(step.scheduled) <= set(planned), (plan, step)
        for rid, n in step.scheduled.items():
            assert 0 < n <= planned[rid]
        assert sum(step.scheduled.values()) <= plan.token_budget
        assert step.scheduled == dict(plan.entries), (plan, step)
        assert not step.preempted
        checked += 1
    assert checked == len(trace)
    assert not sched.has_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_planned_while_another_runs_starts_when_that_one_ends(async_scheduling: bool) -> None:
    """Under async scheduling step N+1 is planned while step N runs, and starts only when N ends: the policy is
    asked to plan it from then (the time step N was predicted to take, from its launch), so that a policy that
    spends slack (FairBatching) does not also give it the time step N is using; and the first tokens step N
    produces are taken as out by then (else a request's next deadline would stay its TTFT envelope's, seconds
    away, and FairBatching held it back a whole step: a second token two steps after the first, measured on a fake
    engine and on an H100, docs/vllm.md). Sync: the policy's clock is the wall clock."""
    shape = Shape(max_num_batched_tokens=256, num_blocks=400, async_scheduling=async_scheduling)
    a_s = 5.0  # a predicted 5 s fixed step cost: far above the test's own time, so the shift is unmistakable
    # (the vllm policy ignores the clock and the cost, so it schedules as usual)
    sched = make_scheduler(PolicyAsyncScheduler if async_scheduling else PolicyScheduler, shape, {
        KEY: UnitSettings(policy="vllm", coefficients=(a_s, 1e-6, 1e-9), online_fit=False).as_config()})
    sched.ts_native_steps = False  # the policy's plan() is asked (a native step asks none)
    inner = sched.ts_policy.plan
    clocks: list[tuple[float, float, int]] = []  # (the policy's now, the wall clock, steps in flight)
    no_first_token: list[str] = []

    def plan(view, now):  # type: ignore[no-untyped-def]
        clocks.append((now, time.time(), len(sched.ts_pending)))
        # A request with output tokens has a first-token time, also when that token is still in flight (async):
        # then it is the time the step in flight ends, the planned step's start.
        for r in view.running:
            if r.output_tokens and (r.first_token_s is None or r.first_token_s > now):
                no_first_token.append(r.request_id)
        return inner(view, now)

    sched.ts_policy.plan = plan  # type: ignore[method-assign]
    drive(sched, random_stream(7, n=8, max_prompt=200, max_out=12), lag=int(async_scheduling))
    ahead = [now - wall for now, wall, _ in clocks]
    assert not no_first_token, no_first_token
    if not async_scheduling:
        assert all(abs(x) < 1.0 for x in ahead), ahead
        return
    with_flight = [x for x, (_, _, n) in zip(ahead, clocks, strict=True) if n]
    without = [x for x, (_, _, n) in zip(ahead, clocks, strict=True) if not n]
    assert with_flight and without
    # One step in flight, launched just before: planned from about its predicted end (5 s and a little more).
    assert all(a_s - 1.0 < x < a_s + 1.0 for x in with_flight), with_flight
    assert all(abs(x) < 1.0 for x in without), without


def test_held_back_requests_stay_running() -> None:
    """A plan that leaves a running decode out of a step does not preempt it (it keeps its KV)."""
    shape = Shape(max_num_batched_tokens=256, num_blocks=400)
    sched = _ours(shape, "vllm")
    inner = sched.ts_policy.plan
    held: list[str] = []

    def plan(view, now):  # type: ignore[no-untyped-def]
        p = inner(view, now)
        decodes = [r.request_id for r in view.running if r.is_decode]
        if view.step_index % 2 and decodes:
            held.append(decodes[0])
            entries = tuple(e for e in p.entries if e.request_id != decodes[0])
            return StepPlan(entries, p.running_order, p.mode, p.token_budget, p.reasons)
        return p

    sched.ts_policy.plan = plan  # type: ignore[method-assign]
    before: dict[str, int] = {}

    def check(step: int) -> None:
        for rid in held[len(before):]:
            before[rid] = step
        for rid in before:
            req = sched.requests.get(rid)
            if req is not None:
                assert req.num_preemptions == 0

    trace = drive(sched, random_stream(5, n=12, max_prompt=100, max_out=30), before_step=check)
    assert held, "some decode was held back"
    for rid in held:
        assert any(rid in t.finished for t in trace) or rid not in sched.requests


def test_step_records_and_control_in_memory() -> None:
    shape = Shape(max_num_batched_tokens=256, num_blocks=400)
    sched = _ours(shape, "vllm")
    trace = drive(sched, random_stream(1, n=10, max_prompt=300, max_out=10))
    records = [r for r in sched.ts_sink.records if isinstance(r, StepMessage)]
    assert len(records) == sum(1 for t in trace if t.scheduled)
    assert [r.step_id for r in records] == list(range(1, len(records) + 1))
    for r, t in zip(records, [t for t in trace if t.scheduled], strict=True):
        assert r.num_prefill_tokens + r.num_decode_tokens == sum(t.scheduled.values())
        assert r.num_prefill_reqs + r.num_decode_reqs == len(t.scheduled)
        assert r.duration_s > 0 and r.predicted_s > 0
        assert 0 <= r.kv_used_blocks <= r.num_blocks == 399
    # control: swap the policy and change a parameter between steps
    sched._ts_control(SetPolicy(name="sarathi", params={"token_budget": 64}, id="1"))
    sched._ts_control(SetParams(changes={"token_budget": 32}, id="2"))
    sched._ts_control(SetParams(changes={"no_such": 1}, id="3"))
    sched._ts_control(SetPolicy(name="nope", id="4"))
    replies = {r.id: r for r in sched.ts_sink.records if isinstance(r, ControlReply)}
    assert replies["1"].ok and replies["1"].policy == "sarathi"
    assert replies["2"].ok and replies["2"].old == {"token_budget": 64} and replies["2"].params["token_budget"] == 32
    assert not replies["3"].ok and "no_such" in replies["3"].error
    assert not replies["4"].ok and "unknown batch policy" in replies["4"].error
    assert sched.ts_policy.name == "sarathi"


def test_bad_control_frames_are_answered_or_skipped_and_the_scheduler_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    addr = f"ipc://{tmp_path}/control"
    shape = Shape(max_num_batched_tokens=256, num_blocks=400)
    sched = make_scheduler(PolicyScheduler, shape, {KEY: UnitSettings(policy="vllm", control_addr=addr).as_config()})
    sender = ControlSender(addr)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    try:
        raw.send(b"\xc1")  # not msgpack, no id: nobody to answer
        raw.send(msgspec.msgpack.encode({"op": "reboot", "id": "a"}))  # an unknown op
        raw.send(msgspec.msgpack.encode({"op": "set_policy", "id": "b"}))  # no name
        raw.send(msgspec.msgpack.encode({"op": "ping", "id": "c", "extra": 1}))  # an unknown field
        sender.send(SetPolicy(id="d", name="sarathi", params={"token_budget": 64}))
        replies: dict[str, ControlReply] = {}
        deadline = time.monotonic() + 10
        with caplog.at_level(logging.WARNING):
            while len(replies) < 4 and time.monotonic() < deadline:
                sched._ts_poll_control()  # what schedule() and the pause state do first
                replies |= {r.id: r for r in sched.ts_sink.drain() if isinstance(r, ControlReply)}
                time.sleep(0.005)
            time.sleep(0.05)
            sched._ts_poll_control()
        assert sorted(replies) == ["a", "b", "c", "d"]
        assert not replies["a"].ok and "reboot" in replies["a"].error
        assert not replies["b"].ok and "name" in replies["b"].error
        assert not replies["c"].ok and "extra" in replies["c"].error
        assert replies["d"].ok and replies["d"].params["token_budget"] == 64
        assert any("control frame skipped" in r.getMessage() for r in caplog.records)
        trace = drive(sched, random_stream(2, n=6, max_prompt=200, max_out=8))
        steps = [r for r in sched.ts_sink.records if isinstance(r, StepMessage)]
        assert steps and len(steps) == sum(1 for t in trace if t.scheduled)
        assert {r.policy for r in steps} == {"sarathi"} and max(r.budget_tokens for r in steps) <= 64
    finally:
        raw.close()
        sender.close()
        sched.shutdown()


def test_settings_round_trip_and_errors() -> None:
    s = UnitSettings(unit_id=3, policy="fairbatching", params={"a": 1}, coefficients=(0.01, 2e-5, 4e-8))
    assert unit_settings({KEY: s.as_config()}) == s
    assert unit_settings(None) == UnitSettings()
    with pytest.raises(ValueError, match="unknown trackside settings"):
        unit_settings({KEY: {"polcy": "vllm"}})
    with pytest.raises(ValueError, match="coefficients"):
        unit_settings({KEY: {"coefficients": [1, 2]}})
