"""``tests/benchmarks/suite_under_load.py`` (issue #21, item 8): its reading of pytest's JUnit XML and its exit
status, on a tiny suite of its own (the whole suite under load is a benchmark, run by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench_scripts import bench_script


def test_the_junit_counts_and_failed_names_are_read(tmp_path: Path) -> None:
    xml = tmp_path / "run.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="test_broken"><error message="y"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    with bench_script("suite_under_load") as bench:
        summary = bench.junit_summary(xml)
    assert (summary["tests"], summary["passed"], summary["failures"], summary["errors"], summary["skipped"]) == (
        4, 1, 1, 1, 1)
    assert summary["failed"] == ["tests.a::test_bad", "tests.b::test_broken"]


def test_a_failing_run_makes_it_exit_1_and_names_the_test(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_tiny.py").write_text("def test_passes():\n    pass\n\ndef test_fails():\n    assert 1 == 2\n")
    monkeypatch.setattr(sys, "argv", ["suite_under_load.py"])
    with bench_script("suite_under_load") as bench:
        code = bench.main(["--runs", "1", "--busy", "1", "--logs", str(tmp_path / "logs"), "--",
                           str(suite / "test_tiny.py")])
    out = capsys.readouterr().out
    assert code == 1 and "passed 1, failed 1" in out and "FAILED" in out and "test_fails" in out
    assert "0 of 1 runs passed" in out and (tmp_path / "logs" / "run1.log").read_text()
