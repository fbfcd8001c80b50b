"""vLLM's ``EngineClient`` over trackside's dispatcher: what lets vLLM's own OpenAI app serve a node of units.

vLLM 0.26.0's OpenAI server (``vllm/entrypoints/openai/api_server.py``: ``build_app`` and ``init_app_state``)
talks to its engine through the ``EngineClient`` ABC (``vllm/engine/protocol.py``): the app renders each request
(chat template, tokenization, sampling parameters: all vLLM's code) and calls ``generate(engine_input,
sampling_params, request_id)``, which yields ``RequestOutput`` s. :class:`RoutedEngineClient` is that client for a
node of units: ``generate`` hands the tokenized request to a :data:`Submit` callable (the agent's cluster: the
dispatcher picks the unit, a migration or a failed unit moves the request on by recompute) and turns what comes
back into the ``RequestOutput`` s the app expects. Everything about the model (``vllm_config``, ``model_config``,
``renderer``, ``input_processor``) is the first unit's: every unit of a node serves the same model.

What comes back from a unit is a stream of :class:`~agent.engine.vllm.sampling.TokenDelta` s, each carrying the
unit's own ``RequestOutput`` (``output``, always a delta). They are forwarded with the request's original id,
prompt and prompt token ids (after a migration a unit's prompt is the original one plus the tokens produced
before), merged by vLLM's own ``RequestOutput.add`` where the app asked for cumulative or final-only output.

Per-request SLOs ride in vLLM's extension field ``vllm_xargs`` (``SamplingParams.extra_args``):
``ttft_slo_ms`` and ``tpot_slo_ms``. Parallel sampling (``n`` > 1) is fanned out here as vLLM's own front end
fans it out (``ParentRequest``: child ids ``i_<id>``, ``seed + i``): each sequence is a request of its own at the
dispatcher (which may place them on different units), and their outputs go back to the app as one request's.
Refused here (``ValueError``, which the app answers with 400): LoRA adapters, multimodal or embedding prompts,
streaming inputs, pooling. Limits of recompute, said in ``docs/openai-intake.md``: a stop string that spans the
point where a request moved is not seen, and a seeded request samples differently after it moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from vllm.engine.protocol import EngineClient
from vllm.entrypoints.openai.engine.protocol import GenerationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.parallel_sampling import ParentRequest

from agent.engine.vllm.sampling import TokenDelta

SLO_KEYS = {"ttft_slo_ms": "ttft_slo_s", "tpot_slo_ms": "tpot_slo_s"}
"""``vllm_xargs`` keys of a request's SLOs (milliseconds), and the request fields they set (seconds)."""


class Routed(Protocol):
    """A request on its way through the node (the cluster's ``RequestStream``)."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    def ready(self) -> list[TokenDelta]:
        """The deltas that came since the last one iterated, taken without waiting (the end stays queued)."""
        ...

    def abort(self) -> bool: ...


class Submit(Protocol):
    """Queue a tokenized request at the node's dispatcher (the agent's cluster)."""

    def __call__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 ttft_slo_s: float | None, tpot_slo_s: float | None, arrival_s: float) -> Routed: ...


def request_slos(params: SamplingParams) -> dict[str, float | None]:
    """The request's SLOs in seconds from ``vllm_xargs`` (None: the node's default); ``ValueError`` for a value
    that is not a positive number."""
    extra = params.extra_args or {}
    out: dict[str, float | None] = {}
    for key, field in SLO_KEYS.items():
        value = extra.get(key)
        if value is None:
            out[field] = None
            continue
        try:
            ms = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"vllm_xargs.{key} must be a number of milliseconds, not {value!r}") from None
        if not ms > 0 or ms == float("inf"):
            raise ValueError(f"vllm_xargs.{key} must be a positive number of milliseconds, not {value!r}")
        out[field] = ms / 1000.0
    return out


def prompt_token_ids(prompt: Any) -> tuple[list[int], str | None]:
    """The token ids (and text, if the app kept it) of a rendered prompt; ``ValueError`` for what units cannot
    take."""
    if not isinstance(prompt, Mapping):
        raise ValueError("trackside routes rendered token prompts only (this request's prompt was not rendered)")
    kind = prompt.get("type", "token")
    ids = prompt.get("prompt_token_ids")
    if kind not in ("token", "tokens") or ids is None:
        raise ValueError(f"trackside units take text and token prompts only, not {kind!r} prompts")
    text = prompt.get("prompt")
    return list(ids), text if isinstance(text, str) else None


class RequestRefused(GenerationError):  # type: ignore[misc]
    """A request refused before it reached a unit, with its HTTP status (429, 503). A ``GenerationError``: vLLM's
    app answers it with that status and no stack trace in the log (``generation_error_handler``), streaming or
    not."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status_code = HTTPStatus(status)


def _final_delta(request_id: str, prompt: str | None, prompt_ids: list[int], delta: TokenDelta,
                 params: SamplingParams, index: int) -> RequestOutput:
    """A ``RequestOutput`` for a delta that came without one (the finish of a request whose unit died after its
    last token)."""
    logprobs: Any = [] if params.logprobs is not None else None
    out = CompletionOutput(index=index, text=delta.text, token_ids=list(delta.token_ids), cumulative_logprob=None,
                           logprobs=logprobs, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
    return RequestOutput(request_id, prompt, prompt_ids, None, [out], delta.finish_reason is not None)


@dataclass(slots=True)
class _Shared:
    """What the outputs of one request (all ``n`` sequences of it) share: only its first output carries the prompt's
    logprobs, and every output reports the prompt tokens its first unit found cached."""

    first: bool = True
    cached: int | None = None


@dataclass(frozen=True, slots=True)
class _ParentInfo:
    """What vLLM's ``ParentRequest`` reads of the request it fans out (an ``EngineCoreRequest`` in vLLM's front end)."""

    request_id: str
    external_req_id: str
    params: SamplingParams


def _outputs(request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, index: int,
             shared: _Shared) -> Callable[[TokenDelta], RequestOutput]:
    """What the app gets for each delta of sequence ``index`` of a request: the unit's own output (a delta: vLLM's
    collector hands over a fresh one each time), told the request's original id and prompt (after a migration the
    unit's prompt is the original one plus the tokens produced before) and its sequence's index."""

    def output(delta: TokenDelta) -> RequestOutput:
        out = delta.output
        if isinstance(out, RequestOutput):
            out.request_id, out.prompt, out.prompt_token_ids = request_id, prompt, prompt_ids
            if not shared.first:
                out.prompt_logprobs = None
            if shared.cached is not None:
                out.num_cached_tokens = shared.cached
            if index:
                for completion in out.outputs:
                    completion.index = index
        else:
            out = _final_delta(request_id, prompt, prompt_ids, delta, params, index)
        if shared.cached is None:
            shared.cached = out.num_cached_tokens
        shared.first = False
        return out

    return output


async def _parallel(routed: Sequence[Routed], outputs: Sequence[Callable[[TokenDelta], RequestOutput]],
                    kind: RequestOutputKind) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of a request's ``n`` sequences, each routed on its own, as vLLM's front end gives a parallel
    sampling request's (``ParentRequest.get_outputs``): every sequence's deltas as they come, each with its index
    (``DELTA``), or all of them merged (``CUMULATIVE``; ``FINAL_ONLY`` once every sequence finished); the request
    is finished with its last sequence. A sequence that fails fails the request."""
    queue: asyncio.Queue[tuple[int, TokenDelta | Exception | None]] = asyncio.Queue()

    async def read(i: int, stream: Routed) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except Exception as exc:  # raised by the consumer below, which then aborts the others
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, None))

    readers = [asyncio.create_task(read(i, stream)) for i, stream in enumerate(routed)]
    done = [False] * len(routed)
    left = len(routed)
    merged: RequestOutput | None = None
    try:
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                if not done[i]:
                    raise RuntimeError(f"{routed[i].request_id} ended without finishing")
                continue
            out = outputs[i](item)
            if item.finish_reason is not None and not done[i]:
                done[i] = True
                left -= 1
            out.finished = not left
            if kind == RequestOutputKind.DELTA:
                yield out
                continue
            merged = _merge(merged, out, out.finished)
            merged.outputs.sort(key=_index)
            if (due := _due(merged, kind)) is not None:
                yield due
    finally:
        for reader in readers:
            reader.cancel()


def _merge(merged: RequestOutput | None, out: RequestOutput, finished: bool) -> RequestOutput:
    """``out`` added to the outputs before it (vLLM's ``RequestOutput.add``, which merges by sequence index), for an
    app that asked for cumulative or final-only output."""
    if merged is None:
        return out
    merged.add(out, aggregate=True)
    merged.finished = finished
    return merged


def _due(merged: RequestOutput, kind: RequestOutputKind) -> RequestOutput | None:
    """What to hand the app now of the merged outputs: a copy at every output (cumulative: the merge goes on), the
    merge itself once finished, else nothing."""
    if merged.finished:
        return merged
    return copy.deepcopy(merged) if kind == RequestOutputKind.CUMULATIVE else None


def _index(completion: CompletionOutput) -> int:
    index: int = completion.index
    return index


class RoutedEngineClient(EngineClient):  # type: ignore[misc]
    """An ``EngineClient`` whose ``generate`` goes through the node's dispatcher (see the module's docstring).

    ``engines`` are the units' ``AsyncLLM`` s (read each time: a restarted unit has a new one); ``serving``
    says how many units serve now (0: ``check_health`` raises, so vLLM's ``/health`` answers 503); ``refusal``
    gives the HTTP status of an error a routed request ended with when it means the request was refused before
    reaching a unit (None: not a refusal), raised to the app as :class:`RequestRefused`.
    """

    def __init__(self, engines: Callable[[], Sequence[Any]], submit: Submit, serving: Callable[[], int],
                 clock: Callable[[], float] = time.time,
                 refusal: Callable[[BaseException], int | None] = lambda exc: None) -> None:
        first = next((e for e in engines() if e is not None), None)
        if first is None:
            raise RuntimeError("start the units before serving them")
        self._engines = engines
        self._submit = submit
        self._serving = serving
        self._clock = clock
        self._refusal = refusal
        self._first = first
        self.vllm_config = first.vllm_config
        self.model_config = first.model_config
        self.renderer = first.renderer
        self.input_processor = first.input_processor
        self._routed: dict[str, list[Routed]] = {}
        """Each request's routed requests (one, or ``n`` for parallel sampling), by the app's request id."""
        self._stopped = False

    def _engine(self) -> Any:
        """A running unit's ``AsyncLLM`` (the first one's when none runs)."""
        return next((e for e in self._engines() if e is not None and not e.errored), self._first)

    # -- state ------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._stopped and self._serving() > 0

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        """True when no unit serves (vLLM's app then answers 503; trackside restarts failed units)."""
        return self._serving() == 0

    @property
    def dead_error(self) -> BaseException:
        """What vLLM's app raises for a request that comes while ``errored``: a 503 (with ``Retry-After``, from the
        middleware), as for a request the dispatcher refused. vLLM's own ``EngineDeadError`` would go to its dead-engine
        handler, which stops the HTTP server (``terminate_if_errored``, through an ``app.state.server`` that only
        vLLM's launcher sets: here it answered 500), when trackside restarts the failed units instead."""
        return RequestRefused("no trackside unit is serving: try again later", 503)

    async def check_health(self) -> None:
        """``EngineDeadError`` while no unit serves: vLLM's ``/health`` answers 503."""
        if self._serving() == 0:
            raise EngineDeadError("no trackside unit is serving")

    # -- requests ---------------------------------------------------------------------------------
    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, *, prompt_text: str | None = None,
        lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None, priority: int = 0, data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None, reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if lora_request is not None:
            raise ValueError("trackside units serve the base model only (no LoRA adapters)")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("trackside units take sampling requests only")
        ids, text = prompt_token_ids(prompt)
        text = prompt_text if prompt_text is not None else text
        slos = request_slos(sampling_params)
        kind = sampling_params.output_kind
        arrival_s = self._clock()
        n = sampling_params.n
        if n == 1:
            children = [(request_id, sampling_params)]
        else:  # parallel sampling: n requests, vLLM's child ids and parameters (seed + i), as its front end makes
            parent = ParentRequest(_ParentInfo(request_id, request_id, sampling_params))
            children = [parent.get_child_info(i) for i in range(n)]
        routed: list[Routed] = []
        self._routed[request_id] = routed
        try:
            for child_id, params in children:
                routed.append(self._submit(child_id, ids, params, ttft_slo_s=slos["ttft_slo_s"],
                                           tpot_slo_s=slos["tpot_slo_s"], arrival_s=arrival_s))
        except BaseException:
            self._routed.pop(request_id, None)
            for r in routed:
                r.abort()
            raise
        state = _Shared()
        finished = False
        try:
            if n == 1:  # the common case, per output token: no reader task, no queue
                output = _outputs(request_id, text, ids, sampling_params, 0, state)
                merged: RequestOutput | None = None
                stream = routed[0]
                async for delta in stream:
                    out = output(delta)
                    finished = out.finished = delta.finish_reason is not None
                    if kind == RequestOutputKind.DELTA:
                        # Deltas that queued up while the app was busy go out as one, as vLLM's own output collector
                        # merges them for a consumer that fell behind: fewer chunks to render and send under load.
                        for more in stream.ready() if not finished else ():
                            out.add(output(more), aggregate=True)
                            finished = out.finished = more.finish_reason is not None
                        yield out
                        continue
                    merged = _merge(merged, out, finished)
                    if (due := _due(merged, kind)) is not None:
                        yield due
            else:
                outputs = [_outputs(request_id, text, ids, sampling_params, i, state) for i in range(n)]
                async with contextlib.aclosing(_parallel(routed, outputs, kind)) as parallel:
                    async for out in parallel:
                        finished = out.finished
                        yield out
        except Exception as exc:  # a refusal the request ended with goes to the app as RequestRefused
            status = self._refusal(exc)
            if status is None:
                raise
            raise RequestRefused(str(exc), status) from None
        finally:
            self._routed.pop(request_id, None)
            if not finished:
                for r in routed:
                    r.abort()  # the app left early (client gone) or the request failed: nothing stays behind

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            for routed in self._routed.get(rid, ()):
                routed.abort()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("trackside serves generation only (no pooling)")

    async def get_supported_tasks(self) -> tuple[Any, ...]:
        return ("generate",)

    # -- what vLLM's app may call besides, answered by the units' engines ----------------------------
    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def notify_kv_transfer_request_rejected(self, request_id: str, kv_transfer_params: dict[str, Any], *,
                                                  data_parallel_rank: int | None = None) -> None:
        return None

    async def _each(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        engines = [e for e in self._engines() if e is not None and not e.errored]
        return list(await asyncio.gather(*(getattr(e, method)(*args, **kwargs) for e in engines)))

    async def start_profile(self) -> None:
        await self._each("start_profile")

    async def stop_profile(self) -> None:
        await self._each("stop_profile")

    async def reset_mm_cache(self) -> None:
        await self._each("reset_mm_cache")

    async def reset_encoder_cache(self) -> None:
        await self._each("reset_encoder_cache")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return all(await self._each("reset_prefix_cache", reset_running_requests, reset_connector))

    async def sleep(self, level: int = 1, mode: Any = "abort") -> None:
        raise NotImplementedError("pause units with trackside ctl pause-unit (sleep is not routed)")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError("resume units with trackside ctl resume-unit (wake_up is not routed)")

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        raise NotImplementedError("trackside units serve the base model only (no LoRA adapters)")

    async def pause_generation(self, *, mode: Any = "abort", wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True) -> None:
        raise NotImplementedError("pause units with trackside ctl pause-unit (each unit pauses on its own)")

    async def resume_generation(self) -> None:
        raise NotImplementedError("resume units with trackside ctl resume-unit")

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops routing; the units are the agent's to stop."""
        self._stopped = True
