"""An executor for vLLM's real engine core that runs no model: it sleeps for a modelled step time instead.

It lets a whole vLLM engine (``EngineCore``, ``LLMEngine``, ``AsyncLLM`` with its engine-core process) run on
a machine without a GPU, with vLLM's own scheduler, request handling, detokenization-free outputs and
process boundaries: what the CPU tests of the vLLM integration drive, and what ``trackside agent --engine vllm
--fake-executor`` offers for trying the integration out. Step time is ``a + b * new_tokens + c * context``
seconds (``additional_config["trackside_fake"]["step_model"]``); every sampled token is token id 7.

It tracks each request's progress from the ``SchedulerOutput``s it is given (as a model runner does), so that
it samples a token exactly when a request's known tokens are all computed, and none for a partial prefill.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput

KEY = "trackside_fake"
TOKEN_ID = 7


class FakeExecutor(Executor):  # type: ignore[misc]
    """No model, no GPU: modelled step times and one sampled token per completed request per step."""

    def _init_executor(self) -> None:
        fake = dict((self.vllm_config.additional_config or {}).get(KEY) or {})
        self._num_blocks = int(fake.get("num_blocks", 2048))
        a, b, c = fake.get("step_model", (0.002, 2e-6, 1e-8))
        self._model = (float(a), float(b), float(c))
        self._progress: dict[str, list[int]] = {}
        """request id -> [known tokens, computed tokens]."""
        self._pending: ModelRunnerOutput | None = None
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
        pass

    @property
    def supported_tasks(self) -> tuple[Any, ...]:
        return ("generate",)

    def take_draft_token_ids(self) -> None:
        return None

    def _run(self, so: Any) -> ModelRunnerOutput:
        progress = self._progress
        for rid in so.finished_req_ids:
            progress.pop(rid, None)
        for new in so.scheduled_new_reqs:
            progress[new.req_id] = [len(new.prompt_token_ids or ()), new.num_computed_tokens]
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
                                 sampled_token_ids=sampled)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        out = self._pending = self._run(scheduler_output)
        if non_block:
            f: Future[Any] = Future()
            f.set_result(out)
            return f
        return out

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        out = self._pending
        self._pending = None
        if non_block:
            f: Future[Any] = Future()
            f.set_result(out)
            return f
        return out
