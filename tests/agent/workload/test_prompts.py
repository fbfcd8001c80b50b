"""Prompt token ids for replays (agent/workload/prompts.py): lengths, range, and the same ids for the same request."""

from __future__ import annotations

from agent.workload.prompts import FIRST_ID, prompt_ids
from agent.workload.types import RequestSpec


def test_ids_are_in_range_of_the_requests_length_and_repeatable() -> None:
    a, b = RequestSpec("r000001", 0.0, 6000, 10), RequestSpec("r000002", 0.0, 6000, 10)
    ids = prompt_ids(a, 32_000)
    assert len(ids) == 6000 and all(FIRST_ID <= t < 32_000 for t in ids) and all(type(t) is int for t in ids)
    assert prompt_ids(a, 32_000) == ids  # the same request, the same prompt (a replay and its baseline agree)
    assert prompt_ids(a, 32_000, seed=1) != ids
    other = prompt_ids(b, 32_000)
    assert other[:16] != ids[:16]  # no prefix shared between requests (no prefix-cache hits by accident)
    assert len(set(ids)) > 5000  # spread over the vocabulary
    assert prompt_ids(RequestSpec("r000003", 0.0, 1, 1), FIRST_ID + 1) == [FIRST_ID]
