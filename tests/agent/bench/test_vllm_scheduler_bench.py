"""``tests/benchmarks/bench_vllm_scheduler.py`` (issue #21 item 5's measurement) runs and prints what it says: a tiny
shape, two policies, one repeat. The timing itself is a benchmark, run by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bench_scripts import bench_script

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_policy_gets_a_ratio_and_a_plan_share(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool) -> None:
    with bench_script("bench_vllm_scheduler") as bench:
        assert bench.parse_shapes("256x1000,64x8") == [(256, 1000), (64, 8)]
        monkeypatch.setattr(sys, "argv", ["bench", "--shapes", "8x4,4x0", "--policies", "vllm,fairbatching",
                                          "--steps", "5", "--repeats", "1",
                                          *(["--async-scheduling"] if async_scheduling else [])])
        assert bench.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["shape", "scheduler", "us/step", "ratio", "plan", "us", "plan"]
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == ["8x4"] * 3 + ["4x0"] * 3
    assert [r[1] for r in rows if r[1] != "vLLM"] == ["vllm", "fairbatching"] * 2
    for r in rows:
        if r[1] == "vLLM":
            assert float(r[3]) > 0  # "vLLM Scheduler": its us/step
        elif r[1] == "vllm":  # vLLM's own default: vLLM's scheduler decides, no plan() is called
            assert float(r[2]) > 0 and float(r[3]) > 0 and r[4:] == ["native", "-"]
        else:
            us, ratio, plan_us, share = float(r[2]), float(r[3]), float(r[4]), float(r[5].rstrip("%"))
            assert us > 0 and ratio > 0 and plan_us > 0 and 0 < share < 100


def test_the_decision_digest_keeps_every_runs_trace_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with bench_script("vllm_scheduler_digest") as digest:
        monkeypatch.setattr(digest, "POLICIES", (("sarathi", {}),))
        monkeypatch.setattr(sys, "argv", ["digest", str(tmp_path / "d.json")])
        assert digest.main() == 0
    runs = json.loads((tmp_path / "d.json").read_text())
    assert len(runs) == 2 * 4 * 2 * 2 and "runs" in capsys.readouterr().out
    for key, run in runs.items():
        assert key.startswith("sarathi{}-async=")
        scheduled = [step for step in run["trace"] if step[0]]
        assert len(run["records"]) == len(scheduled) > 0
        for record, step in zip(run["records"], scheduled, strict=True):
            assert record["num_prefill_tokens"] + record["num_decode_tokens"] == sum(step[0].values())
