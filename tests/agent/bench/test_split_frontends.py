"""The split-front-ends benchmark (docs/vllm.md, "One front-end process for the whole node"): its agents' command
lines resolve to the same units on GPU 0 in both layouts (``--dry-run``, no GPU), and the whole procedure runs on
the fake executor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from agent.bench.split_frontends import agent_cmd, main, parser
from agent.cli.main import main as trackside

pytestmark = pytest.mark.vllm


def test_both_layouts_put_the_same_units_on_gpu_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128_256,
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    token = tmp_path / "token"
    token.write_text("split-token-0123456789")
    token.chmod(0o600)
    args = parser().parse_args(["--units", "2"])

    def plan(units: int, index: int) -> dict[str, Any]:
        cmd = agent_cmd(args, str(tmp_path), units, index, token)
        assert trackside([*cmd[cmd.index("agent.cli") + 1:], "--dry-run"]) == 0
        out = capsys.readouterr().out
        resolved, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
        assert isinstance(resolved, dict)
        return resolved

    one = plan(2, 0)
    assert [(u["gpus"], u["gpu_memory_utilization"]) for u in one["units"]] == [([0], 0.45), ([0], 0.45)]
    split = [plan(1, i) for i in range(2)]
    assert [[(u["gpus"], u["gpu_memory_utilization"]) for u in p["units"]] for p in split] == [
        [([0], 0.45)], [([0], 0.45)]]
    assert [(p["node_id"], p["serve_openai"], p["listen"]) for p in split] == [
        ("split-1x0", "127.0.0.1:8300", "127.0.0.1:7800"), ("split-1x1", "127.0.0.1:8301", "127.0.0.1:7801")]
    args = parser().parse_args(["--units", "2", "--shared-port"])  # one OpenAI port, shared
    shared = [plan(1, i) for i in range(2)]
    assert [(p["serve_openai"], p["openai_reuse_port"], p["listen"]) for p in shared] == [
        ("127.0.0.1:8300", True, "127.0.0.1:7800"), ("127.0.0.1:8300", True, "127.0.0.1:7801")]


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["own-ports", "shared-port"])
def test_the_procedure_on_the_fake_executor(tmp_path: Path, shared: bool) -> None:
    assert main(["--fake", "--out", str(tmp_path), "--prompts", "40", "--concurrency", "8", "--input-len", "32",
                 "--output-len", "8", *(["--shared-port"] if shared else [])]) == 0
    result = json.loads((tmp_path / "compare.json").read_text())
    one, two = result["1_agents"], result["2_agents"]
    assert "error" not in one and "error" not in two, (one.get("error"), two.get("error"))
    assert one["completed"] == two["completed"] == 40 and len(two["benches"]) == (1 if shared else 2)
    for layout in (one, two):  # the tokens of all benches over the longest one
        longest = max(b["duration"] for b in layout["benches"])
        assert layout["output_throughput"] == pytest.approx(layout["output_tokens"] / longest, rel=1e-3, abs=0.1)
        assert layout["output_tokens"] >= 40 * 4  # 8 tokens, lengths drawn from 4 to 12 (--range-ratio 0.5)
    cpu = [*one["cpu"], *two["cpu"]] if shared else [b["cpu"] for b in [*one["benches"], *two["benches"]]]
    assert len(cpu) == 3 and all(c["server_us_per_output_token"] > 0 for c in cpu)  # one agent, then two
    assert result["throughput_ratio"] == pytest.approx(two["output_throughput"] / one["output_throughput"], abs=1e-3)


@pytest.mark.slow
def test_the_intake_comparison_on_the_fake_executor(tmp_path: Path) -> None:
    assert main(["--fake", "--frontends", "2", "--units", "1", "--out", str(tmp_path), "--prompts", "40",
                 "--concurrency", "8", "--input-len", "32", "--output-len", "8", "--openai-port", "19340",
                 "--listen-port", "19840"]) == 0
    result = json.loads((tmp_path / "compare.json").read_text())
    inproc, split = result["in_process"], result["2_frontends"]
    assert "error" not in inproc and "error" not in split, (inproc.get("error"), split.get("error"))
    assert "--openai-frontends" not in inproc["command"] and split["command"][-2:] == ["--openai-frontends", "2"]
    assert inproc["frontend_pids"] == [] and len(split["frontend_pids"]) == 2 and len(split["frontend_cpu"]) == 2
    for layout in (inproc, split):
        row = layout["summary"]
        assert row["completed"] == 40 and row["main_us_per_output_token"] > 0 and row["main_loop_busy"] is not None
    assert split["summary"]["frontends_us_per_output_token"] > 0
    assert inproc["summary"]["frontends_us_per_output_token"] is None
    assert result["main_cpu_ratio"] == pytest.approx(
        split["summary"]["main_us_per_output_token"] / inproc["summary"]["main_us_per_output_token"], abs=1e-3)
