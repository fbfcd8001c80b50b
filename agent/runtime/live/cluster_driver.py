"""The live cluster (:class:`agent.runtime.live.cluster.LiveCluster`) as the dispatch desk drives it: how a placement,
a refusal, a rejection and a move are carried out on vLLM units (:class:`~agent.runtime.desk.DeskDriver`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agent.runtime.desk import Placement, RejectReason, UnitAccess
from agent.runtime.live.requests import PendingTimeout, RequestRejected
from policies.types import DispatchDecision, Migration, PendingRequest, UnitLoad

if TYPE_CHECKING:
    from agent.runtime.live.cluster import LiveCluster


class ClusterDriver:
    """The cluster as the dispatch desk drives it (:class:`~agent.runtime.desk.DeskDriver`)."""

    __slots__ = ("cluster",)

    def __init__(self, cluster: LiveCluster[Any]) -> None:
        self.cluster = cluster

    def unit_access(self, unit_id: int) -> UnitAccess:
        cluster = self.cluster
        if unit_id not in cluster._by_unit:
            return "unknown"
        return "closed" if unit_id in cluster.failed else "open"

    def refuses(self, unit_id: int, prompt_tokens: int) -> bool:
        refuses = self.cluster.refuses
        return refuses is not None and refuses(unit_id, prompt_tokens)

    def dispatching(self, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        self.cluster._round_migrating = None
        if self.cluster.observer is not None:
            self.cluster.observer.dispatching(loads, decision)

    def place(self, placement: Placement[int]) -> None:
        cluster = self.cluster
        stream = cluster.streams[placement.request.request_id]
        unit = cluster._by_unit[placement.unit_id]
        if placement.carried is not None:  # back from a failed unit: it goes on here by recompute
            cluster._recompute(stream, unit, placement.carried, "unit_failed", stream.first_token_s,
                               stream.max_tpot_s)
        else:
            cluster._launch(stream, unit, placement.request)

    def refused(self, request: PendingRequest, unit_id: int) -> None:
        self.cluster._refuse(self.cluster.streams[request.request_id], unit_id)

    def rejected(self, request: PendingRequest, why: RejectReason) -> None:
        cluster = self.cluster
        stream = cluster.streams[request.request_id]
        if why == "pending_timeout":
            error: RequestRejected = PendingTimeout(f"no unit took the request within {cluster.pending_timeout_s:g} s")
        else:
            name = cluster.dispatcher.name or type(cluster.dispatcher).__name__
            error = RequestRejected(f"the {name} dispatcher rejected the request")
        cluster._reject(stream, error)

    def where(self, request_id: str) -> int | None:
        stream = self.cluster.streams.get(request_id)
        if stream is None or stream.done or stream.unit_id is None or stream._task is None or stream._task.done():
            return None
        unit = self.cluster._by_unit[stream.unit_id]
        return stream.unit_id if request_id in unit.live else None

    def moving(self, request_id: str) -> bool:
        stream = self.cluster.streams.get(request_id)
        if stream is None or stream.unit_id is None:
            return False
        live = self.cluster._by_unit[stream.unit_id].live.get(request_id)
        return live is not None and live.migrating

    def takes_moves(self, unit_id: int) -> bool:
        return self.cluster.accepting[unit_id]

    def move(self, migration: Migration) -> None:
        self.cluster._migrate(migration)

    def skip_move(self, migration: Migration) -> None:
        self.cluster.num_migrations_skipped += 1
