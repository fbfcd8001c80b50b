"""What the agent's hub, control plane, metrics and server use of a node, as two small protocols.

Two kinds of node satisfy them:

* the simulated :class:`~agent.runtime.node.Node`: a discrete-event core over simulated units, whose clock the server
  drives (``advance``); node time is simulated seconds since the run's start;
* a live node (:class:`LiveNode`, e.g. ``agent.runtime.live.node.LiveClusterNode``): real engines that step on their
  own. The server does not drive it, it runs it (:meth:`LiveNode.serve`); node time is wall-clock seconds since
  its :attr:`LiveNode.origin_ns`, which the hub takes as its ``boot_ns`` so that event times are wall-clock
  instants for both; control changes reach its units asynchronously and :meth:`LiveNode.settle` waits for their
  acknowledgement.

Both report through the same hooks (``on_step``, ``on_finish``, ``on_request``, ``on_dispatch``, ``on_preempt``,
``on_migrate``), with records in node time, so the hub turns them into the same events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agent.engine.base import RequestOutcome, StepRecord
from agent.runtime.records import DispatchHook, MigrateHook, PreemptHook, RequestEventKind, RequestState
from policies.base import BatchPolicy, DispatchPolicy
from policies.params import ParamValue
from policies.types import RequestView, UnitLoad

SETTABLE_MODES = ("active", "draining", "paused")
"""The unit modes control sets (``failed`` is a fault's, or ``fail_unit``'s), in both kinds of node."""


def check_settable(mode: str) -> None:
    """``ValueError`` for a mode that control cannot set (:data:`SETTABLE_MODES`), in both kinds of node's
    ``set_unit_mode``."""
    if mode not in SETTABLE_MODES:
        raise ValueError(f"unknown unit mode {mode!r} ({', '.join(SETTABLE_MODES)})")


StepHook = Callable[[StepRecord], None]
FinishHook = Callable[[RequestOutcome], None]
RequestHook = Callable[[RequestEventKind, RequestState], None]
FaultHook = Callable[[int, str], None]
"""``on_fault(unit_id, reason)``: a unit failed (its requests went back to the dispatcher); ``on_recover(unit_id,
how)``: a failed unit takes requests again."""


@dataclass(frozen=True, slots=True)
class Settled:
    """What became of the control changes a live node's units were sent (:meth:`LiveNode.settle`)."""

    refused: tuple[str, ...] = ()
    """One line per unit that refused a change (it keeps its previous setting)."""
    unconfirmed: tuple[str, ...] = ()
    """One line per unit that did not answer in time (it applies the change when it gets to it)."""


class ServedUnit(Protocol):
    """One unit as the hub and the control plane see it."""

    @property
    def unit_id(self) -> int: ...

    @property
    def policy(self) -> BatchPolicy:
        """The unit's batch policy (for a live engine, the agent's copy of the one running in the engine)."""
        ...

    def set_policy(self, policy: BatchPolicy) -> None:
        """Swap the batch policy (validated already); it takes effect between two steps."""
        ...

    def set_policy_params(self, changes: Mapping[str, ParamValue]) -> None:
        """Change live parameters of the batch policy, as ``BatchPolicy.check_params`` returned them (not checked
        again), between two steps."""
        ...

    def load(self, with_requests: bool = False) -> UnitLoad: ...

    def running_views(self) -> tuple[RequestView, ...]:
        """The unit's running requests as policies see them, times in node time (slack samples)."""
        ...


class ServedNode(Protocol):
    """A node as the hub (``agent.service.hub``), its control (``agent.runtime.control``) and its metrics read and
    steer it."""

    on_step: StepHook | None
    on_finish: FinishHook | None
    on_request: RequestHook | None
    on_dispatch: DispatchHook | None
    on_preempt: PreemptHook | None
    on_migrate: MigrateHook | None
    on_fault: FaultHook | None
    on_recover: FaultHook | None

    @property
    def units(self) -> Sequence[ServedUnit]: ...

    @property
    def dispatcher(self) -> DispatchPolicy: ...

    @property
    def unit_modes(self) -> Sequence[str]:
        """Per unit, in unit order: ``active``, ``draining``, ``paused`` or ``failed``."""
        ...

    @property
    def now_s(self) -> float:
        """Node time: seconds since the node's start."""
        ...

    @property
    def num_arrived(self) -> int: ...

    @property
    def num_pending(self) -> int:
        """Requests waiting at the dispatcher."""
        ...

    @property
    def num_finished(self) -> int: ...

    @property
    def num_rejected(self) -> int:
        """Refused by the dispatcher or by a unit's admission control."""
        ...

    @property
    def num_refused(self) -> int:
        """Refused by a unit's admission control (a subset of :attr:`num_rejected`)."""
        ...

    def unit_index(self, unit_id: int) -> int:
        """The position of ``unit_id`` in :attr:`units`; ``KeyError`` (with a message) when there is none."""
        ...

    def set_unit_mode(self, unit_id: int, mode: str) -> str:
        """Pause, drain or resume (``active``) a unit; the previous mode. ``ValueError`` for a bad request."""
        ...

    def set_dispatcher(self, dispatcher: DispatchPolicy) -> None: ...

    def fail_unit(self, unit_id: int, reason: str = "") -> int:
        """Take a unit out as a failure would (mode ``failed``, ``on_fault``): its requests go back to the dispatcher
        and on to other units; how many did. It stays failed until :meth:`recover_unit` (a live engine keeps
        running and is not restarted meanwhile). ``ValueError`` when it has failed already."""
        ...

    def recover_unit(self, unit_id: int) -> None:
        """Bring a failed unit back, empty (``on_recover``); a live unit whose engine is dead is restarted, which
        completes in :meth:`LiveNode.settle`. ``ValueError`` when it has not failed."""
        ...


@runtime_checkable
class LiveNode(ServedNode, Protocol):
    """A node whose units run on their own (live engines): served, not driven by the agent's server."""

    @property
    def origin_ns(self) -> int:
        """Wall-clock time (ns since the epoch) of node time 0."""
        ...

    async def serve(self, done: asyncio.Event) -> None:
        """Run until cancelled; set ``done`` when a finite workload has been served completely."""
        ...

    async def settle(self, timeout_s: float) -> Settled:
        """Wait (at most ``timeout_s``) until every unit has acknowledged the control changes sent to it so far
        (batch policy, parameters, pause and resume); what the units that did not apply them said."""
        ...
