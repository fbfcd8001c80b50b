"""Does the test suite hold on a loaded machine? (issue #21, item 8)

    python tests/benchmarks/suite_under_load.py [--runs 3] [--busy 2] [--json FILE] [--logs DIR] [-- PYTEST ARGS...]

Starts ``--busy`` processes that spin on the CPU (a shared CI machine with another job beside ours), then runs
the README's test command (``pytest``, with any arguments after ``--``) ``--runs`` times in a row, each with
JUnit XML and its output kept in ``--logs`` (``runN.xml``, ``runN.log``), and prints per run: the wall time,
passed/failed/errors/skipped, and the failed tests' names. The busy loops stop when it ends, also on Ctrl-C.
Exits 1 if any run had a failure or an error, so it can gate a change.

A suite that holds here waits for events, not for speeds: its fixtures run on simulated time and its waits have
deadlines long enough for a machine that is slow, not only for one that is idle. Record the runs in
docs/benchmarks.md ("The suite on a loaded machine") with the date, the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def spin() -> None:
    """Burn one CPU until terminated."""
    x = 0
    while True:
        x = (x + 1) % 1_000_003


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and the failed tests' ids from a JUnit XML file of pytest."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="suite runs in a row (default 3)")
    ap.add_argument("--busy", type=int, default=2, help="CPU-spinning processes beside the suite (default 2)")
    ap.add_argument("--json", type=Path, help="write the runs' summaries here")
    ap.add_argument("--logs", type=Path, help="keep each run's pytest output here as runN.log (default: a new "
                    "temporary folder, printed and kept)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        ap.error("--runs must be at least 1 and --busy at least 0")

    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    runs: list[dict[str, Any]] = []
    logs = args.logs or Path(tempfile.mkdtemp(prefix="suite-under-load-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"pytest output and JUnit XML in {logs}", flush=True)
    try:
        for n in range(1, args.runs + 1):
            xml = logs / f"run{n}.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra]
            print(f"run {n}/{args.runs}: {' '.join(cmd[2:])} with {args.busy} busy loops", flush=True)
            started = time.monotonic()
            with (logs / f"run{n}.log").open("w") as log:
                code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
            run: dict[str, Any] = {"run": n, "exit": code, "wall_s": round(time.monotonic() - started, 1),
                                   "load_average_1m": load_average()}
            run.update(junit_summary(xml) if xml.exists() else {"failed": ["(no JUnit XML: pytest crashed)"]})
            runs.append(run)
            print(f"  exit {code}, {run['wall_s']} s, passed {run.get('passed')}, failed "
                  f"{run.get('failures')}, errors {run.get('errors')}, skipped {run.get('skipped')}", flush=True)
            for name in run["failed"]:
                print(f"  FAILED {name}", flush=True)
    finally:
        for p in busy:
            p.terminate()
        for p in busy:
            p.join(timeout=5)
    if args.json:
        args.json.write_text(json.dumps({"busy": args.busy, "cpus": os.cpu_count(), "runs": runs}, indent=1) + "\n")
    bad = [r for r in runs if r["exit"] != 0 or r["failed"]]
    print(f"{len(runs) - len(bad)} of {len(runs)} runs passed with {args.busy} busy loops beside them")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
