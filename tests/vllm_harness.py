"""Real vLLM 0.26.0 schedulers on the CPU, driven with fake model outputs (as vLLM's own scheduler tests do).

A tiny Llama ``config.json`` (hidden 256, 2 layers; no weights) serves as the model; ``DeviceConfig("cpu")``
lets a ``VllmConfig`` be built without a GPU. :func:`drive` runs a scheduler through a request stream the way
the engine core does: sync (schedule, then output) or async (step N+1 is scheduled before N's output).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from agent.engine.vllm.cpu import cpu_vllm_config


@dataclass(frozen=True)
class Shape:
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    block_size: int = 16
    num_blocks: int = 120
    max_model_len: int = 4096
    prefix_caching: bool = False
    async_scheduling: bool = False
    long_prefill_token_threshold: int = 0


def vllm_config(shape: Shape, additional: dict[str, Any] | None = None) -> Any:
    return cpu_vllm_config(
        max_num_batched_tokens=shape.max_num_batched_tokens, max_num_seqs=shape.max_num_seqs,
        block_size=shape.block_size, num_blocks=shape.num_blocks, max_model_len=shape.max_model_len,
        prefix_caching=shape.prefix_caching, async_scheduling=shape.async_scheduling,
        long_prefill_token_threshold=shape.long_prefill_token_threshold, additional=additional,
    )


def make_scheduler(cls: type[Scheduler], shape: Shape, additional: dict[str, Any] | None = None) -> Scheduler:
    config = vllm_config(shape, additional)
    kv = KVCacheConfig(
        num_blocks=shape.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=shape.block_size, num_kv_heads=2, head_size=64, dtype=torch.float16))],
    )
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=shape.block_size, log_stats=False)


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt_tokens: int
    max_tokens: int
    extra_args: dict[str, Any] | None = None


def make_request(a: Arrival, arrival_time: float) -> Request:
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, detokenize=False, extra_args=a.extra_args)
    rng = random.Random(a.request_id)
    tokens = [rng.randrange(3, 1000) for _ in range(a.prompt_tokens)]
    return Request(request_id=a.request_id, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   arrival_time=arrival_time)


def random_stream(seed: int, n: int = 40, steps: int = 30, max_prompt: int = 700, max_out: int = 40) -> list[Arrival]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(Arrival(rng.randrange(steps), f"r{i:03d}", rng.randint(1, max_prompt), rng.randint(1, max_out)))
    return sorted(out, key=lambda a: (a.step, a.request_id))


def fake_output(sched: Scheduler, out: Any) -> ModelRunnerOutput:
    """One sampled token for every scheduled request that finished its prefill in this step."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = sched.requests.get(rid)
        sampled.append([] if req is None or req.is_prefill_chunk else [7])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


@dataclass
class StepTrace:
    scheduled: dict[str, int]
    new_ids: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]


def drive(sched: Scheduler, stream: Sequence[Arrival], *, lag: int = 0, max_steps: int = 2000,
          before_step: Callable[[int], None] | None = None, t0: float | None = None) -> list[StepTrace]:
    """Run ``sched`` until every request finished; ``lag=1`` schedules step N+1 before N's output (async)."""
    arrivals = list(stream)
    if t0 is None:
        t0 = time.time()  # the policies' clock (vLLM stamps arrivals with time.time() too)
    trace: list[StepTrace] = []
    queue: list[Any] = []
    step = 0
    while step < max_steps:
        while arrivals and arrivals[0].step <= step:
            a = arrivals.pop(0)
            sched.add_request(make_request(a, t0 + a.step * 0.01))
        if before_step is not None:
            before_step(step)
        out = sched.schedule()
        queue.append((out, fake_output(sched, out)))
        trace.append(StepTrace(dict(out.num_scheduled_tokens), tuple(r.req_id for r in out.scheduled_new_reqs),
                               tuple(sorted(out.preempted_req_ids or ())), tuple(sorted(out.finished_req_ids))))
        while len(queue) > lag:
            o, m = queue.pop(0)
            sched.update_from_output(o, m)
        step += 1
        if not arrivals and not sched.has_requests():
            break
    for o, m in queue:
        sched.update_from_output(o, m)
    return trace
