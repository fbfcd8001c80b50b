"""The side-by-side speed harness (``tests/benchmarks/bench_sim_speed.py --against REV``, issue #21 item 1): its
pure parts; the timing itself is a benchmark, run by hand."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
from bench_scripts import BENCHMARKS, bench_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("bench_sim_speed") as module:
        yield module


def test_the_trees_alternate(bench: ModuleType) -> None:
    assert bench.schedule(3) == ["A", "B", "A", "B", "A", "B"]


def test_the_ratio_is_of_medians_this_tree_over_rev(bench: ModuleType) -> None:
    S = bench.Sample
    # wall (A, B) per pair: (2, 1), (1, 4), (0.5, 2); CPU time a quarter of the wall for A, half for B
    walls = [2.0, 1.0, 1.0, 4.0, 0.5, 2.0]
    samples = [S(tree, wall, wall / (4 if tree == "A" else 2), 100) for tree, wall in zip("ABABAB", walls, strict=True)]
    result = bench.compare(samples)
    assert (result.a_steps_per_s, result.b_steps_per_s) == (100.0, 50.0)
    assert result.ratio == 2.0 and result.same_steps
    assert result.paired_ratio == 4.0  # pairs: 0.5, 4, 4
    assert result.cpu_ratio == 4.0
    assert not bench.compare([S("A", 1.0, 1.0, 100), S("B", 1.0, 1.0, 101)]).same_steps
    with pytest.raises(ValueError, match="each tree"):
        bench.compare([S("A", 1.0, 1.0, 100)])


def test_the_options(bench: ModuleType) -> None:
    args = bench.parse_args(["--against", "b9b4c73", "--repeats", "5", "--limit", "300"])
    assert (args.against, args.repeat, args.limit, args.child) == ("b9b4c73", 5, 300, False)
    plain = bench.parse_args([])
    assert (plain.against, plain.repeat, plain.limit, plain.units) == (None, 3, None, 4)
    argv = bench.child_argv(args)
    assert argv[1] == str(BENCHMARKS / "bench_sim_speed.py") and "--child" in argv and argv[-2:] == ["--limit", "300"]
    assert bench.parse_args(argv[2:]).child
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])


def test_each_run_says_which_code_it_ran(bench: ModuleType) -> None:
    from policies._compiled import STATE

    assert bench.code_state() == STATE  # this tree's own check, not another tree's served by an editable install
    assert bench.parse_args(["--against", "HEAD", "--build"]).build
    assert not bench.parse_args(["--against", "HEAD"]).build
