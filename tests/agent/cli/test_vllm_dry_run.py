"""``trackside agent --engine vllm --dry-run``: units, each unit's GPUs and engine arguments (typed by vLLM's own
parser), the tokenizer, node config files and the examples under ``examples/nodes/``; nothing starts, no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_errors import error_of as agent_error

pytest.importorskip("vllm")

from agent.cli.serve import main

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "nodes"
MODEL = "/models/not-here/Llama-3.1-8B-Instruct"  # a dry run loads nothing: the folder need not exist


def dry_run(capsys: pytest.CaptureFixture[str], *argv: str, model: str | None = MODEL) -> dict[str, Any]:
    """The plan ``--dry-run`` prints (after anything vLLM logged on stdout before it in this process)."""
    given = ["--model", model] if model else []
    assert main(["agent", "--engine", "vllm", *given, "--serve-openai", ":0", *argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
    assert isinstance(plan, dict)
    return plan


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    return agent_error(capsys, "--engine", "vllm", "--model", MODEL, "--serve-openai", ":0", *argv, "--dry-run")


def layout(plan: dict[str, Any]) -> list[tuple[list[int], int, float]]:
    return [(u["gpus"], u["tensor_parallel_size"], u["gpu_memory_utilization"]) for u in plan["units"]]


@pytest.mark.parametrize(("argv", "expected"), [
    (("--gpus", "0-7"), [([i], 1, 0.9) for i in range(8)]),
    (("--gpus", "0-7", "--tensor-parallel-size", "4"), [([0, 1, 2, 3], 4, 0.9), ([4, 5, 6, 7], 4, 0.9)]),
    (("--gpus", "0,2,4"), [([0], 1, 0.9), ([2], 1, 0.9), ([4], 1, 0.9)]),
    (("--gpus", "0", "--units", "2", "--gpu-memory-utilization", "0.45"), [([0], 1, 0.45), ([0], 1, 0.45)]),
    (("--units", "2",), [([0], 1, 0.45), ([0], 1, 0.45)]),  # no --gpus: vLLM's default device, as before
])
def test_gpus_and_tensor_parallelism_make_the_units(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                                    expected: list[tuple[list[int], int, float]]) -> None:
    plan = dry_run(capsys, *argv)
    assert layout(plan) == expected
    for unit in plan["units"]:
        args = unit["engine_args"]
        assert args["tensor_parallel_size"] == unit["tensor_parallel_size"]
        assert args["gpu_memory_utilization"] == unit["gpu_memory_utilization"]
        assert args.get("device_ids") == (unit["gpus"] if "--gpus" in argv else None)  # vLLM's own mechanism
        assert args["model"] == MODEL and args["skip_tokenizer_init"] is False  # --serve-openai loads it
        assert args["scheduler_cls"] == "agent.engine.vllm.scheduler.PolicyAsyncScheduler"


def test_all_gpus_and_pipeline_parallelism(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # --gpus numbers index these, as vLLM's device_ids do
    plan = dry_run(capsys, "--gpus", "all", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    assert layout(plan) == [([0, 1, 2, 3], 2, 0.9)] and plan["units"][0]["pipeline_parallel_size"] == 2
    assert plan["units"][0]["engine_args"]["pipeline_parallel_size"] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "--gpus all: no GPU is visible" in error_of(capsys, "--gpus", "all")


@pytest.mark.parametrize(("argv", "message"), [
    (("--gpus", "0-x"), "--gpus 0-x: '0-x' is not a GPU number or a range A-B"),
    (("--gpus", "0,1,1"), "GPU 1 named twice"),
    (("--gpus", "0-7", "--tensor-parallel-size", "3"), "--gpus names 8 GPUs: not a multiple of the 3 a unit takes"),
    (("--gpus", "0-7", "--tensor-parallel-size", "4", "--units", "3"),
     "--units 3 × 4 GPUs each needs 12 GPUs and --gpus names 8: units share a GPU only with an explicit "
     "--gpu-memory-utilization"),
    (("--gpus", "0-3", "--units", "2"), "uses 2 of the 4 GPUs --gpus names"),
    (("--gpus", "0", "--units", "3", "--gpu-memory-utilization", "0.4"),
     "GPU 0 over-committed: units 0, 1, 2 would take 0.4 + 0.4 + 0.4 = 1.2 of its memory (at most 1)"),
    (("--units", "2", "--gpu-memory-utilization", "0.6"), "GPU 0 over-committed"),
    (("--gpus", "0", "--units", "2", "--gpu-memory-utilization", "0.45",
      "--engine-arg", "1:gpu_memory_utilization=0.6"), "0.45 + 0.6 = 1.05"),
    (("--tensor-parallel-size", "0",), "--tensor-parallel-size must be >= 1"),
])
def test_layouts_that_cannot_run_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                        message: str) -> None:
    assert message in error_of(capsys, *argv)


def test_engine_arguments_are_typed_by_vllms_parser(capsys: pytest.CaptureFixture[str]) -> None:
    plan = dry_run(capsys, "--gpus", "0,1", "--engine-arg", "kv_cache_dtype=fp8", "--engine-arg", "block_size=32",
                   "--engine-arg", "enable_prefix_caching=false", "--engine-arg", "trust-remote-code=true",
                   "--engine-arg", "quantization=fp8", "--engine-arg", "dtype=bfloat16",
                   "--engine-arg", "cudagraph_capture_sizes=[1,2,4]", "--engine-arg", "compilation_config.mode=3",
                   "--engine-arg", 'hf_overrides={"rope_theta": 1000}', "--engine-arg", "kv_cache_dtype=auto",
                   "--engine-arg", "1:kv_cache_dtype=fp8", "--engine-arg", "1:max_num_seqs=128",
                   "--engine-arg", "1:gpu_memory_utilization=0.8", "--engine-arg", "1:max_model_len=32k")
    zero, one = (u["engine_args"] for u in plan["units"])
    assert zero["kv_cache_dtype"] == "auto" and one["kv_cache_dtype"] == "fp8"  # a later one wins; unit 1's own
    assert zero["block_size"] == 32 and zero["enable_prefix_caching"] is False and zero["trust_remote_code"] is True
    assert (zero["quantization"], zero["dtype"]) == ("fp8", "bfloat16")
    assert zero["cudagraph_capture_sizes"] == [1, 2, 4] and zero["hf_overrides"] == {"rope_theta": 1000}
    assert zero["compilation_config"] == {"mode": 3}
    assert (zero["max_num_seqs"], one["max_num_seqs"]) == (512, 128)
    assert (zero["gpu_memory_utilization"], one["gpu_memory_utilization"]) == (0.9, 0.8)
    assert (zero["max_model_len"], one["max_model_len"]) == (16384, 32000)  # vLLM's human-readable numbers
    assert plan["units"][1]["gpu_memory_utilization"] == 0.8


@pytest.mark.parametrize(("arg", "message"), [
    ("kv_cache_dtyp=fp8", "--engine-arg kv_cache_dtyp=fp8: unknown engine argument 'kv_cache_dtyp'"),
    ("kv_cache_dtype=fp9", "--engine-arg kv_cache_dtype=fp9: --kv-cache-dtype: invalid choice: 'fp9'"),
    ("block_size=big", "--engine-arg block_size=big: --block-size: invalid int value: 'big'"),
    ("trust_remote_code=maybe", "trust_remote_code is a switch: give true or false"),
    ("max_num_seqs=8", "max_num_seqs has a flag of its own: --max-num-seqs"),
    ("model=/other", "model is set by --model"),
    ("device_ids=[0]", "device_ids is set by --gpus"),
    ("skip_tokenizer_init=false", "skip_tokenizer_init is set by --tokenizer"),
    ("data_parallel_size=2", "every unit is an engine of its own"),
    ("1:tensor_parallel_size=2", "tensor_parallel_size is the same on every unit"),
    ("3:max_num_seqs=8", "a setting for unit 3, but the node has 1 unit (0 to 0)"),
    ("kv_cache_dtype", "--engine-arg takes [UNIT:]KEY=VALUE, not 'kv_cache_dtype'"),
    ("x:dtype=half", "'x' is not a unit number"),
])
def test_engine_arguments_refused_exit_2_naming_them(capsys: pytest.CaptureFixture[str], arg: str,
                                                    message: str) -> None:
    assert message in error_of(capsys, "--engine-arg", arg)


def test_the_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    plan = dry_run(capsys)  # --serve-openai: vLLM's app renders text and chat with the model's tokenizer
    assert plan["tokenizer"] == MODEL and plan["units"][0]["engine_args"]["skip_tokenizer_init"] is False
    plan = dry_run(capsys, "--no-tokenizer")  # token ids only
    assert plan["tokenizer"] is None and plan["units"][0]["engine_args"]["skip_tokenizer_init"] is True
    assert dry_run(capsys, "--engine-arg", "tokenizer=/models/tok")["tokenizer"] == "/models/tok"


def test_the_fake_executors_model_has_a_tokenizer_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    folder = dry_run(capsys, "--fake-executor", model=None)["tokenizer"]
    assert folder is not None and (Path(folder) / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode([7, 7]) == " ok ok"  # what the fake executor says
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    assert dry_run(capsys, "--fake-executor", "--no-tokenizer", model=None)["tokenizer"] is None


def test_openai_front_end_options_are_checked_by_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    assert dry_run(capsys, "--openai-arg", "response_role=bot")["openai_args"] == ["response_role=bot"]
    assert "--openai-arg: unrecognized arguments: --no-such-option" in error_of(
        capsys, "--openai-arg", "no_such_option=1")
    assert "KEY=VALUE" in error_of(capsys, "--openai-arg", "chat_template")


def test_the_fake_executor(capsys: pytest.CaptureFixture[str]) -> None:
    plan = dry_run(capsys, "--fake-executor", "--units", "2", "--engine-arg", "1:max_num_seqs=8", model=None)
    assert plan["fake_executor"] is True and plan["model"] == "tiny-llama-fake" and plan["warnings"] == []
    assert [(u["gpus"], u["engine_args"]["device"], u["engine_args"]["max_num_seqs"]) for u in plan["units"]] == [
        ([], "cpu", 64), ([], "cpu", 8)]
    assert main(["agent", "--engine", "vllm", "--fake-executor", "--serve-openai", ":0", "--gpus", "0",
                 "--dry-run"]) == 2
    assert "--fake-executor runs on the CPU" in capsys.readouterr().err
    assert main(["agent", "--engine", "vllm", "--fake-executor", "--serve-openai", ":0", "--engine-arg",
                 "kv_cache_dtype=fp8", "--dry-run"]) == 2
    assert "the fake executor's CPU engine takes only" in capsys.readouterr().err


def test_a_config_file_and_the_command_line_over_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"""
model = "{MODEL}"
gpus = "0-3"
tensor_parallel_size = 2
max_num_seqs = 256
serve_openai = "127.0.0.1:8000"
batch_policy = "sarathi"

[engine]
kv_cache_dtype = "fp8"
block_size = 32

[unit.1]
max_num_seqs = 64
gpu_memory_utilization = 0.8
""")
    plan = dry_run(capsys, "--config", str(path), model=None)
    assert layout(plan) == [([0, 1], 2, 0.9), ([2, 3], 2, 0.8)] and plan["config"] == str(path)
    assert [u["engine_args"]["max_num_seqs"] for u in plan["units"]] == [256, 64]  # a unit's own wins
    assert plan["units"][0]["engine_args"]["kv_cache_dtype"] == "fp8" and plan["batch_policy"] == "sarathi"
    plan = dry_run(capsys, "--config", str(path), "--tensor-parallel-size", "4", "--units", "2",
                   "--gpu-memory-utilization", "0.4", "--engine-arg", "kv_cache_dtype=auto",
                   "--engine-arg", "1:max_num_seqs=32", "--engine-arg", "1:gpu_memory_utilization=0.5",
                   "--batch-policy", "vllm", model=None)
    assert layout(plan) == [([0, 1, 2, 3], 4, 0.4), ([0, 1, 2, 3], 4, 0.5)]  # the command line wins
    assert [u["engine_args"]["kv_cache_dtype"] for u in plan["units"]] == ["auto", "auto"]
    assert [u["engine_args"]["max_num_seqs"] for u in plan["units"]] == [256, 32]
    assert plan["units"][0]["engine_args"]["block_size"] == 32 and plan["batch_policy"] == "vllm"
    path.write_text(f'model = "{MODEL}"\n[engine]\nmax_num_seqs = 8\n')
    assert "max_num_seqs has a flag of its own: --max-num-seqs (in a node config file, the top-level key" in (
        error_of(capsys, "--config", str(path)))


EXPECTED = {
    "h100x8-llama31-8b.toml": ([[i] for i in range(8)], 1, 0.9),
    "h100x8-llama31-8b-agent0-of-4.toml": ([[0], [1]], 1, 0.9),
    "h100x8-llama70b-tp4.toml": ([[0, 1, 2, 3], [4, 5, 6, 7]], 4, 0.9),
    "gpu0-shared-two-1b.toml": ([[0], [0]], 1, 0.45),
    "cpu-fake-executor.toml": ([[], []], 1, None),
}


def test_every_example_is_checked_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.toml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_node_configs(capsys: pytest.CaptureFixture[str], name: str) -> None:
    gpus, tp, share = EXPECTED[name]
    assert main(["agent", "--config", str(EXAMPLES / name), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
    assert [u["gpus"] for u in plan["units"]] == gpus
    assert {u["tensor_parallel_size"] for u in plan["units"]} == {tp}
    assert {u["gpu_memory_utilization"] for u in plan["units"]} == {share}
    assert plan["engine"] == "vllm" and plan["serve_openai"] is not None
    if name == "h100x8-llama70b-tp4.toml":
        assert {u["engine_args"]["kv_cache_dtype"] for u in plan["units"]} == {"fp8"}
    if name == "gpu0-shared-two-1b.toml":
        assert [u["engine_args"]["max_num_seqs"] for u in plan["units"]] == [512, 128]
    if name == "h100x8-llama31-8b-agent0-of-4.toml":
        assert plan["node_id"] == "gpu-node-7-0" and plan["serve_openai"] == "127.0.0.1:8000"


def test_a_dry_run_prints_only_json_and_starts_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    env.pop("VLLM_LOGGING_STREAM", None)
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config",
                           str(EXAMPLES / "h100x8-llama70b-tp4.toml"), "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)  # stdout is the plan alone: vLLM logs on stderr
    assert [u["engine_args"]["device_ids"] for u in plan["units"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "Llama-3.1-70B-Instruct: no such folder" in plan["warnings"][0]
    import torch

    assert not torch.cuda.is_initialized()  # nor in this process, after the dry runs above


def test_engine_fault_limits_from_flags_and_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = dry_run(capsys)
    assert (plan["restart"], plan["engine_hang_s"], plan["pending_timeout_s"]) == (True, 60.0, 30.0)
    plan = dry_run(capsys, "--engine-hang-s", "5", "--pending-timeout-s", "0", "--no-restart")
    assert (plan["restart"], plan["engine_hang_s"], plan["pending_timeout_s"]) == (False, 5.0, None)  # 0: no limit
    path = tmp_path / "node.toml"
    path.write_text("engine_hang_s = 2.5\npending_timeout_s = 10\n")
    plan = dry_run(capsys, "--config", str(path))
    assert (plan["engine_hang_s"], plan["pending_timeout_s"]) == (2.5, 10.0)
    assert error_of(capsys, "--engine-hang-s", "-1") == "--engine-hang-s must be >= 0 (0: no limit)"
    assert error_of(capsys, "--pending-timeout-s", "nan") == "--pending-timeout-s must be >= 0 (0: no limit)"


def test_restart_attempts_from_a_flag_and_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dry_run(capsys)["restart_attempts"] == 10
    assert dry_run(capsys, "--restart-attempts", "0")["restart_attempts"] is None  # 0: never give up
    path = tmp_path / "node.toml"
    path.write_text("restart_attempts = 3\n")
    assert dry_run(capsys, "--config", str(path))["restart_attempts"] == 3
    assert error_of(capsys, "--restart-attempts", "-2") == "--restart-attempts must be >= 0 (0: no limit)"


def test_the_event_loop_and_a_shared_openai_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """uvloop unless ``--no-uvloop`` (or ``uvloop = false``); ``--openai-reuse-port`` only with an OpenAI port."""
    plan = dry_run(capsys)
    assert (plan["event_loop"], plan["openai_reuse_port"]) == ("uvloop", False)
    assert dry_run(capsys, "--no-uvloop")["event_loop"] == "asyncio"
    path = tmp_path / "node.toml"
    path.write_text("uvloop = false\nopenai_reuse_port = true\n")
    plan = dry_run(capsys, "--config", str(path))
    assert (plan["event_loop"], plan["openai_reuse_port"]) == ("asyncio", True)
    assert dry_run(capsys, "--config", str(path), "--uvloop")["event_loop"] == "uvloop"  # the command line wins
    assert main(["agent", "--engine", "vllm", "--model", MODEL, "--workload", "sharegpt-like:n=4",
                 "--openai-reuse-port", "--dry-run"]) == 2
    assert "--openai-reuse-port shares --serve-openai's port" in capsys.readouterr().err


def test_openai_frontends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--openai-frontends N``: none by default (the agent's process serves the port); from the config file, the
    command line over it; only with an OpenAI port, never negative."""
    assert dry_run(capsys)["openai_frontends"] == 0
    assert dry_run(capsys, "--openai-frontends", "4")["openai_frontends"] == 4
    path = tmp_path / "node.toml"
    path.write_text("openai_frontends = 2\n")
    assert dry_run(capsys, "--config", str(path))["openai_frontends"] == 2
    assert dry_run(capsys, "--config", str(path), "--openai-frontends", "0")["openai_frontends"] == 0
    assert main(["agent", "--engine", "vllm", "--model", MODEL, "--workload", "sharegpt-like:n=4",
                 "--openai-frontends", "2", "--dry-run"]) == 2
    assert "--openai-frontends N serves --serve-openai's port" in capsys.readouterr().err
    assert main(["agent", "--engine", "vllm", "--model", MODEL, "--serve-openai", ":0", "--openai-frontends", "-1",
                 "--dry-run"]) == 2
    assert "--openai-frontends must be >= 0" in capsys.readouterr().err
    assert main(["agent", "--engine", "sim", "--openai-frontends", "2"]) == 2
    assert "--openai-frontends" in capsys.readouterr().err
