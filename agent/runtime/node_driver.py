"""The simulated node (:class:`agent.runtime.node.Node`) as the dispatch desk drives it: how a placement, a refusal, a
rejection and a move are carried out on simulated units (:class:`~agent.runtime.desk.DeskDriver`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agent.engine.base import Migrant, SubmittedRequest
from agent.runtime.desk import Placement, RejectReason, UnitAccess
from policies.types import DispatchDecision, Migration, PendingRequest, UnitLoad

if TYPE_CHECKING:
    from agent.runtime.node import Node


class NodeDriver:
    """The simulated node as the dispatch desk drives it (:class:`~agent.runtime.desk.DeskDriver`)."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    def unit_access(self, unit_id: int) -> UnitAccess:
        node = self.node
        index = node._index.get(unit_id)
        if index is None:
            return "unknown"
        closed = node.unit_modes[index] == "failed" or (node.disaggregated and node.units[index].role == "decode")
        return "closed" if closed else "open"

    def refuses(self, unit_id: int, prompt_tokens: int) -> bool:
        unit = self.node.units[self.node._index[unit_id]]
        return unit.policy.refuses(prompt_tokens, unit.cost)

    def dispatching(self, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        node = self.node
        if node.on_dispatch is not None:
            node.on_dispatch(node.num_dispatches, loads, decision)

    def place(self, placement: Placement[Migrant]) -> None:
        node = self.node
        now = node.now_s
        index = node._index[placement.unit_id]
        unit = node.units[index]
        state = node.states[placement.request.request_id]
        state.num_rounds_waited = placement.request.cycles_waited
        state.unit_id = placement.unit_id
        state.dispatched_s = now
        if placement.carried is not None:
            # Back from a failed unit: it was admitted once already and keeps the tokens it produced.
            unit.attach(placement.carried, now)
        else:
            spec = state.spec
            unit.submit(
                SubmittedRequest(
                    spec.request_id, spec.arrival_s, spec.prompt_tokens, spec.output_tokens, state.ttft_slo_s,
                    state.tpot_slo_s,
                ),
                now,
            )
        if node.on_request is not None:
            node.on_request("dispatched", state)
        node._schedule_start(index)

    def refused(self, request: PendingRequest, unit_id: int) -> None:
        # Admission control of the unit's batch policy (e.g. FairBatching's PAB): counted, not lost.
        self.node.num_refused += 1
        self._end(request, refused_by=unit_id)

    def rejected(self, request: PendingRequest, why: RejectReason) -> None:
        self._end(request, reason="" if why == "dispatcher" else why)

    def _end(self, request: PendingRequest, *, refused_by: int | None = None, reason: str = "") -> None:
        """A request that ends at the dispatcher: counted as rejected, reported, then let go (``keep_finished``)."""
        node = self.node
        state = node.states[request.request_id]
        state.num_rounds_waited = request.cycles_waited
        state.rejected = True
        state.refused_by = refused_by
        state.refusal_reason = reason
        node.num_rejected += 1
        if node.on_request is not None:
            node.on_request("refused", state)
        node.let_go(request.request_id)

    def where(self, request_id: str) -> int | None:
        node = self.node
        state = node.states.get(request_id)
        if state is None or state.unit_id is None:
            return None
        index = node._index[state.unit_id]
        if node.unit_modes[index] == "failed" or not node.units[index].has_request(request_id):
            return None
        return state.unit_id

    def moving(self, request_id: str) -> bool:
        return request_id in self.node.transfers

    def takes_moves(self, unit_id: int) -> bool:
        return self.node.unit_modes[self.node._index[unit_id]] == "active"

    def move(self, migration: Migration) -> None:
        self.node._start_migration(migration)

    def skip_move(self, migration: Migration) -> None:
        self.node.num_migrations_skipped += 1
