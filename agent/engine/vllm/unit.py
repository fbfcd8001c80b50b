"""A vLLM engine as a trackside unit: one ``AsyncLLM`` (its engine core in a process of its own) per unit.

The agent side of a unit submits requests (token-id prompts; per-request SLOs and the agent's arrival time in
``SamplingParams.extra_args``), times every request's first and last token from the streamed outputs, and
reads the step records our scheduler (:mod:`agent.engine.vllm.scheduler`) pushes out of the engine-core
process. :meth:`VllmUnit.load` turns the last record plus what the front end knows (requests submitted and
not finished) into the :class:`~policies.types.UnitLoad` a dispatcher sees.

**TPOT.** A request's worst per-token TPOT (``RequestOutcome.max_tpot_s``) is tracked as its outputs arrive: each
token counts at the time vLLM's output handler in the front end hands it over (:meth:`VllmUnit._output`, called
in the handler's own task, no task switch later). A delta that carries several tokens (speculative decoding; none
here) counts all of them at the delta's time, so its first token, the one that waited longest since the first
token of the request, is its worst: ``(t - first) / (outputs before the delta)``; spreading the delta's gap over
its tokens would hide a stall.

``plain=True`` runs vLLM's own scheduler untouched (the baseline of the validation); it has no step records.

**Engine failures.** vLLM notices an engine-core process that exits (its client's monitor thread waits on the
process's sentinel and marks the engine dead; ``AsyncLLM.errored``) and fails every ``generate()`` with
``EngineDeadError``. A unit turns that into :class:`EngineFailed` for each of its requests and reports the failure
once (:attr:`VllmUnit.on_failed`); a light watchdog (:meth:`VllmUnit.watch`, every ``watch_interval_s``) asks
``AsyncLLM.errored`` and the process's exit code too, so that an idle unit's death is seen as well. The watchdog
also finds a **hung** engine core (alive, but no step, no finish and no new token for ``hang_s`` while the unit
has requests and is not paused: :class:`~agent.engine.live.StallClock`): it kills the process (SIGKILL) and fails
the unit, which then goes the way of a dead one.
:meth:`VllmUnit.restart` starts a fresh engine in its place (built in a thread: the event loop keeps serving).

What a unit keeps (:attr:`VllmUnit.records`, :attr:`VllmUnit.raw`, :attr:`VllmUnit.outcomes`) is bounded
(:class:`~agent.engine.vllm.history.History`, ``history`` items each), so that a unit can serve for days.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.live import (
    ENGINE_HANG_S,
    EngineFailed,
    FailedCallback,
    FinishCallback,
    FirstTokenCallback,
    LiveEngine,
    LiveRequest,
    StepCallback,
    resident_requests,
    watchdog,
)
from agent.engine.vllm.channel import ControlSender
from agent.engine.vllm.config import KEY, UnitSettings
from agent.engine.vllm.history import History
from agent.engine.vllm.messages import ControlReply, ControlRequest, FrameError, StepMessage, decode_engine
from agent.engine.vllm.options import EngineOptions, engine_kwargs, resumed_params, sampling_params
from agent.engine.vllm.sampling import Sampling, TokenDelta
from policies.types import RunningRequest, UnitLoad

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1
"""How often a unit's watchdog looks at its engine core (an engine-core death is reported within about this)."""
HISTORY = 20_000
"""Step records, raw step messages and outcomes a unit keeps by default (each; the oldest go first)."""
MAX_UNCLAIMED_REPLIES = 1024
"""Control replies nobody has asked for yet that a unit keeps (the oldest go first)."""


def record_from(msg: StepMessage, step_base: int = 0) -> StepRecord:
    """A step record from the scheduler's message (:mod:`agent.engine.vllm.scheduler`); ``step_base`` is added to
    the engine's step id (a restarted engine counts from 0 again, the unit's records go on)."""
    return StepRecord(
        unit_id=msg.unit_id, step_id=msg.step_id + step_base, start_s=msg.start_s, duration_s=msg.duration_s,
        predicted_s=msg.predicted_s, mode=msg.mode, policy=msg.policy, num_prefill_tokens=msg.num_prefill_tokens,
        num_decode_tokens=msg.num_decode_tokens, num_prefill_reqs=msg.num_prefill_reqs,
        num_decode_reqs=msg.num_decode_reqs, context_tokens=msg.context_tokens, budget_tokens=msg.budget_tokens,
        kv_used_blocks=msg.kv_used_blocks, num_blocks=msg.num_blocks, num_running=msg.num_running,
        num_waiting=msg.num_waiting, num_preempted=msg.num_preempted, num_finished=msg.num_finished,
        reasons=dict(msg.reasons),
    )


class VllmUnit:
    """One vLLM engine driven from the agent's event loop."""

    def __init__(self, unit_id: int, options: EngineOptions, settings: UnitSettings | None = None, *,
                 vllm_config: Any = None, executor_class: Any = None, ipc_dir: str | None = None,
                 history: int = HISTORY, hang_s: float | None = ENGINE_HANG_S) -> None:
        self.unit_id = unit_id
        self.options = options
        self._own_ipc = ipc_dir is None
        self._ipc = ipc_dir or tempfile.mkdtemp(prefix="trackside-vllm-")
        tag = uuid.uuid4().hex[:8]
        self.step_addr = f"ipc://{os.path.join(self._ipc, f'steps-{unit_id}-{tag}')}"
        self.control_addr = f"ipc://{os.path.join(self._ipc, f'control-{unit_id}-{tag}')}"
        base = settings or UnitSettings()
        self.settings = UnitSettings(**{**{k: getattr(base, k) for k in base.__dataclass_fields__},
                                        "unit_id": unit_id, "step_addr": self.step_addr,
                                        "control_addr": self.control_addr, "agent_pid": os.getpid()})
        self._vllm_config = vllm_config
        self._config_template = copy.deepcopy(vllm_config)
        """A copy of ``vllm_config`` as given (vLLM changes the one it starts with): what a restart starts from."""
        self._executor_class = executor_class
        self.llm: Any = None
        self._ctx = zmq.asyncio.Context()
        self._steps_sock: Any = None
        self._control: ControlSender | None = None
        self._reader: asyncio.Task[None] | None = None
        self.records: History[StepRecord] = History(history)
        """The last ``history`` step records (indexes count from the first record ever: ``records[mark:]``)."""
        self.raw: History[StepMessage] = History(history)
        """The step messages as received (with the scheduler's extra fields: plan time, PAB...), as ``records``."""
        self.last: StepMessage | None = None
        """The last step message (None before the first, and after a restart)."""
        self._step_base = 0
        """Added to the engine's step ids: the steps the unit's earlier engines made (its ids stay unique)."""
        self._next_step_id = 0
        self.live: dict[str, LiveRequest] = {}
        self.outcomes: History[RequestOutcome] = History(history)
        """The last ``history`` outcomes (the requests that finished, aborted ones have none)."""
        self.control_replies: dict[str, ControlReply] = {}
        """Replies to control requests nobody has claimed yet (:meth:`reply`), by request id."""
        self.on_step: StepCallback | None = None
        self.on_finish: FinishCallback | None = None
        self.on_first_token: FirstTokenCallback | None = None
        """Called when a request's first output token has arrived (its ``first_token_s`` is set)."""
        self.on_failed: FailedCallback | None = None
        """Called once (soon after, from the event loop) when the engine core is found dead, with the reason."""
        self.failure: str | None = None
        """Why the engine core is dead (None while it runs)."""
        self.watch_interval_s = WATCH_INTERVAL_S
        self.hang_s = hang_s
        """An engine core that makes no progress (:class:`~agent.engine.live.StallClock`) for this long while the unit
        has requests and is not paused is hung: the watchdog kills it (SIGKILL) and fails the unit. None: never."""
        self.paused = False
        """Paused (:meth:`pause`): it makes no steps on purpose, which is no hang."""
        self._watchdog: asyncio.Task[None] | None = None
        self.submitted_prompt_since_record = 0
        self._step_time_sum = 0.0
        self.num_blocks = 0
        self.block_size = 16

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine (blocks until vLLM is ready: model load, KV profiling, graph capture)."""
        self._open_steps()
        self._build()
        self._attach()

    async def restart(self) -> None:
        """Replace a failed (or running) engine with a fresh one; the requests the old one had are forgotten (the
        cluster evacuated them). The new engine is built in a thread, so the event loop keeps serving meanwhile;
        raises what vLLM raised if it does not start (the unit is then left without an engine)."""
        for task in (self._watchdog, self._reader):
            if task is not None:
                task.cancel()
        self._watchdog = self._reader = None
        old, self.llm = self.llm, None
        if old is not None:
            # vLLM's shutdown also shuts its renderer (the tokenizer's thread pool), which the OpenAI front end
            # shares (RoutedEngineClient takes the first unit's): keep it, the front end still tokenizes with it.
            # An unshared renderer is simply dropped (its idle threads end when it is collected).
            old.renderer = None
            await asyncio.to_thread(old.shutdown)
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._steps_sock is not None:
            self._steps_sock.close()
            self._steps_sock = None
        self.live.clear()
        self.last = None
        self._step_base = self._next_step_id  # the fresh engine counts from 0: its records go on from here
        self.submitted_prompt_since_record = 0
        self.failure = None
        self.paused = False
        if self._config_template is not None:
            self._vllm_config = copy.deepcopy(self._config_template)
        self._open_steps()
        await asyncio.to_thread(self._build)
        self._attach()

    def _open_steps(self) -> None:
        if not self.options.plain:
            self._steps_sock = self._ctx.socket(zmq.PULL)
            self._steps_sock.setsockopt(zmq.LINGER, 0)
            self._steps_sock.bind(self.step_addr)

    def _build(self) -> None:
        """Construct the engine (vLLM starts its engine-core process and waits for it); no event loop needed."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from agent.engine.vllm.scheduler import SCHEDULER_PATHS

        preset = 0
        if self._vllm_config is not None:
            config = self._vllm_config
            if not self.options.plain:
                config.scheduler_config.scheduler_cls = SCHEDULER_PATHS[bool(config.scheduler_config.async_scheduling)]
                config.additional_config[KEY] = self.settings.as_config()
            # vLLM's client adds the engine's block count to a preset one (it sums DP engines): undo that below.
            preset = int(config.cache_config.num_gpu_blocks or 0)
            self.llm = AsyncLLM(vllm_config=config, executor_class=self._executor_class, log_stats=False)
        else:
            policy = {} if self.options.plain else {"additional_config": {KEY: self.settings.as_config()}}
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(self.options, policy)))
        cfg = self.llm.vllm_config
        self.block_size = int(cfg.cache_config.block_size)
        # vLLM counts usage over num_gpu_blocks - 1 (block 0 is its null block), as the scheduler reports it.
        self.num_blocks = max(1, int(cfg.cache_config.num_gpu_blocks or 1) - preset - 1)

    def _attach(self) -> None:
        """The event-loop side of a started engine: control channel, step reader, watchdog."""
        if not self.options.plain:
            self._control = ControlSender(self.control_addr)
            self._reader = asyncio.get_running_loop().create_task(self._read_steps())
        self._watchdog = asyncio.get_running_loop().create_task(self.watch())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._reader is not None:
            self._reader.cancel()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        if self._control is not None:
            self._control.close()
        if self._steps_sock is not None:
            self._steps_sock.close()
        self._ctx.term()
        if self._own_ipc:
            shutil.rmtree(self._ipc, ignore_errors=True)

    # -- engine failures --------------------------------------------------------------------------
    @property
    def engine_pid(self) -> int | None:
        """The process id of the unit's engine core (None before :meth:`start`, or without one)."""
        proc = self._engine_process()
        return None if proc is None else proc.pid

    def _engine_process(self) -> Any:
        core = getattr(self.llm, "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        procs = getattr(manager, "processes", None) or ()
        return procs[0] if procs else None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def serving(self) -> bool:
        """An engine was started (and not stopped); it may have died since (:meth:`check_engine`)."""
        return self.llm is not None

    @property
    def takes_control(self) -> bool:
        """False for plain vLLM (its own scheduler: no control channel, no step records)."""
        return not self.options.plain

    @property
    def last_preempted(self) -> tuple[str, ...]:
        """vLLM's ids of the requests preempted in the last step (ours plus vLLM's suffix)."""
        return self.last.preempted if self.last is not None else ()

    def check_engine(self) -> str | None:
        """Why the engine core is dead, None while it runs: vLLM's own ``AsyncLLM.errored`` (its monitor thread
        saw the process exit, or its output handler failed), or the process's exit code."""
        if self.failure is not None:
            return self.failure
        llm = self.llm
        if llm is None:
            return None
        proc = self._engine_process()
        code = None if proc is None else proc.exitcode
        if code is not None:
            return f"engine core process {proc.pid} exited with code {code}"
        if llm.errored:
            return "vLLM reports the engine core dead"
        return None

    def _fail(self, reason: str) -> None:
        """Record the failure once and report it from the event loop (never from inside a request's task)."""
        if self.failure is not None:
            return
        self.failure = reason
        if self.on_failed is not None:
            asyncio.get_running_loop().call_soon(self.on_failed, self.unit_id, reason)

    async def watch(self) -> None:
        """The watchdog: look at the engine core every ``watch_interval_s`` until it is found dead, or hung (no
        progress for ``hang_s`` with requests in flight: then it is killed first, :meth:`kill_hung`)."""
        await watchdog(self, self.kill_hung, self._fail)

    def progress(self) -> tuple[int, int]:
        """Step records and finished requests, ever (what the watchdog counts as progress, with tokens)."""
        return len(self.records), len(self.outcomes)

    def kill_hung(self, stalled_s: float) -> str:
        """Kill the engine-core process (SIGKILL: a stopped or stuck process cannot refuse it); why, for the unit's
        failure. vLLM then sees the process gone and fails its requests, as for any dead engine."""
        what = f"engine core hung: no step for {stalled_s:.1f} s with {len(self.live)} request(s) in flight"
        proc = self._engine_process()
        if proc is None:
            return what
        try:
            proc.kill()
        except (OSError, ValueError) as exc:  # gone already, or a process object that cannot signal it
            return f"{what}; killing process {proc.pid} failed: {exc}"
        return f"{what}; process {proc.pid} killed"

    async def _read_steps(self) -> None:
        sock = self._steps_sock
        while True:
            try:
                msg = decode_engine(await sock.recv())
            except FrameError as exc:
                log.warning("unit %d: engine frame skipped: %s", self.unit_id, exc)
                continue
            if isinstance(msg, StepMessage):
                rec = record_from(msg, self._step_base)
                self._next_step_id = rec.step_id + 1
                self.raw.append(msg)
                self.records.append(rec)
                self.last = msg
                self._step_time_sum += rec.duration_s
                self.submitted_prompt_since_record = 0
                if self.on_step is not None:
                    self.on_step(self.unit_id, rec)
            else:
                replies = self.control_replies
                replies[msg.id] = msg
                if len(replies) > MAX_UNCLAIMED_REPLIES:
                    del replies[next(iter(replies))]

    # -- control ----------------------------------------------------------------------------------
    async def control(self, message: ControlRequest, timeout_s: float = 30.0) -> ControlReply:
        """Send a control request and return the engine's reply (:meth:`reply`)."""
        return await self.reply(self.send_control(message), timeout_s, what=str(message.__struct_config__.tag))

    async def reply(self, mid: str, timeout_s: float = 30.0, *, what: str = "control message") -> ControlReply:
        """The engine's reply to the control message ``mid`` (:meth:`send_control`), once it has applied it.

        A busy engine applies control messages at the top of its next ``schedule()``. An idle one calls no
        ``schedule()``; while waiting, this asks the engine core whether it is paused (vLLM's
        ``is_scheduler_paused`` utility, answered between two steps), and our scheduler reads its control
        channel whenever vLLM reads its pause state, so an idle engine applies the message at once.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while mid not in self.control_replies:
            if time.monotonic() > deadline:
                raise TimeoutError(f"unit {self.unit_id}: no reply to {what} in {timeout_s:g} s")
            if self.llm is not None:
                await asyncio.wait_for(self.llm.is_paused(), max(0.001, deadline - time.monotonic()))
            if mid in self.control_replies:
                break
            await asyncio.sleep(delay)  # the message may reach the engine after the question: ask again
            delay = min(2 * delay, 0.05)
        return self.control_replies.pop(mid)

    async def pause(self) -> None:
        """Stop stepping; requests stay in the engine, their KV kept (vLLM's ``pause_generation(mode="keep")``)."""
        self.paused = True
        if self.llm is not None:
            await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        """Step again after :meth:`pause`."""
        if self.llm is not None:
            await self.llm.resume_generation()
        self.paused = False

    def send_control(self, message: ControlRequest) -> str:
        """Send a control request without waiting (with a fresh ``id``, returned); its reply lands in
        :attr:`control_replies` under that id."""
        if self._control is None:
            raise RuntimeError("a plain vLLM unit takes no control messages")
        mid = uuid.uuid4().hex
        self._control.send(msgspec.structs.replace(message, id=mid))
        return mid

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, *, arrival_s: float,
               ttft_slo_s: float, tpot_slo_s: float, sampling: Sampling | None = None,
               on_output: Callable[[TokenDelta], None] | None = None, prompt_tokens: int | None = None,
               prior_outputs: int = 0, first_token_s: float | None = None,
               params: Any = None, max_tpot_s: float | None = None) -> asyncio.Task[RequestOutcome]:
        """Start a request; the task ends with its outcome (the unit also keeps it in :attr:`outcomes`).

        ``on_output`` sees every output that adds tokens or finishes the request, in order. Cancelling the task
        aborts the request in vLLM (which frees its KV blocks); an aborted request has no outcome.

        A request migrated here by recompute (``prompt_tokens`` given: its original prompt length) brings its
        original prompt plus the ``prior_outputs`` tokens it produced elsewhere as ``prompt_token_ids``, the
        tokens it still has to produce as ``max_tokens``, its original ``first_token_s`` and its worst per-token TPOT
        so far (``max_tpot_s``); its outcome counts the original prompt and every output token, and no first-token
        report is made again.

        ``params``: a front end's ``vllm.SamplingParams`` (text, stop strings, logprobs...), used instead of
        ``sampling`` (see :func:`resumed_params`); each delta then carries the engine's ``RequestOutput``.
        """
        live = self.live[request_id] = LiveRequest.submitted(
            prompt_token_ids, max_tokens, time.time(), arrival_s=arrival_s, ttft_slo_s=ttft_slo_s,
            tpot_slo_s=tpot_slo_s, sampling=sampling, on_output=on_output, prompt_tokens=prompt_tokens,
            prior_outputs=prior_outputs, first_token_s=first_token_s, params=params, max_tpot_s=max_tpot_s,
        )
        self.submitted_prompt_since_record += len(prompt_token_ids)
        task = asyncio.get_running_loop().create_task(self._run(request_id, prompt_token_ids))
        # A task cancelled before it ran never reaches _run's cleanup.
        task.add_done_callback(lambda _: self.live.pop(request_id) if self.live.get(request_id) is live else None)
        return task

    async def _run(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutcome:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return await self._generate(request_id, prompt_token_ids)
        except EngineDeadError as exc:
            self._fail(self.check_engine() or "vLLM reports the engine core dead")
            # Not chained: vLLM raises one EngineDeadError instance in every request, and its traceback grows
            # with each raise (formatting it for a hundred requests took seconds).
            raise EngineFailed(self.unit_id, self.failure or str(exc)) from None

    async def _generate(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutcome:
        """Run the request to its end. vLLM's output handler hands each of its outputs to :meth:`_output` as it
        puts it in the request's collector (the collector's ``put`` is replaced), so a token reaches the stream in
        the output handler's own task: one task switch per request and step fewer than reading ``generate()``,
        which wakes a reader task for every output (the front end's CPU per output token fell 4-7% with it on a 2-core
        VM: docs/vllm.md, "The front end per token"). What happens on a cancel or an error is
        ``generate()``'s: the request is aborted in the engine, and the engine's death raises ``EngineDeadError``."""
        from vllm.inputs.engine import tokens_input

        live = self.live[request_id]
        slos = {"ttft_slo_s": live.ttft_slo_s, "tpot_slo_s": live.tpot_slo_s, "arrival_s": live.arrival_s}
        if live.params is not None:
            params = resumed_params(live.params, live.max_tokens, live.prior_outputs, slos)
        else:
            params = sampling_params(live.max_tokens, live.sampling, slos)
        llm = self.llm
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue: Any = None
        try:
            # Rendered already (by vLLM's app, or a replay's token ids): an engine input, as vLLM's own server hands
            # over, skips the input processor's legacy preprocessing of a raw prompt (9 us of 34 per 512-token
            # request on the 2-core VM) and its deprecation warning.
            queue = await llm.add_request(request_id, tokens_input(prompt_token_ids), params)
            queue.put = functools.partial(self._output, request_id, live, done)  # no Python frame of its own
            early = queue.get_nowait()  # an output put before the replacement (none seen: the engine had to step)
            if early is not None:
                self._output(request_id, live, done, early)
            await done
        except asyncio.CancelledError:
            if queue is not None:
                await llm.abort(queue.request_id, internal=True)
            raise
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if queue is not None and not isinstance(exc, EngineDeadError):  # a dead engine has nothing to abort
                await llm.abort(queue.request_id, internal=True)
            raise
        finally:
            if queue is not None:
                queue.close()
            if self.live.get(request_id) is live:  # a request that migrated back here meanwhile is not ours
                del self.live[request_id]
        outcome = live.outcome(request_id, self.unit_id, time.time())
        self.outcomes.append(outcome)
        if self.on_finish is not None:
            self.on_finish(self.unit_id, outcome)
        return outcome

    def _output(self, request_id: str, live: LiveRequest, done: asyncio.Future[None], out: Any) -> None:
        """One output of a request (or the exception that ends it), in vLLM's output handler: counted, handed to the
        request's ``on_output``, and its end resolves ``done``. Nothing here may raise into vLLM's handler, which
        serves every request: an error ends this request alone. Once ``done`` is resolved or cancelled (the task
        was cancelled: a migration, an abort), later outputs are dropped, as a cancelled ``generate()`` reads none."""
        if done.done():
            return
        if isinstance(out, BaseException):
            done.set_exception(out)
            return
        try:
            first = out.outputs[0] if out.outputs else None
            n = len(first.token_ids) if first is not None else 0
            if n and live.took(n, time.time()) and self.on_first_token is not None:
                self.on_first_token(self.unit_id, request_id)
            on_output = live.on_output  # read each time: a migration detaches it
            if on_output is not None and first is not None and (n or out.finished):
                on_output(TokenDelta(tuple(first.token_ids), first.text or "",
                                     first.finish_reason if out.finished else None, first.stop_reason,
                                     out if live.params is not None else None))
        except Exception as exc:  # handed to the request's task, not to vLLM's output handler
            done.set_exception(exc)
            return
        if out.finished:
            done.set_result(None)

    # -- load -------------------------------------------------------------------------------------
    def requests(self) -> tuple[RunningRequest, ...]:
        """The requests the front end has on the unit (:func:`~agent.engine.live.resident_requests`)."""
        return resident_requests(self.live)

    def load(self, healthy: bool = True, with_requests: bool = False) -> UnitLoad:
        """What a dispatcher sees: the last step record, corrected by what the front end knows since;
        ``with_requests`` fills ``requests`` (:meth:`requests`)."""
        resident = len(self.live)
        last = self.last
        if last is None:
            running = used = queued = inflight = 0
            last_step_s: float | None = None
            pab: float | None = None
        else:
            running = min(last.num_running, resident)
            used = last.kv_used_blocks
            queued = last.queued_prefill_tokens
            inflight = last.num_prefill_tokens + last.num_decode_tokens
            last_step_s = last.duration_s
            # An idle engine does not step, so its last PAB is stale (it was measured under load): report none,
            # which a budget balancer treats as an idle unit's (unbounded). Seen on the H100: `pab` sent 2,996 of
            # 3,000 requests to the unit that kept stepping.
            pab = last.admission_budget if resident else None
        steps = len(self.records)
        queued += self.submitted_prompt_since_record
        requests = self.requests() if with_requests else ()
        return UnitLoad(
            unit_id=self.unit_id, healthy=healthy, num_running=running, num_waiting=resident - running,
            kv_used_blocks=used, num_blocks=self.num_blocks, kv_tokens=used * self.block_size,
            queued_prefill_tokens=queued,
            last_step_s=last_step_s,
            mean_step_s=self._step_time_sum / steps if steps else None,
            prefill_admission_budget=None if pab is None else pab - self.submitted_prompt_since_record,
            max_num_seqs=self.options.max_num_seqs, steps_done=steps, busy=resident > 0,
            inflight_tokens=inflight,
            chunk_tokens=self.options.max_num_batched_tokens, block_size=self.block_size,
            migrations_inflight=sum(r.migrating for r in requests), requests=requests,
        )


if TYPE_CHECKING:
    _CHECKED: type[LiveEngine] = VllmUnit  # mypy checks that it implements the protocol
