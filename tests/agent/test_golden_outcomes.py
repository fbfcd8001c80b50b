"""The simulator predicts what it predicted when the golden files were made, to the microsecond (issue #21, item 2).

Every case of ``tests/golden_outcomes.py`` is replayed through ``trackside bench``'s path and compared with its file
in ``tests/agent/golden/`` (made from the commit each file names). A difference means the model changed: if that
was not the point of the change, it is a bug; if it was, regenerate (``tests/benchmarks/make_golden.py``) and say
why in the commit (docs/benchmarks.md, "Golden outcomes").
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import golden_outcomes as g
import pytest

from policies.registry import BATCH_POLICIES, BUILTIN_POLICIES, DISPATCH_POLICIES

CASES = g.golden_cases()
GENERATOR = Path(__file__).resolve().parents[1] / "benchmarks" / "make_golden.py"
REGENERATE = "python tests/benchmarks/make_golden.py --case '{}'"


def test_every_case_has_its_file_and_every_file_its_case() -> None:
    files = {p.name.removesuffix(".json") for p in g.GOLDEN_DIR.glob("*.json")}
    names = {c.name for c in CASES}
    assert len(names) == len(CASES), "two cases share a name"
    assert not names - files, f"no golden file for {sorted(names - files)}: run make_golden.py for them"
    assert not files - names, f"golden files of no case: {sorted(files - names)}"


def test_the_cases_cover_every_built_in_policy() -> None:
    batch = {c.bench["batch_policy"] for c in CASES}
    dispatch = {c.bench["dispatch"] for c in CASES}
    assert batch >= {name for name in BATCH_POLICIES if name in BUILTIN_POLICIES}
    assert dispatch >= {name for name in DISPATCH_POLICIES if name in BUILTIN_POLICIES}


def test_the_cases_reach_preemptions_migrations_and_faults() -> None:
    counts = [g.load(g.path_of(c))["counts"] for c in CASES]
    assert sum(c["preemptions"] for c in counts) >= 10
    assert any(c["faults"] for c in counts)
    assert any(c["migrations"] > c["faults"] for c in counts)
    assert any(c["rejected"] for c in counts)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_replay_matches_its_golden_file(case: g.GoldenCase) -> None:
    expected = g.load(g.path_of(case))
    assert expected["case"] == case.name
    assert {k: expected[k] for k in case.describe()} == case.describe(), (
        f"the case's definition changed since its file was made: {REGENERATE.format(case.name)}"
    )
    assert expected["trace_sha256"] == case.slice.sha256(), f"examples/traces/{case.slice.trace} changed"
    diff = g.first_difference(expected, g.replay(case))
    if diff is not None:
        pytest.fail(
            f"{case.name}: the simulator's predictions changed (golden from {expected['made_from']}):\n{diff}\n"
            f"If the change of the model is meant, regenerate ({REGENERATE.format(case.name)}) and say why in the "
            "commit.",
            pytrace=False,
        )


def test_a_changed_microsecond_is_reported_with_its_request_and_column() -> None:
    case = next(c for c in CASES if c.name == "small.vllm.least_loaded")
    expected = g.load(g.path_of(case))
    rows = copy.deepcopy(expected["outcomes"])
    finish = g.OUTCOME_COLUMNS.index("finish_us")
    rows[7][finish] += 1
    actual = g.Golden(counts=dict(expected["counts"]), unit_steps=list(expected["unit_steps"]), outcomes=rows,
                      migrations=copy.deepcopy(expected["migrations"]))
    diff = g.first_difference(expected, actual)
    assert diff is not None
    assert f"1 of {len(rows)} requests differ; the first, {rows[7][0]}" in diff
    assert "finish_us" in diff and "(+1)" in diff
    del rows[3]
    diff = g.first_difference(expected, actual)
    assert diff is not None and f"the first, {expected['outcomes'][3][0]}" in diff and "got      nothing" in diff


def test_changed_counts_and_migrations_are_reported() -> None:
    case = next(c for c in CASES if c.name == "azure_code_2023.vllm.least_loaded.fault")
    expected = g.load(g.path_of(case))
    migrations = copy.deepcopy(expected["migrations"])
    migrations[0][g.MIGRATION_COLUMNS.index("start_us")] -= 5
    actual = g.Golden(counts={**expected["counts"], "faults": 1}, unit_steps=list(expected["unit_steps"]),
                      outcomes=copy.deepcopy(expected["outcomes"]), migrations=migrations)
    diff = g.first_difference(expected, actual)
    assert diff is not None
    assert "faults 2 -> 1" in diff
    assert "migrations differ (4 expected, 4 got); first at #0" in diff and "(-5)" in diff


def test_the_generator_lists_its_cases(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("make_golden", GENERATOR)
    assert spec is not None and spec.loader is not None
    make_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_golden)
    assert make_golden.g is g
    assert make_golden.main(["--list", "--case", "small.*"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [c.name for c in CASES if c.name.startswith("small.")]
    with pytest.raises(SystemExit):
        make_golden.main(["--case", "no-such-case"])
