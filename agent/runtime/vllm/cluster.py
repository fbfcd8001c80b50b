"""Live vLLM units behind a trackside dispatcher: the agent's request path, shared by replays and HTTP intake.

A submitted request waits at the dispatcher (:class:`~policies.types.PendingRequest`) until the
:class:`~policies.base.DispatchPolicy` places it on a unit or rejects it. The dispatcher is asked on every
arrival, at the ``next_check_s`` it asks for, and (when it ``wants_step_reports``) after every step record while
requests are pending, as in the simulated node. :meth:`VllmCluster.submit` returns a :class:`RequestStream`: an
async iterator of the request's :class:`~agent.engine.vllm.unit.TokenDelta` s (or, with ``collect=False``,
only its outcome). Aborting a request removes it from the pending queue, or cancels it on its unit (vLLM's
``AsyncLLM.abort``, which frees its KV blocks).

A unit can be closed to new requests (:meth:`VllmCluster.set_accepting`: the dispatcher sees it unhealthy), and
the dispatcher swapped (:meth:`VllmCluster.set_dispatcher`). A :class:`ClusterObserver` (the agent's live node,
``agent.runtime.vllm.live``) hears of every arrival, dispatch decision, placement, rejection, step record, first
token, finish and abort.

**Migration by recompute** (vLLM 0.26.0 cannot move a live request's KV): a dispatcher that ``needs_requests`` sees
each unit's resident requests in ``UnitLoad.requests`` (from what the front end knows: prompt, outputs so far,
arrival, whether it is migrating); one that ``rebalances`` is also asked after step records when nothing is pending
(at most every ``rebalance_interval_s``). A :class:`~policies.types.Migration` aborts the request on its source
(its KV blocks are freed) and submits it again on the target with the original prompt plus the output tokens it
produced as prompt and ``max_tokens`` reduced by those: the target recomputes prompt and outputs in one prefill.
The request's :class:`RequestStream` goes on without a gap or a repeated token, and its outcome counts the
original prompt, every output token and the original first-token time. A request is ``migrating`` from the move
until its first token on the target; at most ``max_migrations`` are at once. A move is skipped when the request
finished meanwhile (or has no token left to produce), is migrating already, is not on the named source, or the
target is closed to new requests.

**Engine failures**: a unit whose engine core dies (:attr:`~agent.engine.vllm.unit.VllmUnit.on_failed`) is marked
failed (:attr:`VllmCluster.failed`): it is closed and the observer hears of it (``unit_failed``). Its
requests are evacuated: each goes back to the front of the dispatcher's queue with the tokens it produced, and the
unit the dispatcher places it on gets it by the same recompute path as a migration (reason ``unit_failed``), so its
stream goes on. With no unit left to take it, a request waits at the dispatcher (or the dispatcher rejects it).
With ``restart_delays`` (a backoff, :func:`backoff`), a failed unit is restarted after each delay in turn until a
fresh engine starts (:meth:`~agent.engine.vllm.unit.VllmUnit.restart`); it then rejoins, empty (``unit_restarted``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.vllm.sampling import Sampling, TokenDelta
from agent.engine.vllm.unit import EngineFailed, VllmUnit
from agent.runtime.vllm.requests import (
    ClusterObserver,
    ClusterRequest,
    RequestAborted,
    RequestRejected,
    RequestStream,
)
from policies.base import DispatchPolicy
from policies.types import Migration, PendingRequest

log = logging.getLogger(__name__)


def backoff(first_s: float = 1.0, factor: float = 2.0, max_s: float = 60.0) -> Iterator[float]:
    """Delays before each restart attempt of a failed unit: ``first_s``, then ``factor`` times longer, at most
    ``max_s``, without end."""
    delay = first_s
    while True:
        yield delay
        delay = min(max_s, delay * factor)


class VllmCluster:
    """Units, a dispatcher, and the pending queue between them."""

    def __init__(self, units: Sequence[VllmUnit], dispatcher: DispatchPolicy, *, ttft_slo_s: float,
                 tpot_slo_s: float, clock: Callable[[], float] = time.time, max_migrations: int = 8,
                 rebalance_interval_s: float = 0.005,
                 restart_delays: Callable[[], Iterator[float]] | None = None) -> None:
        if not units:
            raise ValueError("a cluster needs at least one unit")
        self.units = list(units)
        self.dispatcher = dispatcher
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        """SLOs of a request that names none."""
        self._clock = clock
        self._by_unit = {u.unit_id: u for u in self.units}
        self.pending: dict[str, PendingRequest] = {}
        """Requests waiting at the dispatcher, in arrival order."""
        self.streams: dict[str, RequestStream] = {}
        """Requests not yet finished (pending or on a unit)."""
        self.rejected: deque[str] = deque(maxlen=100_000)
        """Ids of requests the dispatcher refused (the most recent)."""
        self.num_rejected = 0
        self.num_aborted = 0
        self.accepting: dict[int, bool] = {u.unit_id: True for u in self.units}
        """Per unit id: whether it takes new requests (the dispatcher sees the others as unhealthy)."""
        self.failed: dict[int, str] = {}
        """Units whose engine core died, by id, with the reason (closed until a restart brings them back)."""
        self.num_evacuated = 0
        self.restart_delays = restart_delays
        """A fresh backoff (delays in seconds) for each failure: a failed unit is restarted after each delay in turn
        until it starts; None: failed units stay failed."""
        self.num_restarts = 0
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self.observer: ClusterObserver | None = None
        self.max_migrations = max_migrations
        """Requests migrating at once (moved, their first token on the target not yet out); further moves wait."""
        self.rebalance_interval_s = rebalance_interval_s
        """Least time between two calls of a rebalancing dispatcher made for step records with nothing pending."""
        self.num_migrations = 0
        self.num_migrations_skipped = 0
        self._last_dispatch_s = -float("inf")
        self._next_check: float | None = None
        self._wake = asyncio.Event()
        self._checker: asyncio.Task[None] | None = None

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Hook the units' step reports and start the ``next_check_s`` timer (inside the running loop)."""
        if self._checker is not None:
            return
        for u in self.units:
            u.on_step = self._on_step
            u.on_first_token = self._on_first_token
            u.on_finish = self._on_finish
            u.on_failed = self._on_unit_failed
            if u.failed and u.unit_id not in self.failed:
                self._on_unit_failed(u, u.failure or "engine core dead")
        self._checker = asyncio.get_running_loop().create_task(self._checks())

    async def close(self) -> None:
        """Stop dispatching; abort what is still pending or running. The units keep running (stop them apart)."""
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None
        for task in self._restarts.values():
            task.cancel()
        for u in self.units:
            if u.on_step == self._on_step:
                u.on_step = None
            if u.on_first_token == self._on_first_token:
                u.on_first_token = None
            if u.on_finish == self._on_finish:
                u.on_finish = None
            if u.on_failed == self._on_unit_failed:
                u.on_failed = None
        tasks = [s._task for s in self.streams.values() if s._task is not None]
        for rid in list(self.streams):
            self.abort(rid)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> VllmCluster:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, request: ClusterRequest, *, collect: bool = True) -> RequestStream:
        """Queue ``request`` at the dispatcher and ask it at once; ``collect=False`` keeps no deltas."""
        rid = request.request_id
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} is already in flight")
        stream = RequestStream(request, self, collect)
        self.streams[rid] = stream
        pending = self.pending[rid] = PendingRequest(
            rid, request.arrival_s if request.arrival_s is not None else self._clock(),
            len(request.prompt_token_ids),
            request.ttft_slo_s if request.ttft_slo_s is not None else self.ttft_slo_s,
            request.tpot_slo_s if request.tpot_slo_s is not None else self.tpot_slo_s,
        )
        if self.observer is not None:
            self.observer.arrived(stream, pending)
        self.dispatch()
        return stream

    def abort(self, request_id: str) -> bool:
        """Take a pending request off the queue, or abort it on its unit; False if it is not in flight.

        On a unit the request's task is cancelled, and vLLM's ``generate()`` answers a cancel with
        ``AsyncLLM.abort`` (the engine core drops the request and frees its KV blocks at its next iteration).
        """
        stream = self.streams.get(request_id)
        return stream is not None and self._abort(stream)

    def _abort(self, stream: RequestStream) -> bool:
        rid = stream.request_id
        if stream.done or self.streams.get(rid) is not stream:
            return False
        if self.pending.pop(rid, None) is not None:
            del self.streams[rid]
            stream._finish(None, RequestAborted(f"request {rid} was aborted while pending"))
            if self.observer is not None:
                self.observer.ended(stream)
        elif stream._task is None or not stream._task.cancel():
            return False
        self.num_aborted += 1
        return True

    # -- control ----------------------------------------------------------------------------------
    def set_accepting(self, unit_id: int, accepting: bool) -> None:
        """Open or close a unit to new requests (its requests carry on); an opened unit is offered the queue."""
        if unit_id not in self._by_unit:
            raise KeyError(f"no unit {unit_id}")
        if accepting and unit_id in self.failed:
            raise ValueError(f"unit {unit_id} has failed: {self.failed[unit_id]}")
        self.accepting[unit_id] = accepting
        if accepting:
            self.dispatch()

    @property
    def num_serving(self) -> int:
        """Units whose engine core runs (started, not failed; a closed but running unit counts)."""
        return sum(1 for u in self.units if u.llm is not None and u.unit_id not in self.failed and not u.failed)

    def set_dispatcher(self, dispatcher: DispatchPolicy) -> None:
        """Replace the dispatch policy; the requests waiting are offered to the new one now."""
        self.dispatcher = dispatcher
        self._next_check = None
        self.dispatch()

    # -- dispatching ------------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Ask the dispatcher about the pending requests now (also called on arrivals, reports and checks); a
        dispatcher that ``rebalances`` is asked with nothing pending too (for its migrations)."""
        dispatcher = self.dispatcher
        if not self.pending and not dispatcher.rebalances:
            return
        now = self._clock()
        self._last_dispatch_s = now
        want = dispatcher.needs_requests
        loads = [u.load(healthy=self.accepting[u.unit_id], with_requests=want) for u in self.units]
        decision = dispatcher.dispatch(list(self.pending.values()), loads, now)
        observer = self.observer
        if observer is not None:
            observer.dispatching(loads, decision)
        for rid, uid in decision.assignments:
            p = self.pending.pop(rid, None)
            if p is None:
                continue
            self._launch(self.streams[rid], self._by_unit[uid], p)
        for rid in decision.rejected:
            if self.pending.pop(rid, None) is not None:
                self.rejected.append(rid)
                self.num_rejected += 1
                stream = self.streams.pop(rid)
                stream._finish(None, RequestRejected(
                    f"the {self.dispatcher.name or type(self.dispatcher).__name__} dispatcher rejected the request"
                ))
                if observer is not None:
                    observer.rejected(stream)
        for rid, p in self.pending.items():  # held back this round (as the simulated node counts them)
            self.pending[rid] = replace(p, cycles_waited=p.cycles_waited + 1)
        if decision.migrations:
            self._migrate(decision.migrations)
        self._next_check = decision.next_check_s
        if decision.next_check_s is not None:
            self._wake.set()

    def _launch(self, stream: RequestStream, unit: VllmUnit, p: PendingRequest) -> None:
        source = stream.evacuated_from
        if source is not None:  # back from a failed unit: it goes on here by recompute
            stream.evacuated_from = None
            self._recompute(stream, unit, source, "unit_failed", stream.first_token_s)
            return
        stream._pending = p
        self._start(stream, unit, stream.request.prompt_token_ids, stream.request.max_tokens, stream.request.sampling)
        if self.observer is not None:
            self.observer.launched(stream, p)

    def _start(self, stream: RequestStream, unit: VllmUnit, prompt_token_ids: list[int], max_tokens: int,
               sampling: Sampling | None, *, migrated: bool = False, prior_outputs: int = 0,
               first_token_s: float | None = None) -> None:
        """Submit ``stream``'s request to ``unit`` (again, with its ``prior_outputs`` appended, when ``migrated``)."""
        r = stream.request
        p = stream._pending
        assert p is not None
        stream.unit_id = unit.unit_id
        task = unit.submit(r.request_id, prompt_token_ids, max_tokens, arrival_s=p.arrival_s,
                           ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s, sampling=sampling,
                           on_output=stream._push,
                           prompt_tokens=len(r.prompt_token_ids) if migrated else None,
                           prior_outputs=prior_outputs, first_token_s=first_token_s)
        stream._task = task

        def done(t: asyncio.Task[RequestOutcome]) -> None:
            if stream._task is not t:  # the request migrated (or was evacuated): its new task carries on
                if not t.cancelled():
                    t.exception()  # retrieved: an evacuated task's EngineFailed is no news
                return
            exc = None if t.cancelled() else t.exception()
            if isinstance(exc, EngineFailed):  # its unit is dead: the request goes on elsewhere
                if unit.unit_id in self.failed:
                    self._evacuate(stream, unit.unit_id)
                    self.dispatch()
                else:
                    self._on_unit_failed(unit, exc.reason)  # evacuates this request with the others
                return
            self.streams.pop(r.request_id, None)
            stream._on_task_done(t)
            if stream.outcome is None and self.observer is not None:
                self.observer.ended(stream)

        task.add_done_callback(done)

    # -- migration by recompute -------------------------------------------------------------------
    def num_migrating(self) -> int:
        """Requests moved and not yet producing on their target."""
        return sum(1 for u in self.units for live in u.live.values() if live.migrating)

    def _migrate(self, migrations: Sequence[Migration]) -> None:
        """Carry out a dispatcher's migrations by recompute (see the module's docstring); skipped ones are counted."""
        migrating = self.num_migrating()
        for m in migrations:
            if migrating >= self.max_migrations or not self._move(m):
                self.num_migrations_skipped += 1
                continue
            migrating += 1

    def _move(self, m: Migration) -> bool:
        stream = self.streams.get(m.request_id)
        source, target = self._by_unit.get(m.source_unit), self._by_unit.get(m.target_unit)
        if (stream is None or stream.done or source is None or target is None or source is target
                or stream.unit_id != source.unit_id or not self.accepting[target.unit_id]):
            return False
        task, live = stream._task, source.live.get(m.request_id)
        if task is None or task.done() or live is None or live.migrating:
            return False
        r = stream.request
        produced = list(stream.output_token_ids)
        left = r.max_tokens - len(produced)
        if left <= 0 or len(produced) != live.outputs:
            return False
        # Cancelling the task aborts the request in its engine (vLLM's generate() answers a cancel with
        # AsyncLLM.abort, which frees its KV blocks); the task runs no further output through, and its done
        # callback sees a newer task on the stream and leaves the stream alone.
        if not task.cancel():
            return False
        live.on_output = None
        self._recompute(stream, target, source.unit_id, m.reason or "rebalance", live.first_token_s)
        return True

    def _recompute(self, stream: RequestStream, target: VllmUnit, source_unit: int, reason: str,
                   first_token_s: float | None) -> None:
        """Submit ``stream``'s request to ``target`` with its outputs so far appended to its prompt (its old task
        is cancelled or over already)."""
        r = stream.request
        produced = list(stream.output_token_ids)
        sampling = r.sampling
        if sampling is not None and sampling.min_tokens:
            sampling = replace(sampling, min_tokens=max(0, sampling.min_tokens - len(produced)))
        self._start(stream, target, r.prompt_token_ids + produced, r.max_tokens - len(produced), sampling,
                    migrated=True, prior_outputs=len(produced), first_token_s=first_token_s)
        stream.num_migrations += 1
        self.num_migrations += 1
        if self.observer is not None:
            self.observer.migrated(stream, source_unit, target.unit_id, reason)

    # -- engine failures --------------------------------------------------------------------------
    def _on_unit_failed(self, unit: VllmUnit, reason: str) -> None:
        """Close the dead unit for good, send its requests back to the dispatcher and offer them around."""
        uid = unit.unit_id
        if uid in self.failed:
            return
        self.failed[uid] = reason
        self.accepting[uid] = False
        moved = 0
        for stream in list(self.streams.values()):
            if stream.unit_id == uid and stream._task is not None and not stream.done:
                self._evacuate(stream, uid)
                moved += 1
        if self.observer is not None:
            self.observer.unit_failed(unit, reason, moved)
        if self.restart_delays is not None and self._checker is not None:
            self._restarts[uid] = asyncio.get_running_loop().create_task(self._restart(unit, self.restart_delays()))
        self.dispatch()

    async def _restart(self, unit: VllmUnit, delays: Iterator[float]) -> None:
        """Restart ``unit`` after each delay until its engine starts, then let it rejoin."""
        attempts = 0
        for delay in delays:
            await asyncio.sleep(delay)
            attempts += 1
            try:
                await unit.restart()
            except Exception:  # vLLM's start failed (no memory, no GPU...): try again after the next delay
                log.exception("unit %s: restart attempt %d failed", unit.unit_id, attempts)
                continue
            uid = unit.unit_id
            self.failed.pop(uid, None)
            self._restarts.pop(uid, None)
            self.accepting[uid] = True
            self.num_restarts += 1
            if self.observer is not None:
                self.observer.unit_restarted(unit, attempts)
            self.dispatch()
            return

    def _evacuate(self, stream: RequestStream, unit_id: int) -> None:
        """Take ``stream``'s request off its (dead) unit and put it at the front of the dispatcher's queue."""
        task, stream._task = stream._task, None  # its done callback now leaves the stream alone
        unit = self._by_unit[unit_id]
        live = unit.live.get(stream.request_id)
        if live is not None:
            live.on_output = None
            if stream.first_token_s is None:
                stream.first_token_s = live.first_token_s
        if task is not None and not task.done():
            task.cancel()
        r, p = stream.request, stream._pending
        assert p is not None
        produced = len(stream.output_token_ids)
        if produced >= r.max_tokens:  # every token is out, only the finish was lost with the engine
            self._finish_evacuated(stream, unit_id)
            return
        stream.unit_id = None
        stream.evacuated_from = unit_id
        self.num_evacuated += 1
        self.pending = {stream.request_id: replace(p, prompt_tokens=len(r.prompt_token_ids) + produced),
                        **self.pending}

    def _finish_evacuated(self, stream: RequestStream, unit_id: int) -> None:
        r, p = stream.request, stream._pending
        assert p is not None
        now = self._clock()
        first = stream.first_token_s if stream.first_token_s is not None else now
        outcome = RequestOutcome(
            request_id=r.request_id, unit_id=unit_id, arrival_s=p.arrival_s, first_token_s=first, finish_s=now,
            prompt_tokens=len(r.prompt_token_ids), output_tokens=len(stream.output_token_ids), num_preemptions=0,
            ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s,
        )
        stream._push(TokenDelta((), "", "length", None))
        self.streams.pop(r.request_id, None)
        stream._finish(outcome, None)
        if self.observer is not None:
            self.observer.finished(self._by_unit[unit_id], outcome)

    def _on_step(self, unit: VllmUnit, rec: StepRecord) -> None:
        if self.observer is not None:
            self.observer.stepped(unit, rec)
        dispatcher = self.dispatcher
        if self.pending:
            if dispatcher.wants_step_reports:
                self.dispatch()
        elif dispatcher.rebalances and self._clock() - self._last_dispatch_s >= self.rebalance_interval_s:
            self.dispatch()

    def _on_first_token(self, unit: VllmUnit, request_id: str) -> None:
        stream, live = self.streams.get(request_id), unit.live.get(request_id)
        if stream is not None and live is not None and stream.first_token_s is None:
            stream.first_token_s = live.first_token_s
        if self.observer is not None:
            self.observer.first_token(unit, request_id)

    def _on_finish(self, unit: VllmUnit, outcome: RequestOutcome) -> None:
        if self.observer is not None:
            self.observer.finished(unit, outcome)

    async def _checks(self) -> None:
        wake = self._wake
        while True:
            when = self._next_check
            if when is None:
                wake.clear()
                await wake.wait()
                continue
            delay = when - self._clock()
            if delay > 0:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), timeout=delay)
                    continue
                except TimeoutError:
                    pass
            self._next_check = None
            self.dispatch()
