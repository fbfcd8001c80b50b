"""Live units (vLLM engine cores, or simulated ones in wall time) behind a trackside dispatcher: the agent's request
path, shared by replays and HTTP intake.

A submitted request waits at the dispatcher (:class:`~policies.types.PendingRequest`) until the
:class:`~policies.base.DispatchPolicy` places it on a unit or rejects it. The dispatcher is asked on every
arrival, at the ``next_check_s`` it asks for, and (when it ``wants_step_reports``) after every step record while
requests are pending, as in the simulated node. :meth:`LiveCluster.submit` returns a :class:`RequestStream`: an
async iterator of the request's :class:`~agent.engine.vllm.unit.TokenDelta` s (or, with ``collect=False``,
only its outcome). Aborting a request removes it from the pending queue, or cancels it on its unit (vLLM's
``AsyncLLM.abort``, which frees its KV blocks).

A unit can be closed to new requests (:meth:`LiveCluster.set_accepting`: the dispatcher sees it unhealthy), and
the dispatcher swapped (:meth:`LiveCluster.set_dispatcher`). A :class:`ClusterObserver` (the agent's live node,
``agent.runtime.live.node``) hears of every arrival, dispatch decision, placement, rejection, step record, first
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

**Engine failures**: a unit whose engine core dies (``on_failed``, :class:`~agent.engine.live.LiveEngine`) is marked
failed (:attr:`LiveCluster.failed`): it is closed and the observer hears of it (``unit_failed``). Its
requests are evacuated: each goes back to the front of the dispatcher's queue with the tokens it produced, and the
unit the dispatcher places it on gets it by the same recompute path as a migration (reason ``unit_failed``), so its
stream goes on. With no unit left to take it, a request waits at the dispatcher (or the dispatcher rejects it).
With ``restart_delays`` (a backoff, :func:`~agent.runtime.live.restarts.backoff`), a failed unit is restarted after
each delay in turn until a fresh engine starts (:meth:`~agent.engine.live.LiveEngine.restart`), at most
``restart_attempts`` times (then it stays failed, and the observer hears ``unit_failed`` again with why); it rejoins,
empty (``unit_restarted``).
A unit whose engine hangs is killed by its own watchdog and goes the same way.

**On request** (the control plane's ``fail_unit``/``recover_unit``): :meth:`LiveCluster.fail_unit` takes a unit out
exactly as a failure does (closed, ``unit_failed``, its requests evacuated) but leaves its engine running and does
not restart it; :meth:`LiveCluster.recover_unit` lets it rejoin (``unit_recovered``), or, when its engine is dead
(it died meanwhile, or a failure's backoff is under way), restarts it now (``unit_restarted``).

**Pending timeout**: a request that waited at the dispatcher ``pending_timeout_s`` (no unit took it: every unit
failed or closed, or a dispatcher that holds it) is rejected (:class:`~agent.runtime.live.requests.PendingTimeout`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Generic, TypeVar

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.live import EngineFailed, LiveEngine
from agent.engine.vllm.sampling import Sampling, TokenDelta
from agent.runtime.desk import DispatchDesk
from agent.runtime.live.cluster_driver import ClusterDriver
from agent.runtime.live.requests import (
    ClusterObserver,
    ClusterRequest,
    RequestAborted,
    RequestRejected,
    RequestStream,
)
from agent.runtime.live.restarts import Restarts
from policies.base import DispatchPolicy
from policies.types import Migration, PendingRequest

PENDING_TIMEOUT_S = 30.0
"""How long a request may wait at the dispatcher for a unit by default before it is rejected."""
RESTART_ATTEMPTS = 10
"""Restart attempts after a failure before the backoff gives up, by default (1 s doubling to 60 s: about 5 minutes)."""


E = TypeVar("E", bound=LiveEngine)
"""The units' engine type (``VllmUnit``, or any :class:`~agent.engine.live.LiveEngine`)."""


class LiveCluster(Generic[E]):
    """Units, a dispatcher, and the pending queue between them."""

    def __init__(self, units: Sequence[E], dispatcher: DispatchPolicy, *, ttft_slo_s: float,
                 tpot_slo_s: float, clock: Callable[[], float] = time.time, max_migrations: int = 8,
                 rebalance_interval_s: float = 0.005,
                 restart_delays: Callable[[], Iterator[float]] | None = None,
                 pending_timeout_s: float | None = PENDING_TIMEOUT_S,
                 restart_attempts: int | None = RESTART_ATTEMPTS) -> None:
        if not units:
            raise ValueError("a cluster needs at least one unit")
        self.units = list(units)
        self.dispatcher = dispatcher
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        """SLOs of a request that names none."""
        self._clock = clock
        self._by_unit = {u.unit_id: u for u in self.units}
        self.desk: DispatchDesk[int] = DispatchDesk(strict=False, pending_timeout_s=pending_timeout_s)
        """The requests waiting at the dispatcher and the dispatch round over them (``agent.runtime.desk``; lenient: a
        bad decision is skipped and logged, not raised); a request back from a failed unit carries that unit's id."""
        self._driver = ClusterDriver(self)
        self.streams: dict[str, RequestStream] = {}
        """Requests not yet finished (pending or on a unit)."""
        self.rejected: deque[str] = deque(maxlen=100_000)
        """Ids of requests the dispatcher refused (the most recent)."""
        self.num_rejected = 0
        self.num_refused = 0
        """Rejected by the admission control of the unit the dispatcher placed them on (a subset of
        ``num_rejected``)."""
        self.refuses: Callable[[int, int], bool] | None = None
        """Admission control at dispatch: ``refuses(unit_id, prompt_tokens)`` is True when the unit's batch policy
        refuses the request (FairBatching+PAB's admission budget, as the unit last reported it); None: admit all."""
        self.num_aborted = 0
        self.accepting: dict[int, bool] = {u.unit_id: True for u in self.units}
        """Per unit id: whether it takes new requests (the dispatcher sees the others as unhealthy)."""
        self.failed: dict[int, str] = {}
        """Units whose engine core died, by id, with the reason (closed until a restart brings them back)."""
        self.num_evacuated = 0
        self.restarts = Restarts(restart_delays, self._rejoin, max_attempts=restart_attempts,
                                 gave_up=self._gave_up)
        """Failed units' restarts: after a fresh backoff from ``restart_delays`` for each failure (None: failed units
        stay failed), giving up after ``restart_attempts`` failed attempts (None: never), or at once on
        :meth:`recover_unit`."""
        self.num_restarts = 0
        self._held: set[int] = set()
        """Units failed on request (:meth:`fail_unit`): never restarted by the backoff."""
        self.observer: ClusterObserver | None = None
        self.serving_listeners: list[Callable[[int], None]] = []
        """Each called with :attr:`num_serving` when a unit fails or rejoins (the front ends' ``/health`` and 503s)."""
        self.max_migrations = max_migrations
        """Requests migrating at once (moved, their first token on the target not yet out); further moves wait."""
        self.rebalance_interval_s = rebalance_interval_s
        """Least time between two calls of a rebalancing dispatcher made for step records with nothing pending."""
        self.num_migrations = 0
        self.num_migrations_skipped = 0
        self._round_migrating: int | None = None
        """Requests migrating, counted at the round's first move and kept up to date through the round."""
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
                self._on_unit_failed(u.unit_id, u.failure or "engine core dead")
        self._checker = asyncio.get_running_loop().create_task(self._checks())

    async def close(self) -> None:
        """Stop dispatching; abort what is still pending or running. The units keep running (stop them apart)."""
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None
        self.restarts.cancel()
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

    async def __aenter__(self) -> LiveCluster[E]:
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
        now = self._clock()
        pending = PendingRequest(
            rid, request.arrival_s if request.arrival_s is not None else now,
            len(request.prompt_token_ids),
            request.ttft_slo_s if request.ttft_slo_s is not None else self.ttft_slo_s,
            request.tpot_slo_s if request.tpot_slo_s is not None else self.tpot_slo_s,
        )
        self.desk.add(pending, now)
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
        if self.desk.remove(rid) is not None:
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
        return sum(1 for u in self.units if u.serving and u.unit_id not in self.failed and not u.failed)

    def set_dispatcher(self, dispatcher: DispatchPolicy) -> None:
        """Replace the dispatch policy; the requests waiting are offered to the new one now."""
        self.dispatcher = dispatcher
        self._next_check = None
        self.dispatch()

    # -- dispatching ------------------------------------------------------------------------------
    @property
    def pending(self) -> dict[str, PendingRequest]:
        """Requests waiting at the dispatcher, in queue order."""
        return self.desk.pending

    @property
    def pending_timeout_s(self) -> float | None:
        """A request that waited this long at the dispatcher (since it arrived, or since its failed unit sent it back)
        is rejected; None: it waits for ever."""
        return self.desk.pending_timeout_s

    @pending_timeout_s.setter
    def pending_timeout_s(self, value: float | None) -> None:
        self.desk.pending_timeout_s = value

    def dispatch(self) -> None:
        """Ask the dispatcher about the pending requests now (also called on arrivals, reports and checks); a
        dispatcher that ``rebalances`` is asked with nothing pending too (for its migrations). One round of the
        desk (``agent.runtime.desk``)."""
        dispatcher = self.dispatcher
        if not self.desk.wants_round(dispatcher):
            return
        now = self._clock()
        self._last_dispatch_s = now
        want = dispatcher.needs_requests
        loads = [u.load(healthy=self.accepting[u.unit_id], with_requests=want) for u in self.units]
        self._next_check = self.desk.round(dispatcher, loads, now, self._driver)
        if self._next_check is not None:
            self._wake.set()

    def _launch(self, stream: RequestStream, unit: LiveEngine, p: PendingRequest) -> None:
        stream._pending = p
        self._start(stream, unit, stream.request.prompt_token_ids, stream.request.max_tokens, stream.request.sampling)
        if self.observer is not None:
            self.observer.launched(stream, p)

    def _reject(self, stream: RequestStream, error: RequestRejected) -> None:
        """``stream``'s request ends here, rejected: counted, not lost."""
        self.rejected.append(stream.request_id)
        self.num_rejected += 1
        self.streams.pop(stream.request_id, None)
        stream._finish(None, error)
        if self.observer is not None:
            self.observer.rejected(stream)

    def _refuse(self, stream: RequestStream, unit_id: int) -> None:
        """The admission control of ``unit_id`` refused ``stream``'s request: it ends here, counted, not lost."""
        self.num_refused += 1
        self._reject(stream, RequestRejected(
            f"unit {unit_id}'s admission control refused the request (its prefill admission budget is spent)",
            refused_by=unit_id, retry_after_s=self.ttft_slo_s,
        ))

    def _start(self, stream: RequestStream, unit: LiveEngine, prompt_token_ids: list[int], max_tokens: int,
               sampling: Sampling | None, *, migrated: bool = False, prior_outputs: int = 0,
               first_token_s: float | None = None, max_tpot_s: float | None = None) -> None:
        """Submit ``stream``'s request to ``unit`` (again, with its ``prior_outputs`` appended, when ``migrated``)."""
        r = stream.request
        p = stream._pending
        assert p is not None
        stream.unit_id = unit.unit_id
        task = unit.submit(r.request_id, prompt_token_ids, max_tokens, arrival_s=p.arrival_s,
                           ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s, sampling=sampling,
                           on_output=stream._push,
                           prompt_tokens=len(r.prompt_token_ids) if migrated else None,
                           prior_outputs=prior_outputs, first_token_s=first_token_s, params=r.params,
                           max_tpot_s=max_tpot_s)
        stream._task = task

        def done(t: asyncio.Task[RequestOutcome]) -> None:
            if stream._task is not t:  # the request migrated (or was evacuated): its new task carries on
                if not t.cancelled():
                    t.exception()  # retrieved: an evacuated task's EngineFailed is no news
                return
            exc = None if t.cancelled() else t.exception()
            if isinstance(exc, EngineFailed):  # its unit is dead: the request goes on elsewhere
                if unit.unit_id in self.failed:
                    self._evacuate([stream], unit.unit_id)
                    self.dispatch()
                else:
                    self._on_unit_failed(unit.unit_id, exc.reason)  # evacuates this request with the others
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

    def _migrate(self, m: Migration) -> None:
        """Carry out by recompute a migration that passed the desk's rules (``DispatchDesk.movable``; see the module's
        docstring); one the mechanism cannot make now (``max_migrations`` moving already, nothing left to produce) is
        skipped and counted."""
        if self._round_migrating is None:  # counted once per dispatch round, then kept up to date
            self._round_migrating = self.num_migrating()
        if self._round_migrating >= self.max_migrations or not self._move(m):
            self.num_migrations_skipped += 1
            return
        self._round_migrating += 1

    def _move(self, m: Migration) -> bool:
        stream = self.streams[m.request_id]
        source, target = self._by_unit[m.source_unit], self._by_unit[m.target_unit]
        task, live = stream._task, source.live[m.request_id]
        assert task is not None
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
        self._recompute(stream, target, source.unit_id, m.reason or "rebalance", live.first_token_s, live.max_tpot_s)
        return True

    def _recompute(self, stream: RequestStream, target: LiveEngine, source_unit: int, reason: str,
                   first_token_s: float | None, max_tpot_s: float | None) -> None:
        """Submit ``stream``'s request to ``target`` with its outputs so far appended to its prompt (its old task
        is cancelled or over already)."""
        r = stream.request
        produced = list(stream.output_token_ids)
        sampling = r.sampling
        if sampling is not None and sampling.min_tokens:
            sampling = replace(sampling, min_tokens=max(0, sampling.min_tokens - len(produced)))
        self._start(stream, target, r.prompt_token_ids + produced, r.max_tokens - len(produced), sampling,
                    migrated=True, prior_outputs=len(produced), first_token_s=first_token_s, max_tpot_s=max_tpot_s)
        stream.num_migrations += 1
        self.num_migrations += 1
        if self.observer is not None:
            self.observer.migrated(stream, source_unit, target.unit_id, reason)

    # -- engine failures --------------------------------------------------------------------------
    def _on_unit_failed(self, unit_id: int, reason: str) -> None:
        """Close the dead unit, send its requests back to the dispatcher and offer them around; restart it with
        backoff (``restart_delays``). A unit failed already (on request, say) stays as it is."""
        if unit_id not in self.failed:
            self._take_out(self._by_unit[unit_id], reason, restart=self._checker is not None)

    def fail_unit(self, unit_id: int, reason: str = "failed on request") -> int:
        """Take a unit out as a failure would (closed, ``unit_failed``, its requests evacuated); its engine keeps
        running and is not restarted, until :meth:`recover_unit`. Returns how many requests were evacuated;
        ``KeyError`` for no such unit, ``ValueError`` when it has failed already."""
        unit = self._unit(unit_id)
        if unit_id in self.failed:
            raise ValueError(f"unit {unit_id} has failed already: {self.failed[unit_id]}")
        self._held.add(unit_id)
        return self._take_out(unit, reason, restart=False)

    def recover_unit(self, unit_id: int) -> asyncio.Task[None] | None:
        """Bring a failed unit back. One whose engine runs rejoins at once (``unit_recovered``; None). A dead engine
        is restarted now, in place of any backoff waiting: the task ends once the unit rejoined (``unit_restarted``)
        or raises what the restart raised (the unit stays failed; a failure's backoff takes over again).
        ``KeyError`` for no such unit, ``ValueError`` when it has not failed or is being restarted."""
        unit = self._unit(unit_id)
        if unit_id not in self.failed:
            raise ValueError(f"unit {unit_id} has not failed")
        if self.restarts.restarting(unit_id):
            raise ValueError(f"unit {unit_id} is being restarted already")
        if unit.serving and unit.check_engine() is None:
            self._rejoin(unit, None)
            return None
        # A unit failed on request goes back to waiting for the operator if this fails; a dead one to its backoff.
        return self.restarts.now(unit, then_backoff=unit_id not in self._held and self._checker is not None)

    def _unit(self, unit_id: int) -> E:
        unit = self._by_unit.get(unit_id)
        if unit is None:
            raise KeyError(f"no unit {unit_id} (units: {', '.join(str(u) for u in self._by_unit)})")
        return unit

    def _take_out(self, unit: LiveEngine, reason: str, *, restart: bool) -> int:
        """Mark ``unit`` failed and closed, evacuate its requests, tell the observer, then (``restart`` and a backoff
        configured) start restarting it; the requests are offered around. How many were evacuated."""
        uid = unit.unit_id
        self.failed[uid] = reason
        self.accepting[uid] = False
        on_it = [s for s in self.streams.values() if s.unit_id == uid and s._task is not None and not s.done]
        self._evacuate(on_it, uid)
        moved = len(on_it)
        if self.observer is not None:
            self.observer.unit_failed(unit, reason, moved)
        self._serving_changed()
        if restart:
            self.restarts.after_backoff(unit)
        self.dispatch()
        return moved

    def _gave_up(self, unit: LiveEngine, num_attempts: int, error: str) -> None:
        """The backoff could not start a fresh engine: the unit stays failed (``recover_unit`` tries again), and the
        observer hears of it as of a failure, with why."""
        reason = f"gave up restarting after {num_attempts} attempts (the last: {error})"
        self.failed[unit.unit_id] = reason
        if self.observer is not None:
            self.observer.unit_failed(unit, reason, 0)

    def _rejoin(self, unit: LiveEngine, num_attempts: int | None) -> None:
        """Open a failed unit again: restarted after ``num_attempts`` (``unit_restarted``), or with its engine as it
        was (None: ``unit_recovered``); the requests waiting are offered to it."""
        uid = unit.unit_id
        self.failed.pop(uid, None)
        self._held.discard(uid)
        self.accepting[uid] = True
        if num_attempts is not None:
            self.num_restarts += 1
        if self.observer is not None:
            if num_attempts is None:
                self.observer.unit_recovered(unit)
            else:
                self.observer.unit_restarted(unit, num_attempts)
        self._serving_changed()
        self.dispatch()

    def _serving_changed(self) -> None:
        n = self.num_serving
        for listener in self.serving_listeners:
            listener(n)

    def _evacuate(self, streams: Sequence[RequestStream], unit_id: int) -> None:
        """Take ``streams``' requests off their (dead) unit and put them at the front of the dispatcher's queue, each
        to go on by recompute where it is placed next."""
        unit = self._by_unit[unit_id]
        back: list[tuple[PendingRequest, int]] = []
        for stream in streams:
            task, stream._task = stream._task, None  # its done callback now leaves the stream alone
            live = unit.live.get(stream.request_id)
            if live is not None:
                live.on_output = None
                if stream.first_token_s is None:
                    stream.first_token_s = live.first_token_s
                stream.max_tpot_s = live.max_tpot_s
            if task is not None and not task.done():
                task.cancel()
            r, p = stream.request, stream._pending
            assert p is not None
            produced = len(stream.output_token_ids)
            if produced >= r.max_tokens:  # every token is out, only the finish was lost with the engine
                self._finish_evacuated(stream, unit_id)
                continue
            stream.unit_id = None
            self.num_evacuated += 1
            back.append((replace(p, prompt_tokens=len(r.prompt_token_ids) + produced), unit_id))
        self.desk.requeue(back, self._clock())

    def _finish_evacuated(self, stream: RequestStream, unit_id: int) -> None:
        r, p = stream.request, stream._pending
        assert p is not None
        now = self._clock()
        first = stream.first_token_s if stream.first_token_s is not None else now
        outcome = RequestOutcome(
            request_id=r.request_id, unit_id=unit_id, arrival_s=p.arrival_s, first_token_s=first, finish_s=now,
            prompt_tokens=len(r.prompt_token_ids), output_tokens=len(stream.output_token_ids), num_preemptions=0,
            ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s, max_tpot_s=stream.max_tpot_s,
        )
        stream._push(TokenDelta((), "", "length", None))
        self.streams.pop(r.request_id, None)
        stream._finish(outcome, None)
        if self.observer is not None:
            self.observer.finished(self._by_unit[unit_id], outcome)

    def _on_step(self, unit_id: int, rec: StepRecord) -> None:
        if self.observer is not None:
            self.observer.stepped(self._by_unit[unit_id], rec)
        dispatcher = self.dispatcher
        if self.pending:
            if dispatcher.wants_step_reports:
                self.dispatch()
        elif dispatcher.rebalances and self._clock() - self._last_dispatch_s >= self.rebalance_interval_s:
            self.dispatch()

    def _on_first_token(self, unit_id: int, request_id: str) -> None:
        unit = self._by_unit[unit_id]
        stream, live = self.streams.get(request_id), unit.live.get(request_id)
        if stream is not None and live is not None and stream.first_token_s is None:
            stream.first_token_s = live.first_token_s
        if self.observer is not None:
            self.observer.first_token(unit, request_id)

    def _on_finish(self, unit_id: int, outcome: RequestOutcome) -> None:
        if self.observer is not None:
            self.observer.finished(self._by_unit[unit_id], outcome)

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

