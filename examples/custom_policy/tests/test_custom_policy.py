"""The example's policies as plain sync tests: small views in, plans out (run ``pytest`` in this folder)."""

from __future__ import annotations

import tomllib
from importlib import import_module
from pathlib import Path

import pytest
from policies.cost.step_model import StepCoefficients
from policies.params import ParamError
from policies.registry import check_policy_class
from policies.types import PendingRequest, RequestView, StepMode, UnitLoad, UnitView

from custom_policy import LeastTokens, ShortFirst

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
COST = StepCoefficients(9e-3, 24e-6, 44e-9)


def request(rid: str, prompt: int, *, arrival: float = 0.0, computed: int = 0, output: int = 0) -> RequestView:
    return RequestView(rid, arrival, prompt, computed, output, ttft_slo_s=0.5, tpot_slo_s=0.05)


def unit(running: tuple[RequestView, ...] = (), waiting: tuple[RequestView, ...] = (), *, budget: int = 2048,
         max_num_seqs: int = 8) -> UnitView:
    return UnitView(unit_id=0, step_index=0, running=running, waiting=waiting, block_size=16, num_blocks=1000,
                    free_blocks=1000, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=16_384,
                    cost=COST)


def load(unit_id: int, *, queued: int = 0, kv: int = 0, healthy: bool = True) -> UnitLoad:
    return UnitLoad(unit_id=unit_id, healthy=healthy, num_running=0, num_waiting=0, kv_used_blocks=kv // 16,
                    num_blocks=1000, kv_tokens=kv, queued_prefill_tokens=queued)


def test_the_entry_points_name_policies_that_keep_the_contract() -> None:
    """What trackside checks when it loads the plugin: each entry point a policy class, named as the policy."""
    entry_points = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["trackside.policies"]
    assert set(entry_points) == {"short_first", "least_tokens"}
    for name, value in entry_points.items():
        module, _, attr = value.partition(":")
        cls = getattr(import_module(module), attr)
        assert cls.name == name
        assert check_policy_class(cls) == ("batch" if cls is ShortFirst else "dispatch")


def test_short_first_runs_the_running_then_admits_the_shortest_prompts() -> None:
    running = (request("dec", 100, computed=100, output=1),)
    waiting = (request("long", 900, arrival=1.0), request("short", 50, arrival=1.2), request("mid", 300, arrival=1.1))
    plan = ShortFirst().plan(unit(running, waiting, budget=400), now_s=1.5)
    assert [(e.request_id, e.num_tokens) for e in plan.entries] == [("dec", 1), ("short", 50), ("mid", 300),
                                                                    ("long", 49)]
    assert plan.running_order == ("dec",) and plan.mode == StepMode.MIXED
    assert plan.num_tokens <= plan.token_budget == 400
    assert plan.reasons["admitted"] == 3 and plan.reasons["admitted_aged"] == 0


def test_a_request_waiting_max_wait_ms_goes_ahead_of_shorter_ones() -> None:
    waiting = (request("old-long", 900, arrival=0.0), request("short", 50, arrival=2.0))
    policy = ShortFirst({"max_wait_ms": 2500})
    plan = policy.plan(unit(waiting=waiting, budget=4096), now_s=3.0)
    assert [e.request_id for e in plan.entries] == ["old-long", "short"]
    assert plan.reasons["admitted_aged"] == 1 and plan.reasons["waiting_aged"] == 1
    # Earlier, the same queue is shortest first: the time is an argument, not a clock the policy reads.
    assert [e.request_id for e in policy.plan(unit(waiting=waiting), now_s=2.2).entries] == ["short", "old-long"]


def test_short_first_keeps_the_seat_cap_and_the_chunk_cap() -> None:
    waiting = tuple(request(f"r{i}", 500 + i, arrival=0.1 * i) for i in range(5))
    plan = ShortFirst({"max_chunk_tokens": 256}).plan(unit(waiting=waiting, budget=8192, max_num_seqs=3), now_s=0.5)
    assert [(e.request_id, e.num_tokens) for e in plan.entries] == [("r0", 256), ("r1", 256), ("r2", 256)]
    assert plan.mode == StepMode.PREFILL


def test_an_empty_unit_plans_an_idle_step() -> None:
    plan = ShortFirst().plan(unit(), now_s=0.0)
    assert plan.entries == () and plan.mode == StepMode.IDLE


def test_parameters_are_checked_against_the_schema() -> None:
    with pytest.raises(ParamError, match="below the minimum"):
        ShortFirst({"max_wait_ms": -1})
    policy = ShortFirst()
    assert policy.update_params({"max_wait_ms": "500"}) == {"max_wait_ms": 2000.0}
    assert policy.max_wait_s == 0.5
    with pytest.raises(ParamError, match="no parameter"):
        LeastTokens({"weight": 1})


def test_least_tokens_spreads_a_burst_by_token_work() -> None:
    units = [load(0, queued=1000), load(1, kv=2000), load(2, queued=100, healthy=False)]
    pending = [PendingRequest(f"p{i}", 0.0, 400, 0.5, 0.05) for i in range(4)]
    decision = LeastTokens().dispatch(pending, units, now_s=0.0)
    # unit 1 starts at 0.1 x 2000 = 200 tokens of work, unit 0 at 1000; unit 2 is down
    assert decision.assignments == (("p0", 1), ("p1", 1), ("p2", 0), ("p3", 1))
    assert decision.reasons == {"placed": 4, "spread_tokens": 0}


def test_least_tokens_places_nothing_without_a_healthy_unit() -> None:
    decision = LeastTokens().dispatch([PendingRequest("p", 0.0, 10, 0.5, 0.05)], [load(0, healthy=False)], 0.0)
    assert decision.assignments == () and decision.reasons == {"no_healthy_unit": True}
