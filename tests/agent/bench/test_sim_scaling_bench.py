"""The scaling benchmark (``tests/benchmarks/bench_sim_scaling.py``, issue #21 item 4): its pure parts; the timing
itself is a benchmark, run by hand."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from types import ModuleType

import pytest
from bench_scripts import bench_script

from agent.workload.types import RequestSpec


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("bench_sim_scaling") as module:
        yield module


def test_a_repeated_trace_shifts_each_copy_by_whole_hours_and_keeps_ids_unique(bench: ModuleType) -> None:
    trace = [RequestSpec("a", 0.0, 10, 5), RequestSpec("b", 3599.5, 10, 5)]
    out = bench.repeated(trace, 3)
    assert [r.arrival_s for r in out] == [0.0, 3599.5, 3600.0, 7199.5, 7200.0, 10799.5]
    assert len({r.request_id for r in out}) == 6 and out[0].request_id == "a" and out[2].request_id == "a~1"
    longer = bench.repeated([RequestSpec("a", 0.0, 10, 5), RequestSpec("b", 3700.0, 10, 5)], 2)
    assert longer[2].arrival_s == 7200.0, "a trace longer than an hour repeats every two hours"
    with pytest.raises(ValueError):
        bench.repeated(trace, 0)


def test_the_tables_compare_with_four_units_at_1x_and_with_the_first_length(bench: ModuleType) -> None:
    rows = [bench.Row(1, 1.0, 1, 10, 100, 1.0, 40.0), bench.Row(4, 1.0, 1, 10, 1000, 2.0, 40.0)]
    lines = bench.table_units(rows)
    assert lines[2].endswith("| 10000.0 | 5.00 | 40 |") and lines[3].endswith("| 2000.0 | 1.00 | 40 |")
    long = [bench.Row(4, 1.0, 1, 10, 1000, 2.0, 40.0), bench.Row(4, 1.0, 4, 40, 4000, 10.0, 80.0)]
    assert "| 10.0 | 1.25 |" in bench.table_hours(long)[3]


def test_lists_must_be_positive(bench: ModuleType) -> None:
    assert bench.parse_list("1,4,16") == [1, 4, 16]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_list("4,0")
    assert bench.parse_args(["--quick", "--hours", "1,24"]).hours == [1]
