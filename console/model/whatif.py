"""The What-if screen's plain side: the window, the child's command line and progress lines, its JSON result as
typed records, and what the screen shows of them (the ranked rows, the fidelity line, the recommendation) and
applies (the recommendation as a :class:`~console.model.policy_view.PolicyChange`).

No Textual, no clock, no processes: the screen runs ``trackside whatif`` in a child (:mod:`console.whatif`) and
draws what these functions return. The child's contract (``python -m agent.cli whatif --db STORE --node NODE
[--since ISO] [--until ISO] [--compare P1,P2] --json FILE --progress jsonl``): one JSON object per finished run on
stderr (``{"event": "progress", "done": 2, "total": 6, "label": "sarathi + least_loaded"}``), other stderr lines
plain text, ``trackside whatif: error: ...`` as the last one and exit status 2 on a problem; the result in the
``--json`` file (:func:`parse_result`).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from agent.telemetry import ParamSchema, PolicySchema
from console.model.policy_view import PolicyChange, find_schema, params_text
from console.model.records import NodeInfo
from console.model.render import fmt_clock
from policies.params import ParamValue

DEFAULT_WINDOW: Final = "10m"
"""The window the screen starts with: the last 10 minutes before now (live) or the replay's cursor."""
POOR_FIDELITY: Final = 0.10
"""A fidelity error above this (10%; 10 points for SLO attainment) makes the fidelity poor."""
ERROR_PREFIX: Final = "trackside whatif: error: "
"""How the child's one error line starts."""

_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([hms])")
_CLOCK: Final = r"(\d{1,2}):(\d{2})(?::(\d{2}))?"
_CLOCK_RANGE: Final = re.compile(rf"^{_CLOCK}\s*(?:-|–|\.\.)\s*{_CLOCK}$")


# -- the window ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Window:
    """The stretch of history a what-if replays: ``start_ns`` to ``end_ns`` (wall-clock ns)."""

    start_ns: int
    end_ns: int

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def describe(self) -> str:
        """``07:50:08-08:00:08 (10m)``: local clock times and the length."""
        return f"{fmt_clock(self.start_ns)}-{fmt_clock(self.end_ns)} ({fmt_duration(self.seconds)})"


def fmt_duration(seconds: float) -> str:
    """``45s``, ``10m``, ``2m30s``, ``1h05m``."""
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        minutes, rest = divmod(total, 60)
        return f"{minutes}m{rest:02d}s" if rest else f"{minutes}m"
    hours, rest_m = divmod(round(total / 60), 60)
    return f"{hours}h{rest_m:02d}m" if rest_m else f"{hours}h"


def parse_window(text: str, end_ns: int) -> Window:
    """The window the operator typed, at ``end_ns`` (now, or the replay's cursor): a length (``10m``, ``90s``,
    ``1h30m``: the last so long before ``end_ns``), or two local clock times (``07:55-08:00:30``, on ``end_ns``'s day;
    a start later than the end is on the day before). Raises ValueError with what is accepted."""
    raw = text.strip().lower()
    clock = _CLOCK_RANGE.match(raw)
    if clock:
        day = time.localtime(end_ns / 1e9)
        start = _clock_ns(day, clock.group(1), clock.group(2), clock.group(3))
        end = _clock_ns(day, clock.group(4), clock.group(5), clock.group(6))
        if start >= end:
            start -= 86_400 * 10**9
        return Window(start, end)
    parts = _DURATION.findall(raw)
    if not raw or not parts or _DURATION.sub("", raw).strip():
        raise ValueError(f"not a window: {text.strip()!r} (a length such as 10m, 90s, 1h30m; or 07:55-08:00)")
    seconds = sum(float(value) * {"h": 3600, "m": 60, "s": 1}[unit] for value, unit in parts)
    if seconds <= 0:
        raise ValueError("the window must be longer than 0 s")
    return Window(end_ns - round(seconds * 1e9), end_ns)


def _clock_ns(day: time.struct_time, hours: str, minutes: str, seconds: str | None) -> int:
    h, m, s = int(hours), int(minutes), int(seconds or 0)
    if h > 23 or m > 59 or s > 59:
        raise ValueError(f"not a clock time: {hours}:{minutes}" + (f":{seconds}" if seconds else ""))
    local = (day.tm_year, day.tm_mon, day.tm_mday, h, m, s, 0, 0, -1)
    return round(time.mktime(local)) * 10**9


def iso_time(time_ns: int, *, round_up: bool = False) -> str:
    """``time_ns`` as ISO 8601 in UTC to the microsecond (``2026-11-26T10:00:00.123456+00:00``), rounded down (a
    window's start) or up (its end), so the window given to the child holds every event of the one shown."""
    micros = -(-time_ns // 1000) if round_up else time_ns // 1000
    moment = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(microseconds=micros)
    return moment.isoformat(timespec="microseconds")


def child_args(
    *, db: str, node_id: str, window: Window, candidates: Sequence[str], json_path: str
) -> list[str]:
    """The arguments after ``whatif``: the copied store, the node, the window, the candidates (none: the child's
    default, every built-in batch policy), the result file, progress as JSON lines."""
    args = ["--db", db, "--node", node_id, "--since", iso_time(window.start_ns)]
    args += ["--until", iso_time(window.end_ns, round_up=True)]
    if candidates:
        args += ["--compare", ",".join(candidates)]
    return [*args, "--json", json_path, "--progress", "jsonl"]


# -- the child's stderr -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Progress:
    """Runs finished so far (a progress line of the child)."""

    done: int
    total: int
    label: str


def parse_progress(line: str) -> Progress | None:
    """A progress line (``{"event": "progress", "done": 2, "total": 6, "label": "..."}``); None for any other line."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("event") != "progress":
        return None
    done, total = data.get("done"), data.get("total")
    if not isinstance(done, int) or not isinstance(total, int) or isinstance(done, bool) or isinstance(total, bool):
        return None
    return Progress(done, total, str(data.get("label") or ""))


WARNING_PREFIX: Final = "trackside whatif: warning: "


def warning_text(line: str) -> str:
    """A warning line of the child without its ``trackside whatif: warning:`` prefix."""
    text = line.strip()
    return text[len(WARNING_PREFIX) :] if text.startswith(WARNING_PREFIX) else text


def error_line(lines: Sequence[str], returncode: int) -> str:
    """What the operator is shown of a failed child: its ``trackside whatif: error: ...`` line, else its last line
    of text, else its exit status."""
    texts = [line.strip() for line in lines if line.strip()]
    errors = [line for line in texts if line.startswith(ERROR_PREFIX)]
    if errors:
        return errors[-1]
    if texts:
        return texts[-1]
    return f"trackside whatif exited with status {returncode} and said nothing"


# -- the result ---------------------------------------------------------------------------------------------------
class ResultError(ValueError):
    """The child's JSON is not what the contract says."""


@dataclass(frozen=True, slots=True)
class Summary:
    """One run's (or the recorded window's) numbers that the screen shows."""

    requests: int | None
    completed: int | None
    effective_rps: float | None
    goodput_rps: float | None
    slo_attainment: float | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None


@dataclass(frozen=True, slots=True)
class Run:
    """One simulated run: the policy that ran (``role`` ``replay``) or a candidate, ranked by effective req/s."""

    batch_policy: str
    dispatch: str
    params: dict[str, ParamValue]
    label: str
    role: str
    rank: int | None
    summary: Summary
    effective_rps_rel: float | None
    """Relative to the recorded window (0.12: 12% more); None when unknown."""


@dataclass(frozen=True, slots=True)
class Fidelity:
    """How well the replay of the policy that ran matches what was recorded (each None when unknown)."""

    goodput_rel_err: float | None
    slo_attainment_abs_err: float | None
    ttft_p50_rel_err: float | None
    ttft_p99_rel_err: float | None
    tpot_p50_rel_err: float | None
    tpot_p99_rel_err: float | None


@dataclass(frozen=True, slots=True)
class Recommendation:
    action: Literal["switch", "keep"]
    batch_policy: str
    dispatch: str
    params: dict[str, ParamValue]
    expected_gain: float | None
    """A fraction (0.12: +12%); None when not given."""
    reason: str


@dataclass(frozen=True, slots=True)
class WhatIfResult:
    """The child's JSON, as far as the screen uses it."""

    node_id: str
    start_ns: int
    end_ns: int
    requests: int | None
    batch_policy: str
    """What ran in the window (the node's shape)."""
    dispatch: str
    profile: str
    recorded: Summary
    runs: tuple[Run, ...]
    """By rank (best first), unranked ones last."""
    fidelity: Fidelity
    recommendation: Recommendation


def _obj(data: object, where: str) -> Mapping[str, object]:
    if not isinstance(data, Mapping):
        raise ResultError(f"{where} is not an object")
    return data


def _num(data: Mapping[str, object], key: str) -> float | None:
    value = data.get(key)
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _int(data: Mapping[str, object], key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(data: Mapping[str, object], key: str) -> str:
    value = data.get(key)
    return value if isinstance(value, str) else ""


def _params(data: Mapping[str, object], key: str) -> dict[str, ParamValue]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise ResultError(f"{key} is not an object")
    return {str(k): v for k, v in value.items() if isinstance(v, bool | int | float | str)}


def _summary(data: object, where: str) -> Summary:
    summary = _obj(data, where)
    ttft = _obj(summary.get("ttft_ms") or {}, f"{where}.ttft_ms")
    tpot = _obj(summary.get("tpot_ms") or {}, f"{where}.tpot_ms")
    return Summary(
        requests=_int(summary, "requests"),
        completed=_int(summary, "completed"),
        effective_rps=_num(summary, "effective_rps"),
        goodput_rps=_num(summary, "goodput_rps"),
        slo_attainment=_num(summary, "slo_attainment"),
        ttft_p99_ms=_num(ttft, "p99"),
        tpot_p99_ms=_num(tpot, "p99"),
    )


def parse_result(data: object) -> WhatIfResult:
    """The child's ``--json`` document as a :class:`WhatIfResult`; raises :class:`ResultError` for one that does not
    follow the contract (missing sections, a run that is not an object)."""
    doc = _obj(data, "the result")
    window = _obj(doc.get("window"), "window")
    shape = _obj(doc.get("shape") or {}, "shape")
    profile = _obj(doc.get("profile") or {}, "profile")
    runs_data = doc.get("runs")
    if not isinstance(runs_data, list):
        raise ResultError("runs is not a list")
    runs = []
    for i, item in enumerate(runs_data):
        run = _obj(item, f"runs[{i}]")
        delta = _obj(run.get("delta") or {}, f"runs[{i}].delta")
        runs.append(
            Run(
                batch_policy=_str(run, "batch_policy"),
                dispatch=_str(run, "dispatch"),
                params=_params(run, "params"),
                label=_str(run, "label"),
                role=_str(run, "role"),
                rank=_int(run, "rank"),
                summary=_summary(run.get("summary"), f"runs[{i}].summary"),
                effective_rps_rel=_num(delta, "effective_rps_rel"),
            )
        )
    runs.sort(key=lambda r: (r.rank is None, r.rank or 0))
    fid = _obj(doc.get("fidelity") or {}, "fidelity")
    rec = _obj(doc.get("recommendation"), "recommendation")
    action = rec.get("action")
    if action not in ("switch", "keep"):
        raise ResultError(f"recommendation.action is {action!r}, not switch or keep")
    return WhatIfResult(
        node_id=_str(window, "node_id"),
        start_ns=_int(window, "start_ns") or 0,
        end_ns=_int(window, "end_ns") or 0,
        requests=_int(window, "requests"),
        batch_policy=_str(shape, "batch_policy"),
        dispatch=_str(shape, "dispatch"),
        profile=_str(profile, "name"),
        recorded=_summary(doc.get("recorded"), "recorded"),
        runs=tuple(runs),
        fidelity=Fidelity(
            goodput_rel_err=_num(fid, "goodput_rel_err"),
            slo_attainment_abs_err=_num(fid, "slo_attainment_abs_err"),
            ttft_p50_rel_err=_num(fid, "ttft_p50_rel_err"),
            ttft_p99_rel_err=_num(fid, "ttft_p99_rel_err"),
            tpot_p50_rel_err=_num(fid, "tpot_p50_rel_err"),
            tpot_p99_rel_err=_num(fid, "tpot_p99_rel_err"),
        ),
        recommendation=Recommendation(
            action="switch" if action == "switch" else "keep",
            batch_policy=_str(rec, "batch_policy"),
            dispatch=_str(rec, "dispatch"),
            params=_params(rec, "params"),
            expected_gain=_num(rec, "expected_gain"),
            reason=_str(rec, "reason"),
        ),
    )


# -- what the screen shows ----------------------------------------------------------------------------------------
COLUMNS: Final[tuple[tuple[str, str], ...]] = (
    ("rank", "#"),
    ("policy", "batch policy"),
    ("dispatch", "dispatch"),
    ("effective", "eff req/s"),
    ("delta", "Δ vs rec"),
    ("slo", "SLO"),
    ("ttft", "TTFT p99"),
    ("tpot", "TPOT p99"),
)
"""Column keys and headers of the ranked table: the change of effective req/s against the recorded window next to
it (the ranking's measure), so both show at 80 columns."""

RowKind = Literal["recorded", "replay", "candidate"]


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One row of the ranked table."""

    key: str
    kind: RowKind
    cells: tuple[str, ...]
    """One per :data:`COLUMNS` entry."""
    recommended: bool = False


def fmt_rps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_share(fraction: float | None) -> str:
    """A fraction as a percentage to a tenth (``93.1%``)."""
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def fmt_change(fraction: float | None) -> str:
    """A relative change with its sign (``+12.0%``, ``-3.4%``)."""
    return "-" if fraction is None else f"{fraction * 100:+.1f}%"


def fmt_latency(value_ms: float | None) -> str:
    """``8.5 ms``, ``820 ms``, ``2.50 s``."""
    if value_ms is None:
        return "-"
    if value_ms >= 1000:
        return f"{value_ms / 1000:.2f} s"
    return f"{value_ms:.1f} ms" if value_ms < 10 else f"{value_ms:.0f} ms"


def _policy_cell(batch_policy: str, params: Mapping[str, ParamValue]) -> str:
    return f"{batch_policy} {params_text(params)}" if params else batch_policy


def notable_params(
    params: Mapping[str, ParamValue], batch: PolicySchema | None, dispatch: PolicySchema | None = None
) -> dict[str, ParamValue]:
    """The parameters worth showing (a run carries every parameter of its batch and dispatch policies): those that
    differ from their default in ``batch``'s or ``dispatch``'s schema, and those neither schema names."""
    notable: dict[str, ParamValue] = {}
    for name, value in params.items():
        param = _param(batch, name) or _param(dispatch, name)
        if param is None or not same_value(value, param.default):
            notable[name] = value
    return notable


def same_value(a: ParamValue | None, b: ParamValue | None) -> bool:
    """Equal parameter values, an int and a float of the same number alike (``50`` and ``50.0``)."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def _param(schema: PolicySchema | None, name: str) -> ParamSchema | None:
    return next((p for p in schema.params if p.name == name), None) if schema is not None else None


@dataclass(frozen=True, slots=True)
class Schemas:
    """The policies a node offers (from its hello), to tell a run's notable parameters from its defaults."""

    batch: tuple[PolicySchema, ...] = ()
    dispatch: tuple[PolicySchema, ...] = ()

    @classmethod
    def of(cls, node: NodeInfo | None) -> Schemas:
        return cls() if node is None else cls(node.batch_policies, node.dispatch_policies)

    def cell(self, batch_policy: str, dispatch: str, params: Mapping[str, ParamValue]) -> str:
        """``sarathi tbt_target_ms=40.0``: the batch policy and its notable parameters."""
        notable = notable_params(params, find_schema(self.batch, batch_policy), find_schema(self.dispatch, dispatch))
        return _policy_cell(batch_policy, notable)


def _is_recommended(run: Run, rec: Recommendation) -> bool:
    if rec.action == "keep":
        return run.role == "replay"
    return (run.batch_policy, run.dispatch, run.params) == (rec.batch_policy, rec.dispatch, rec.params)


def result_rows(result: WhatIfResult, schemas: Schemas = Schemas()) -> list[ResultRow]:
    """The recorded window first (no rank), then every run by rank, with its notable parameters; the policy that ran
    is marked ``(replay)``, the recommended run flagged."""
    rec = result.recorded
    rows = [
        ResultRow(
            "recorded",
            "recorded",
            (
                "",
                f"{result.batch_policy or '?'} (recorded)",
                result.dispatch or "?",
                fmt_rps(rec.effective_rps),
                "",
                fmt_share(rec.slo_attainment),
                fmt_latency(rec.ttft_p99_ms),
                fmt_latency(rec.tpot_p99_ms),
            ),
        )
    ]
    for i, run in enumerate(result.runs):
        replay = run.role == "replay"
        policy = schemas.cell(run.batch_policy, run.dispatch, run.params) + (" (replay)" if replay else "")
        rows.append(
            ResultRow(
                f"run:{i}",
                "replay" if replay else "candidate",
                (
                    "-" if run.rank is None else str(run.rank),
                    policy,
                    run.dispatch,
                    fmt_rps(run.summary.effective_rps),
                    fmt_change(run.effective_rps_rel),
                    fmt_share(run.summary.slo_attainment),
                    fmt_latency(run.summary.ttft_p99_ms),
                    fmt_latency(run.summary.tpot_p99_ms),
                ),
                _is_recommended(run, result.recommendation),
            )
        )
    return rows


FIDELITY_PARTS: Final[tuple[tuple[str, str, bool], ...]] = (
    ("goodput_rel_err", "goodput", False),
    ("slo_attainment_abs_err", "SLO", True),
    ("ttft_p50_rel_err", "TTFT p50", False),
    ("ttft_p99_rel_err", "p99", False),
    ("tpot_p50_rel_err", "TPOT p50", False),
    ("tpot_p99_rel_err", "p99", False),
)
"""Each fidelity error: its field, its label (a p99 follows its p50), whether it is absolute (points of attainment)
rather than relative."""


def _err(value: float | None, absolute: bool) -> str:
    if value is None:
        return "n/a"
    return f"{abs(value) * 100:.1f} pt" if absolute else f"{abs(value) * 100:.1f}%"


def fidelity_text(fidelity: Fidelity, threshold: float = POOR_FIDELITY) -> tuple[str, bool]:
    """The fidelity line: how far the replay of the policy that ran is from the recording, each error
    (``goodput 2.2% · SLO 2.1 pt · TTFT p50 17.7% p99 21.2% · TPOT p50 11.8% p99 13.4%``), and whether that is
    poor (any error above ``threshold``, or none known), said plainly then."""
    values = [(label, getattr(fidelity, key), absolute) for key, label, absolute in FIDELITY_PARTS]
    parts = [f"{label} {_err(value, absolute)}" for label, value, absolute in values]
    errors = " · ".join([parts[0], parts[1], f"{parts[2]} {parts[3]}", f"{parts[4]} {parts[5]}"])
    known = [value for _, value, _ in values if value is not None]
    if not known:
        return f"replay fidelity unknown ({errors}): read the ranking with care", True
    poor = sum(abs(value) > threshold for value in known)
    head = f"replay fidelity: {errors}"
    limit = f"{threshold * 100:.0f}%"
    if poor:
        what = "an error" if poor == 1 else f"{poor} errors"
        return f"{head} · POOR: {what} over {limit}, read the ranking with care", True
    return f"{head} · good: every error within {limit}", False


def recommendation_text(rec: Recommendation, schemas: Schemas = Schemas()) -> str:
    """``switch to sarathi + least_loaded: expected +12.0% effective req/s (reason)`` or ``keep ...``."""
    what = schemas.cell(rec.batch_policy or "?", rec.dispatch, rec.params)
    what += f" + {rec.dispatch}" if rec.dispatch else ""
    if rec.action == "keep":
        text = f"keep {what}"
    else:
        text = f"switch to {what}"
        if rec.expected_gain is not None:
            text += f": expected {fmt_change(rec.expected_gain)} effective req/s"
    return f"{text} ({rec.reason})" if rec.reason else text


def recommended_change(rec: Recommendation, node: NodeInfo) -> PolicyChange:
    """The recommendation as the change the Policies screen sends: every unit of the node to the recommended batch
    policy, with those of its parameters (the policy's own, by its schema in the hello) that differ from the defaults
    (a swap) or from what the units run (the same policy). Raises ValueError, saying why, when there is nothing to
    apply: a ``keep``, a dispatcher other than the node's, a policy the node does not offer, every unit already so."""
    if rec.action == "keep":
        raise ValueError("the recommendation is to keep the running policy: nothing to apply")
    if rec.dispatch and node.dispatch_policy and rec.dispatch != node.dispatch_policy:
        raise ValueError(
            f"the recommendation runs dispatch {rec.dispatch} and {node.node_id} now runs {node.dispatch_policy}: "
            "change the dispatcher on the Policies screen first"
        )
    schema = find_schema(node.batch_policies, rec.batch_policy)
    if node.batch_policies and schema is None:
        raise ValueError(f"{node.node_id} does not offer the batch policy {rec.batch_policy}")
    own = {name: value for name, value in rec.params.items() if schema is None or _param(schema, name) is not None}
    units = node.units.values()
    if not units or any(unit.batch_policy != rec.batch_policy for unit in units):
        return PolicyChange(node.node_id, "batch", rec.batch_policy, True, notable_params(own, schema))
    changed = {
        name: value
        for name, value in own.items()
        if any(not same_value(unit.batch_params.get(name, value), value) for unit in units)
    }
    if not changed:
        shown = _policy_cell(rec.batch_policy, notable_params(own, schema))
        raise ValueError(f"every unit of {node.node_id} already runs {shown}")
    return PolicyChange(node.node_id, "batch", rec.batch_policy, False, changed)
