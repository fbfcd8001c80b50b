"""The GPU comparison's command lines (issue #14 item 8), checked where a GPU session cannot afford a mistake: both
servers get the same engine flags, ``vllm serve`` parses its command with vLLM's own parser, and the agent's
resolves to one unit on GPU 0 (``--dry-run``, no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from agent.bench.vllm_serve_compare import (
    agent_cmd,
    engine_args,
    histogram_quantile,
    parse_ttft_buckets,
    parser,
    plain_cmd,
    without_flag,
)
from agent.cli.main import main as trackside

pytestmark = pytest.mark.vllm


def _model(tmp_path: Path) -> str:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128_256, "max_position_embeddings": 131_072,
              "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_both_servers_get_the_same_engine_flags_and_vllm_serve_parses_them(tmp_path: Path) -> None:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from agent.engine.vllm.engine_args import describable_platform

    args = parser().parse_args([])
    model = _model(tmp_path)
    plain = plain_cmd(args, model, 8100)
    ours = agent_cmd(args, model, 8200, tmp_path / "token", 7700, "vllm")
    shared = engine_args(args)
    assert plain[-len(shared):] == shared and ours[-len(shared):] == shared
    serve = plain[plain.index("serve") + 1:]
    with describable_platform():
        parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *serve])
    assert (parsed.load_format, parsed.max_num_batched_tokens, parsed.max_num_seqs, parsed.max_model_len) == (
        "dummy", 8192, 512, 16384)
    assert parsed.async_scheduling is True and parsed.served_model_name == ["model"]
    # The fallback without placement drops the flag and its value, nothing else.
    i = ours.index("--gpus")
    assert without_flag(ours, "--gpus") == ours[:i] + ours[i + 2:]


def test_the_agents_command_resolves_to_one_unit_on_gpu_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args([])
    token = tmp_path / "token"
    token.write_text("compare-token-0123456789")
    token.chmod(0o600)
    cmd = agent_cmd(args, _model(tmp_path), 8200, token, 7700, "vllm")
    assert cmd[cmd.index("agent.cli") + 1] == "agent"
    assert trackside([*cmd[cmd.index("agent.cli") + 1:], "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(u["unit"], u["gpus"], u["gpu_memory_utilization"]) for u in plan["units"]] == [(0, [0], 0.9)]
    engine = plan["units"][0]["engine_args"]
    assert (engine["load_format"], engine["max_num_seqs"], engine["async_scheduling"]) == ("dummy", 512, True)
    assert plan["tokenizer"] == str(tmp_path)  # the model folder: the script writes its tokenizer there


def test_the_servers_own_ttft_comes_from_its_histogram() -> None:
    """``server_ttft_ms`` (beside the client's TTFT) is read from the ``vllm:time_to_first_token_seconds`` histogram
    both servers export: the counts summed over label sets, the quantile of what a run added, interpolated within
    its bucket as Prometheus does."""
    def exposition(counts: dict[str, float]) -> str:
        lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
        for engine in ("0", "1"):
            for le, n in counts.items():
                lines.append(f'vllm:time_to_first_token_seconds_bucket{{model_name="m",engine="{engine}",le="{le}"}}'
                             f" {n}")
        lines.append('vllm:time_to_first_token_seconds_count{model_name="m",engine="0"} 5')
        return "\n".join(lines)

    before = parse_ttft_buckets(exposition({"0.01": 1, "0.02": 1, "0.1": 1, "+Inf": 1}))
    after = parse_ttft_buckets(exposition({"0.01": 1, "0.02": 51, "0.1": 101, "+Inf": 101}))
    assert before == {0.01: 2.0, 0.02: 2.0, 0.1: 2.0, float("inf"): 2.0}
    assert after is not None
    # The run added 0 below 10 ms, 100 in (10, 20] ms, 100 in (20, 100] ms: 200 in all.
    assert histogram_quantile(0.5, before, after) == pytest.approx(0.02)
    assert histogram_quantile(0.25, before, after) == pytest.approx(0.015)
    assert histogram_quantile(0.99, before, after) == pytest.approx(0.02 + 0.08 * 98 / 100)
    assert histogram_quantile(0.5, after, after) is None  # nothing observed in between
    assert parse_ttft_buckets("# no histogram here\nother_metric 1") is None
