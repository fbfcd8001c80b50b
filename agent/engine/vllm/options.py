"""How a vLLM unit's engine starts (:class:`EngineOptions`, :func:`engine_kwargs`: ``vllm.AsyncEngineArgs`` fields)
and how a request samples (:func:`sampling_params`, :func:`resumed_params`: ``vllm.SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.engine.vllm.sampling import Sampling


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How to start the vLLM engine of a unit (``vllm.AsyncEngineArgs`` fields we set)."""

    model: str
    load_format: str = "auto"
    """``dummy``: random weights from a folder with only ``config.json`` (real kernels, real step times)."""
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 512
    max_model_len: int = 16384
    enforce_eager: bool = False
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    plain: bool = False
    """vLLM's own scheduler, no trackside policy (a baseline)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further ``AsyncEngineArgs`` fields."""


def engine_kwargs(options: EngineOptions, trackside: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``vllm.AsyncEngineArgs`` fields a unit's engine starts with: ``options``, our policy scheduler (unless
    ``plain``) and ``trackside`` (the unit's settings, ``additional_config``), then ``options.extra`` over them."""
    from agent.engine.vllm.scheduler import SCHEDULER_PATHS

    o = options
    kwargs: dict[str, Any] = dict(
        model=o.model, load_format=o.load_format, gpu_memory_utilization=o.gpu_memory_utilization,
        max_num_batched_tokens=o.max_num_batched_tokens, max_num_seqs=o.max_num_seqs,
        max_model_len=o.max_model_len, enforce_eager=o.enforce_eager, async_scheduling=o.async_scheduling,
        enable_prefix_caching=o.enable_prefix_caching, skip_tokenizer_init=True, disable_log_stats=True,
    )
    if o.attention_backend:
        kwargs["attention_backend"] = o.attention_backend
    if not o.plain:
        kwargs["scheduler_cls"] = SCHEDULER_PATHS[o.async_scheduling]
        kwargs.update(trackside or {})
    kwargs.update(o.extra)
    return kwargs


def resumed_params(params: Any, max_tokens: int, prior_outputs: int, extra_args: dict[str, Any]) -> Any:
    """A copy of a front end's ``vllm.SamplingParams`` for one unit: at most ``max_tokens`` more, ``min_tokens``
    less what was produced before a migration, delta outputs, the unit's ``extra_args`` (SLOs) added."""
    from vllm.sampling_params import RequestOutputKind

    out = params.clone()
    out.max_tokens = max_tokens
    if out.min_tokens:
        out.min_tokens = max(0, out.min_tokens - prior_outputs)
    out.output_kind = RequestOutputKind.DELTA
    out.extra_args = {**(params.extra_args or {}), **extra_args}
    return out


def sampling_params(max_tokens: int, sampling: Sampling | None = None,
                    extra_args: dict[str, Any] | None = None) -> Any:
    """The ``vllm.SamplingParams`` of a request; raises ``ValueError`` (vLLM's validation) for bad values."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = sampling or Sampling()
    optional = {
        name: getattr(s, name)
        for name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "presence_penalty",
                     "frequency_penalty", "repetition_penalty")
        if getattr(s, name) is not None
    }
    if s.stop_token_ids:
        optional["stop_token_ids"] = list(s.stop_token_ids)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=s.ignore_eos, detokenize=s.detokenize,
                          output_kind=RequestOutputKind.DELTA, extra_args=extra_args, **optional)
