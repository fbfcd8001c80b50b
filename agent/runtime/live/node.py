"""Live vLLM units as the agent's node: what ``trackside agent --engine vllm`` streams and steers.

:class:`LiveClusterNode` wraps a :class:`~agent.runtime.live.cluster.LiveCluster` (the units, the dispatcher and the
queue between them) in the :class:`~agent.runtime.port.LiveNode` protocol, so that the hub, the control plane and the
metrics serve it exactly as they serve the simulated node: the cluster reports to it
(:class:`~agent.runtime.live.cluster.ClusterObserver`) and it calls the same hooks with the same records.

Time base: node time is wall-clock seconds since :attr:`LiveClusterNode.origin_ns` (the agent's start), which the
hub takes as its ``boot_ns``; event times are therefore wall-clock instants, as for the simulated node running
at speed 1. The units stamp steps and tokens with ``time.time()``; records are moved to node time here.

Control: a unit's batch policy lives in its engine-core process. :class:`LiveUnit` keeps the agent's copy of it
(what the control plane validates against, what status and audits show), sends every change over the unit's
control channel, and :meth:`LiveClusterNode.settle` waits for the engine's acknowledgement (an idle engine is asked
to look at its channel at once: ``LiveEngine.reply``); a unit that refuses a change gets its copy back. Pause uses
vLLM's own ``pause_generation(mode="keep")`` (no steps, requests and KV kept); pause, drain and resume also close
and open the unit to the dispatcher.

What differs from simulated units: a unit's ``running_views`` (slack samples) are every request the front end has
on it, running or waiting in the engine; a unit's admission control (FairBatching+PAB) is asked at dispatch with the
admission budget the engine last reported (``BatchPolicy.refuses_within``), and a request it refuses is rejected
with ``refused_by`` set; a request its client aborted, or that its engine failed, has no ``request_finished``.

Engine failures: a unit whose engine core died is in mode ``failed`` (``set_unit_mode`` refuses it) and
:attr:`LiveClusterNode.on_fault` hears of it (the hub's ``unit_failed`` alert); its requests go on elsewhere
(``LiveCluster``'s evacuation, reported as migrations with reason ``unit_failed``). When the cluster restarts it,
it is ``active`` again and :attr:`LiveClusterNode.on_recover` hears of it (``unit_restarted``). The control plane fails
a unit on request the same way (:meth:`LiveClusterNode.fail_unit`: its engine keeps running, and is not restarted) and
brings it back (:meth:`LiveClusterNode.recover_unit`: at once, or by a restart now when its engine is dead, which
:meth:`LiveClusterNode.settle` waits for).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.live import LiveEngine
from agent.engine.vllm.messages import SetParams, SetPolicy
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.requests import (
    ClusterRequest,
    PendingTimeout,
    RequestAborted,
    RequestRejected,
    RequestStream,
)
from agent.runtime.port import FaultHook, FinishHook, RequestHook, Settled, StepHook, check_settable
from agent.runtime.records import DispatchHook, MigrateHook, MigrationRecord, PreemptHook, RequestState
from agent.workload.prompts import prompt_ids
from agent.workload.types import RequestSpec
from policies.base import BatchPolicy, DispatchPolicy
from policies.params import ParamValue
from policies.types import DispatchDecision, PendingRequest, RequestView, UnitLoad

log = logging.getLogger(__name__)

REPLAY_PRUNE = 1024
"""A workload replay drops its ended streams once it holds this many (or, when more, twice as many as were left at its
last pruning)."""


@dataclass(slots=True)
class _Sent:
    """A control message on its way to a unit, and how to take the agent's copy back if the unit refuses it."""

    unit: LiveUnit
    message_id: str
    what: str
    undo: Callable[[], None]


class LiveUnit:
    """One vLLM unit as the hub and the control plane see it (:class:`agent.runtime.port.ServedUnit`)."""

    def __init__(self, unit: LiveEngine, policy: BatchPolicy, node: LiveClusterNode) -> None:
        self.unit = unit
        self._policy = policy
        self._node = node

    @property
    def unit_id(self) -> int:
        return self.unit.unit_id

    @property
    def policy(self) -> BatchPolicy:
        """The agent's copy of the engine's batch policy (name, parameters, schema; its decisions are the
        engine's)."""
        return self._policy

    def set_policy(self, policy: BatchPolicy) -> None:
        old = self._policy
        self._policy = policy
        mid = self.unit.send_control(SetPolicy(name=policy.name, params=dict(policy.params)))
        self._node._sent.append(_Sent(self, mid, f"set_policy {policy.name}", lambda: self._restore(old)))

    def set_policy_params(self, changes: Mapping[str, ParamValue]) -> None:
        policy = self._policy
        old = policy.apply_params(changes)  # checked by the control plane; the engine checks what it receives
        mid = self.unit.send_control(SetParams(changes=dict(changes)))

        def undo() -> None:
            policy.apply_params(old)

        self._node._sent.append(_Sent(self, mid, "set_params", undo))

    def _restore(self, policy: BatchPolicy) -> None:
        self._policy = policy

    @property
    def engine_pid(self) -> int | None:
        """The process id of the unit's engine core."""
        return self.unit.engine_pid

    @property
    def failure(self) -> str | None:
        """Why the unit failed (None while its engine runs)."""
        return self._node.cluster.failed.get(self.unit_id)

    def load(self, with_requests: bool = False) -> UnitLoad:
        """The unit's load as its dispatcher sees it (``with_requests``: its resident requests too)."""
        return self.unit.load(with_requests=with_requests)

    def running_views(self) -> tuple[RequestView, ...]:
        """Every request the front end has on the unit (running or waiting in the engine), in node time."""
        origin = self._node.origin_s
        preemptions = self._node.preemptions
        out = []
        for rid, live in self.unit.live.items():
            first = live.first_token_s
            outputs = live.outputs
            out.append(RequestView(
                rid, live.arrival_s - origin, live.prompt_tokens,
                live.prompt_tokens + outputs - 1 if outputs > live.prior_outputs else 0, outputs, live.ttft_slo_s,
                live.tpot_slo_s,
                None if first is None else first - origin, preemptions.get(rid, 0),
            ))
        return tuple(out)


class LiveClusterNode:
    """A :class:`LiveCluster` as an :class:`agent.runtime.port.LiveNode` (see the module's docstring)."""

    def __init__(self, cluster: LiveCluster[Any], policies: Sequence[BatchPolicy], *, origin_ns: int | None = None,
                 requests: Sequence[RequestSpec] = (), vocab: int = 32000, seed: int = 0,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        if len(policies) != len(cluster.units):
            raise ValueError("one batch policy (the agent's copy of the engine's) per unit")
        self.cluster = cluster
        self._clock_ns = clock_ns
        self._origin_ns = clock_ns() if origin_ns is None else origin_ns
        self.origin_s = self._origin_ns / 1e9
        """:attr:`origin_ns` in seconds (the units' clock is ``time.time()``)."""
        self.units = [LiveUnit(u, p, self) for u, p in zip(cluster.units, policies, strict=True)]
        cluster.refuses = self._refuses
        self.unit_modes: list[str] = ["active"] * len(self.units)
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        """A workload to replay (arrival times from :meth:`serve`'s start); none when requests come over HTTP."""
        self.vocab = vocab
        self.seed = seed
        self.on_step: StepHook | None = None
        self.on_finish: FinishHook | None = None
        self.on_request: RequestHook | None = None
        self.on_dispatch: DispatchHook | None = None
        self.on_preempt: PreemptHook | None = None
        self.on_migrate: MigrateHook | None = None
        """Each migration by recompute (``LiveCluster``: aborted on its source, re-submitted on its target)."""
        self.on_fault: FaultHook | None = None
        """A unit's engine core died (``unit_id``, reason)."""
        self.on_recover: FaultHook | None = None
        """A failed unit was restarted and takes requests again (``unit_id``, how)."""
        self.states: dict[str, RequestState] = {}
        """The requests in flight (pending or on a unit): finished, refused and ended ones are forgotten."""
        self.preemptions: dict[str, int] = {}
        """Preemptions so far of the requests in flight that had any (from the units' step records)."""
        self.num_arrived = 0
        self.num_finished = 0
        self.num_rejected = 0
        self.num_ended = 0
        """Requests that ended without an outcome (aborted by their client, or failed by their engine)."""
        self.num_dispatches = 0
        self.num_migrations = 0
        self.replaying: list[RequestStream] = []
        """The workload replay's streams not known to have ended yet: ended ones are dropped whenever the list reaches
        :data:`REPLAY_PRUNE` or twice what was left at the last pruning (a stream holds its prompt's and outputs' token
        ids, and a replay can run for days)."""
        self._sent: list[_Sent] = []
        self._actions: list[tuple[int, str, asyncio.Task[None]]] = []
        self._mode_task: dict[int, asyncio.Task[None]] = {}
        cluster.observer = self

    # -- what the hub reads -----------------------------------------------------------------------
    @property
    def origin_ns(self) -> int:
        return self._origin_ns

    @property
    def dispatcher(self) -> DispatchPolicy:
        return self.cluster.dispatcher

    @property
    def now_s(self) -> float:
        return (self._clock_ns() - self._origin_ns) / 1e9

    @property
    def num_pending(self) -> int:
        return len(self.cluster.pending)

    @property
    def num_refused(self) -> int:
        """Refused at dispatch by the admission control of the unit they were placed on (a subset of
        :attr:`num_rejected`)."""
        return self.cluster.num_refused

    def _refuses(self, unit_id: int, prompt_tokens: int) -> bool:
        """The unit's batch policy (the agent's copy) asked with the admission budget the engine last reported."""
        unit = self.units[self.unit_index(unit_id)]
        return unit.policy.refuses_within(prompt_tokens, unit.unit.load().prefill_admission_budget)

    def unit_index(self, unit_id: int) -> int:
        for i, u in enumerate(self.units):
            if u.unit_id == unit_id:
                return i
        raise KeyError(f"no unit {unit_id} (units: {', '.join(str(u.unit_id) for u in self.units)})")

    def _node_s(self, t_s: float) -> float:
        return t_s - self.origin_s

    # -- control ------------------------------------------------------------------------------------
    def set_dispatcher(self, dispatcher: DispatchPolicy) -> None:
        self.cluster.set_dispatcher(dispatcher)

    def set_unit_mode(self, unit_id: int, mode: str) -> str:
        """``active``, ``draining`` (no new requests, the unit finishes its own) or ``paused`` (no new requests and
        no steps: vLLM's ``pause_generation(mode="keep")``); the engine's part completes in :meth:`settle`."""
        check_settable(mode)
        index = self.unit_index(unit_id)
        old = self.unit_modes[index]
        if old == "failed":
            raise ValueError(f"unit {unit_id} has failed: {self.cluster.failed.get(unit_id, 'engine core dead')}")
        self.unit_modes[index] = mode
        unit = self.units[index].unit
        if mode == "paused" and old != "paused":
            self._act(unit_id, "pause", unit.pause)
        elif mode != "paused" and old == "paused":
            self._act(unit_id, "resume", unit.resume)
        self.cluster.set_accepting(unit_id, mode == "active")
        return old

    def fail_unit(self, unit_id: int, reason: str = "") -> int:
        """Take a unit out as a failure would (``LiveCluster.fail_unit``: its requests go on elsewhere, its engine
        keeps running and is not restarted); a paused engine is resumed (it is empty once its requests are gone). How
        many requests moved; ``ValueError`` when it has failed already."""
        index = self.unit_index(unit_id)
        if self.unit_modes[index] == "failed":
            why = self.cluster.failed.get(unit_id, "engine core dead")
            raise ValueError(f"unit {unit_id} has failed already: {why}")
        if self.unit_modes[index] == "paused":  # after the pause, in the order asked
            self._act(unit_id, "resume", self.units[index].unit.resume)
        return self.cluster.fail_unit(unit_id, reason or "failed on request")

    def recover_unit(self, unit_id: int) -> None:
        """Bring a failed unit back (``LiveCluster.recover_unit``): at once when its engine runs, else by a restart
        now, which :meth:`settle` waits for (a restart that fails is reported there). ``ValueError`` when it has not
        failed."""
        index = self.unit_index(unit_id)
        if self.unit_modes[index] != "failed":
            raise ValueError(f"unit {unit_id} has not failed")
        task = self.cluster.recover_unit(unit_id)
        if task is not None:
            self._actions.append((unit_id, "restart", task))

    def _act(self, unit_id: int, what: str, action: Callable[[], Awaitable[None]]) -> None:
        """Run ``action`` on the engine after the unit's previous pause or resume (in the order asked)."""
        before = self._mode_task.get(unit_id)

        async def run() -> None:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            await action()

        task = asyncio.get_running_loop().create_task(run(), name=f"unit {unit_id} {what}")
        self._mode_task[unit_id] = task
        self._actions.append((unit_id, what, task))

    async def settle(self, timeout_s: float) -> Settled:
        sent, self._sent = self._sent, []
        actions, self._actions = self._actions, []
        refused: list[str] = []
        unconfirmed: list[str] = []

        async def acknowledged(s: _Sent) -> None:
            try:
                reply = await s.unit.unit.reply(s.message_id, timeout_s, what=s.what)
            except TimeoutError:
                unconfirmed.append(f"unit {s.unit.unit_id}: {s.what} not acknowledged within {timeout_s:g} s "
                                   "(it applies it when it gets to it)")
                return
            except Exception as exc:  # the engine is gone, most likely: report it with the others
                unconfirmed.append(f"unit {s.unit.unit_id}: {s.what} not acknowledged: {exc}")
                return
            if not reply.ok:
                s.undo()
                refused.append(f"unit {s.unit.unit_id}: {reply.error or 'refused'}")

        async def done(unit_id: int, what: str, task: asyncio.Task[None]) -> None:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except TimeoutError:
                unconfirmed.append(f"unit {unit_id}: {what} not done within {timeout_s:g} s")
            except Exception as exc:  # the engine's answer, not a bug of ours: report it
                refused.append(f"unit {unit_id}: {what} failed: {exc}")

        await asyncio.gather(*(acknowledged(s) for s in sent), *(done(*a) for a in actions))
        return Settled(tuple(refused), tuple(unconfirmed))

    # -- running ----------------------------------------------------------------------------------
    async def serve(self, done: asyncio.Event) -> None:
        """Dispatch until cancelled; replay :attr:`requests` first when there are any (``done`` is set once the
        last of them has finished or been refused)."""
        self.cluster.start()
        if self.requests:
            await self._replay()
            done.set()
        await asyncio.Event().wait()

    async def _replay(self) -> None:
        t0 = time.time()
        streams = self.replaying
        keep = REPLAY_PRUNE
        for spec in self.requests:
            delay = t0 + spec.arrival_s - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(streams) >= keep:
                streams[:] = [s for s in streams if not s.done]
                keep = max(REPLAY_PRUNE, 2 * len(streams))
            streams.append(self.cluster.submit(ClusterRequest(
                spec.request_id, prompt_ids(spec, self.vocab, self.seed), spec.output_tokens,
                ttft_slo_s=spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms else None,
                tpot_slo_s=spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None,
                arrival_s=t0 + spec.arrival_s,
            ), collect=False))
        await asyncio.gather(*(s.wait() for s in streams), return_exceptions=True)

    async def close(self) -> None:
        """Stop dispatching and abort what is in flight (the units keep running: stop them apart)."""
        await self.cluster.close()
        for _, _, task in self._actions:
            task.cancel()

    # -- what the cluster reports (ClusterObserver) ---------------------------------------------------
    def arrived(self, stream: RequestStream, pending: PendingRequest) -> None:
        self.num_arrived += 1
        r = stream.request
        spec = RequestSpec(stream.request_id, max(0.0, self._node_s(pending.arrival_s)),
                           max(1, len(r.prompt_token_ids)), max(1, r.max_tokens))
        state = self.states[stream.request_id] = RequestState(spec, pending.ttft_slo_s, pending.tpot_slo_s)
        if self.on_request is not None:
            self.on_request("arrived", state)

    def dispatching(self, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        self.num_dispatches += 1  # a paused or draining unit's load is unhealthy already (the cluster's)
        if self.on_dispatch is not None:
            self.on_dispatch(self.num_dispatches, loads, decision)

    def launched(self, stream: RequestStream, pending: PendingRequest) -> None:
        state = self.states.get(stream.request_id)
        if state is None:
            return
        state.unit_id = stream.unit_id
        state.dispatched_s = self.now_s
        state.num_rounds_waited = pending.cycles_waited
        if self.on_request is not None:
            self.on_request("dispatched", state)

    def rejected(self, stream: RequestStream) -> None:
        self.num_rejected += 1
        state = self.states.pop(stream.request_id, None)
        if state is not None:
            state.rejected = True
            error = stream.error
            state.refused_by = error.refused_by if isinstance(error, RequestRejected) else None
            state.refusal_reason = "pending_timeout" if isinstance(error, PendingTimeout) else ""
            if self.on_request is not None:
                self.on_request("refused", state)

    def stepped(self, unit: LiveEngine, record: StepRecord) -> None:
        record = msgspec.structs.replace(record, start_s=self._node_s(record.start_s))
        if self.on_step is not None:
            self.on_step(record)
        raw = unit.last_preempted
        if raw:
            ids = tuple(self._our_id(rid) for rid in raw)
            for rid in ids:
                if rid in self.states:
                    self.preemptions[rid] = self.preemptions.get(rid, 0) + 1
            if self.on_preempt is not None:
                self.on_preempt(record, ids)

    def _our_id(self, engine_id: str) -> str:
        """vLLM adds a random suffix (``-1a2b3c4d``) to the request ids it is given."""
        if engine_id in self.states:
            return engine_id
        base, sep, _ = engine_id.rpartition("-")
        return base if sep and base in self.states else engine_id

    def first_token(self, unit: LiveEngine, request_id: str) -> None:
        state = self.states.get(request_id)
        if state is not None and self.on_request is not None:
            self.on_request("first_token", state)

    def finished(self, unit: LiveEngine, outcome: RequestOutcome) -> None:
        rid = outcome.request_id
        self.states.pop(rid, None)
        self.num_finished += 1
        outcome = msgspec.structs.replace(outcome, arrival_s=self._node_s(outcome.arrival_s),
                          first_token_s=self._node_s(outcome.first_token_s), finish_s=self._node_s(outcome.finish_s),
                          num_preemptions=self.preemptions.pop(rid, 0))
        if self.on_finish is not None:
            self.on_finish(outcome)

    def ended(self, stream: RequestStream) -> None:
        if self.states.pop(stream.request_id, None) is not None:
            self.num_ended += 1
            self.preemptions.pop(stream.request_id, None)
            if stream.error is not None and not isinstance(stream.error, RequestAborted):
                log.warning("request %s failed on unit %s: %s", stream.request_id, stream.unit_id, stream.error)

    def unit_failed(self, unit: LiveEngine, reason: str, num_evacuated: int) -> None:
        self.unit_modes[self.unit_index(unit.unit_id)] = "failed"
        log.error("unit %s failed: %s (%d request(s) go on elsewhere)", unit.unit_id, reason, num_evacuated)
        if self.on_fault is not None:
            self.on_fault(unit.unit_id, reason)

    def unit_restarted(self, unit: LiveEngine, num_attempts: int) -> None:
        index = self.unit_index(unit.unit_id)
        self.unit_modes[index] = "active"
        if unit.takes_control:  # the fresh engine starts with the launch policy: give it the current one
            served = self.units[index]
            served.set_policy(served.policy)
        how = f"restarted (attempt {num_attempts}){_pid(unit)}"
        log.warning("unit %s %s", unit.unit_id, how)
        if self.on_recover is not None:
            self.on_recover(unit.unit_id, how)

    def unit_recovered(self, unit: LiveEngine) -> None:
        self.unit_modes[self.unit_index(unit.unit_id)] = "active"
        how = f"recovered on request{_pid(unit)}"
        log.warning("unit %s %s", unit.unit_id, how)
        if self.on_recover is not None:
            self.on_recover(unit.unit_id, how)

    def migrated(self, stream: RequestStream, source_unit: int, target_unit: int, reason: str) -> None:
        state = self.states.get(stream.request_id)
        if state is not None:
            state.unit_id = target_unit
        self.num_migrations += 1
        if self.on_migrate is not None:
            now = self.now_s
            self.on_migrate(MigrationRecord(stream.request_id, source_unit, target_unit, reason, "recompute", now, now,
                                            0))


def _pid(unit: LiveEngine) -> str:
    """``, engine core pid P`` for an engine in a process of its own; nothing for one without."""
    pid = unit.engine_pid
    return "" if pid is None else f", engine core pid {pid}"
