"""``trackside bench``: replay a workload through simulated units and summarize what each policy did.

A :class:`BenchConfig` describes one cluster (profile, units, overrides); :func:`run_once` builds fresh
units and policies, replays the workload in virtual time and returns a :class:`RunResult`. Compare and
sweep runs are many :func:`run_once` calls over the same workload.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.bench.report import ClusterStats, UnitStats, offered_rps, summarize
from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.profile_types import Profile
from agent.engine.profiles import load_profile
from agent.engine.sim import FixedCostModel, SimUnit
from agent.engine.timing import StepTimer
from agent.runtime.node import Node
from agent.runtime.records import MigrationConfig, MigrationRecord
from agent.telemetry import DEFAULT_TPOT_METRIC, TpotMetric
from agent.workload.types import RequestSpec
from policies.cost.fit import OnlineStepModel
from policies.params import ParamError, ParamValue
from policies.registry import batch_policy_class, dispatch_policy_class, make_batch_policy, make_dispatch_policy
from policies.types import DispatchDecision, UnitLoad

KV_BYTES_PER_TOKEN = {"Llama-3.1-8B": 131_072, "Llama-3.2-1B": 32_768}
"""bf16 KV bytes per token from the models' configs: layers x KV heads x head dim x 2 (K and V) x 2 bytes
(8B: 32 x 8 x 128; 1B: 16 x 8 x 64)."""

TOPOLOGIES = ("colocated", "disaggregated")


@dataclass(frozen=True, slots=True)
class Fault:
    """Unit ``unit_id`` fails at ``at_s`` (node time) and, unless ``down_s`` is None, comes back after it."""

    unit_id: int
    at_s: float
    down_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``UNIT@SECONDS`` or ``UNIT@SECONDS+DOWN_SECONDS`` (e.g. ``2@30+10``)."""
        unit, at, rest = text.partition("@")
        when, plus, down = rest.partition("+")
        try:
            fault = cls(int(unit), float(when), float(down) if plus else None)
        except ValueError:
            raise ValueError(f"a fault is UNIT@SECONDS[+DOWN_SECONDS], e.g. 2@30+10 (got {text!r})") from None
        if not at or fault.unit_id < 0 or fault.at_s < 0 or (fault.down_s is not None and fault.down_s <= 0):
            raise ValueError(f"a fault is UNIT@SECONDS[+DOWN_SECONDS] with times >= 0 (got {text!r})")
        return fault


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One simulated cluster and its run settings."""

    profile: str = "h100-llama31-8b"
    units: int = 4
    batch_policy: str = "vllm"
    dispatch: str = "least_loaded"
    params: Mapping[str, str] = field(default_factory=dict)
    """``name=value`` or ``policy.name=value`` assignments, given to every policy that has the name."""
    ttft_slo_ms: float = 500.0
    tpot_slo_ms: float = 50.0
    seed: int = 0
    time_scale: float = 1.0
    noise: bool = False
    heterogeneity: bool = False
    interference_on: str = "step"
    """What the profile's mixed-batch interference slows: ``step`` (the whole step, its ``interference_kappa``) or
    ``attention`` (the context term only, its ``interference_kappa_attention``; ``agent.engine.timing``)."""
    online_fit: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    topology: str = "colocated"
    prefill_units: int | None = None
    """Disaggregated: units in the prefill pool (default half, at least one); the rest decode."""
    lockstep: bool = False
    instance_size: int = 0
    """Seed 000's instances: consecutive groups of this many units step in lockstep, each group on its own (out of
    phase with the others); 0: none (every unit on its own, or all together with ``lockstep``)."""
    pass_sync_ms: float = 0.0
    """Added to every lockstep pass (``lockstep`` or ``instance_size``): a DP+EP pass's all-to-all and barrier
    (``Node.pass_sync_s``); 0: none, as on a dense model."""
    migration: str = "live"
    kv_bandwidth_gb_s: float = 50.0
    faults: tuple[Fault, ...] = ()
    tpot_metric: TpotMetric = DEFAULT_TPOT_METRIC
    """Which TPOT the summary's percentiles and SLO attainment use (``agent.bench.report``)."""

    def roles(self) -> list[str]:
        """Each unit's role in this topology."""
        if self.topology == "colocated":
            return ["mixed"] * self.units
        if self.topology != "disaggregated":
            raise ValueError(f"unknown topology {self.topology!r} ({', '.join(TOPOLOGIES)})")
        n_pre = self.prefill_units if self.prefill_units is not None else max(1, self.units // 2)
        if not 1 <= n_pre < self.units:
            raise ValueError(f"disaggregated: {n_pre} prefill units of {self.units}; need 1..{self.units - 1}")
        return ["prefill"] * n_pre + ["decode"] * (self.units - n_pre)

    def lockstep_groups(self) -> list[list[int]] | None:
        """The unit ids of each instance (``instance_size``), checked: the size divides the units and an instance
        lies inside one pool; None without instances."""
        size = self.instance_size
        if size <= 0:
            return None
        if self.lockstep:
            raise ValueError("lockstep puts every unit in one group; give it or instance_size, not both")
        if self.units % size:
            raise ValueError(f"instance size {size} does not divide {self.units} units")
        roles = self.roles()
        groups = [list(range(k, k + size)) for k in range(0, self.units, size)]
        for g in groups:
            if len({roles[k] for k in g}) > 1:
                raise ValueError(f"instance {g[0]}-{g[-1]} spans the prefill and decode pools: choose a size that "
                                 "divides both")
        return groups

    def pass_groups(self) -> list[list[int]]:
        """The unit ids of each group that steps in lockstep (every unit with ``lockstep``); empty for none."""
        if self.pass_sync_ms < 0:
            raise ValueError(f"pass sync {self.pass_sync_ms} ms: must be >= 0")
        groups = self.lockstep_groups() or ([list(range(self.units))] if self.lockstep else [])
        if self.pass_sync_ms and not groups:
            raise ValueError("a pass sync cost needs passes: give lockstep or an instance size")
        return groups

    def describe(self) -> dict[str, Any]:
        return {
            "profile": self.profile, "units": self.units, "batch_policy": self.batch_policy,
            "dispatch": self.dispatch, "params": dict(self.params), "slo_ttft_ms": self.ttft_slo_ms,
            "slo_tpot_ms": self.tpot_slo_ms, "tpot_metric": self.tpot_metric, "seed": self.seed,
            "time_scale": self.time_scale,
            "noise": self.noise, "heterogeneity": self.heterogeneity, "interference_on": self.interference_on,
            "online_fit": self.online_fit,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_gpu_blocks": self.num_gpu_blocks, "topology": self.topology,
            "prefill_units": self.prefill_units, "lockstep": self.lockstep,
            "instance_size": self.instance_size, "pass_sync_ms": self.pass_sync_ms, "migration": self.migration,
            "kv_bandwidth_gb_s": self.kv_bandwidth_gb_s,
            "faults": [{"unit": f.unit_id, "at_s": f.at_s, "down_s": f.down_s} for f in self.faults],
        }


@dataclass(slots=True)
class RunResult:
    config: BenchConfig
    summary: dict[str, Any]
    units: list[dict[str, Any]]
    unfinished: int
    batch_params: dict[str, ParamValue]
    dispatch_params: dict[str, ParamValue]
    offered_rps: float = 0.0
    """Offered load of the (scaled) workload, requests per second over its arrival span."""
    refused: int = 0
    """Requests refused by a unit's admission control (included in ``summary["rejected"]``)."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """Balance across units, prefill chunk utilization, migrations, flow control, faults, stage boundaries."""
    outcomes: list[RequestOutcome] = field(default_factory=list, repr=False)
    """Every finished request's outcome, in finish order (``trackside bench --outcomes``)."""

    def as_run(self) -> dict[str, Any]:
        """One entry of the JSON ``runs`` list."""
        return {
            "batch_policy": self.config.batch_policy,
            "dispatch": self.config.dispatch,
            "params": {**self.batch_params, **self.dispatch_params},
            "time_scale": self.config.time_scale,
            "offered_rps": self.offered_rps,
            "refused": self.refused,
            "summary": self.summary,
            "cluster": self.cluster,
            "units": self.units,
        }


def split_params(
    assignments: Mapping[str, str], batch_policy: str, dispatch: str
) -> tuple[dict[str, str], dict[str, str]]:
    """Route ``--param`` assignments to the batch and dispatch policy that declare them.

    ``name=value`` goes to each of the two policies that has a parameter ``name``; ``policy.name=value``
    only to ``policy`` (and is ignored for other policies, so one command line can serve a comparison).
    A name that neither policy declares is an error.
    """
    bcls, dcls = batch_policy_class(batch_policy), dispatch_policy_class(dispatch)
    bnames = {p.name for p in bcls.params_schema}
    dnames = {p.name for p in dcls.params_schema}
    batch: dict[str, str] = {}
    disp: dict[str, str] = {}
    for key, value in assignments.items():
        owner, dot, name = key.rpartition(".")
        if dot:
            if owner == batch_policy:
                batch[name] = value
            elif owner == dispatch:
                disp[name] = value
            continue
        if name not in bnames and name not in dnames:
            raise ParamError(
                f"neither {batch_policy} nor {dispatch} has a parameter {name!r} "
                f"({batch_policy}: {', '.join(sorted(bnames)) or 'none'}; "
                f"{dispatch}: {', '.join(sorted(dnames)) or 'none'})"
            )
        if name in bnames:
            batch[name] = value
        if name in dnames:
            disp[name] = value
    return batch, disp


def scale_arrivals(requests: Sequence[RequestSpec], time_scale: float) -> list[RequestSpec]:
    """Multiply every arrival time (and so every inter-arrival gap) by ``time_scale``."""
    if time_scale <= 0:
        raise ValueError("time scale must be > 0")
    if time_scale == 1.0:
        return list(requests)
    return [replace(r, arrival_s=r.arrival_s * time_scale) for r in requests]


def build_units(
    config: BenchConfig,
    profile: Profile,
    batch_params: Mapping[str, str],
    on_step: Callable[[StepRecord], None] | None = None,
) -> list[SimUnit]:
    """``config.units`` fresh simulated units with their own policy instances and cost models."""
    units = []
    for k, role in enumerate(config.roles()):
        timer = StepTimer(
            profile.coefficients,
            noise_sigma=profile.noise_sigma if config.noise else 0.0,
            heterogeneity=config.heterogeneity,
            seed=config.seed * 1000 + k,
            loop_overhead_s=profile.loop_overhead_s,
            loop_overhead_per_request_s=profile.loop_overhead_per_request_s,
            interference_kappa=(profile.interference_kappa if config.interference_on == "step"
                                else profile.interference_kappa_attention),
            interference_on=config.interference_on,
        )
        # Forgetting 0.99 tracked the held-out ShareGPT-like steps better than 0.999 or a fixed model on
        # all four profiles (mean error before each update: 8B 7.2%, eager 13.8%, 1B 20.9%, shared 18.8%).
        cost = (
            OnlineStepModel(profile.coefficients, forgetting=0.99)
            if config.online_fit
            else FixedCostModel(profile.coefficients)
        )
        units.append(
            SimUnit(
                k,
                make_batch_policy(config.batch_policy, batch_params),
                timer,
                block_size=profile.block_size,
                num_blocks=config.num_gpu_blocks or profile.usable_gpu_blocks,
                max_num_batched_tokens=config.max_num_batched_tokens or profile.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs or profile.max_num_seqs,
                max_model_len=profile.max_model_len,
                cost_model=cost,
                on_step=on_step,
                mixed_interference=profile.interference_kappa,
                role=role,
            )
        )
    return units


def unit_makers(bench: BenchConfig, profile: Profile) -> tuple[Callable[[], SimUnit], ...]:
    """Each of ``bench``'s simulated units as a maker, for units that step on their own
    (:class:`~agent.engine.sim_live.SimLiveUnit`): the unit built with the others at first, a fresh one (the same
    settings, its timer's noise seeded the same) at each restart."""
    batch, _ = split_params(bench.params, bench.batch_policy, bench.dispatch)
    built: list[SimUnit | None] = list(build_units(bench, profile, batch))

    def maker(k: int) -> Callable[[], SimUnit]:
        def make() -> SimUnit:
            unit, built[k] = built[k], None
            return unit if unit is not None else build_units(bench, profile, batch)[k]

        return make

    return tuple(maker(k) for k in range(bench.units))


def build_node(
    config: BenchConfig,
    profile: Profile,
    requests: Sequence[RequestSpec],
    batch_params: Mapping[str, str],
    dispatch_params: Mapping[str, str],
    **hooks: Any,
) -> Node:
    """Fresh units, dispatcher and node for ``config``: topology, lockstep and the KV link included."""
    link = MigrationConfig(
        "recompute" if config.migration == "recompute" else "live",
        kv_bytes_per_token=KV_BYTES_PER_TOKEN.get(profile.model, 131_072),
        bandwidth_gb_s=config.kv_bandwidth_gb_s,
    )
    return Node(
        build_units(config, profile, batch_params),
        make_dispatch_policy(config.dispatch, dispatch_params),
        requests,
        ttft_slo_s=config.ttft_slo_ms / 1e3,
        tpot_slo_s=config.tpot_slo_ms / 1e3,
        lockstep=config.lockstep,
        lockstep_groups=config.lockstep_groups(),
        pass_sync_s=config.pass_sync_ms / 1e3,
        migration=link,
        **hooks,
    )


def run_once(
    config: BenchConfig,
    workload: Sequence[RequestSpec],
    *,
    progress: Callable[[int, int], None] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    on_migrate: Callable[[MigrationRecord], None] | None = None,
) -> RunResult:
    """Replay ``workload`` (arrivals scaled by ``config.time_scale``) and summarize the run.

    ``on_step`` sees every step record and ``on_migrate`` every migration as the node makes them; the finished
    requests are the result's ``outcomes``.

    Requests whose prompt cannot fit the model length are rejected up front and counted.
    ``progress(done, total)`` is called now and then with the number of finished or rejected requests.
    """
    profile = load_profile(config.profile)
    batch_params, dispatch_params = split_params(config.params, config.batch_policy, config.dispatch)
    requests = scale_arrivals(workload, config.time_scale)
    too_long = [r for r in requests if r.prompt_tokens >= profile.max_model_len]
    runnable = [r for r in requests if r.prompt_tokens < profile.max_model_len]
    stats = [UnitStats(k) for k in range(config.units)]
    roles = config.roles()
    cluster = ClusterStats(config.units, profile.block_size, [k for k, r in enumerate(roles) if r != "prefill"],
                           config.pass_groups())

    def record(rec: StepRecord) -> None:
        stats[rec.unit_id].add(rec)
        cluster.add(rec)
        if on_step is not None:
            on_step(rec)

    def on_dispatch(_: int, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        cluster.add_decision(node.now_s, decision)

    def record_migration(m: MigrationRecord) -> None:
        cluster.add_migration(m.reason, m.mechanism)
        if on_migrate is not None:
            on_migrate(m)

    outcomes: list[RequestOutcome] = []
    node = build_node(
        config, profile, runnable, batch_params, dispatch_params,
        on_step=record, on_finish=outcomes.append, on_dispatch=on_dispatch, on_migrate=record_migration,
    )
    units = node.units
    dispatcher = node.dispatcher
    total = len(requests)
    last_arrival = max((r.arrival_s for r in runnable), default=0.0)
    chunk = max(last_arrival / 400.0, 0.25)
    faults = _fault_events(config.faults, config.units)
    while True:
        t = node.next_event_s()
        if t is None and not faults:
            break
        until = t + chunk if t is not None else faults[0][0]
        if faults and faults[0][0] <= until:
            at, kind, unit_id = faults.pop(0)
            node.advance(at)
            if kind == "fail":
                node.fail_unit(unit_id)
            else:
                node.recover_unit(unit_id)
            continue
        node.advance(until)
        if progress is not None:
            progress(node.num_finished + node.num_rejected + len(too_long), total)
    # ``advance`` moves the node clock to the end of its window: the run ends at the last finish.
    duration = max((o.finish_s for o in outcomes), default=0.0)
    offered = offered_rps([r.arrival_s for r in requests])
    summary = summarize(
        outcomes, num_requests=total, num_rejected=node.num_rejected + len(too_long), duration_s=duration,
        offered_rps=offered, tpot_metric=config.tpot_metric,
    )
    return RunResult(
        config=config,
        summary=summary,
        units=[s.as_dict(duration) for s in stats],
        unfinished=len(node.unfinished()),
        batch_params=dict(units[0].policy.params),
        dispatch_params=dict(dispatcher.params),
        offered_rps=offered,
        refused=node.num_refused,
        cluster={
            **cluster.as_dict(max_num_batched_tokens=config.max_num_batched_tokens or profile.max_num_batched_tokens),
            "migrations_skipped": node.num_migrations_skipped,
            "faults": node.num_faults,
        },
        outcomes=outcomes,
    )


def _fault_events(faults: Sequence[Fault], num_units: int) -> list[tuple[float, str, int]]:
    """Fail and recover events in time order (a recovery before a failure of the same unit at one time)."""
    events: list[tuple[float, str, int]] = []
    for f in faults:
        if f.unit_id >= num_units:
            raise ValueError(f"fault on unit {f.unit_id}: there are {num_units} units")
        events.append((f.at_s, "fail", f.unit_id))
        if f.down_s is not None:
            events.append((f.at_s + f.down_s, "recover", f.unit_id))
    events.sort(key=lambda e: (e[0], e[1] == "fail"))
    return events
