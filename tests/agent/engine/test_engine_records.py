"""The engine's records (``agent/engine/base.py``) are frozen msgspec Structs: they behave as the frozen dataclasses
they replaced (construction by position or keyword, defaults, equality, pickling, immutability, copies with
changes), which process pools, the hub's replay buffer and the tests rely on."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from agent.engine.base import Migrant, RequestOutcome, StepRecord, StepResult, SubmittedRequest
from policies.types import StepMode


def _record(**changes: object) -> StepRecord:
    fields = dict(unit_id=0, step_id=1, start_s=0.0, duration_s=0.1, predicted_s=0.09, mode=StepMode.DECODE,
                  policy="vllm", num_prefill_tokens=0, num_decode_tokens=4, num_prefill_reqs=0, num_decode_reqs=4,
                  context_tokens=100, budget_tokens=8192, kv_used_blocks=10, num_blocks=100, num_running=4,
                  num_waiting=0, num_preempted=0, num_finished=0)
    fields.update(changes)
    return StepRecord(**fields)  # type: ignore[arg-type]


def test_positional_and_keyword_construction_agree_and_defaults_are_fresh() -> None:
    keyword = _record()
    positional = StepRecord(0, 1, 0.0, 0.1, 0.09, StepMode.DECODE, "vllm", 0, 4, 0, 4, 100, 8192, 10, 100, 4, 0, 0, 0)
    assert keyword == positional and keyword.reasons == {}
    assert keyword.reasons is not positional.reasons  # default_factory: one dict per record
    assert keyword.new_tokens == 4 and keyword.kv_usage == pytest.approx(0.1)
    assert _record(num_decode_tokens=5) != keyword


def test_records_pickle_compare_and_hash_as_before() -> None:
    spec = SubmittedRequest("r1", 0.5, 100, 20, 0.5, 0.05)
    outcome = RequestOutcome("r1", 2, 0.5, 0.7, 2.0, 100, 20, 1, 0.5, 0.05, max_tpot_s=0.06)
    migrant = Migrant(spec, 5, 105, 0.7, 1, 0.04)
    result = StepResult(_record(reasons={"why": "test"}), (outcome,), ("r2",), ("r1",), (migrant,))
    for value in (spec, outcome, migrant, result):
        assert pickle.loads(pickle.dumps(value)) == value
    assert hash(outcome) == hash(RequestOutcome("r1", 2, 0.5, 0.7, 2.0, 100, 20, 1, 0.5, 0.05, max_tpot_s=0.06))
    assert outcome.ttft_s == pytest.approx(0.2) and migrant.request_id == "r1" and migrant.num_tokens == 105


def test_records_are_immutable_and_copied_with_changes() -> None:
    spec = SubmittedRequest("r1", 0.5, 100, 20, 0.5, 0.05)
    migrant = Migrant(spec, 5, 105, 0.7, 1)
    with pytest.raises(AttributeError):
        migrant.computed_tokens = 0  # type: ignore[misc]
    moved = migrant.without_kv()
    assert moved.computed_tokens == 0 and migrant.computed_tokens == 105 and moved.spec is spec
    assert msgspec.structs.replace(_record(), start_s=3.0).start_s == 3.0
