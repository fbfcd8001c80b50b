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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.vllm.sampling import Sampling, TokenDelta
from agent.engine.vllm.unit import VllmUnit
from policies.base import DispatchPolicy
from policies.types import DispatchDecision, Migration, PendingRequest, UnitLoad


@dataclass(frozen=True, slots=True)
class ClusterRequest:
    """A request for the cluster: a token-id prompt and how much to generate."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ttft_slo_s: float | None = None
    """None: the cluster's default."""
    tpot_slo_s: float | None = None
    arrival_s: float | None = None
    """When the request reached the agent (wall clock); None: now."""
    sampling: Sampling | None = None
    """None: the unit's default (``ignore_eos``, no text), what workload replays use."""


class RequestRejected(Exception):
    """The dispatcher refused the request (it was never given to a unit)."""


class RequestAborted(Exception):
    """The request was aborted (:meth:`VllmCluster.abort`) before it finished."""


_END = object()


class RequestStream:
    """One request's progress: iterate for its token deltas, :meth:`wait` for its outcome, :meth:`abort` to end it.

    Iteration ends after the delta that carries ``finish_reason``; it raises :class:`RequestRejected` when the
    dispatcher refused the request, :class:`RequestAborted` when someone aborted it, and the unit's exception
    when vLLM failed it (a ``ValueError`` for a request vLLM finds invalid).
    """

    def __init__(self, request: ClusterRequest, cluster: VllmCluster, collect: bool) -> None:
        self.request = request
        self.request_id = request.request_id
        self.unit_id: int | None = None
        """The unit the request is on (the dispatcher's choice, or a migration's target); None while pending (and
        for a rejected request)."""
        self.output_token_ids: list[int] = []
        """The output tokens so far (what a migration re-submits after the prompt)."""
        self.num_migrations = 0
        self._pending: PendingRequest | None = None
        self.outcome: RequestOutcome | None = None
        self.error: BaseException | None = None
        self._cluster = cluster
        self._queue: asyncio.Queue[TokenDelta | object] | None = asyncio.Queue() if collect else None
        self._task: asyncio.Task[RequestOutcome] | None = None
        self._done = asyncio.Event()

    # -- consumer side ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._queue is None:
            raise RuntimeError("submitted with collect=False: no deltas to iterate")
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # a further __anext__ ends (or raises) again
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        assert isinstance(item, TokenDelta)
        return item

    async def wait(self) -> RequestOutcome:
        """The outcome once the request finished; raises what iteration would raise."""
        await self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome

    def abort(self) -> bool:
        """End the request wherever it is (see :meth:`VllmCluster.abort`); False if it had already finished."""
        return self._cluster._abort(self)

    # -- cluster side -----------------------------------------------------------------------------
    def _push(self, delta: TokenDelta) -> None:
        self.output_token_ids.extend(delta.token_ids)
        if self._queue is not None:
            self._queue.put_nowait(delta)

    def _finish(self, outcome: RequestOutcome | None, error: BaseException | None) -> None:
        if self._done.is_set():
            return
        self.outcome = outcome
        self.error = error
        self._done.set()
        if self._queue is not None:
            self._queue.put_nowait(_END)

    def _on_task_done(self, task: asyncio.Task[RequestOutcome]) -> None:
        if task.cancelled():
            self._finish(None, RequestAborted(f"request {self.request_id} was aborted"))
        elif (exc := task.exception()) is not None:
            self._finish(None, exc)
        else:
            self._finish(task.result(), None)


class ClusterObserver(Protocol):
    """What happens in a cluster, as it happens (the agent's telemetry); times are the units' (wall clock)."""

    def arrived(self, stream: RequestStream, pending: PendingRequest) -> None:
        """A request reached the dispatcher's queue."""

    def dispatching(self, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        """The dispatcher decided (called before the decision is carried out) on these loads."""

    def launched(self, stream: RequestStream, pending: PendingRequest) -> None:
        """A request went to its unit (``stream.unit_id``); ``pending`` as the dispatcher last saw it."""

    def rejected(self, stream: RequestStream) -> None:
        """The dispatcher refused a request."""

    def stepped(self, unit: VllmUnit, record: StepRecord) -> None:
        """A unit reported a step (its raw message is ``unit.last``)."""

    def first_token(self, unit: VllmUnit, request_id: str) -> None: ...

    def finished(self, unit: VllmUnit, outcome: RequestOutcome) -> None: ...

    def ended(self, stream: RequestStream) -> None:
        """A request ended without an outcome: aborted (pending or on its unit), or failed by its engine
        (``stream.error``)."""

    def migrated(self, stream: RequestStream, source_unit: int, target_unit: int, reason: str) -> None:
        """A request moved by recompute (aborted on ``source_unit``, re-submitted on ``target_unit`` now)."""


class VllmCluster:
    """Units, a dispatcher, and the pending queue between them."""

    def __init__(self, units: Sequence[VllmUnit], dispatcher: DispatchPolicy, *, ttft_slo_s: float,
                 tpot_slo_s: float, clock: Callable[[], float] = time.time, max_migrations: int = 8,
                 rebalance_interval_s: float = 0.005) -> None:
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
        self._checker = asyncio.get_running_loop().create_task(self._checks())

    async def close(self) -> None:
        """Stop dispatching; abort what is still pending or running. The units keep running (stop them apart)."""
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None
        for u in self.units:
            if u.on_step == self._on_step:
                u.on_step = None
            if u.on_first_token == self._on_first_token:
                u.on_first_token = None
            if u.on_finish == self._on_finish:
                u.on_finish = None
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
        self.accepting[unit_id] = accepting
        if accepting:
            self.dispatch()

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
            if stream._task is not t:
                return  # the request migrated: its new task carries on
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
        sampling = r.sampling
        if sampling is not None and sampling.min_tokens:
            sampling = replace(sampling, min_tokens=max(0, sampling.min_tokens - len(produced)))
        self._start(stream, target, r.prompt_token_ids + produced, left, sampling, migrated=True,
                    prior_outputs=len(produced), first_token_s=live.first_token_s)
        stream.num_migrations += 1
        self.num_migrations += 1
        if self.observer is not None:
            self.observer.migrated(stream, source.unit_id, target.unit_id, m.reason or "rebalance")
        return True

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
