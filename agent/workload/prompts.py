"""Prompt token ids for replayed requests: a trace or a generator gives lengths, an engine needs tokens."""

from __future__ import annotations

import random

from agent.workload.types import RequestSpec


def prompt_ids(spec: RequestSpec, vocab: int, seed: int = 0) -> list[int]:
    """Random token ids for a request's prompt (no prefix is shared between requests)."""
    rng = random.Random(f"{seed}:{spec.request_id}")
    return [rng.randrange(1000, vocab) for _ in range(spec.prompt_tokens)]
