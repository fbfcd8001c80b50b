"""Simulator speed: replay the whole Azure code trace on simulated H100 units in virtual time.

    python tests/benchmarks/bench_sim_speed.py [--units 4] [--repeat 3] [--batch-policy vllm] [--limit N]
    python tests/benchmarks/bench_sim_speed.py --against REV [--repeats 3] [--limit N] [--build]

Prints wall time, unit-steps per second and requests per second for each repetition and the median.
Target (issue #2): the full trace (8,819 requests, one hour) on 4 units under 30 s on the 2-core machine.

``--against REV`` (issue #21, item 1) checks REV out in a temporary git worktree and times this tree and REV's
alternately on the same machine (A B A B ..., each run in a fresh process with its tree first on the path),
then prints each tree's median unit-steps/s and their ratio, this tree over REV (above 1: this tree is faster):
of wall time, the median of each adjacent pair's ratio (robust to the machine's load drifting over the runs) and
of CPU time (robust to other processes taking turns on the cores of a shared machine).
The worktree is removed afterwards, also on an error or ^C. Both trees replay the same trace file (this tree's).
Each run says which code it ran: this tree's compiled modules (``setup.py``; an install builds them) or its source
(``TRACKSIDE_PURE=1``, or stale). REV's worktree runs its source unless ``--build`` compiles it first.
Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.bench.runner import BenchConfig, run_once
from agent.engine.base import StepRecord
from agent.workload.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "examples" / "traces" / "azure_code_2023.csv"
RESULT = "RESULT "
"""Prefix of the one line a ``--child`` run prints: its measurement as JSON."""


@dataclass(frozen=True, slots=True)
class Replay:
    """One timed replay of the trace."""

    wall_s: float
    cpu_s: float
    """CPU time of the process during the replay."""
    steps: int
    requests: int
    simulated_s: float


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed replay in a side-by-side run."""

    tree: str
    """``A`` (this tree) or ``B`` (REV)."""
    wall_s: float
    cpu_s: float
    steps: int
    code: str = "?"
    """Compiled or source (``policies._compiled.STATE`` in the child)."""

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def steps_per_cpu_s(self) -> float:
        return self.steps / self.cpu_s


@dataclass(frozen=True, slots=True)
class Comparison:
    """Both trees' medians; every ratio is this tree's speed over REV's (above 1: this tree is faster)."""

    a_steps_per_s: float
    """Median unit-steps per wall second of this tree."""
    b_steps_per_s: float
    """Median unit-steps per wall second of REV's tree."""
    paired_ratio: float
    """Median over the adjacent pairs (A then B) of their ratio of unit-steps per wall second."""
    cpu_ratio: float
    """Ratio of the medians of unit-steps per CPU second."""
    same_steps: bool
    """Every run of both trees simulated the same number of unit-steps."""

    @property
    def ratio(self) -> float:
        """Ratio of the medians of unit-steps per wall second."""
        return self.a_steps_per_s / self.b_steps_per_s


def schedule(repeats: int) -> list[str]:
    """The order of the runs: ``A B`` ``repeats`` times, so that both trees see the machine's drifts alike."""
    return ["A", "B"] * repeats


def compare(samples: Sequence[Sample]) -> Comparison:
    """Medians of each tree's rates (each run's own, so runs of different step counts still compare), in the order
    of :func:`schedule`."""
    a = [s for s in samples if s.tree == "A"]
    b = [s for s in samples if s.tree == "B"]
    if not a or not b:
        raise ValueError("need at least one run of each tree")
    pairs = [x.steps_per_s / y.steps_per_s for x, y in zip(a, b, strict=False)]
    cpu = statistics.median(x.steps_per_cpu_s for x in a) / statistics.median(y.steps_per_cpu_s for y in b)
    return Comparison(statistics.median(s.steps_per_s for s in a), statistics.median(s.steps_per_s for s in b),
                      statistics.median(pairs), cpu, len({s.steps for s in samples}) == 1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--repeat", "--repeats", dest="repeat", type=int, default=3,
                        help="runs (of each tree with --against); the median is reported (default 3)")
    parser.add_argument("--batch-policy", default="vllm")
    parser.add_argument("--dispatch", default="least_loaded")
    parser.add_argument("--profile", default="h100-llama31-8b")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the trace's first N requests")
    parser.add_argument("--against", metavar="REV", help="time this tree against REV's, alternately (see above)")
    parser.add_argument("--build", action="store_true",
                        help="with --against: compile REV's modules in its worktree too (its setup.py, if it has "
                             "one), so that both trees run compiled; without it REV runs its source")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--repeat and --limit must be >= 1")
    if args.against and args.child:
        parser.error("--against and --child exclude each other")
    return args


def time_replay(args: argparse.Namespace) -> Replay:
    workload = load_trace(args.trace, limit=args.limit)
    config = BenchConfig(profile=args.profile, units=args.units, batch_policy=args.batch_policy, dispatch=args.dispatch)
    steps = 0

    def count(_: StepRecord) -> None:
        nonlocal steps
        steps += 1

    t0, c0 = time.perf_counter(), time.process_time()
    result = run_once(config, workload, on_step=count)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Replay(wall, cpu, steps, len(workload), result.summary["duration_s"])


def run_here(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    workload = load_trace(args.trace, limit=args.limit)
    load_s = time.perf_counter() - t0
    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}")
    print(f"trace: {args.trace.name}, {len(workload):,} requests, loaded in {load_s:.2f} s; code: {code_state()}")
    walls = []
    for i in range(args.repeat):
        r = time_replay(args)
        walls.append(r.wall_s)
        print(
            f"run {i + 1}: {r.wall_s:.2f} s wall, {r.steps:,} unit-steps ({r.steps / r.wall_s:,.0f}/s), "
            f"{r.requests / r.wall_s:,.0f} requests/s, simulated {r.simulated_s:,.0f} s"
        )
    med = statistics.median(walls)
    what = f"the first {len(workload):,} requests" if args.limit else "the whole trace"
    print(f"median: {med:.2f} s wall for {what} on {args.units} units (target < 30 s for the whole trace)")


def run_child(args: argparse.Namespace) -> None:
    """One replay in this process, its numbers as one JSON line (the parent checks where ``agent`` came from)."""
    import agent

    r = time_replay(args)
    print(RESULT + json.dumps({"wall_s": r.wall_s, "cpu_s": r.cpu_s, "steps": r.steps, "agent": agent.__file__,
                               "code": code_state()}))


def code_state() -> str:
    """Whether this process runs the compiled modules (``setup.py``) or the source, and why."""
    import agent

    try:
        from policies import _compiled
    except ImportError:  # a tree from before setup.py compiled anything
        return "pure (no setup.py)"
    # An editable install's finder serves a module this tree lacks from the installed tree: not this tree's state.
    if not Path(_compiled.__file__).resolve().is_relative_to(Path(agent.__file__).resolve().parents[1]):
        return "pure (no setup.py)"
    return _compiled.STATE


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def describe_tree(path: Path) -> str:
    """Commit, and whether the simulator's sources (agent/, policies/) differ from it."""
    dirty = git(path, "status", "--porcelain", "--", "agent", "policies")
    return git(path, "rev-parse", "HEAD") + (" + uncommitted changes in agent/ or policies/" if dirty else "")


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """REV checked out (detached) in a temporary worktree of this repository, removed on the way out."""
    try:
        commit = git(ROOT, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"--against: {rev!r} is not a commit of {ROOT}") from None
    tmp = Path(tempfile.mkdtemp(prefix="trackside-against-"))
    path = tmp / "tree"
    try:
        git(ROOT, "worktree", "add", "--detach", str(path), commit)
        yield path
    finally:
        if path.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--units", str(args.units),
            "--batch-policy", args.batch_policy, "--dispatch", args.dispatch, "--profile", args.profile,
            "--trace", str(args.trace.resolve())]
    return argv + (["--limit", str(args.limit)] if args.limit is not None else [])


def time_in(tree: Path, label: str, args: argparse.Namespace) -> Sample:
    """One replay in a fresh process with ``tree`` first on the path (and nothing else from PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    done = subprocess.run(child_argv(args), cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the run in {tree} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1].removeprefix(RESULT))
    if not Path(result["agent"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the run meant for {tree} imported agent from {result['agent']}")
    return Sample(label, result["wall_s"], result["cpu_s"], result["steps"], result.get("code", "?"))


def run_against(args: argparse.Namespace) -> None:
    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")
    with worktree(args.against) as other:
        if args.build and (other / "setup.py").exists():
            print(f"building {args.against}'s compiled modules in its worktree ...", flush=True)
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=other, check=True,
                           capture_output=True)
        trees = {"A": ROOT, "B": other}
        print(f"A: this tree, {ROOT} ({describe_tree(ROOT)})")
        print(f"B: {args.against}, {other} ({describe_tree(other)})")
        print(f"trace: {args.trace.name}" + (f", first {args.limit:,} requests" if args.limit else "") +
              f"; {args.units} units, {args.batch_policy} + {args.dispatch}; {args.repeat} runs each, alternately")
        samples = []
        for i, label in enumerate(schedule(args.repeat)):
            sample = time_in(trees[label], label, args)
            samples.append(sample)
            print(f"run {i + 1} ({label}): {sample.wall_s:.2f} s wall, {sample.cpu_s:.2f} s CPU, "
                  f"{sample.steps:,} unit-steps ({sample.steps_per_s:,.0f}/s); code: {sample.code}", flush=True)
    result = compare(samples)
    print(f"median unit-steps/s: A {result.a_steps_per_s:,.0f}, B {result.b_steps_per_s:,.0f}")
    print(f"ratio A/B {result.ratio:.3f} (above 1: this tree is faster); median of the pairs' ratios "
          f"{result.paired_ratio:.3f}; of CPU time {result.cpu_ratio:.3f}")
    if not result.same_steps:
        print("note: the trees simulated different numbers of unit-steps (the model differs; see the golden test)")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
    elif args.against:
        run_against(args)
    else:
        run_here(args)


if __name__ == "__main__":
    main()
