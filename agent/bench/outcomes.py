"""``trackside bench --outcomes FILE``: one row per finished request, for another tool to compare (issue #21, item 7).

A run's summary (:mod:`agent.bench.report`) is what trackside concludes; the per-request rows are what another
simulator, a real run (``vllm bench serve --save-detailed``), or a notebook can check it against. Each row is a
request that finished in one run of the bench (a comparison or a sweep writes every run's rows, told apart by
``batch_policy``, ``dispatch`` and ``time_scale``): the columns of :data:`COLUMNS`, times in seconds of node time
from the run's start (the workload's clock, scaled by ``time_scale``), latencies in milliseconds. Requests that
were rejected have no row (the summary counts them). CSV here (the standard library); Parquet is written by the
command from the same rows (``agent.cli``, through DuckDB).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from agent.bench.runner import RunResult

COLUMNS = (
    "batch_policy", "dispatch", "time_scale", "request_id", "unit_id", "arrival_s", "first_token_s", "finish_s",
    "prompt_tokens", "output_tokens", "num_preemptions", "ttft_ms", "e2e_ms", "mean_tpot_ms", "worst_tpot_ms",
    "ttft_slo_ms", "tpot_slo_ms", "met_slo",
)
"""The columns, in order. ``mean_tpot_ms`` is ``(finish - first token) / (outputs - 1)``, ``worst_tpot_ms`` seed
003's worst per-token TPOT (empty for a one-token request); ``met_slo`` by the run's ``--tpot-metric``."""


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 6)


def outcome_rows(results: Iterable[RunResult]) -> Iterator[dict[str, Any]]:
    """The rows of every run in ``results``, run by run, each run's in finish order."""
    for r in results:
        c = r.config
        for o in r.outcomes:
            yield {
                "batch_policy": c.batch_policy, "dispatch": c.dispatch, "time_scale": c.time_scale,
                "request_id": o.request_id, "unit_id": o.unit_id, "arrival_s": o.arrival_s,
                "first_token_s": o.first_token_s, "finish_s": o.finish_s, "prompt_tokens": o.prompt_tokens,
                "output_tokens": o.output_tokens, "num_preemptions": o.num_preemptions, "ttft_ms": _ms(o.ttft_s),
                "e2e_ms": _ms(o.finish_s - o.arrival_s), "mean_tpot_ms": _ms(o.tpot_by("mean")),
                "worst_tpot_ms": _ms(o.tpot_by("worst")), "ttft_slo_ms": _ms(o.ttft_slo_s),
                "tpot_slo_ms": _ms(o.tpot_slo_s), "met_slo": o.meets_slo(c.tpot_metric),
            }


def write_outcomes_csv(results: Iterable[RunResult], path: Path) -> int:
    """Write the rows of ``results`` to ``path`` as CSV (a header, then one line per request); how many rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in outcome_rows(results):
            writer.writerow(row)
            n += 1
    return n
