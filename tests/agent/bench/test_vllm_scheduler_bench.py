"""``tests/benchmarks/bench_vllm_scheduler.py`` (issue #21 item 5's measurement) runs and prints what it says: a tiny
shape, two policies, one repeat. The timing itself is a benchmark, run by hand."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm")

from bench_scripts import bench_script

pytestmark = pytest.mark.vllm


def test_every_policy_gets_a_ratio_and_a_plan_share(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with bench_script("bench_vllm_scheduler") as bench:
        assert bench.parse_shapes("256x1000,64x8") == [(256, 1000), (64, 8)]
        monkeypatch.setattr(sys, "argv", ["bench", "--shapes", "8x4,4x0", "--policies", "vllm,fairbatching",
                                          "--steps", "5", "--repeats", "1"])
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
