"""A request on its way through the live vLLM cluster (:mod:`agent.runtime.live.cluster`): what a client submits
(:class:`ClusterRequest`), the stream it reads back (:class:`RequestStream`: token deltas, the outcome, abort), why
a stream ends without finishing (:class:`RequestRejected`, :class:`RequestAborted`), and what an observer of the
cluster hears (:class:`ClusterObserver`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.live import LiveEngine
from agent.engine.vllm.sampling import Sampling, TokenDelta
from policies.types import DispatchDecision, PendingRequest, UnitLoad

if TYPE_CHECKING:
    from agent.runtime.live.cluster import LiveCluster


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
    params: object | None = None
    """vLLM's ``SamplingParams`` as its OpenAI front end made them (text, stop strings, logprobs...), passed to the
    unit untouched (``agent.engine.vllm.engine_client``); used instead of ``sampling``."""


class RequestRejected(Exception):
    """The request was refused before any unit took it: by the dispatcher, by the admission control of the unit it
    was placed on (``refused_by``, e.g. FairBatching+PAB's admission budget), or because no unit took it in time.
    ``retry_after_s``: when asking again makes sense (an HTTP intake's ``Retry-After``), if known."""

    def __init__(self, message: str, *, refused_by: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.refused_by = refused_by
        self.retry_after_s = retry_after_s


class PendingTimeout(RequestRejected):
    """No unit took the request within the cluster's ``pending_timeout_s`` (every unit failed or closed, say)."""


class RequestAborted(Exception):
    """The request was aborted (:meth:`LiveCluster.abort`) before it finished."""


_END = object()


class Deltas:
    """A request's token deltas on their way to one consumer: iterate for them (the end raises the request's
    ``error``, if it has one), or take what is queued with :meth:`ready` and :meth:`drain`. The base of
    :class:`RequestStream` and of a front-end process's view of one (``agent.service.frontend.RemoteStream``)."""

    def __init__(self, collect: bool = True) -> None:
        self.error: BaseException | None = None
        self._items: deque[Any] | None = deque() if collect else None
        """Deltas not yet iterated, then ``_END`` (which stays: a further ``__anext__`` ends again); a deque and one
        waiter rather than an ``asyncio.Queue``, as vLLM's own output collector (fewer futures per token)."""
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[Any], None] | None = None
        """Told of each delta and of the end as they are queued, instead of an iterating consumer (:meth:`listen`)."""

    def __aiter__(self) -> Deltas:
        return self

    async def __anext__(self) -> TokenDelta:
        items = self._items
        if items is None:
            raise RuntimeError("submitted with collect=False: no deltas to iterate")
        while not items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if items[0] is _END:  # left in place: a further __anext__ ends (or raises) again
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        delta: TokenDelta = items.popleft()  # per output token: no isinstance check (only deltas and _END go in)
        return delta

    def ready(self) -> list[TokenDelta]:
        """The deltas queued since the last one iterated, without waiting; the end of the stream (and an error)
        stays queued for the next ``__anext__``."""
        items = self._items
        out: list[TokenDelta] = []
        while items and items[0] is not _END:
            out.append(items.popleft())
        return out

    def listen(self, listener: Callable[[Any], None]) -> None:
        """Have ``listener(self)`` called (synchronously, on the producer's side) whenever a delta or the end is
        queued, for a consumer that takes them with :meth:`drain` instead of iterating (one reader for many streams:
        the link to front-end processes, ``agent.service.frontends``). Called at once if something is queued
        already."""
        self._listener = listener
        if self._items:
            listener(self)

    def drain(self) -> tuple[list[TokenDelta], bool]:
        """The deltas queued since the last ones taken, and whether the stream ended after them (then ``outcome`` or
        ``error`` says how); without waiting. The end stays queued, as for :meth:`ready`."""
        out = self.ready()
        items = self._items
        return out, items is not None and bool(items) and items[0] is _END

    def _put(self, item: TokenDelta | object) -> None:
        assert self._items is not None
        self._items.append(item)
        if self._listener is not None:
            self._listener(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _put_end(self) -> None:
        if self._items is not None:
            self._put(_END)


class RequestStream(Deltas):
    """One request's progress: iterate for its token deltas, :meth:`wait` for its outcome, :meth:`abort` to end it.

    Iteration ends after the delta that carries ``finish_reason``; it raises :class:`RequestRejected` when the
    dispatcher refused the request, :class:`RequestAborted` when someone aborted it, and the unit's exception
    when vLLM failed it (a ``ValueError`` for a request vLLM finds invalid).
    """

    def __init__(self, request: ClusterRequest, cluster: LiveCluster[Any], collect: bool) -> None:
        super().__init__(collect)
        self.request = request
        self.request_id = request.request_id
        self.unit_id: int | None = None
        """The unit the request is on (the dispatcher's choice, or a migration's target); None while pending (and
        for a rejected request)."""
        self.output_token_ids: list[int] = []
        """The output tokens so far (what a migration re-submits after the prompt)."""
        self.num_migrations = 0
        self.first_token_s: float | None = None
        """When the request's first token came out (on any unit), wall clock; None before."""
        self.max_tpot_s: float | None = None
        """The worst per-token TPOT on the units it left (``RequestOutcome.max_tpot_s``), set when it is taken off one
        (a failed unit); the unit it is on tracks it from there."""
        self._pending: PendingRequest | None = None
        self.outcome: RequestOutcome | None = None
        self._cluster = cluster
        self._task: asyncio.Task[RequestOutcome] | None = None
        self._done = asyncio.Event()

    # -- consumer side ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> RequestOutcome:
        """The outcome once the request finished; raises what iteration would raise."""
        await self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome

    def abort(self) -> bool:
        """End the request wherever it is (see :meth:`LiveCluster.abort`); False if it had already finished."""
        return self._cluster._abort(self)

    # -- cluster side -----------------------------------------------------------------------------
    def _push(self, delta: TokenDelta) -> None:
        self.output_token_ids.extend(delta.token_ids)
        if self._items is not None:
            self._put(delta)

    def _finish(self, outcome: RequestOutcome | None, error: BaseException | None) -> None:
        if self._done.is_set():
            return
        self.outcome = outcome
        self.error = error
        self._done.set()
        self._put_end()

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

    def stepped(self, unit: LiveEngine, record: StepRecord) -> None:
        """A unit reported a step (its preempted requests: ``unit.last_preempted``)."""

    def first_token(self, unit: LiveEngine, request_id: str) -> None: ...

    def finished(self, unit: LiveEngine, outcome: RequestOutcome) -> None: ...

    def ended(self, stream: RequestStream) -> None:
        """A request ended without an outcome: aborted (pending or on its unit), or failed by its engine
        (``stream.error``)."""

    def migrated(self, stream: RequestStream, source_unit: int, target_unit: int, reason: str) -> None:
        """A request moved by recompute (aborted on ``source_unit``, re-submitted on ``target_unit`` now)."""

    def unit_failed(self, unit: LiveEngine, reason: str, num_evacuated: int) -> None:
        """A unit's engine core died; ``num_evacuated`` of its requests went back to the dispatcher."""

    def unit_restarted(self, unit: LiveEngine, num_attempts: int) -> None:
        """A failed unit runs a fresh engine and takes requests again."""

    def unit_recovered(self, unit: LiveEngine) -> None:
        """A unit failed on request (:meth:`LiveCluster.fail_unit`) takes requests again, its engine the same."""
