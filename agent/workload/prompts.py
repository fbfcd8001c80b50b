"""Prompt token ids for replayed requests: a trace or a generator gives lengths, an engine needs tokens."""

from __future__ import annotations

import hashlib

import numpy as np

from agent.workload.types import RequestSpec

FIRST_ID = 1000
"""The lowest id drawn (below it, a tokenizer's special and byte tokens)."""


def prompt_ids(spec: RequestSpec, vocab: int, seed: int = 0) -> list[int]:
    """Random token ids in ``[FIRST_ID, vocab)`` for a request's prompt, the same for the same request id and seed (no
    prefix is shared between requests). Drawn with numpy: a live replay makes them in the agent's event loop, where a
    Python loop over a long prompt held the loop for 16 ms per 6,000 tokens."""
    key = int.from_bytes(hashlib.blake2b(f"{seed}:{spec.request_id}".encode(), digest_size=8).digest(), "little")
    ids: list[int] = np.random.default_rng(key).integers(FIRST_ID, vocab, size=spec.prompt_tokens).tolist()
    return ids
