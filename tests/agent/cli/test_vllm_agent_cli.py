"""``trackside agent --engine vllm``: what the command line refuses before any engine starts (no vLLM needed:
these checks run first), and the ``--engine sim`` default left as it was."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from agent_errors import error_of

from agent.cli import agent_vllm as cli_vllm
from agent.cli.agent_vllm import model_max_len
from agent.cli.serve import main


@pytest.fixture
def vllm_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the vllm extra were installed (the checks below come before anything imports it)."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return object() if name == "vllm" else real(name, *args)

    monkeypatch.setattr(cli_vllm.importlib.util, "find_spec", find_spec)



def test_without_the_vllm_extra_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(cli_vllm.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    assert error_of(capsys, "--engine", "vllm", "--fake-executor", "--serve-openai", ":0") == (
        "--engine vllm needs vLLM: pip install -e '.[vllm]' (vLLM 0.26.0 and torch 2.11.0)")


@pytest.mark.usefixtures("vllm_installed")
def test_what_a_vllm_agent_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "model"
    empty.mkdir()
    cases = {
        ("--serve-openai", ":0"): "--engine vllm needs --model DIR",
        ("--model", str(empty), "--serve-openai", ":0"): "no config.json in it",
        ("--model", str(tmp_path / "nothing"), "--serve-openai", ":0"): "no such folder",
        ("--fake-executor",): "--engine vllm serves --serve-openai HOST:PORT, replays --workload/--trace, or both",
        ("--fake-executor", "--model", str(empty)): "--fake-executor runs its own tiny model: leave out --model",
        ("--fake-executor", "--serve-openai", ":0", "--openai-arg", "x"): "--openai-arg: 'x': KEY=VALUE",
        ("--fake-executor", "--serve-openai", ":0", "--speed", "2"): "--speed applies to simulated units",
        ("--fake-executor", "--serve-openai", ":0", "--lockstep"): "--lockstep applies to simulated units",
        ("--fake-executor", "--serve-openai", ":0", "--sim-tokenizer", "x"): (
            "--sim-tokenizer applies to simulated units (--runtime live); its model's tokenizer renders a vLLM "
            "unit's requests"),
        ("--fake-executor", "--serve-openai", ":0", "--units", "2", "--gpu-memory-utilization", "1.5"):
            "--gpu-memory-utilization is each unit's share",
        ("--fake-executor", "--serve-openai", "localhost"): (
            "--serve-openai takes HOST:PORT (port 0-65535; IPv6 in brackets: [::1]:7700), not 'localhost'"),
        ("--fake-executor", "--serve-openai", ":0", "--max-num-seqs", "0"): "--max-num-seqs must be >= 1",
        ("--fake-executor", "--serve-openai", ":0", "--batch-policy", "nosuch"): "unknown batch policy 'nosuch'",
    }
    for argv, message in cases.items():
        assert message in error_of(capsys, "--engine", "vllm", *argv), argv


def test_the_simulated_agent_is_unchanged_and_takes_no_vllm_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert error_of(capsys, "--workload", "poisson:n=5", "--serve-openai", ":0") == (
        "--serve-openai on simulated units needs --runtime live (vLLM's OpenAI app over units that step by themselves "
        "in wall time), or --engine vllm")
    assert error_of(capsys, "--workload", "poisson:n=5", "--no-async-scheduling") == (
        "--no-async-scheduling applies to --engine vllm")
    assert error_of(capsys, "--workload", "poisson:n=5", "--load-format", "dummy") == (
        "--load-format applies to --engine vllm")
    assert error_of(capsys) == ("simulated units replay a workload: give --workload SPEC or --trace FILE (with "
                                "--runtime live, --serve-openai HOST:PORT takes requests instead)")


def test_help_explains_the_engines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["agent", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("--engine {sim,vllm}", "--fake-executor", "--serve-openai HOST:PORT", "--load-format",
                     "--gpu-memory-utilization SHARE", "--async-scheduling, --no-async-scheduling",
                     "--engine vllm --model /models/Llama-3.1-8B-Instruct --units 2"):
        assert fragment in text, fragment


def test_model_length_from_the_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert model_max_len(str(tmp_path)) == 8192
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert model_max_len(str(tmp_path)) is None
    assert model_max_len("meta-llama/Llama-3.1-8B-Instruct") is None, "a Hugging Face name: vLLM fetches it"
