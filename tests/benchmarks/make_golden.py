"""Write the golden per-request outcomes (issue #21, item 2): one JSON file per case in tests/agent/golden/.

    python tests/benchmarks/make_golden.py [--case GLOB ...] [--out DIR] [--list] [--check]

Replays every case of ``tests/golden_outcomes.py`` (a slice of each shipped trace under every batch and dispatch
policy, plus lockstep, disaggregated, fault and migration cases) with the simulator of the tree that ``agent`` is
imported from, and records that tree's commit in each file. To make the files from another commit, check it out
in a worktree and put it first on the path (the cases and this script stay the current ones):

    git worktree add --detach /tmp/golden-src REV
    (cd /tmp/golden-src && PYTHONPATH=/tmp/golden-src python /path/to/repo/tests/benchmarks/make_golden.py)
    git worktree remove /tmp/golden-src

Regenerate only when a change of the model is meant, and say why in the commit; docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import agent


def _load_golden_outcomes() -> ModuleType:
    """``tests/golden_outcomes.py`` by its path: tests/ on ``sys.path`` would make its ``agent`` and ``policies``
    folders namespace packages that hide an editable install's."""
    path = Path(__file__).resolve().parents[1] / "golden_outcomes.py"
    loaded = sys.modules.get("golden_outcomes")
    if loaded is not None and Path(loaded.__file__ or "").resolve() == path:  # the tests imported it
        return loaded
    spec = importlib.util.spec_from_file_location("golden_outcomes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


g = _load_golden_outcomes()


def source_tree() -> dict[str, Any]:
    """The commit of the tree ``agent`` came from, and whether its simulator sources differ from that commit."""
    root = Path(agent.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--", "agent", "policies").strip())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "tree": str(root)}
    return {"commit": commit, "dirty": dirty}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", default=[], metavar="GLOB",
                        help="only the cases whose name matches (repeatable; e.g. 'small.*' or '*.cascade*')")
    parser.add_argument("--out", type=Path, default=g.GOLDEN_DIR, help=f"directory (default {g.GOLDEN_DIR})")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--check", action="store_true",
                        help="compare with the files in --out instead of writing them; exit 1 on a difference")
    args = parser.parse_args(argv)

    cases = [c for c in g.golden_cases() if not args.case or any(fnmatch.fnmatch(c.name, p) for p in args.case)]
    if not cases:
        parser.error("no case matches")
    if args.list:
        for case in cases:
            print(f"{case.name:50} {case.describe()}")
        return 0
    made_from = source_tree()
    print(f"simulator from {Path(agent.__file__).resolve().parent} ({made_from})")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for case in cases:
        t0 = time.perf_counter()
        golden = g.replay(case)
        wall = time.perf_counter() - t0
        path = g.path_of(case, args.out)
        c = golden.counts
        what = (f"{c['finished']}/{c['requests']} finished, {c['preemptions']} preemptions, "
                f"{c['migrations']} migrations, {c['faults']} faults, {sum(golden.unit_steps)} unit-steps")
        if args.check:
            diff = g.first_difference(g.load(path), golden) if path.exists() else f"{path} is missing"
            failed += diff is not None
            print(f"{'DIFF' if diff else 'same'} {case.name} ({wall:.2f} s)" + (f"\n{diff}" if diff else ""))
        else:
            path.write_text(g.to_json(case, golden, made_from), encoding="utf-8")
            print(f"wrote {path.name}: {what} ({wall:.2f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
