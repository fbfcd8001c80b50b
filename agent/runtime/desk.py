"""The dispatch desk: the requests waiting at the dispatcher and what one dispatch round does to them.

Both node runtimes use it, so that dispatching is written once: the simulated :class:`~agent.runtime.node.Node`
(a discrete-event core) and the live :class:`~agent.runtime.live.cluster.LiveCluster` (vLLM engines that step on
their own). The desk does no I/O and reads no clock (Sans-I/O, as the wire layer): the runtime passes ``now`` in,
and the desk calls back a :class:`DeskDriver`, the runtime, for everything that touches units or clients.

What one round (:meth:`DispatchDesk.round`) does, in this order:

1. The dispatcher is asked about the pending requests, in queue order (:meth:`DispatchDesk.views`), and the loads
   the runtime shows it; the runtime hears of the decision before anything is applied
   (:meth:`DeskDriver.dispatching`).
2. Each assignment, in the dispatcher's order, is checked: the request must be pending and named once, the unit
   known and open to new requests (not failed; in a disaggregated node, not a decode unit). A request back from a
   failed unit (:meth:`DispatchDesk.requeue`) is placed with what it carries; a new one is first offered to the
   unit's admission control (:meth:`DeskDriver.refuses`, e.g. FairBatching+PAB's prefill admission budget) and,
   refused, it ends there, counted (:meth:`DeskDriver.refused`). Placements are made one by one
   (:meth:`DeskDriver.place`), so that the admission control of a later one sees the earlier ones.
3. The requests the dispatcher rejects end, counted (:meth:`DeskDriver.rejected`).
4. Every request still pending has waited one more round (``PendingRequest.cycles_waited``).
5. The dispatcher's migrations, one at a time (each checked when its turn comes, after the moves before it), by one
   set of rules (:meth:`DispatchDesk.movable`): two different known units, the request on the named source and not
   moving already, a target that takes moves (active: not paused, draining or failed). Those that pass go to the
   runtime (:meth:`DeskDriver.move`), the others are counted (:meth:`DeskDriver.skip_move`). How a request moves is
   the runtime's (KV copy or recompute in the simulator, recompute on vLLM units), and so are the limits of its
   mechanism (a vLLM unit's request with no token left to produce, how many may move at once).
6. With a ``pending_timeout_s``, a request that has waited that long since it was queued ends
   (:meth:`DeskDriver.rejected`, ``why="pending_timeout"``).
7. The round returns when the dispatcher should be asked again with nothing new (its ``next_check_s``, or the next
   pending timeout), or None; only while requests are pending.

A decision that names an unknown request or unit, a request twice, or a closed unit is a bug in the dispatcher:
with ``strict`` (the simulator's default) the round raises :class:`DispatchError`; otherwise (a live agent, which
must not stop serving for one bad decision) the bad entry is skipped, counted (:attr:`DispatchDesk.num_invalid`)
and logged, and its request stays pending.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from policies.base import DispatchPolicy
from policies.types import DispatchDecision, Migration, PendingRequest, UnitLoad

log = logging.getLogger(__name__)

C = TypeVar("C")
"""What a request back from a failed unit carries (the runtime's: a ``Migrant``, or the unit it came from)."""

UnitAccess = Literal["open", "closed", "unknown"]
RejectReason = Literal["dispatcher", "pending_timeout"]


class DispatchError(RuntimeError):
    """A dispatch decision that cannot be applied (raised by a strict desk)."""


@dataclass(frozen=True, slots=True)
class Placement(Generic[C]):
    """A request the dispatcher placed, as the runtime is to carry it out."""

    request: PendingRequest
    """The request as the dispatcher saw it (``cycles_waited``: rounds it was held back)."""
    unit_id: int
    carried: C | None = None
    """Not None for a request back from a failed unit: what it carries (it is placed without admission control)."""


class DeskDriver(Protocol[C]):
    """The runtime, as a dispatch round needs it."""

    def unit_access(self, unit_id: int) -> UnitAccess:
        """Whether a unit may be given a new request: ``open``, ``closed`` (failed, or a decode unit), ``unknown``."""
        ...

    def refuses(self, unit_id: int, prompt_tokens: int) -> bool:
        """The unit's admission control: True when it refuses a new request of ``prompt_tokens``."""
        ...

    def dispatching(self, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        """The dispatcher decided (nothing is applied yet)."""
        ...

    def place(self, placement: Placement[C]) -> None:
        """Give a request to its unit now."""
        ...

    def refused(self, request: PendingRequest, unit_id: int) -> None:
        """``unit_id``'s admission control refused the request: it ends, counted."""
        ...

    def rejected(self, request: PendingRequest, why: RejectReason) -> None:
        """The dispatcher rejected the request, or it waited past the pending timeout: it ends, counted."""
        ...

    def where(self, request_id: str) -> int | None:
        """The unit a request is on now (None: pending, finished, or not known)."""
        ...

    def moving(self, request_id: str) -> bool:
        """Whether a request is being moved already."""
        ...

    def takes_moves(self, unit_id: int) -> bool:
        """Whether a (known) unit may be the target of a move: active, not paused, draining or failed."""
        ...

    def move(self, migration: Migration) -> None:
        """Start a move that passed the desk's rules now (the runtime skips and counts one its mechanism cannot
        make)."""
        ...

    def skip_move(self, migration: Migration) -> None:
        """A move the desk's rules turned down: count it."""
        ...


class DispatchDesk(Generic[C]):
    """The pending queue and the dispatch round over it (see the module's docstring)."""

    def __init__(self, *, strict: bool = True, pending_timeout_s: float | None = None) -> None:
        self.strict = strict
        self.pending_timeout_s = pending_timeout_s
        """A request that waited this long at the dispatcher (since it was queued) is rejected; None: no limit."""
        self.pending: dict[str, PendingRequest] = {}
        """Requests waiting at the dispatcher, in queue order: arrival order, requeued requests first."""
        self._carried: dict[str, C] = {}
        self._queued_s: dict[str, float] = {}
        self.num_rounds = 0
        """Dispatch rounds so far (the last decision's ``dispatch_id``)."""
        self.num_invalid = 0
        """Decision entries skipped as invalid (a lenient desk)."""

    # -- the queue ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.pending

    def add(self, request: PendingRequest, now: float) -> None:
        """Queue a new request at the back."""
        rid = request.request_id
        if rid in self.pending:
            raise ValueError(f"request {rid!r} is pending already")
        self.pending[rid] = request
        if self.pending_timeout_s:
            self._queued_s[rid] = now

    def requeue(self, entries: Iterable[tuple[PendingRequest, C]], now: float) -> None:
        """Put requests back from a failed unit at the front of the queue, in arrival order, each with what it
        carries (``request.prompt_tokens``: what its next unit must prefill, prompt plus outputs so far); they are
        placed without admission control, and their pending timeout starts again now."""
        back = sorted(entries, key=lambda e: e[0].arrival_s)
        front: dict[str, PendingRequest] = {}
        for request, carried in back:
            rid = request.request_id
            if rid in self.pending or rid in front:
                raise ValueError(f"request {rid!r} is pending already")
            front[rid] = request
            self._carried[rid] = carried
            if self.pending_timeout_s:
                self._queued_s[rid] = now
        if front:
            front.update(self.pending)
            self.pending = front

    def remove(self, request_id: str) -> PendingRequest | None:
        """Take a request off the queue (aborted by its client); None when it is not pending."""
        request = self.pending.pop(request_id, None)
        if request is not None:
            self._carried.pop(request_id, None)
            self._queued_s.pop(request_id, None)
        return request

    def carried(self, request_id: str) -> C | None:
        """What a pending request back from a failed unit carries; None for a new one."""
        return self._carried.get(request_id)

    def views(self) -> list[PendingRequest]:
        """The pending requests, as the dispatcher sees them, in queue order."""
        return list(self.pending.values())

    def wants_round(self, dispatcher: DispatchPolicy) -> bool:
        """Whether a round now could do anything: requests are pending, or the dispatcher rebalances."""
        return bool(self.pending) or dispatcher.rebalances

    # -- the round ---------------------------------------------------------------------------------
    def round(self, dispatcher: DispatchPolicy, loads: Sequence[UnitLoad], now: float,
              driver: DeskDriver[C]) -> float | None:
        """Ask ``dispatcher`` and apply its decision through ``driver``; returns when to ask it again (see the module's
        docstring), or None."""
        pending = self.pending
        views = list(pending.values())
        decision = dispatcher.dispatch(views, loads, now)
        self.num_rounds += 1
        driver.dispatching(loads, decision)
        name = dispatcher.name or type(dispatcher).__name__
        done: set[str] = set()
        for rid, unit_id in decision.assignments:
            request = pending.get(rid)
            if request is None or rid in done:
                self._invalid(f"dispatcher {name} placed {rid} twice or unknown")
                continue
            access = driver.unit_access(unit_id)
            if access != "open":
                what = "unknown unit" if access == "unknown" else "unit"
                self._invalid(f"dispatcher {name} placed {rid} on {what} {unit_id}, closed to it")
                continue
            done.add(rid)
            del pending[rid]
            self._queued_s.pop(rid, None)
            carried = self._carried.pop(rid, None)
            if carried is None and driver.refuses(unit_id, request.prompt_tokens):
                driver.refused(request, unit_id)
                continue
            driver.place(Placement(request, unit_id, carried))
        for rid in decision.rejected:
            request = pending.get(rid)
            if request is None or rid in done:
                self._invalid(f"dispatcher {name} rejected {rid} twice or unknown")
                continue
            done.add(rid)
            self.remove(rid)
            driver.rejected(request, "dispatcher")
        for rid, p in pending.items():
            pending[rid] = PendingRequest(p.request_id, p.arrival_s, p.prompt_tokens, p.ttft_slo_s, p.tpot_slo_s,
                                          p.cycles_waited + 1, p.prefix_hits)
        for m in decision.migrations:
            if self.movable(m, driver):
                driver.move(m)
            else:
                driver.skip_move(m)
        expiry = self._expire(now, driver)
        if not pending:
            return None
        checks = [t for t in (decision.next_check_s, expiry) if t is not None]
        return max(min(checks), now) if checks else None

    @staticmethod
    def movable(m: Migration, driver: DeskDriver[C]) -> bool:
        """Whether a migration passes the rules both runtimes apply (see the module's docstring)."""
        return (
            m.source_unit != m.target_unit
            and driver.unit_access(m.source_unit) != "unknown"
            and driver.unit_access(m.target_unit) != "unknown"
            and driver.where(m.request_id) == m.source_unit
            and not driver.moving(m.request_id)
            and driver.takes_moves(m.target_unit)
        )

    def _invalid(self, message: str) -> None:
        if self.strict:
            raise DispatchError(message)
        self.num_invalid += 1
        log.warning("%s: skipped", message)

    def _expire(self, now: float, driver: DeskDriver[C]) -> float | None:
        """Reject what waited ``pending_timeout_s``; when the next of those left will have (None: none, no limit)."""
        timeout = self.pending_timeout_s
        if not timeout or not self._queued_s:
            return None
        for rid, since in list(self._queued_s.items()):
            if now - since >= timeout:
                request = self.pending[rid]
                self.remove(rid)
                driver.rejected(request, "pending_timeout")
        return min(self._queued_s.values()) + timeout if self._queued_s else None
