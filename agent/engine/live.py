"""Engines that step on their own, as the live cluster drives them (issue #14, item 0).

A simulated unit under the discrete-event node (:class:`agent.engine.base.Engine`) steps when the node tells it to.
A live engine does not: vLLM's engine core steps in a process of its own (:class:`agent.engine.vllm.unit.VllmUnit`),
and the simulated unit can step by itself in the event loop, in wall time (:class:`agent.engine.sim_live.SimLiveUnit`).
The live cluster (``agent.runtime.live.cluster``) drives either through :class:`LiveEngine`:

- :meth:`LiveEngine.submit` returns at once, with a task that ends with the request's outcome; cancelling it aborts
  the request (its KV is freed). Token deltas come through the request's ``on_output``.
- Steps, first tokens, finishes and the engine's death arrive as callbacks (``on_step``, ``on_first_token``,
  ``on_finish``, ``on_failed``), each with the unit's id.
- A request moves between live engines by recompute only: its task is cancelled on the source and it is submitted
  again on the target with its outputs so far appended to its prompt (``prior_outputs``).
- The batch policy lives in the engine: it is changed by typed control messages
  (:data:`~agent.engine.vllm.messages.ControlRequest`), each answered once applied (:meth:`LiveEngine.reply`);
  :func:`apply_control` is how an engine applies one.

What the front end knows of a request on a unit is a :class:`LiveRequest`: every live engine keeps one per request
(:attr:`LiveEngine.live`) and counts its tokens with :meth:`LiveRequest.took`, so that TTFT, the worst per-token TPOT
and the outcome are measured the same way whatever the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agent.engine.base import RequestOutcome, StepRecord, token_tpot_s
from agent.engine.vllm.messages import ControlReply, ControlRequest, Ping, SetParams, SetPolicy
from agent.engine.vllm.sampling import Sampling, TokenDelta
from agent.plugins import load_plugins
from policies.base import BatchPolicy
from policies.params import ParamError, ParamValue
from policies.registry import BATCH_POLICIES
from policies.types import RunningRequest, UnitLoad

log = logging.getLogger(__name__)

ENGINE_HANG_S = 60.0
"""How long a live engine may make no progress while its unit has requests before the unit's watchdog kills it (the
default of vLLM units and of simulated units under the live runtime)."""


class EngineFailed(RuntimeError):
    """A request's engine died under it (the cluster moves the request to another unit)."""

    def __init__(self, unit_id: int, reason: str) -> None:
        super().__init__(f"unit {unit_id}: {reason}")
        self.unit_id = unit_id
        self.reason = reason


@dataclass(slots=True)
class LiveRequest:
    """What the front end knows of a request on a live unit."""

    arrival_s: float
    prompt_tokens: int
    """The request's original prompt (a request migrated here by recompute brings more as its engine prompt)."""
    max_tokens: int
    """Tokens still to produce on this unit."""
    ttft_slo_s: float
    tpot_slo_s: float
    submitted_s: float
    sampling: Sampling | None = None
    on_output: Callable[[TokenDelta], None] | None = None
    first_token_s: float | None = None
    outputs: int = 0
    """Output tokens so far, those produced on a unit the request migrated from included."""
    prior_outputs: int = 0
    """Output tokens produced before the request came to this unit (migrated by recompute)."""
    migrating: bool = False
    """Migrated here by recompute and its first token here not yet out (the target recomputes its KV)."""
    params: Any = None
    """The front end's ``vllm.SamplingParams`` (vLLM's OpenAI app), used instead of ``sampling`` when given."""
    max_tpot_s: float | None = None
    """The worst per-token TPOT so far (``RequestOutcome.max_tpot_s``), on the units it came from included."""
    finish_s: float | None = None
    """When its last token so far came out."""

    @classmethod
    def submitted(cls, prompt_token_ids: list[int], max_tokens: int, now_s: float, *, arrival_s: float,
                  ttft_slo_s: float, tpot_slo_s: float, sampling: Sampling | None = None,
                  on_output: Callable[[TokenDelta], None] | None = None, prompt_tokens: int | None = None,
                  prior_outputs: int = 0, first_token_s: float | None = None, params: Any = None,
                  max_tpot_s: float | None = None) -> LiveRequest:
        """The record of a request submitted at ``now_s`` with :meth:`LiveEngine.submit`'s arguments (one migrated
        here by recompute gives ``prompt_tokens``: it is ``migrating`` until its first token here)."""
        return cls(arrival_s, prompt_tokens if prompt_tokens is not None else len(prompt_token_ids), max_tokens,
                   ttft_slo_s, tpot_slo_s, now_s, sampling, on_output, first_token_s, prior_outputs, prior_outputs,
                   prompt_tokens is not None, params, max_tpot_s)

    def took(self, n: int, t: float) -> bool:
        """``n`` (>= 1) output tokens came out together at ``t``: count them and track the worst per-token TPOT
        (:mod:`agent.engine.vllm.unit`'s docstring, "TPOT": the delta's first token is its worst). True when they
        include the request's first token."""
        before = self.outputs
        self.outputs += n
        self.migrating = False
        self.finish_s = t
        if self.first_token_s is None:
            self.first_token_s = t
            if n > 1:  # the delta's other tokens came out with the first: TPOT 0
                self.max_tpot_s = 0.0
            return True
        if before:
            tpot = token_tpot_s(self.first_token_s, before + 1, t)
            if self.max_tpot_s is None or tpot > self.max_tpot_s:
                self.max_tpot_s = tpot
        return False

    def outcome(self, request_id: str, unit_id: int, now_s: float) -> RequestOutcome:
        """The request's outcome once it finished on ``unit_id`` (``now_s`` stands in for a first token never seen)."""
        first = self.first_token_s if self.first_token_s is not None else now_s
        return RequestOutcome(
            request_id=request_id, unit_id=unit_id, arrival_s=self.arrival_s, first_token_s=first,
            finish_s=self.finish_s if self.finish_s is not None else first, prompt_tokens=self.prompt_tokens,
            output_tokens=self.outputs, num_preemptions=0, ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s,
            max_tpot_s=self.max_tpot_s,
        )


def resident_requests(live: Mapping[str, LiveRequest]) -> tuple[RunningRequest, ...]:
    """The requests the front end has on a unit (running or waiting in the engine), as a rebalancing dispatcher sees
    them. ``computed_tokens`` is an estimate: every known token but the last once the request produced a token on this
    unit, 0 before (a request migrated here recomputes everything)."""
    out = []
    for rid, r in live.items():
        ctx = r.prompt_tokens + r.outputs
        computed = ctx - 1 if r.outputs > r.prior_outputs else 0
        out.append(RunningRequest(rid, ctx, r.prompt_tokens, r.outputs, computed, r.arrival_s, r.migrating))
    return tuple(out)


def build_policy(name: str, params: dict[str, Any]) -> BatchPolicy:
    """A new batch policy ``name``: a built-in or a plugin's (:mod:`agent.plugins`). An engine builds its own (vLLM's
    engine core in its process), so the installed plugins are registered (once) before the first name is looked up."""
    load_plugins(warn=log.warning)
    try:
        cls = BATCH_POLICIES[name]
    except KeyError:
        raise ParamError(f"unknown batch policy {name!r} (known: {', '.join(sorted(BATCH_POLICIES))})") from None
    return cls(params)


def apply_control(policy: BatchPolicy, message: ControlRequest, unit_id: int,
                  build: Callable[[str, dict[str, ParamValue]], BatchPolicy]) -> tuple[BatchPolicy, ControlReply]:
    """Apply a control request to an engine's ``policy`` (``build`` makes a new one by name): the policy the engine
    steps with next, and the reply. A refused request changes nothing."""
    name = ""
    old: dict[str, ParamValue] = {}
    try:
        match message:
            case SetPolicy(name=new_name, params=params):
                policy = build(new_name, dict(params))
                name = policy.name
            case SetParams(changes=changes):
                old = policy.update_params(changes)
            case Ping():
                pass
    except (ParamError, KeyError, TypeError, ValueError) as exc:
        return policy, ControlReply(unit_id=unit_id, id=message.id, ok=False, error=str(exc))
    return policy, ControlReply(unit_id=unit_id, id=message.id, ok=True, policy=name, old=old,
                                params=dict(policy.params))


StepCallback = Callable[[int, StepRecord], None]
"""``(unit_id, record)``: the unit stepped."""
FirstTokenCallback = Callable[[int, str], None]
"""``(unit_id, request_id)``: a request's first token came out (not again after a migration)."""
FinishCallback = Callable[[int, RequestOutcome], None]
"""``(unit_id, outcome)``: a request finished."""
FailedCallback = Callable[[int, str], None]
"""``(unit_id, reason)``: the unit's engine died (called once, from the event loop)."""


class StallClock:
    """How long an engine has made no progress while it had work; pure (the caller passes the time and what it saw).

    Progress is a new step record, a finished request, or more output tokens for a request it had at the last look
    (a request that arrived or left is none: a hung engine takes requests into its queue and lets aborts pile up).
    """

    def __init__(self) -> None:
        self._counts: tuple[int, int] | None = None
        self._outputs: dict[str, int] = {}
        self._since_s: float | None = None
        self._busy = False

    def stalled_s(self, now_s: float, *, steps: int, finished: int, outputs: dict[str, int], busy: bool) -> float:
        """Seconds without progress up to ``now_s`` while ``busy`` (0 when idle or just progressed): ``steps`` and
        ``finished`` count step records and finished requests ever, ``outputs`` the tokens of each request in
        flight."""
        last = self._outputs
        progressed = (steps, finished) != self._counts or any(n > last.get(rid, n) for rid, n in outputs.items())
        self._counts, self._outputs = (steps, finished), outputs
        if progressed or not (busy and self._busy) or self._since_s is None:
            self._since_s = now_s  # the clock runs from the first look at which it had work
        self._busy = busy
        return now_s - self._since_s


class Watched(Protocol):
    """What :func:`watchdog` looks at in a live engine."""

    live: dict[str, LiveRequest]
    failure: str | None
    paused: bool
    watch_interval_s: float
    hang_s: float | None
    """No progress for this long with requests in flight (and not paused) is a hang; None: never."""

    def check_engine(self) -> str | None: ...

    def progress(self) -> tuple[int, int]:
        """Step records and finished requests, ever (both only grow)."""
        ...


async def watchdog(unit: Watched, kill_hung: Callable[[float], str], fail: Callable[[str], None],
                   clock: Callable[[], float] = time.monotonic) -> None:
    """Look at ``unit`` every ``watch_interval_s`` until it has failed: dead (``check_engine`` says why), or hung (no
    progress for ``hang_s`` with requests in flight, :class:`StallClock`: ``kill_hung`` ends the engine and says
    how). ``fail`` records the failure. Every live engine's watchdog (run it as a task)."""
    stall = StallClock()
    while unit.failure is None:
        await asyncio.sleep(unit.watch_interval_s)
        reason = unit.check_engine()
        if reason is None and unit.hang_s:
            steps, finished = unit.progress()
            stalled_s = stall.stalled_s(clock(), steps=steps, finished=finished,
                                        outputs={rid: live.outputs for rid, live in unit.live.items()},
                                        busy=bool(unit.live) and not unit.paused)
            if stalled_s >= unit.hang_s:
                reason = kill_hung(stalled_s)
        if reason is not None:
            fail(reason)


class LiveEngine(Protocol):
    """One DP unit whose engine steps on its own (see the module's docstring)."""

    unit_id: int
    live: dict[str, LiveRequest]
    """The requests submitted and not yet ended, by id."""
    on_step: StepCallback | None
    on_first_token: FirstTokenCallback | None
    on_finish: FinishCallback | None
    on_failed: FailedCallback | None
    failure: str | None
    """Why the engine died (None while it runs)."""

    @property
    def failed(self) -> bool: ...

    @property
    def serving(self) -> bool:
        """The engine was started and is not stopped (it may have died since: :meth:`check_engine`)."""
        ...

    @property
    def engine_pid(self) -> int | None:
        """The engine's process id (None without a process of its own)."""
        ...

    @property
    def takes_control(self) -> bool:
        """The engine runs a trackside batch policy that control messages change (plain vLLM does not)."""
        ...

    @property
    def last_preempted(self) -> tuple[str, ...]:
        """The engine's ids of the requests preempted in its last step (an engine may add a suffix to ours)."""
        ...

    def check_engine(self) -> str | None:
        """Why the engine is dead, None while it runs."""
        ...

    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, *, arrival_s: float,
               ttft_slo_s: float, tpot_slo_s: float, sampling: Sampling | None = None,
               on_output: Callable[[TokenDelta], None] | None = None, prompt_tokens: int | None = None,
               prior_outputs: int = 0, first_token_s: float | None = None,
               params: Any = None, max_tpot_s: float | None = None) -> asyncio.Task[RequestOutcome]:
        """Start a request; the task ends with its outcome, or raises :class:`EngineFailed` when the engine dies under
        it. A request migrated here by recompute gives its original ``prompt_tokens`` and the ``prior_outputs`` it
        produced elsewhere (appended to ``prompt_token_ids``), its ``first_token_s`` and worst TPOT so far."""
        ...

    def load(self, healthy: bool = True, with_requests: bool = False) -> UnitLoad:
        """What a dispatcher sees (``with_requests``: :func:`resident_requests` too)."""
        ...

    async def restart(self) -> None:
        """Replace a dead (or running) engine with a fresh one; its requests are forgotten (the cluster moved them)."""
        ...

    async def pause(self) -> None:
        """Stop stepping; requests stay, their KV kept."""
        ...

    async def resume(self) -> None: ...

    def send_control(self, message: ControlRequest) -> str:
        """Send a control request without waiting; its id (the reply's, :meth:`reply`)."""
        ...

    async def reply(self, mid: str, timeout_s: float = 30.0, *, what: str = "control message") -> ControlReply:
        """The engine's reply to the control message ``mid``, once it has applied it."""
        ...
