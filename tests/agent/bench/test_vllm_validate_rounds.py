"""The throughput part of the GPU validation (``sync``/``async``) on the fake executor: ``--rounds`` runs plain
vLLM and trackside in turn, each on a fresh engine, and gives the ratio of each round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from agent.bench import vllm_validate
from agent.workload.types import RequestSpec

pytestmark = pytest.mark.vllm


def test_rounds_alternate_plain_and_trackside_and_give_a_ratio_per_round(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_validate, "sharegpt_like",
                        lambda: [RequestSpec(f"s{i:03d}", 0.0, 40 + i, 8) for i in range(12)])
    assert vllm_validate.main(["sync", "--fake", "--skip-slo", "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sync.json").read_text())
    runs = [(r["round"], r["label"]) for r in result["runs"]]
    assert runs == [(0, "throughput-plain"), (0, "throughput-trackside-vllm"),
                    (1, "throughput-plain"), (1, "throughput-trackside-vllm")]
    assert all(r["output_tokens"] == 12 * 8 for r in result["runs"])
    ratios = result["trackside_over_plain"]
    assert len(ratios) == 2
    by_round = {(r["round"], r["label"]): r["output_tok_s"] for r in result["runs"]}
    for rnd, ratio in enumerate(ratios):
        expected = by_round[(rnd, "throughput-trackside-vllm")] / by_round[(rnd, "throughput-plain")]
        assert ratio == pytest.approx(expected, abs=1e-4)
