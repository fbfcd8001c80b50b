"""What the node runtime reports and keeps about requests: where each one is (:class:`RequestState`), the moves
between units (:class:`MigrationRecord`, :class:`MigrationConfig`), and the hooks through which a node tells
its server what happened. Shared by the simulated :class:`~agent.runtime.node.Node` and the live vLLM node
(``agent.runtime.live.node``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from agent.engine.base import Migrant, RequestOutcome, StepRecord
from agent.workload.types import RequestSpec
from policies.frozen import picklable
from policies.types import DispatchDecision, UnitLoad


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """How KV moves between units (migrations and the disaggregated hand-over)."""

    mechanism: Literal["live", "recompute"] = "live"
    """``live``: copy the KV (overlapped with decoding on the source); ``recompute``: the target prefills again."""
    kv_bytes_per_token: int = 131_072
    """KV bytes per token (Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes)."""
    bandwidth_gb_s: float = 50.0
    """Link bandwidth in GB/s (50 = one 400 Gb/s RDMA NIC; NVLink inside a node is several times more)."""

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.bandwidth_gb_s * 1e9)


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """One request moved between units (or back to the dispatcher after a fault); the ``request_migrated`` event's
    names, times in node seconds (``docs/records.md``)."""

    request_id: str
    from_unit_id: int
    """The unit it left."""
    unit_id: int | None
    """The unit it moved to; None: the request went back to the dispatcher (its unit failed)."""
    reason: str
    """The dispatcher's reason (``handover``, ``rebalance``...), ``handoff`` (disaggregated) or ``fault``."""
    mechanism: str
    """``live``, ``recompute`` or ``lost`` (fault: KV gone)."""
    start_s: float
    end_s: float
    kv_tokens: int
    """KV tokens that travelled (0: recomputed)."""


RequestEventKind = Literal["arrived", "dispatched", "refused", "first_token"]
"""What :attr:`Node.on_request` reports: a request arrived, was placed on a unit, was refused (by the dispatcher
or a unit's admission control; ``RequestState.refused_by`` tells which), or produced its first token."""

MigrateHook = Callable[[MigrationRecord], None]
"""``on_migrate(record)``: a request moved between units, or went back to the dispatcher (its unit failed)."""

DispatchHook = Callable[[int, Sequence[UnitLoad], DispatchDecision], None]
"""``on_dispatch(dispatch_id, loads, decision)``: the dispatcher's decision number ``dispatch_id`` (from 1), the
loads it was shown (one per unit, in unit order; units not ``active`` appear unhealthy) and what it decided."""
PreemptHook = Callable[[StepRecord, tuple[str, ...]], None]
"""``on_preempt(record, request_ids)``: the step ``record`` preempted ``request_ids`` (when it was planned, at
``record.start_s``; the node learns it at the step's end, after ``on_step``)."""


@dataclass(slots=True)
class RequestState:
    """Where one request is, and what happened to it."""

    spec: RequestSpec
    ttft_slo_s: float
    tpot_slo_s: float
    unit_id: int | None = None
    dispatched_s: float | None = None
    outcome: RequestOutcome | None = None
    rejected: bool = False
    refused_by: int | None = None
    """The unit whose batch policy refused the request at admission (it is then also ``rejected``)."""
    refusal_reason: str = ""
    """Why the node refused a request no dispatcher or unit refused (``pending_timeout``: no unit took it in time)."""
    num_rounds_waited: int = 0
    """Dispatch rounds the request was held back at the dispatcher (``PendingRequest.cycles_waited`` to policies)."""


@dataclass(slots=True)
class Transfer:
    """A move under way in the simulated node: ``copying`` the KV off a source, or ``in_flight`` (detached, not yet
    placed)."""

    request_id: str
    source_index: int
    target_index: int
    reason: str
    start_s: float
    migrant: Migrant | None = None
    switch_due: bool = False
    """The copy finished while the request was in its source's step: switch at that step's end."""


picklable(MigrationConfig, MigrationRecord)  # compiled with mypyc (setup.py): see picklable
