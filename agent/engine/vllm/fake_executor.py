"""An executor for vLLM's real engine core that runs no model: it sleeps for a modelled step time instead.

It lets a whole vLLM engine (``EngineCore``, ``LLMEngine``, ``AsyncLLM`` with its engine-core process) run on
a machine without a GPU, with vLLM's own scheduler, request handling, detokenization-free outputs and
process boundaries: what the CPU tests of the vLLM integration drive, and what ``trackside agent --engine vllm
--fake-executor`` offers for trying the integration out. Step time is ``a + b * new_tokens + c * context``
seconds (``additional_config["trackside_fake"]["step_model"]``); every sampled token is token id 7.

It tracks each request's progress from the ``SchedulerOutput``s it is given (as a model runner does), so that
it samples a token exactly when a request's known tokens are all computed, and none for a partial prefill.

A non-blocking ``execute_model`` (what the engine core asks for) runs the step on one worker thread, as a GPU runs
a launched step while the CPU goes on: under async scheduling step N+1 is planned while step N sleeps, so the
scheduler sees the same overlap as on a GPU (before 2026-11-26 the sleep blocked the call, so step N had always
ended by the time N+1 was planned).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

from agent.engine.vllm.tiny_tokenizer import FAKE_TOKEN_ID

KEY = "trackside_fake"
TOKEN_ID = FAKE_TOKEN_ID
LOGPROBS_OF_ALL = 5
"""Alternatives given to a request that asks for the logprobs of the whole vocabulary (``logprobs=-1``)."""


class FakeExecutor(Executor):  # type: ignore[misc]
    """No model, no GPU: modelled step times and one sampled token per completed request per step."""

    def _init_executor(self) -> None:
        fake = dict((self.vllm_config.additional_config or {}).get(KEY) or {})
        self._num_blocks = int(fake.get("num_blocks", 2048))
        a, b, c = fake.get("step_model", (0.002, 2e-6, 1e-8))
        self._model = (float(a), float(b), float(c))
        self._progress: dict[str, list[int]] = {}
        self._logprobs: dict[str, int] = {}
        """Requests that asked for sample logprobs, and how many alternatives each."""
        """request id -> [known tokens, computed tokens]."""
        self._pending: Future[ModelRunnerOutput] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-executor")
        """One step at a time, in launch order, as one GPU runs them."""
        self._spec = FullAttentionSpec(
            block_size=self.cache_config.block_size, num_kv_heads=2, head_size=64, dtype=torch.float16
        )

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def determine_available_memory(self) -> list[int]:
        return [self._num_blocks * self._spec.page_size_bytes]

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [{"model.layers.0.self_attn.attn": self._spec}]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        pass

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False) -> Any:
        if method in ("check_health", "reset_mm_cache", "reset_encoder_cache", "profile"):
            return [None]
        raise NotImplementedError(f"FakeExecutor: {method}")

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    @property
    def supported_tasks(self) -> tuple[Any, ...]:
        return ("generate",)

    def take_draft_token_ids(self) -> None:
        return None

    def _run(self, so: Any) -> ModelRunnerOutput:
        progress = self._progress
        for rid in so.finished_req_ids:
            progress.pop(rid, None)
            self._logprobs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            progress[new.req_id] = [len(new.prompt_token_ids or ()), new.num_computed_tokens]
            k = getattr(new.sampling_params, "logprobs", None)
            if k is not None:
                self._logprobs[new.req_id] = k if k >= 0 else LOGPROBS_OF_ALL
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            if rid in resumed and rid in progress:
                known = len(cached.all_token_ids[rid]) if getattr(cached, "all_token_ids", None) else None
                if known is not None:
                    progress[rid][0] = known
                progress[rid][1] = cached.num_computed_tokens[i]
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        ctx = 0
        for rid in ids:
            n = so.num_scheduled_tokens[rid]
            p = progress.setdefault(rid, [n, 0])
            p[1] += n
            ctx += p[1]
            if p[1] >= p[0]:
                sampled.append([TOKEN_ID])
                p[0] += 1
            else:
                sampled.append([])
        a, b, c = self._model
        if ids:
            time.sleep(a + b * so.total_num_scheduled_tokens + c * ctx)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, logprobs=self._sample_logprobs(ids, sampled))

    def _sample_logprobs(self, ids: list[str], sampled: list[list[int]]) -> LogprobsLists | None:
        """Made-up logprobs for the sampled tokens when a request asked for them: the sampled token (rank 1, log
        probability -0.1) and its ``k`` alternatives (the next token ids, ever less likely), as vLLM's sampler
        lays them out (one row per sampled token, ``cu_num_generated_tokens`` the first row of each request)."""
        if not any(rid in self._logprobs for rid in ids):
            return None
        k = max(self._logprobs.get(rid, 0) for rid in ids)
        starts, rows = [], 0
        for tokens in sampled:
            starts.append(rows)
            rows += len(tokens)
        token_ids = np.tile(np.arange(TOKEN_ID, TOKEN_ID + k + 1, dtype=np.int32), (rows, 1))
        logprobs = np.tile(np.array([-0.1] + [-1.0 - i for i in range(k)], dtype=np.float32), (rows, 1))
        return LogprobsLists(token_ids, logprobs, np.ones(rows, dtype=np.int32), starts)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if not non_block:
            out = self._run(scheduler_output)
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(out)
            self._pending = done
            return out
        self._pending = self._worker.submit(self._run, scheduler_output)
        return self._pending

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        """The last launched step's output (a future of it when ``non_block``): the fake samples in ``_run``."""
        pending = self._pending
        self._pending = None
        if pending is None:
            return None
        return pending if non_block else pending.result()
