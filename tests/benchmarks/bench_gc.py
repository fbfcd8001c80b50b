"""GC pauses of the node's engine loop, with and without ``agent.runtime.gc_control.GcController``.

    python tests/benchmarks/bench_gc.py [--mode both] [--speed 100] [--hours 1] [--ballast 0] [--repeat 1]
                                        [--set NAME=VALUE ...]

Replays the Azure code trace (8,819 requests, one hour) through simulated H100 units the way
``agent.bench.runner.run_once`` builds them, keeping every step record and outcome alive (a live agent keeps
history), and measures every stop-the-world collection with :data:`gc.callbacks` while the loop runs.

Two clocks:

* ``wall``: :class:`agent.runtime.clock.WallClock` sped up ``--speed`` times, so that the loop really waits between
  events and quiet periods occur (at 100x the hour takes about 36 s);
* ``virtual``: no waiting at all, a fully loaded loop: the controller never sees a quiet period and only
  its fallback collects.

``--ballast N`` keeps N more small long-lived containers alive from the start, a stand-in for the heap of a
process that has imported vLLM and torch and loaded a model (the simulator's own heap is small).

A pause is *idle* when it ran inside the controller's hook, before a wait at least as long as the pause;
every other pause delays the loop (*on the loop's path*). Throughput is unit-steps per second of busy time
(wall time minus time slept), quiet-period collections included. Each case runs in its own process, cases
alternate between repeats. Prints numbers, asserts nothing; results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from agent.bench.runner import BenchConfig, build_units
from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.profiles import load_profile
from agent.runtime.clock import Clock, VirtualClock, WallClock
from agent.runtime.gc_control import GcController, GcSettings
from agent.runtime.node import Node
from agent.workload.traces import load_trace
from policies.registry import make_dispatch_policy

TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "azure_code_2023.csv"


@dataclass
class PauseRecorder:
    """Every collection while ``recording``: its generation, duration and whether it ran in idle time."""

    recording: bool = False
    in_hook: bool = False
    gap_s: float = 0.0
    pauses_s: list[float] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    idle: list[bool] = field(default_factory=list)
    _t0: float = 0.0
    _hook: bool = False
    _gap: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            self._hook, self._gap = self.in_hook, self.gap_s
            return
        if not self.recording:
            return
        pause = time.perf_counter() - self._t0
        self.pauses_s.append(pause)
        self.generations.append(int(info["generation"]))
        self.idle.append(self._hook and pause <= self._gap)


class ProbeClock:
    """Wraps a clock: marks the span between ``seconds_until`` (where the hook runs) and the wait."""

    def __init__(self, inner: Clock, recorder: PauseRecorder) -> None:
        self.inner = inner
        self.recorder = recorder
        self.num_waits = 0

    def seconds_until(self, t_s: float) -> float:
        gap = self.inner.seconds_until(t_s)
        self.recorder.in_hook, self.recorder.gap_s = True, gap
        return gap

    def wait_until(self, t_s: float) -> None:
        self.recorder.in_hook = False
        self.num_waits += 1
        self.inner.wait_until(t_s)


def parse_settings(assignments: list[str]) -> GcSettings:
    """``GcSettings`` from ``name=value`` strings (``none`` for None, ``true``/``false`` for flags)."""
    kinds = {f.name: f.type for f in fields(GcSettings)}
    values: dict[str, Any] = {}
    for a in assignments:
        name, _, text = a.partition("=")
        if name not in kinds:
            raise SystemExit(f"GcSettings has no field {name!r} ({', '.join(kinds)})")
        kind = str(kinds[name])
        if text.lower() == "none":
            values[name] = None
        elif "bool" in kind:
            values[name] = text.lower() in ("1", "true", "yes")
        elif "int" in kind:
            values[name] = int(text)
        else:
            values[name] = float(text)
    return GcSettings(**values)


def summarize_pauses(pauses_s: list[float]) -> dict[str, float]:
    ms = np.array(pauses_s) * 1e3
    if not len(ms):
        return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "total_ms": 0.0, "over_10ms": 0}
    return {
        "count": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()), "total_ms": float(ms.sum()), "over_10ms": int((ms > 10).sum()),
    }


def run_case(
    mode: str, controlled: bool, *, speed: float, units: int, ballast: int, trace: Path, hours: int,
    settings: GcSettings,
) -> dict[str, Any]:
    """One replay in this process; returns its measurements."""
    one_hour = load_trace(trace)
    span = max(r.arrival_s for r in one_hour) + 1.0
    workload = [
        replace(r, request_id=f"{r.request_id}-{h}", arrival_s=r.arrival_s + h * span)
        for h in range(hours) for r in one_hour
    ]
    config = BenchConfig(units=units)
    profile = load_profile(config.profile)
    runnable = [r for r in workload if r.prompt_tokens < profile.max_model_len]
    history: list[StepRecord] = []
    outcomes: list[RequestOutcome] = []
    node = Node(
        build_units(config, profile, {}), make_dispatch_policy(config.dispatch, {}), runnable,
        ttft_slo_s=config.ttft_slo_ms / 1e3, tpot_slo_s=config.tpot_slo_ms / 1e3,
        on_step=history.append, on_finish=outcomes.append,
    )
    kept_alive = [[i] for i in range(ballast)]
    slept = 0.0

    def sleep(seconds: float) -> None:
        nonlocal slept
        t0 = time.perf_counter()
        time.sleep(seconds)
        slept += time.perf_counter() - t0

    inner: Clock = WallClock(speed, sleep=sleep) if mode == "wall" else VirtualClock()
    recorder = PauseRecorder()
    clock = ProbeClock(inner, recorder)
    gc.callbacks.append(recorder)
    controller = GcController(settings) if controlled else None
    stats: dict[str, Any] | None = None
    if controller is not None:
        with controller:
            recorder.recording = True
            t0 = time.perf_counter()
            node.run(clock, gc_control=controller)
            wall = time.perf_counter() - t0
            recorder.recording = False
            stats = controller.stats()
    else:
        recorder.recording = True
        t0 = time.perf_counter()
        node.run(clock)
        wall = time.perf_counter() - t0
        recorder.recording = False
    gc.callbacks.remove(recorder)
    busy = wall - slept
    on_path = [p for p, idle in zip(recorder.pauses_s, recorder.idle, strict=True) if not idle]
    full_on_path = [
        p for p, g, idle in zip(recorder.pauses_s, recorder.generations, recorder.idle, strict=True)
        if g == 2 and not idle
    ]
    by_gen = [summarize_pauses([p for p, g in zip(recorder.pauses_s, recorder.generations, strict=True) if g == k])
              for k in range(3)]
    return {
        "mode": mode, "controlled": controlled, "speed": speed if mode == "wall" else None,
        "ballast": len(kept_alive), "steps": len(history), "finished": len(outcomes), "waits": clock.num_waits,
        "wall_s": wall, "slept_s": slept, "busy_s": busy, "steps_per_busy_s": len(history) / busy,
        "all": summarize_pauses(recorder.pauses_s), "on_path": summarize_pauses(on_path),
        "full_on_path": summarize_pauses(full_on_path),
        "by_generation": by_gen, "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "controller": stats,
    }


def _pauses(p: dict[str, float]) -> str:
    return (
        f"n={p['count']:<4} p50={p['p50_ms']:.2f} p99={p['p99_ms']:.2f} max={p['max_ms']:.1f} "
        f"total={p['total_ms']:.1f} ms"
    )


def report(r: dict[str, Any]) -> str:
    """A few lines for one case."""
    g2, f = r["by_generation"][2], r["full_on_path"]
    lines = [
        f"{r['mode']:<8}{'GcController' if r['controlled'] else 'default GC':<13} all pauses  {_pauses(r['all'])}",
        f"{'':<21} on path     {_pauses(r['on_path'])}",
        f"{'':<21} full        {g2['count']} collections, max {g2['max_ms']:.1f} ms; on path {f['count']}, "
        f"max {f['max_ms']:.1f} ms",
        f"{'':<21} loop        {r['steps']:,} unit-steps, busy {r['busy_s']:.2f} s ({r['steps_per_busy_s']:,.0f} "
        f"steps/s), wall {r['wall_s']:.1f} s, max RSS {r['max_rss_mib']:.0f} MiB",
    ]
    c = r["controller"]
    if c is not None:
        lines.append(
            f"{'':<21} controller  {c['num_collections']}, frozen {c['freeze_count']:,} objects"
        )
    return "\n".join(lines)


MEDIANS = (
    ("max_ms", ("all", "max_ms")),
    ("on_path_max_ms", ("on_path", "max_ms")),
    ("on_path_p99_ms", ("on_path", "p99_ms")),
    ("total_ms", ("all", "total_ms")),
    ("on_path_total_ms", ("on_path", "total_ms")),
    ("steps_per_busy_s", ("steps_per_busy_s",)),
)
"""What the summary over repeats shows: (label, keys to the value in a case's result)."""


def _get(result: dict[str, Any], keys: tuple[str, ...]) -> float:
    value: Any = result
    for key in keys:
        value = value[key]
    return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["wall", "virtual", "both"], default="both")
    parser.add_argument("--speed", type=float, default=100.0, help="wall clock speed-up (default 100)")
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--ballast", type=int, default=0, help="extra long-lived containers kept alive")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--hours", type=int, default=1, help="replay the trace this many times back to back")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a GcSettings field for the controller"
    )
    parser.add_argument("--json", action="store_true", help="also print every case's measurements as JSON")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "mode:on|off": run one case, print JSON
    args = parser.parse_args()
    settings = parse_settings(args.set)
    common = {
        "speed": args.speed, "units": args.units, "ballast": args.ballast, "trace": args.trace, "hours": args.hours,
        "settings": settings,
    }
    if args.case:
        mode, _, ctrl = args.case.partition(":")
        print(json.dumps(run_case(mode, ctrl == "on", **common)))
        return

    print(f"machine: {platform.machine()} python {platform.python_version()}, gc thresholds {gc.get_threshold()}")
    print(f"trace: {args.trace.name}, {args.units} units, ballast {args.ballast:,}, wall speed {args.speed:g}x")
    print(f"controller: {settings}")
    modes = ["wall", "virtual"] if args.mode == "both" else [args.mode]
    results = []
    for i in range(args.repeat):
        for mode in modes:
            order = ["off", "on"] if i % 2 == 0 else ["on", "off"]
            for ctrl in order:
                cmd = [sys.executable, __file__, "--case", f"{mode}:{ctrl}", "--speed", str(args.speed),
                       "--units", str(args.units), "--ballast", str(args.ballast), "--trace", str(args.trace),
                       "--hours", str(args.hours), *(f"--set={a}" for a in args.set)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                results.append(r)
                print(report(r), flush=True)
    if args.repeat > 1:
        print(f"median of {args.repeat} runs:")
        for mode in modes:
            for controlled in (False, True):
                rs = [r for r in results if r["mode"] == mode and r["controlled"] == controlled]
                med = {label: statistics.median(_get(r, keys) for r in rs) for label, keys in MEDIANS}
                print(f"  {mode:<8}{'GcController' if controlled else 'default GC':<13} "
                      + ", ".join(f"{k} {v:,.1f}" for k, v in med.items()))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
