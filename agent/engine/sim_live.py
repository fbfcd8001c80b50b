"""A simulated unit as a live engine: it steps by itself in the event loop, in wall time (issue #14, item 0).

:class:`SimLiveUnit` runs a :class:`~agent.engine.sim.SimUnit` (the calibrated simulator: its batch policy, its KV
cache, its step timer) behind the :class:`~agent.engine.live.LiveEngine` interface that vLLM units implement, so the
live cluster (``agent.runtime.live.cluster``), its node for the hub and the control plane, migration by recompute,
engine failures and restarts all run, and are tested, without vLLM. It is the second implementation of that interface,
and keeps it honest: what the cluster needs from an engine is in the protocol, not in ``VllmUnit``.

- **Steps**: while the unit has work and is not paused, a task plans a step (``SimUnit.begin_step``), sleeps for the
  step's duration as the unit's timer gives it, and ends it. The unit keeps its own clock, as an engine core in a
  process of its own does: steps run back to back (the next starts when the last ended, however late the event loop
  got to it; after an idle spell, at the wall clock), and a step lasts exactly what the timer said. What the loop's
  delays change is when the front end gets the outputs: tokens are counted when the loop gets to them, by the
  request's :class:`~agent.engine.live.LiveRequest` (TTFT and TPOT as a client would see them;
  :attr:`SimLiveUnit.late_s` sums the delays), and streamed as
  :class:`~agent.engine.vllm.sampling.TokenDelta` s with made-up token ids (the simulator has no model); every request
  produces exactly ``max_tokens`` (no end of sequence, no stop strings). Behind a tokenizer (``token``: vLLM's OpenAI
  app over simulated units, :mod:`agent.engine.vllm.sim_model`) every token is that one id with its text, as the fake
  executor's are; without one the ids differ by position and carry no text.
- **Aborts**: cancelling a request's task takes it off the unit (its KV freed), after the step in flight when it is
  part of it.
- **Control**: :func:`~agent.engine.live.apply_control` on the unit's policy, at once (a new policy plans the next step,
  never one in flight), answered at once.
- **Failures**: :meth:`SimLiveUnit.kill` stands for an engine-core process that died: the unit fails (``on_failed``)
  and each of its requests' tasks raises :class:`~agent.engine.live.EngineFailed`. :meth:`SimLiveUnit.restart` builds
  a fresh unit with ``make``.
- **Hangs**: :meth:`SimLiveUnit.hang` stands for an engine core that is alive but makes no progress. With ``hang_s``
  set, the unit's watchdog (:func:`~agent.engine.live.watchdog`, the one vLLM units run) finds it after ``hang_s``
  with requests in flight and kills it (:meth:`SimLiveUnit.kill`).

There is no engine process (``engine_pid`` is None).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from agent.engine.base import RequestOutcome, StepResult, SubmittedRequest
from agent.engine.live import (
    EngineFailed,
    FailedCallback,
    FinishCallback,
    FirstTokenCallback,
    LiveEngine,
    LiveRequest,
    StepCallback,
    apply_control,
    build_policy,
    resident_requests,
    watchdog,
)
from agent.engine.sim import SimUnit
from agent.engine.vllm.messages import ControlReply, ControlRequest
from agent.engine.vllm.sampling import Sampling, TokenDelta
from policies.types import UnitLoad

VOCAB = 32_000
"""Made-up token ids are below this."""
WAKE_EARLY_S = 0.001
"""How early the unit wakes before a step's end (see ``SimLiveUnit._steps``)."""


def token_id(index: int) -> int:
    """The made-up id of a request's output token number ``index`` (from 0): the same on any unit, so that a request
    moved by recompute goes on with the ids it would have had."""
    return 1 + (7919 * (index + 1)) % (VOCAB - 1)


class SimLiveUnit:
    """A :class:`~agent.engine.sim.SimUnit` stepping on its own (see the module's docstring). ``make`` builds the unit,
    now and at each :meth:`restart`; ``clock`` is the wall clock the cluster uses (seconds)."""

    def __init__(self, make: Callable[[], SimUnit], *, clock: Callable[[], float] = time.time,
                 hang_s: float | None = None, watch_interval_s: float = 0.5,
                 token: tuple[int, str] | None = None) -> None:
        self._make = make
        self.token = token
        """The id and text of every token the unit produces (a tokenizer's: the OpenAI intake renders them); None:
        made-up ids (:func:`token_id`) without text."""
        self.hang_s = hang_s
        """No progress for this long with requests in flight (and not paused) is a hang (:meth:`hang`); None: no
        watchdog."""
        self.watch_interval_s = watch_interval_s
        self.sim = make()
        self.unit_id = self.sim.unit_id
        self._clock = clock
        self.live: dict[str, LiveRequest] = {}
        self._done: dict[str, asyncio.Future[RequestOutcome]] = {}
        """Each live request's outcome, to come."""
        self.on_step: StepCallback | None = None
        self.on_first_token: FirstTokenCallback | None = None
        self.on_finish: FinishCallback | None = None
        self.on_failed: FailedCallback | None = None
        self.failure: str | None = None
        self.paused = False
        self.last_preempted: tuple[str, ...] = ()
        self.num_steps = 0
        """Steps run, over restarts (the step records' ids go on across a restart, as a vLLM unit's do)."""
        self.num_finished = 0
        """Requests finished, over restarts."""
        self.hung = False
        """:meth:`hang` was called (until :meth:`restart`)."""
        self.late_s = 0.0
        """How much later than its step ended the event loop got to each step's outputs, in all."""
        self.max_late_s = 0.0
        self.lateness: list[float] | None = None
        """Set to a list to collect each step's delay (``late_s``'s terms; benchmarks)."""
        self._started = False
        self._stepper: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._dropping: set[str] = set()
        """Requests aborted while part of the step in flight: taken off the unit when it ends."""
        self._deferred: list[SubmittedRequest] = []
        """Submissions of a request that is still being dropped (moved back here at once): made after the step."""
        self._replies: dict[str, ControlReply] = {}
        self._prompt_since_step = 0
        """Prompt tokens submitted since the last step ended (what the policy's admission budget has not seen)."""
        self._step_base = 0
        """Added to the unit's step ids: the steps its earlier units made (its records' ids stay unique)."""

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start stepping (inside the running loop), and the watchdog with ``hang_s``."""
        self._started = True
        loop = asyncio.get_running_loop()
        if self._stepper is None and self.failure is None and not self.hung:
            self._stepper = loop.create_task(self._steps())
        if self._watchdog is None and self.hang_s:
            self._watchdog = loop.create_task(watchdog(self, self._hung_for, self.kill))

    async def stop(self) -> None:
        """Stop stepping for good (:meth:`restart` starts afresh); requests still on the unit are left unanswered (the
        cluster aborts them first)."""
        self._started = False
        tasks = [t for t in (self._stepper, self._watchdog) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._stepper = self._watchdog = None

    def hang(self) -> None:
        """The engine stops making progress but does not die (a hung engine core): no more steps, no failure until
        the watchdog (with ``hang_s``) finds it."""
        self.hung = True
        if self._stepper is not None:
            self._stepper.cancel()
            self._stepper = None

    def _hung_for(self, stalled_s: float) -> str:
        """The watchdog's kill of a hung engine: why the unit fails."""
        return f"engine hung: no step for {stalled_s:.1f} s with {len(self.live)} request(s) in flight"

    def progress(self) -> tuple[int, int]:
        """Steps and finished requests, ever (what the watchdog counts as progress, with tokens)."""
        return self.num_steps, self.num_finished

    async def restart(self) -> None:
        """A fresh unit from ``make`` in place of this one (its requests are forgotten: the cluster moved them)."""
        await self.stop()
        self.sim = self._make()
        self.live.clear()
        self._done.clear()
        self._dropping.clear()
        self._deferred.clear()
        self.failure = None
        self.paused = False
        self.hung = False
        self.last_preempted = ()
        self._prompt_since_step = 0
        self._step_base = self.num_steps  # the fresh unit counts its steps from 0
        self.start()

    def kill(self, reason: str = "engine killed") -> None:
        """The engine dies: it stops stepping, the unit fails, and its requests' tasks raise ``EngineFailed``."""
        if self.failure is not None:
            return
        if self._stepper is not None:
            self._stepper.cancel()
            self._stepper = None
        self.failure = reason
        for fut in self._done.values():
            if not fut.done():
                fut.set_exception(EngineFailed(self.unit_id, reason))
        if self.on_failed is not None:
            asyncio.get_running_loop().call_soon(self.on_failed, self.unit_id, reason)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def serving(self) -> bool:
        return self._started

    @property
    def engine_pid(self) -> int | None:
        return None

    @property
    def takes_control(self) -> bool:
        return True

    def check_engine(self) -> str | None:
        return self.failure

    async def pause(self) -> None:
        """Stop stepping after the step in flight; requests stay, their KV kept."""
        self.paused = True

    async def resume(self) -> None:
        self.paused = False
        self._wake.set()

    # -- control ----------------------------------------------------------------------------------
    def send_control(self, message: ControlRequest) -> str:
        """Apply a control request now (see the module's docstring); its reply waits under the returned id."""
        mid = uuid.uuid4().hex
        policy, reply = apply_control(self.sim.policy, msgspec.structs.replace(message, id=mid), self.unit_id,
                                      build_policy)
        if policy is not self.sim.policy:
            self.sim.set_policy(policy)
        self._replies[mid] = reply
        self._wake.set()
        return mid

    async def reply(self, mid: str, timeout_s: float = 30.0, *, what: str = "control message") -> ControlReply:
        try:
            return self._replies.pop(mid)
        except KeyError:
            raise KeyError(f"unit {self.unit_id}: no {what} {mid} was sent") from None

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, *, arrival_s: float,
               ttft_slo_s: float, tpot_slo_s: float, sampling: Sampling | None = None,
               on_output: Callable[[TokenDelta], None] | None = None, prompt_tokens: int | None = None,
               prior_outputs: int = 0, first_token_s: float | None = None,
               params: Any = None, max_tpot_s: float | None = None) -> asyncio.Task[RequestOutcome]:
        """Start a request (:meth:`~agent.engine.live.LiveEngine.submit`); a prompt the unit cannot hold fails the
        task with ``ValueError``."""
        loop = asyncio.get_running_loop()
        live = self.live[request_id] = LiveRequest.submitted(
            prompt_token_ids, max_tokens, self._clock(), arrival_s=arrival_s, ttft_slo_s=ttft_slo_s,
            tpot_slo_s=tpot_slo_s, sampling=sampling, on_output=on_output, prompt_tokens=prompt_tokens,
            prior_outputs=prior_outputs, first_token_s=first_token_s, params=params, max_tpot_s=max_tpot_s,
        )
        fut: asyncio.Future[RequestOutcome] = loop.create_future()
        self._done[request_id] = fut
        if self.failure is not None:
            fut.set_exception(EngineFailed(self.unit_id, self.failure))
        else:
            spec = SubmittedRequest(request_id, arrival_s, len(prompt_token_ids), max_tokens, ttft_slo_s, tpot_slo_s)
            self._prompt_since_step += len(prompt_token_ids)
            if request_id in self._dropping:
                self._deferred.append(spec)
            else:
                try:
                    self.sim.submit(spec, self._clock())
                except ValueError as exc:
                    fut.set_exception(exc)
            self._wake.set()
        task = loop.create_task(self._outcome(fut))
        task.add_done_callback(lambda t: self._ended(request_id, live, fut, t))
        return task

    @staticmethod
    async def _outcome(fut: asyncio.Future[RequestOutcome]) -> RequestOutcome:
        return await fut

    def _ended(self, request_id: str, live: LiveRequest, fut: asyncio.Future[RequestOutcome],
               task: asyncio.Task[RequestOutcome]) -> None:
        """A request's task is over: forget it; a cancelled one (aborted, or moved away) leaves the unit."""
        if self.live.get(request_id) is live:
            del self.live[request_id]
        if self._done.get(request_id) is not fut:
            return  # submitted here again meanwhile: the new submission is not ours to touch
        del self._done[request_id]
        if task.cancelled() and self.failure is None:
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        sim = self.sim
        deferred = [s for s in self._deferred if s.request_id == request_id]
        if deferred:
            self._deferred.remove(deferred[0])
        elif sim.stepping(request_id):
            self._dropping.add(request_id)
        elif sim.has_request(request_id):
            sim.detach(request_id)
        self._wake.set()

    # -- stepping ---------------------------------------------------------------------------------
    async def _steps(self) -> None:
        wake = self._wake
        ended: float | None = None  # when the engine's last step ended, on its own clock; None: it has waited since
        while True:
            sim = self.sim
            if self.paused or not sim.has_work():
                wake.clear()
                await wake.wait()
                ended = None
                continue
            before = {rid: r.output for rid, r in sim.requests.items()}
            start = self._clock() if ended is None else ended  # back to back: the engine does not wait for the loop
            duration = sim.begin_step(start)
            if duration is None:  # nothing the policy would run now: wait for a change
                wake.clear()
                await wake.wait()
                ended = None
                continue
            ended = start + duration
            # Woken up to a millisecond early (an epoll wait is rounded up to whole milliseconds, which would make every
            # step's outputs late by up to that), the outputs count from the step's end or from when the loop got to
            # them, whichever is later: what is left is the loop's own delay, as when a vLLM unit's outputs arrive.
            await asyncio.sleep(max(0.0, ended - self._clock() - WAKE_EARLY_S))
            now = max(self._clock(), ended)
            late = now - ended
            self.late_s += late
            if late > self.max_late_s:
                self.max_late_s = late
            if self.lateness is not None:
                self.lateness.append(late)
            self._after(sim.end_step(ended), before, now)

    def _after(self, result: StepResult, before: dict[str, int], now: float) -> None:
        """Report a step whose outputs the event loop got to at ``now``: tokens, first tokens, finishes (timed at
        ``now``, as the front end of a vLLM unit times them), then the step record (on the engine's clock)."""
        sim = self.sim
        self.num_steps += 1
        self.last_preempted = result.preempted
        self._prompt_since_step = 0
        dropped = self._dropping
        self._dropping = set()
        for rid in dropped:
            if sim.has_request(rid):
                sim.detach(rid)
        for spec in self._deferred:
            fut = self._done.get(spec.request_id)
            try:
                sim.submit(spec, now)
            except ValueError as exc:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
        self._deferred.clear()
        finished = {o.request_id: o for o in result.finished}
        for rid, was in before.items():
            live, fut = self.live.get(rid), self._done.get(rid)
            if rid in dropped or live is None or fut is None or fut.done():
                continue
            req = sim.requests.get(rid)
            done = finished.get(rid)
            n = (req.output if req is not None else done.output_tokens if done is not None else was) - was
            if n > 0:
                if live.took(n, now) and self.on_first_token is not None:
                    self.on_first_token(self.unit_id, rid)
                if live.on_output is not None:
                    end = "length" if done is not None else None
                    if self.token is not None:
                        live.on_output(TokenDelta((self.token[0],) * n, self.token[1] * n, end))
                    else:
                        live.on_output(TokenDelta(tuple(token_id(i) for i in range(live.outputs - n, live.outputs)),
                                                  "", end))
            if done is not None:
                outcome = live.outcome(rid, self.unit_id, now)
                self.num_finished += 1
                fut.set_result(outcome)
                if self.on_finish is not None:
                    self.on_finish(self.unit_id, outcome)
        if self.on_step is not None:
            record = result.record
            if self._step_base:
                record = msgspec.structs.replace(record, step_id=record.step_id + self._step_base)
            self.on_step(self.unit_id, record)

    # -- load -------------------------------------------------------------------------------------
    def load(self, healthy: bool = True, with_requests: bool = False) -> UnitLoad:
        """The unit's own load (exact: the simulator knows it), with the front end's requests when asked. The
        policy's admission budget is reduced by the prompts submitted since its last step, as a vLLM unit reports
        it (the live cluster asks ``refuses_within`` with it; the policy itself counts only what ``refuses``
        admitted, which a live node never calls)."""
        load = self.sim.load()
        pab = load.prefill_admission_budget
        if pab is not None:
            pab -= self._prompt_since_step
        requests = resident_requests(self.live) if with_requests else ()
        return dataclasses.replace(load, healthy=healthy, requests=requests, prefill_admission_budget=pab,
                                   migrations_inflight=sum(1 for r in self.live.values() if r.migrating))


if TYPE_CHECKING:
    _CHECKED: type[LiveEngine] = SimLiveUnit  # mypy checks that it implements the protocol
