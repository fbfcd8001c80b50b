"""A stand-in for ``trackside whatif`` (the console's What-if screen runs it as a child): the same arguments, progress
lines and JSON result, with fixed numbers, so the console's tests do not depend on the simulator.

    python tests/whatif_fake.py MODE --db STORE --node NODE --since ISO --until ISO [--compare P1,P2] --json FILE \
        --progress jsonl

``MODE`` takes the place of ``whatif``: ``switch`` (recommends the best candidate), ``keep`` (recommends keeping the
policy that ran), ``error`` (a warning, then ``trackside whatif: error: ...``, exit 2), ``hang`` (one progress line,
then waits to be killed). It checks what it was given as the real one would (the store opens read-only and holds only
the node's rows, the times have a zone) and, with ``WHATIF_FAKE_LOG`` set, writes what it saw there as JSON. With
``WHATIF_FAKE_GATE`` set to a path, it waits (up to 60 s) for that file before its first run, so a test can look at
the console while the child is certainly still running, however slow the machine.
The tests import :func:`result_document` for results of their own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence

RECORDED = {"effective_rps": 10.0, "slo_attainment": 0.9, "ttft_p99": 800.0, "tpot_p99": 45.0}
NUMBERS = {
    "vllm": (9.8, 0.89, 820.0, 47.0),
    "sarathi": (11.2, 0.95, 700.0, 38.0),
    "fairbatching": (10.6, 0.93, 760.0, 41.0),
    "fairbatching+pab": (10.1, 0.94, 650.0, 40.0),
    "eb": (9.1, 0.85, 900.0, 52.0),
    "eb+": (9.5, 0.88, 870.0, 49.0),
    "static": (4.2, 0.40, 2500.0, 80.0),
}
"""Each batch policy's effective req/s, SLO attainment, TTFT p99 and TPOT p99 (ms) in every fake what-if."""
FIDELITY = {
    "goodput_rel_err": 0.021,
    "slo_attainment_abs_err": 0.01,
    "ttft_p50_rel_err": 0.034,
    "ttft_p99_rel_err": -0.025,
    "tpot_p50_rel_err": 0.041,
    "tpot_p99_rel_err": 0.044,
}


def summary(effective: float, slo: float, ttft_p99: float, tpot_p99: float, requests: int) -> dict[str, object]:
    dist = {"mean": ttft_p99 / 3, "p50": ttft_p99 / 4, "p90": ttft_p99 / 2, "p99": ttft_p99}
    tpot = {"mean": tpot_p99 / 2, "p50": tpot_p99 / 2.5, "p90": tpot_p99 / 1.5, "p99": tpot_p99}
    return {
        "requests": requests, "completed": requests, "rejected": 0, "duration_s": 600.0, "throughput_rps": effective,
        "goodput_rps": effective * slo, "offered_rps": effective, "effective_rps": effective, "slo_attainment": slo,
        "ttft_ms": dist, "tpot_ms": tpot,
    }


def result_document(
    *,
    node_id: str = "node-a",
    start_ns: int = 0,
    end_ns: int = 600_000_000_000,
    requests: int = 600,
    ran: str = "vllm",
    dispatch: str = "least_loaded",
    candidates: Sequence[str] = ("sarathi", "fairbatching", "eb"),
    action: str = "switch",
    fidelity: dict[str, float | None] | None = None,
) -> dict[str, object]:
    """A result as ``trackside whatif --json`` writes it: the replay of ``ran`` and each candidate, ranked."""
    entries = [(ran, "replay"), *((name, "candidate") for name in candidates)]
    order = sorted(range(len(entries)), key=lambda i: -NUMBERS.get(entries[i][0], (5.0,))[0])
    runs = []
    for i, (policy, role) in enumerate(entries):
        effective, slo, ttft, tpot = NUMBERS.get(policy, (5.0, 0.5, 1000.0, 60.0))
        runs.append({
            "batch_policy": policy, "dispatch": dispatch, "params": {}, "label": f"{policy} + {dispatch}",
            "role": role, "rank": order.index(i) + 1, "summary": summary(effective, slo, ttft, tpot, requests),
            "delta": {
                "effective_rps_rel": effective / RECORDED["effective_rps"] - 1,
                "slo_attainment_abs": slo - RECORDED["slo_attainment"],
                "ttft_p99_rel": ttft / RECORDED["ttft_p99"] - 1, "tpot_p99_rel": None,
            },
        })
    best = min(runs, key=lambda run: run["rank"])  # type: ignore[arg-type, return-value]
    keep = action == "keep" or best["role"] == "replay"
    chosen = runs[0] if keep else best
    gain = None if keep else float(chosen["summary"]["effective_rps"]) / RECORDED["effective_rps"] - 1  # type: ignore[index]
    return {
        "window": {"node_id": node_id, "start_ns": start_ns, "end_ns": end_ns, "requests": requests,
                   "unfinished": 0, "refused": 0},
        "shape": {"units": 4, "topology": "colocated", "lockstep": False, "batch_policy": ran, "dispatch": dispatch,
                  "profile": "h100-llama31-8b"},
        "profile": {"name": "h100-llama31-8b", "source": "built-in"},
        "recorded": summary(RECORDED["effective_rps"], RECORDED["slo_attainment"], RECORDED["ttft_p99"],
                            RECORDED["tpot_p99"], requests),
        "runs": runs,
        "fidelity": FIDELITY if fidelity is None else fidelity,
        "recommendation": {
            "action": "keep" if keep else "switch", "batch_policy": chosen["batch_policy"], "dispatch": dispatch,
            "params": {}, "expected_gain": gain,
            "reason": "the policy that ran is the best here" if keep else "highest effective req/s, SLO not worse",
        },
    }


def fail(message: str) -> int:
    print(f"trackside whatif: error: {message}", file=sys.stderr, flush=True)
    return 2


def ns_of(text: str) -> int:
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"no zone in {text}")
    return round(moment.timestamp() * 1e6) * 1000


def progress(done: int, total: int, label: str) -> None:
    line = {"event": "progress", "done": done, "total": total, "label": label}
    print(json.dumps(line), file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> int:
    import duckdb  # here: the tests that import result_document need no database

    mode, *rest = argv
    parser = argparse.ArgumentParser(prog="trackside whatif")
    parser.add_argument("--db", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--since", required=True)
    parser.add_argument("--until", required=True)
    parser.add_argument("--compare", default="")
    parser.add_argument("--json", required=True)
    parser.add_argument("--progress", choices=["jsonl"], required=True)
    args = parser.parse_args(rest)
    since, until = ns_of(args.since), ns_of(args.until)
    con = duckdb.connect(args.db, read_only=True)
    tables = ("nodes", "steps", "requests", "request_events", "unit_loads", "audits", "alerts")
    nodes = sorted({n for table in tables for (n,) in con.execute(f"SELECT DISTINCT node_id FROM {table}").fetchall()})
    (hello,) = con.execute("SELECT dispatch_policy, units[1].batch_policy FROM nodes WHERE node_id = ? "
                           "ORDER BY boot_ns DESC LIMIT 1", [args.node]).fetchall() or [("?", "?")]
    (requests,) = con.execute("SELECT count(*) FROM requests WHERE node_id = ? AND time_ns BETWEEN ? AND ?",
                              [args.node, since, until]).fetchone() or (0,)
    con.close()
    if log := os.environ.get("WHATIF_FAKE_LOG"):
        with open(log, "w", encoding="utf-8") as out:
            json.dump({"argv": list(argv), "nodes": nodes, "since_ns": since, "until_ns": until}, out)
    if nodes != [args.node]:
        return fail(f"the store holds nodes {nodes}, not only {args.node}")
    candidates = [c for c in args.compare.split(",") if c] or list(NUMBERS)
    dispatch, ran = hello
    total = 1 + len(candidates)
    if mode == "error":
        print("warning: 3 requests had no finish in the window", file=sys.stderr, flush=True)
        return fail(f"no finished requests of {args.node} between {args.since} and {args.until}")
    if mode == "hang":
        print("warning: slow", file=sys.stderr, flush=True)
        progress(1, total, f"{ran} + {dispatch}")
        time.sleep(120)
        return 0
    if gate := os.environ.get("WHATIF_FAKE_GATE"):
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
    for done, name in enumerate([ran, *candidates], start=1):
        time.sleep(0.01)
        progress(done, total, f"{name} + {dispatch}")
    doc = result_document(node_id=args.node, start_ns=since, end_ns=until, requests=int(requests), ran=ran,
                          dispatch=dispatch, candidates=candidates, action="keep" if mode == "keep" else "switch")
    with open(args.json, "w", encoding="utf-8") as out:
        json.dump(doc, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
