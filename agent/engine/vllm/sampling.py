"""What a request asks of a vLLM unit and what it gets back, as plain data (no vLLM, no I/O).

:func:`agent.engine.vllm.options.sampling_params` turns a :class:`Sampling` into ``vllm.SamplingParams``; the unit
reports each engine output as a :class:`TokenDelta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a request samples (``vllm.SamplingParams`` fields); None leaves vLLM's default.

    The default is what workload replays use: ``ignore_eos`` (every request generates exactly its
    ``max_tokens``), no detokenization.
    """

    ignore_eos: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    detokenize: bool = False
    """Produce text (needs a tokenizer: ``skip_tokenizer_init=False``)."""


class TokenDelta(msgspec.Struct, frozen=True):
    """What one engine output added to a request (``RequestOutputKind.DELTA``).

    Built once per output of every request (per token, under load) in vLLM's output handler: a msgspec Struct, as
    the engine's records are (:mod:`agent.engine.base`), because its constructor is C (a frozen dataclass's sets each
    field through ``object.__setattr__``: ~0.35 µs of the front end's ~38 µs per output token on the 2-core VM)."""

    token_ids: tuple[int, ...]
    text: str = ""
    """Empty without detokenization."""
    finish_reason: str | None = None
    """``length``, ``stop`` or ``abort`` on the last delta; None before."""
    stop_reason: int | str | None = None
    """The stop token id or string that ended the request, if one did."""
    output: object | None = None
    """The engine's own output for this delta (vLLM's ``RequestOutput``, ``DELTA`` kind: text, token ids,
    logprobs), passed through untouched for vLLM's OpenAI front end (:mod:`agent.engine.vllm.engine_client`);
    None for a delta made by the agent (the finish of a request whose unit died after its last token)."""
