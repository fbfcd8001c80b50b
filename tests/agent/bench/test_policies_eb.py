"""The ``eb`` and ``eb+`` batch policies: phases, the switch rule, the KV gate, and never mixing."""

from __future__ import annotations

from builders import rview
from hypothesis import given, settings
from hypothesis import strategies as st
from node_builders import H100_LIKE, make_unit, requests, run_node

from policies.registry import make_batch_policy
from policies.types import RequestView, StepFeedback, StepMode, UnitView


def view(
    running: list[RequestView], waiting: list[RequestView] = [], *, max_num_seqs: int = 10,  # noqa: B006
    free_blocks: int = 10_000, num_blocks: int = 10_000,
) -> UnitView:
    return UnitView(
        0, 0, tuple(running), tuple(waiting), 16, num_blocks, free_blocks, 8192, max_num_seqs, 16_384, H100_LIKE
    )


def decode(rid: str) -> RequestView:
    return rview(rid, 100, computed=104, output=5)


def ids(plan: object) -> set[str]:
    return {e.request_id for e in plan.entries}  # type: ignore[attr-defined]


def test_eb_stays_in_decode_until_theta_of_the_slots_are_free() -> None:
    policy = make_batch_policy("eb", {"theta": 0.5, "memory_safe": False})
    policy.phase = StepMode.DECODE  # type: ignore[attr-defined]
    waiting = [rview("w0", 50), rview("w1", 50)]
    # 10 slots, 6 running: 4 free < 5 = ceil(0.5 * 10): keep decoding, the waiting requests wait.
    plan = policy.plan(view([decode(f"d{i}") for i in range(6)], waiting), 0.0)
    assert plan.mode is StepMode.DECODE and ids(plan) == {f"d{i}" for i in range(6)}
    assert plan.reasons["threshold_slots"] == 5 and plan.reasons["free_slots"] == 4
    # 5 running: 5 free slots reach the threshold: a prefill-only step admits the waiting requests.
    plan = policy.plan(view([decode(f"d{i}") for i in range(5)], waiting), 0.0)
    assert plan.mode is StepMode.PREFILL and ids(plan) == {"w0", "w1"}
    assert plan.reasons["switched"] is True and plan.reasons["decodes_waiting"] == 5


def test_eb_prefill_phase_refills_then_returns_to_decode() -> None:
    policy = make_batch_policy("eb", {"theta": 0.5, "memory_safe": False})
    policy.phase = StepMode.PREFILL  # type: ignore[attr-defined]
    running = [decode("d0"), rview("p", 5000, computed=4000)]
    waiting = [rview(f"w{i}", 100) for i in range(12)]
    plan = policy.plan(view(running, waiting), 0.0)
    # The running prefill first, then waiting FCFS until the 10 slots are full; no decode in this step.
    assert plan.mode is StepMode.PREFILL
    assert ids(plan) == {"p"} | {f"w{i}" for i in range(8)}
    # All slots full and nothing left prefilling: back to decoding.
    full = [decode(f"d{i}") for i in range(10)]
    plan = policy.plan(view(full, waiting[8:]), 0.0)
    assert plan.mode is StepMode.DECODE and plan.reasons["switched"] is True


def test_eb_kv_reserve_gate_defers_the_switch() -> None:
    policy = make_batch_policy("eb", {"theta": 0.1, "memory_safe": False})
    policy.phase = StepMode.DECODE  # type: ignore[attr-defined]
    policy.reserve_blocks = 500  # type: ignore[attr-defined]
    running = [decode("d0")]
    plan = policy.plan(view(running, [rview("w", 50)], free_blocks=100), 0.0)
    assert plan.mode is StepMode.DECODE and plan.reasons["gate_deferred"] is True
    plan = policy.plan(view(running, [rview("w", 50)], free_blocks=600), 0.0)
    assert plan.mode is StepMode.PREFILL and plan.reasons["gate_deferred"] is False


def test_eb_adapts_theta_from_finished_requests() -> None:
    policy = make_batch_policy("eb", {"min_samples": 16, "update_every": 16, "memory_safe": False})
    policy.plan(view([decode("d0")]), 0.0)  # creates the cost estimator from the unit's model
    assert policy.theta == policy.params["theta_init"]  # type: ignore[attr-defined]
    outputs = tuple(1 + (7 * i) % 300 for i in range(64))
    policy.observe_step(
        StepFeedback(StepMode.DECODE, 0, 64, 64 * 300, 64, 0.02, 0.02, 64, outputs, tuple([200] * 64), 0)
    )
    policy.plan(view([decode("d0")]), 0.0)
    theta = policy.theta  # type: ignore[attr-defined]
    assert theta != policy.params["theta_init"] and 0.05 <= theta <= 0.95


workloads = st.lists(
    st.tuples(st.integers(1, 900), st.integers(1, 60), st.floats(0.0, 5.0, allow_nan=False)),
    min_size=1, max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(workload=workloads, num_blocks=st.integers(80, 600), max_num_seqs=st.integers(1, 16))
def test_eb_never_mixes_and_loses_nothing(workload: list[tuple[int, int, float]], num_blocks: int,
                                         max_num_seqs: int) -> None:
    unit = make_unit(0, "eb", cost=H100_LIKE, num_blocks=num_blocks, max_num_batched_tokens=512,
                     max_num_seqs=max_num_seqs, params={"min_samples": 8, "update_every": 8})
    reqs = requests([(p, o) for p, o, _ in workload], arrivals=[t for _, _, t in workload])
    node, steps, done = run_node([unit], reqs)
    assert {s.mode for s in steps} <= {StepMode.DECODE, StepMode.PREFILL}
    assert len(done) == len(reqs) and not node.unfinished()
    assert all(s.kv_used_blocks <= num_blocks for s in steps)


def test_eb_plus_forced_modes_and_reasons() -> None:
    running = [decode("d0"), decode("d1")]
    waiting = [rview("w", 100)]
    mixed = make_batch_policy("eb+", {"mode": "mixed"}).plan(view(running, waiting), 0.0)
    assert mixed.mode is StepMode.MIXED and mixed.reasons["batching"] == "mixed"
    excl = make_batch_policy("eb+", {"mode": "exclusive", "theta": 0.5, "memory_safe": False})
    plan = excl.plan(view(running, waiting), 0.0)
    assert plan.mode in (StepMode.DECODE, StepMode.PREFILL) and plan.reasons["batching"] == "exclusive"


def test_eb_plus_mixes_until_it_knows_the_workload() -> None:
    # No finished request yet: R(N) is unknown (infinite) and the rule picks mixed batching.
    plan = make_batch_policy("eb+").plan(view([decode("d0")], [rview("w", 100)]), 0.0)
    assert plan.reasons["batching"] == "mixed" and plan.reasons["r_adv_us"] == "inf"


def _batching_shares(workload: str, profile: str) -> dict[str, float]:
    from agent.bench.runner import BenchConfig, run_once
    from agent.workload.spec import parse_workload

    steps: list[str] = []
    run_once(
        BenchConfig(profile=profile, units=1, batch_policy="eb+"), parse_workload(workload, seed=0),
        on_step=lambda rec: steps.append(str(rec.reasons["batching"])),
    )
    late = steps[len(steps) // 4:]  # after the window has filled
    return {k: late.count(k) / len(late) for k in ("mixed", "exclusive")}


def test_eb_plus_mixes_at_low_load_on_the_bandwidth_constrained_profile() -> None:
    shares = _batching_shares("sharegpt-like:rate=1,n=200", "rtxpro6000-llama31-8b-derived")
    assert shares["mixed"] > 0.95


def test_eb_plus_goes_exclusive_under_saturation_on_the_bandwidth_constrained_profile() -> None:
    shares = _batching_shares("all-at-once:n=1200", "rtxpro6000-llama31-8b-derived")
    assert shares["exclusive"] > 0.9
