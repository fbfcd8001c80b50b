"""Golden per-request outcomes: what the simulator predicts, pinned to the microsecond (issue #21, item 2).

A :class:`GoldenCase` is a slice of a shipped trace replayed through ``trackside bench``'s own path
(:func:`agent.bench.runner.run_once`) with one cluster configuration. :func:`replay` runs it and returns a
:class:`Golden`: every finished request's outcome (arrival, first token, finish and worst TPOT as integer
microseconds of node time, tokens, unit, preemptions), every migration, the run's counts and each unit's steps.
``tests/benchmarks/make_golden.py`` writes one JSON file per case under :data:`GOLDEN_DIR`;
``tests/agent/test_golden_outcomes.py`` replays every case on the current tree and wants the same file, to the
microsecond. Regenerate only when a change of the model is meant, and say why in the commit (docs/benchmarks.md).

This module is the one source of the cases, the replay and the file format for both: the generator runs it against
another tree (the commit that made the files) by putting that tree first on ``sys.path``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import agent.bench.runner as runner
from agent.bench.runner import BenchConfig, Fault, run_once
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec
from policies.registry import BATCH_POLICIES, BUILTIN_POLICIES, DISPATCH_POLICIES

if TYPE_CHECKING:  # read through their attributes only: the runtime may move them
    from agent.engine.base import RequestOutcome
    from agent.runtime.records import MigrationRecord

GOLDEN_DIR = Path(__file__).resolve().parent / "agent" / "golden"
TRACES_DIR = Path(__file__).resolve().parents[1] / "examples" / "traces"
FORMAT = 1
"""Version of the file layout (not of the model): bump it when the columns change."""

OUTCOME_COLUMNS = (
    "request_id", "unit_id", "arrival_us", "first_token_us", "finish_us", "prompt_tokens", "output_tokens",
    "num_preemptions", "max_tpot_us",
)
MIGRATION_COLUMNS = ("request_id", "from_unit_id", "unit_id", "reason", "mechanism", "start_us", "end_us", "kv_tokens")


@functools.cache
def _trace(name: str) -> tuple[RequestSpec, ...]:
    """A whole trace, parsed once per process (the code trace takes 0.1 s; its cases are a third of all)."""
    return tuple(load_trace(TRACES_DIR / name))


@dataclass(frozen=True, slots=True)
class TraceSlice:
    """Requests ``start`` to ``start + count`` of a shipped trace, arrivals rebased so the first one is at 0."""

    trace: str
    """A file name in ``examples/traces``."""
    start: int
    count: int

    def load(self) -> list[RequestSpec]:
        requests = _trace(self.trace)[self.start : self.start + self.count]
        if len(requests) != self.count:
            raise ValueError(f"{self.trace} has {len(requests) + self.start} requests, fewer than {self}")
        t0 = requests[0].arrival_s
        return [replace(r, arrival_s=r.arrival_s - t0) for r in requests]

    def sha256(self) -> str:
        return hashlib.sha256((TRACES_DIR / self.trace).read_bytes()).hexdigest()


@dataclass(frozen=True, slots=True)
class GoldenCase:
    """One replay: a trace slice and the :class:`BenchConfig` fields that differ from bench's defaults."""

    name: str
    slice: TraceSlice
    bench: Mapping[str, Any] = field(default_factory=dict)
    """``BenchConfig`` keyword arguments as JSON values; ``faults`` in ``--fault`` syntax (``UNIT@S[+DOWN]``)."""

    def config(self) -> BenchConfig:
        kwargs = dict(self.bench)
        kwargs["faults"] = tuple(Fault.parse(text) for text in kwargs.get("faults", ()))
        return BenchConfig(**kwargs)

    def describe(self) -> dict[str, Any]:
        """What the file records about the case (the test checks it against the case's definition)."""
        return {"trace": self.slice.trace, "start": self.slice.start, "count": self.slice.count,
                "bench": dict(self.bench)}


# Each trace slice with enough load to queue (TTFT p90 0.3-5 s) and, on the tightest KV the model length allows
# (1,024 blocks of 16 tokens = max_model_len), to preempt now and then: the code trace's outputs are short (~28
# tokens), so preemptions stay rare whatever the KV; small.jsonl has 22k tokens in all and is queued by max_num_seqs.
SLICES: dict[str, tuple[TraceSlice, dict[str, Any]]] = {
    # A burst 14 minutes in: 250 requests in 8.9 s (28 req/s) on four units.
    "azure_code_2023": (TraceSlice("azure_code_2023.csv", 2000, 250), {"units": 4, "num_gpu_blocks": 1024}),
    # The first 200 requests of the code trace (199 s), 20x faster.
    "small_azure": (TraceSlice("small_azure.csv", 0, 200), {"units": 4, "num_gpu_blocks": 1024, "time_scale": 0.05}),
    # All 40 requests of the synthetic JSONL trace (14 s), 10x faster on two units.
    "small": (TraceSlice("small.jsonl", 0, 40),
              {"units": 2, "num_gpu_blocks": 1024, "max_num_seqs": 8, "time_scale": 0.1}),
}

BASE_BATCH = "vllm"
"""The batch policy of the every-dispatch-policy cases."""
BASE_DISPATCH = "least_loaded"
"""The dispatch policy of the every-batch-policy cases."""

EXTRA_CASES: tuple[tuple[str, str, str, str, dict[str, Any]], ...] = (
    # (slice, batch, dispatch, variant, bench fields beyond the slice's)
    ("azure_code_2023", "vllm", "sbs", "lockstep", {"lockstep": True}),
    ("azure_code_2023", "fairbatching+pab", "pab", "", {}),
    ("azure_code_2023", "vllm", "least_loaded", "fault", {"faults": ["1@2+3", "3@6"]}),
    ("azure_code_2023", "vllm", "cascade", "recompute", {"migration": "recompute"}),
    ("small_azure", "vllm", "least_loaded", "disaggregated", {"topology": "disaggregated"}),
    ("small_azure", "vllm", "sbs", "disaggregated", {"topology": "disaggregated"}),
    ("azure_code_2023", "eb", "least_loaded", "one-unit", {"units": 1}),
    ("azure_code_2023", "eb", "least_loaded", "one-unit-fluid", {"units": 1, "params": {"theta_method": "fluid"}}),
)
"""Cluster shapes and paths that bench's defaults do not reach: lockstep (sbs's home), PAB's balancer with its
batch policy, a unit failing mid-run (one comes back, one does not), cascade's migrations by recompute (its
default, live, is in the every-dispatch cases), disaggregated prefill/decode pools (hand-offs), and EB's adaptive
theta* by both methods (on four units no unit finishes the 64 requests theta* waits for; on one it adapts)."""


def case_name(slice_name: str, batch: str, dispatch: str, variant: str = "") -> str:
    return ".".join(part for part in (slice_name, batch, dispatch, variant) if part)


def golden_cases() -> list[GoldenCase]:
    """Every built-in batch policy with :data:`BASE_DISPATCH` and every built-in dispatch policy with
    :data:`BASE_BATCH` on each slice, then :data:`EXTRA_CASES`."""
    batch = [name for name in BATCH_POLICIES if name in BUILTIN_POLICIES]
    dispatch = [name for name in DISPATCH_POLICIES if name in BUILTIN_POLICIES]
    pairs = [(b, BASE_DISPATCH) for b in batch] + [(BASE_BATCH, d) for d in dispatch if d != BASE_DISPATCH]
    cases = []
    for slice_name, (trace_slice, fields) in SLICES.items():
        for b, d in pairs:
            cases.append(GoldenCase(case_name(slice_name, b, d), trace_slice,
                                    {**fields, "batch_policy": b, "dispatch": d}))
    for slice_name, b, d, variant, extra in EXTRA_CASES:
        trace_slice, fields = SLICES[slice_name]
        cases.append(GoldenCase(case_name(slice_name, b, d, variant), trace_slice,
                                {**fields, "batch_policy": b, "dispatch": d, **extra}))
    return cases


@dataclass(slots=True)
class Golden:
    """What one replay predicted, in the file's terms (times in integer microseconds of node time)."""

    counts: dict[str, int]
    unit_steps: list[int]
    outcomes: list[list[Any]]
    """One row per finished request (:data:`OUTCOME_COLUMNS`), sorted by request id."""
    migrations: list[list[Any]]
    """One row per move (:data:`MIGRATION_COLUMNS`), sorted by start time, then the other columns."""


def us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def outcome_row(o: RequestOutcome) -> list[Any]:
    max_tpot = None if o.max_tpot_s is None else us(o.max_tpot_s)
    return [o.request_id, o.unit_id, us(o.arrival_s), us(o.first_token_s), us(o.finish_s), o.prompt_tokens,
            o.output_tokens, o.num_preemptions, max_tpot]


def migration_row(m: MigrationRecord) -> list[Any]:
    return [m.request_id, m.from_unit_id, m.unit_id, m.reason, m.mechanism, us(m.start_s), us(m.end_s), m.kv_tokens]


@contextmanager
def _teeing_node(outcomes: list[RequestOutcome], migrations: list[MigrationRecord]) -> Iterator[None]:
    """Make ``run_once`` hand its node's finished requests and migrations to us as well.

    For a tree from before ``run_once`` took ``on_migrate`` (b9b4c73 made the files): wrapping its module's
    ``build_node`` for the length of one call reads them through the node's own hooks without another replay loop.
    Newer trees pass ``on_migrate`` instead: a module that ``setup.py`` compiles would not see the wrapper.
    """
    build_node = runner.build_node

    def tee(*args: Any, **hooks: Any) -> Any:
        def tee_hook(name: str, sink: Callable[[Any], None]) -> None:
            inner = hooks.get(name)

            def both(item: Any) -> None:
                sink(item)
                if inner is not None:
                    inner(item)

            hooks[name] = both

        tee_hook("on_finish", outcomes.append)
        tee_hook("on_migrate", migrations.append)
        return build_node(*args, **hooks)

    runner.build_node = tee  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.build_node = build_node


def replay(case: GoldenCase) -> Golden:
    requests = case.slice.load()
    outcomes: list[RequestOutcome] = []
    migrations: list[MigrationRecord] = []
    if "on_migrate" in inspect.signature(run_once).parameters:
        result = run_once(case.config(), requests, on_migrate=migrations.append)
        outcomes.extend(result.outcomes)
    else:
        with _teeing_node(outcomes, migrations):
            result = run_once(case.config(), requests)
    finished = {o.request_id for o in outcomes}
    if len(finished) != len(outcomes):
        raise AssertionError(f"{case.name}: a request finished twice")
    counts = {
        "requests": len(requests),
        "finished": len(outcomes),
        "rejected": int(result.summary["rejected"]),
        "refused": result.refused,
        "unfinished": result.unfinished,
        "migrations": len(migrations),
        "migrations_skipped": int(result.cluster["migrations_skipped"]),
        "faults": int(result.cluster["faults"]),
        "preemptions": sum(o.num_preemptions for o in outcomes),
    }
    return Golden(
        counts=counts,
        unit_steps=[int(u["steps"]) for u in result.units],
        outcomes=sorted(outcome_row(o) for o in outcomes),
        migrations=sorted((migration_row(m) for m in migrations), key=_migration_order),
    )


def _migration_order(row: Sequence[Any]) -> tuple[Any, ...]:
    """Start time first; a move back to the dispatcher (no target unit) sorts before moves to unit 0."""
    return (row[5], row[0], row[1], -1 if row[2] is None else row[2], *row[3:5], *row[6:])


def to_json(case: GoldenCase, golden: Golden, made_from: Mapping[str, Any]) -> str:
    """The file: a JSON object whose tables have one row per line (readable diffs; 2-17 KB a case)."""
    head = {"format": FORMAT, "case": case.name, **case.describe(), "trace_sha256": case.slice.sha256(),
            "made_from": dict(made_from), "counts": golden.counts, "unit_steps": golden.unit_steps}
    lines = ["{"]
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    for key, columns, rows in (("outcomes", OUTCOME_COLUMNS, golden.outcomes),
                               ("migrations", MIGRATION_COLUMNS, golden.migrations)):
        lines.append(f'  "{key}_columns": {json.dumps(list(columns))},')
        body = ",\n".join(f"    {json.dumps(row, separators=(',', ':'))}" for row in rows)
        lines.append(f'  "{key}": [\n{body}\n  ],' if rows else f'  "{key}": [],')
    lines[-1] = lines[-1].rstrip(",")
    lines.append("}")
    return "\n".join(lines) + "\n"


def path_of(case: GoldenCase, directory: Path = GOLDEN_DIR) -> Path:
    return directory / f"{case.name}.json"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path.name}: format {data.get('format')!r}, this code reads {FORMAT}")
    return data


def first_difference(expected: Mapping[str, Any], actual: Golden) -> str | None:
    """None when ``actual`` predicts what the file says; else a message that names each part that differs and, in
    the tables, the first differing row column by column."""
    diffs: list[str] = []
    counts = sorted(k for k in set(expected["counts"]) | set(actual.counts)
                    if expected["counts"].get(k) != actual.counts.get(k))
    if counts:
        changes = ", ".join(f"{k} {expected['counts'].get(k)} -> {actual.counts.get(k)}" for k in counts)
        diffs.append(f"counts (expected -> got): {changes}")
    outcomes = _first_changed_request(expected["outcomes"], actual.outcomes)
    if outcomes:
        diffs.append(outcomes)
    if expected["unit_steps"] != actual.unit_steps:
        diffs.append(f"unit steps: expected {expected['unit_steps']}, got {actual.unit_steps}")
    migrations = _first_changed_migration(expected["migrations"], actual.migrations)
    if migrations:
        diffs.append(migrations)
    return "\n".join(diffs) or None


def _first_changed_request(expected: Sequence[Sequence[Any]], actual: Sequence[Sequence[Any]]) -> str | None:
    """The first request (by id, i.e. in arrival order) whose outcome differs, or that only one side finished."""
    by_e = {row[0]: list(row) for row in expected}
    by_a = {row[0]: list(row) for row in actual}
    ids = sorted(by_e.keys() | by_a.keys())
    changed = [i for i in ids if by_e.get(i) != by_a.get(i)]
    if not changed:
        return None
    first = changed[0]
    return (f"{len(changed)} of {len(ids)} requests differ; the first, {first}:\n"
            + _row_difference(OUTCOME_COLUMNS, by_e.get(first), by_a.get(first)))


def _first_changed_migration(expected: Sequence[Sequence[Any]], actual: Sequence[Sequence[Any]]) -> str | None:
    """The first position (in start-time order) where the migrations differ."""
    exp, act = [list(row) for row in expected], [list(row) for row in actual]
    if exp == act:
        return None
    index = next((i for i, (e, a) in enumerate(zip(exp, act, strict=False)) if e != a), min(len(exp), len(act)))
    return (f"migrations differ ({len(exp)} expected, {len(act)} got); first at #{index}:\n"
            + _row_difference(MIGRATION_COLUMNS, exp[index] if index < len(exp) else None,
                              act[index] if index < len(act) else None))


def _row_difference(columns: Sequence[str], expected: Sequence[Any] | None, actual: Sequence[Any] | None) -> str:
    if expected is None or actual is None:
        def show(row: Sequence[Any] | None) -> str:
            return "nothing" if row is None else str(dict(zip(columns, row, strict=True)))

        return f"  expected {show(expected)}\n  got      {show(actual)}"
    lines = []
    for name, e, a in zip(columns, expected, actual, strict=True):
        mark = ""
        if e != a:
            delta = f" ({a - e:+d})" if isinstance(a, int) and isinstance(e, int) else ""
            mark = f"   <-- got {a!r}{delta}"
        lines.append(f"  {name:>16} {e!r}{mark}")
    return "\n".join(lines)
