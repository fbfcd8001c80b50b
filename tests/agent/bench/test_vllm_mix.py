"""The mixed-batch probe (``python -m agent.bench.vllm_mix``, issue #19 item 6) on the CPU: a real vLLM engine with
the fake executor. Its step times are the fake's model, so what is checked is the path: each share's steps come out
with exactly the composition asked for, the budget switch and the aborts leave the engine empty for the next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from agent.bench.vllm_mix import MEASURED_STEPS, cell_requests, main, parse_cells

pytestmark = pytest.mark.vllm


def test_cells_and_requests() -> None:
    assert parse_cells("512:256,2048:1024") == [(512, 256), (2048, 1024)]
    decodes, feeders = cell_requests(512, 256, 0.25, "x")
    assert len(decodes) == 128 and {r.prompt_tokens for r in decodes} == {256}
    # enough prompt tokens to fill the other 384 tokens of more than the measured steps
    assert sum(r.prompt_tokens for r in feeders) >= 384 * MEASURED_STEPS and {r.output_tokens for r in feeders} == {1}
    assert cell_requests(512, 256, 1.0, "y")[1] == []  # all decodes: nothing to feed


def test_a_sweep_on_the_fake_engine(tmp_path: Path) -> None:
    assert main(["--fake", "--out", str(tmp_path), "--cells", "64:32", "--rhos", "0,0.5,1"]) == 0
    result = json.loads((tmp_path / "mix.json").read_text())
    rows = result["cells"]
    assert [r["rho"] for r in rows] == [0.0, 0.5, 1.0]
    for r in rows:
        assert r["steps"] >= MEASURED_STEPS, r
        assert (r["decode_tokens"], r["prefill_tokens"]) == (round(r["rho"] * 64), 64 - round(r["rho"] * 64))
        assert r["t_med_ms"] > 0 and r["linear_ms"] > 0 and r["with_kappa_ms"] >= r["linear_ms"]
    assert result["machine"]["fake_executor"] is True
