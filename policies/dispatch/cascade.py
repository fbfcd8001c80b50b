"""``cascade``: CascadeInfer, a length-staged pipeline of DP units with bid-ask migration (seed 001).

POLICIES.md 2.4. The units (healthy ones, sorted by id) form *stages*: consecutive unit ranges, stage ``j``
serving sequence lengths ``[l_j, l_{j+1})`` (the last one everything above). The math lives in
:mod:`policies.dispatch.cascade_model` (the QoE model, section 4.1) and
:mod:`policies.dispatch.cascade_partition` (partition DP, fast path, range refinement, sections 4.2-4.3).
The installed stages, routing and the length sample are in :mod:`policies.dispatch.cascade_stages`, the
migration planning (asks, bids, transfer queue, starvation) in :mod:`policies.dispatch.cascade_bidask`
(section 4.4); this module keeps the policy, its parameters and when to partition and refine.

Every call of :meth:`CascadeInfer.dispatch`:

1. **Partition** (section 4.2) when the healthy units change, after a parameter change, every
   ``repartition_interval_s``, and at the first refinement tick with enough data: over the ``(I, L)`` of the
   resident and pending requests (topped up with the last seen lengths of departed requests when fewer than
   ``min_partition_samples``: the DP's ``n^2`` term needs the *concurrent* population, so departed requests
   only fill a thin snapshot). Too little data, or one unit: a single stage (plain least-load dispatch).
   ``partition_method=fast`` (default) runs the paper's two-phase heuristic, ``dp`` the exact DP. Measured
   on a 2-core sandbox (``tests/benchmarks/bench_cascade_partition.py``), 16 units over 128K context in
   doubling buckets: DP 2.6-8.3 ms for 1K-16K sampled requests, fast path 2.1-5.9 ms but 6-9% worse in
   pipeline quality; the paper's speed argument for the heuristic does not hold for a vectorized DP. End to
   end the exact partition loses all the same (issue 19 item 8: "the paper's fast path as the default unless
   the exact one wins end to end"): on a conversation-like load of 8 units at 51-127 req/s it met 1.3-2.2
   points fewer SLOs than the fast path at four of the five heaviest loads (tied at the fifth, 0.2-0.5 points
   more at the two lightest), with 2-3 times its migrations (``docs/policies.md``).
2. **Refinement** (section 4.3) every ``refine_interval_s``: each unit of stage ``j`` proposes a boundary
   from its own lengths and the average of stage ``j+1``'s; the stage boundary becomes the mean of the
   unfrozen units' EMA-smoothed proposals (our choice: the paper lets each instance keep its own boundary,
   which a central router cannot express), clipped to stay strictly between its neighbours.
3. **Routing** (section 3.2): a request goes to the stage covering its prompt length; inside it (the paper does
   not say how) to the unit with the lowest ``4 * waiting + running``, vLLM's DP balancer's score, counting this
   call's placements, then the lowest id (``stage_routing=load``, the default since 2026-11-26), or to the least
   memory demand (``kv_tokens + queued_prefill_tokens``), then fewer requests (``stage_routing=memory``). On
   conversation-like traffic (8 units, 51-127 req/s) the load score lifted the attainment by 0.2-2.4 points, to
   0.979-0.994x ``least_loaded``'s (docs/policies.md, seed 001's claims).
4. **Hand-over and rebalancing** (section 4.4). Senders *ask*: a unit holding a request whose context
   reached its stage's upper boundary hands it to the stage covering its length (the next stage as requests
   grow; reason ``handover``); a unit whose demand exceeds its stage's mean by more than
   ``imbalance_threshold`` offers its longest requests that fit in the excess (reason ``rebalance``; at most
   ``max_transfers`` asks per sender and call, and only while the receiver would stay below the sender).
   Candidate receivers *bid* ``(load, earliest start)``: load = demand plus tokens already won; earliest
   start = buffered tokens (won migrations plus queued prefill) over the unit's throughput (its token
   budget per step over its mean step time). :func:`select_bid`: drop the more loaded half, keep the three
   earliest, take the first to answer (the earliest). A receiver without free KV for the request's context
   does not bid. The winner queues the request.
5. **Transfers.** At most ``max_transfers`` in flight (requests flagged ``migrating`` and
   ``UnitLoad.migrations_inflight``, which counts each transfer at both ends), one outgoing transfer per
   sender and one new incoming per receiver per call. Receivers (ascending id) take their queue in order of
   the sender's load (its buffered tokens, section 4.4), skipping requests whose sender is busy. A skip
   counts once per distinct blocking transfer; after more than ``starvation_limit`` the request escalates:
   the receiver waits for it and the sender sends it before anything else (reason ``starvation``). A
   request whose receiver lacks free KV at start is dropped from the queue and asked again later.

Never: a request that is migrating or already moved in this call, a target equal to the source, an
unhealthy receiver, an unhealthy sender. Decisions depend only on the inputs and the policy's state (no
clock, no randomness, every iteration in a sorted order).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import DispatchPolicy
from policies.cost.step_model import StepCoefficients
from policies.dispatch.cascade_bidask import Bid, BidAskConfig, BidOutcome, MigrationPlanner, select_bid
from policies.dispatch.cascade_model import QoeCoefficients, QoeFit, QoeSample, fit_qoe_samples
from policies.dispatch.cascade_partition import (
    Partition,
    StageCostTable,
    exponential_edges,
    partition_dp,
    partition_fast,
)
from policies.dispatch.cascade_stages import RecentLengths, Stage, StageMap
from policies.params import ParamSpec, ParamValue
from policies.types import DispatchDecision, PendingRequest, ReasonValue, UnitLoad

__all__ = ["Bid", "BidOutcome", "CascadeInfer", "Stage", "select_bid"]

_QOE_WINDOW = 4096
_QOE_MIN_SAMPLES = 16


CASCADE_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec(
        "max_context_tokens",
        "int",
        131_072,
        "top bucket edge (longer lengths share the last bucket)",
        unit="tokens",
        min=256,
        max=1 << 24,
    ),
    ParamSpec("bucket_base_tokens", "int", 64, "first bucket edge", unit="tokens", min=1, max=65_536),
    ParamSpec("bucket_growth", "float", 2.0, "ratio of consecutive bucket edges", min=1.05, max=16.0),
    ParamSpec(
        "partition_method",
        "str",
        "fast",
        "dp: the exact dynamic program; fast: the paper's one unit per stage then greedy merges",
        choices=("fast", "dp"),
    ),
    ParamSpec(
        "repartition_interval_s", "float", 30.0, "time between full stage partitions", unit="s", min=0.1, max=86_400.0
    ),
    ParamSpec(
        "min_partition_samples",
        "int",
        32,
        "requests needed before the partition uses data",
        unit="requests",
        min=2,
        max=1_000_000,
    ),
    ParamSpec("refine_interval_s", "float", 1.0, "time between range refinements", unit="s", min=0.001, max=3600.0),
    ParamSpec(
        "ema_alpha", "float", 0.3, "EMA weight of a new boundary proposal (0 = boundaries never move)", min=0.0, max=1.0
    ),
    ParamSpec(
        "freeze_below", "int", 5, "no refinement with fewer requests than this", unit="requests", min=1, max=10_000
    ),
    ParamSpec(
        "imbalance_threshold",
        "float",
        0.25,
        "rebalance a unit whose demand exceeds its stage's mean by this fraction",
        min=0.0,
        max=10.0,
    ),
    ParamSpec(
        "stage_routing", "str", "load",
        "inside the stage a request goes to: load (lowest 4*waiting + running, vLLM's DP balancer's score) or "
        "memory (least KV plus queued prefill tokens)",
        choices=("load", "memory"),
    ),
    ParamSpec("rebalance", "bool", True, "intra-stage bid-ask rebalancing (hand-over runs regardless)"),
    ParamSpec("max_transfers", "int", 3, "migrations in flight at once", unit="transfers", min=0, max=64),
    ParamSpec("starvation_limit", "int", 3, "skips before a queued migration escalates", min=1, max=1000),
    ParamSpec(
        "migration_cost_us_per_token",
        "float",
        2.6,
        "delay a migration adds per moved token, for the cut cost (2.6: 128 KiB of KV per token over 50 GB/s)",
        unit="us",
        min=0.0,
        max=10_000.0,
    ),
    ParamSpec(
        "mean_output_tokens",
        "float",
        256.0,
        "O in the default QoE coefficients and the cut cost",
        unit="tokens",
        min=1.0,
        max=1e6,
    ),
    ParamSpec(
        "prefill_chunk_tokens", "int", 8192, "C in the default QoE coefficients", unit="tokens", min=1, max=1 << 20
    ),
    ParamSpec(
        "step_a_ms", "float", 9.11, "step model a (default: H100, Llama-3.1-8B)", unit="ms", min=0.0, max=60_000.0
    ),
    ParamSpec("step_b_us", "float", 24.0, "step model b per new token", unit="us", min=0.0, max=1e6),
    ParamSpec("step_c_ns", "float", 43.9, "step model c per context token", unit="ns", min=0.0, max=1e6),
    ParamSpec(
        "qoe_source",
        "str",
        "step_model",
        "QoE coefficients: derived from the step model, or fitted from observe() once enough samples came in",
        choices=("step_model", "fitted"),
    ),
    ParamSpec("qoe_refit_every", "int", 64, "observed samples between two QoE fits", min=1, max=1_000_000),
)


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class CascadeInfer(DispatchPolicy):
    """Length-staged units; hand-over of outgrown requests; bid-ask rebalancing inside a stage."""

    name: ClassVar[str] = "cascade"
    summary: ClassVar[str] = "length-staged pipeline of units with hand-over and bid-ask migration (CascadeInfer)"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = CASCADE_PARAMS
    wants_step_reports: ClassVar[bool] = True
    needs_requests: ClassVar[bool] = True
    rebalances: ClassVar[bool] = True

    def __init__(self, params: Mapping[str, ParamValue] | None = None) -> None:
        self._stages = StageMap()
        self._healthy_key: tuple[int, ...] | None = None
        self._from_data = False
        self._dirty = True
        self._partition_key: tuple[object, ...] = ()
        self._next_refine_s = -math.inf
        self._next_repartition_s = -math.inf
        self._bidask = MigrationPlanner()
        self._recent = RecentLengths()
        self._samples: deque[QoeSample] = deque(maxlen=_QOE_WINDOW)
        self._since_fit = 0
        self._fit: QoeFit | None = None
        self._fit_failed = ""
        self.last_partition: Partition | None = None
        """The last partition computed from data (None before one)."""
        super().__init__(params)

    def configure(self) -> None:
        p = self.params
        self.max_context = int(p["max_context_tokens"])
        base = min(int(p["bucket_base_tokens"]), self.max_context - 1)
        self.edges = exponential_edges(self.max_context, base, float(p["bucket_growth"]))
        self.method = str(p["partition_method"])
        self.repartition_interval_s = float(p["repartition_interval_s"])
        self.min_partition_samples = int(p["min_partition_samples"])
        self.refine_interval_s = float(p["refine_interval_s"])
        self.alpha = float(p["ema_alpha"])
        self.freeze_below = int(p["freeze_below"])
        self.threshold = float(p["imbalance_threshold"])
        self.rebalance = bool(p["rebalance"])
        self.route_by_memory = p["stage_routing"] == "memory"
        self.max_transfers = int(p["max_transfers"])
        self.starvation_limit = int(p["starvation_limit"])
        self.migration_s_per_token = float(p["migration_cost_us_per_token"]) * 1e-6
        self.mean_output_tokens = float(p["mean_output_tokens"])
        self.chunk_tokens = int(p["prefill_chunk_tokens"])
        self.step = StepCoefficients(
            float(p["step_a_ms"]) * 1e-3, float(p["step_b_us"]) * 1e-6, float(p["step_c_ns"]) * 1e-9
        )
        self.bidask_config = BidAskConfig(
            imbalance_threshold=self.threshold,
            rebalance=self.rebalance,
            max_transfers=self.max_transfers,
            starvation_limit=self.starvation_limit,
            chunk_tokens=self.chunk_tokens,
            step=self.step,
        )
        self.qoe_source = str(p["qoe_source"])
        self.qoe_refit_every = int(p["qoe_refit_every"])
        self.default_coefficients = QoeCoefficients.from_step_model(
            self.step, mean_output_tokens=self.mean_output_tokens, chunk_tokens=self.chunk_tokens
        )
        key = (
            self.edges,
            self.method,
            self.default_coefficients,
            self.qoe_source,
            self.migration_s_per_token,
            self.min_partition_samples,
        )
        if key != self._partition_key:  # a change that alters the partition: recompute it at the next call
            self._partition_key = key
            self._dirty = True

    # ---- public state -----------------------------------------------------------------------------------

    @property
    def stage_boundaries(self) -> tuple[int, ...]:
        """Stage boundaries in tokens: ``0, l_1, ..., max_context`` (one more than stages; empty before the
        first call)."""
        return tuple(self._stages.int_bounds())

    def stage_layout(self) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]] | None:
        """The interior cuts and each stage's units (None before the first partition)."""
        bounds = self.stage_boundaries
        return (bounds[1:-1], self.stage_units) if bounds else None

    @property
    def stage_units(self) -> tuple[tuple[int, ...], ...]:
        """Unit ids of each stage, in stage order."""
        return tuple(self._stages.members)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self._stages.stages()

    @property
    def qoe_coefficients(self) -> QoeCoefficients:
        """The coefficients in use: fitted (``qoe_source=fitted`` after a successful fit) or the defaults."""
        if self.qoe_source == "fitted" and self._fit is not None:
            return self._fit.coefficients
        return self.default_coefficients

    @property
    def qoe_fit(self) -> QoeFit | None:
        """The last successful fit of :meth:`observe`'s samples."""
        return self._fit

    def observe(self, sample: QoeSample) -> None:
        """Add one finished request's record (normalized latency and lifetime-average batch features).

        Refits ``D0..D4`` every ``qoe_refit_every`` samples once 16 are in; a failed fit (rank-deficient
        samples) keeps the previous coefficients.
        """
        if not sample.normalized_latency_s > 0.0:
            return
        self._samples.append(sample)
        self._since_fit += 1
        if self._since_fit >= self.qoe_refit_every and len(self._samples) >= _QOE_MIN_SAMPLES:
            self._since_fit = 0
            try:
                self._fit = fit_qoe_samples(list(self._samples))
                self._fit_failed = ""
            except ValueError as exc:
                self._fit_failed = str(exc)

    def set_stages(self, boundaries: Sequence[int], unit_groups: Sequence[Sequence[int]]) -> None:
        """Pin a partition (operator override, tests): kept until the healthy units change or the next
        periodic repartition. ``boundaries``: ``0, l_1, ..., top``; one group of unit ids per stage."""
        if len(boundaries) != len(unit_groups) + 1 or boundaries[0] != 0:
            raise ValueError("need one more boundary than stages, starting at 0")
        if any(b <= a for a, b in itertools.pairwise(boundaries)):
            raise ValueError(f"boundaries must increase strictly, got {tuple(boundaries)}")
        ids = [u for g in unit_groups for u in g]
        if not all(unit_groups) or len(set(ids)) != len(ids):
            raise ValueError("every stage needs units, and a unit belongs to one stage")
        self._install([float(b) for b in boundaries], [tuple(sorted(g)) for g in unit_groups])
        self._healthy_key = tuple(sorted(ids))
        self._dirty = False

    # ---- dispatch ---------------------------------------------------------------------------------------

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        by_id = {u.unit_id: u for u in units}
        healthy = tuple(sorted(u.unit_id for u in units if u.healthy))
        repartitioned = False
        if self._dirty or healthy != self._healthy_key:
            repartitioned = self._repartition(units, pending, healthy, now_s, force=True)
            self._next_refine_s = now_s + self.refine_interval_s
        elif now_s >= self._next_refine_s:
            if now_s >= self._next_repartition_s or not self._from_data:
                repartitioned = self._repartition(units, pending, healthy, now_s, force=False)
            if not repartitioned:
                self._refine(by_id)
            self._next_refine_s = now_s + self.refine_interval_s
        reasons: dict[str, ReasonValue] = {
            "boundaries": ",".join(str(b) for b in self._stages.int_bounds()),
            "num_stages": len(self._stages.members),
            "stage_units": ";".join(",".join(str(u) for u in m) for m in self._stages.members),
            "repartitioned": repartitioned,
            "qoe_source": "fitted" if self.qoe_source == "fitted" and self._fit is not None else "step_model",
        }
        if self._fit is not None:
            reasons["qoe_fit_error"] = self._fit.mean_relative_error
        if self._fit_failed:
            reasons["qoe_fit_failed"] = self._fit_failed
        if not healthy:
            reasons["no_healthy_unit"] = True
            return DispatchDecision(reasons=reasons)
        assignments = self._stages.route(pending, by_id, by_memory=self.route_by_memory)
        migrations, inflight = self._bidask.plan(units, by_id, self._stages, self.bidask_config)
        reasons["placed"] = len(assignments)
        reasons["migrations_inflight"] = inflight
        for kind in ("handover", "rebalance", "starvation"):
            reasons[f"num_{kind}"] = sum(1 for m in migrations if m.reason == kind)
        reasons["queued_migrations"] = self._bidask.num_queued
        return DispatchDecision(assignments=assignments, reasons=reasons, migrations=migrations)

    # ---- stages -----------------------------------------------------------------------------------------

    def _install(self, bounds: list[float], members: list[tuple[int, ...]]) -> None:
        self._stages = StageMap(bounds, members)
        self._bidask.reset()

    def stage_for_length(self, tokens: int) -> int:
        """Index of the stage covering a sequence length (the last stage covers everything above)."""
        return self._stages.stage_for_length(tokens)

    def _repartition(
        self,
        units: Sequence[UnitLoad],
        pending: Sequence[PendingRequest],
        healthy: tuple[int, ...],
        now_s: float,
        *,
        force: bool,
    ) -> bool:
        """Partition ``healthy`` from the length sample; True when the stages were (re)installed."""
        prompts, contexts = self._recent.sample(units, pending, self.min_partition_samples)
        enough = len(healthy) >= 2 and len(prompts) >= self.min_partition_samples
        if not enough and not force:
            return False
        self._healthy_key = healthy
        self._dirty = False
        if not enough:
            self._install([0.0, float(self.max_context)] if healthy else [], [healthy] if healthy else [])
            self._from_data = False
            return True
        table = StageCostTable(
            prompts,
            contexts,
            self.edges,
            self.qoe_coefficients,
            self.migration_s_per_token / self.mean_output_tokens,
        )
        part = (partition_dp if self.method == "dp" else partition_fast)(table, len(healthy))
        self.last_partition = part
        members: list[tuple[int, ...]] = []
        start = 0
        for k in part.units:
            members.append(healthy[start : start + k])
            start += k
        self._install([float(b) for b in part.boundaries], members)
        self._from_data = True
        self._next_repartition_s = now_s + self.repartition_interval_s
        return True

    def _refine(self, by_id: Mapping[int, UnitLoad]) -> None:
        """Section 4.3 for every stage boundary but the outermost two."""
        self._recent.remember(list(by_id.values()))
        if self._stages.refine(by_id, self.qoe_coefficients, alpha=self.alpha, freeze_below=self.freeze_below):
            self._bidask.rescan()
