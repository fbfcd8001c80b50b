"""``trackside agent --engine vllm --agents N`` (``agent.cli.agent_group``): the node split into agents of its units,
resolved (``--dry-run``) and run on the CPU with the fake executor, as a child process: one OpenAI port, both agents
answering, one killed and started again, all stopped by one SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import httpx
import psutil

from agent.cli import agent_group
from agent.cli.common import ServeError
from agent.cli.main import main

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "nodes"

MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128_256, "max_position_embeddings": 131_072,
                "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def group_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert main(["agent", "--engine", "vllm", "--serve-openai", "127.0.0.1:8000", *argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    doc, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
    agents = doc["agents"]
    assert isinstance(agents, list)
    return agents


def test_a_node_of_eight_gpus_as_four_agents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    agents = group_plan(capsys, "--model", str(tmp_path), "--gpus", "0-7", "--agents", "4", "--node-id", "n7",
                        "--listen", "127.0.0.1:7700")
    assert [(a["node_id"], a["listen"], a["serve_openai"], a["openai_reuse_port"]) for a in agents] == [
        (f"n7-{i}", f"127.0.0.1:{7700 + i}", "127.0.0.1:8000", True) for i in range(4)]
    assert [[(u["gpus"], u["gpu_memory_utilization"]) for u in a["units"]] for a in agents] == [
        [([2 * i], 0.9), ([2 * i + 1], 0.9)] for i in range(4)]
    # TP groups stay whole, and two units sharing one GPU keep their share in agents of one unit each
    tp = group_plan(capsys, "--model", str(tmp_path), "--gpus", "0-7", "--tensor-parallel-size", "4", "--agents", "2")
    assert [[(u["gpus"], u["tensor_parallel_size"]) for u in a["units"]] for a in tp] == [
        [([0, 1, 2, 3], 4)], [([4, 5, 6, 7], 4)]]
    shared = group_plan(capsys, "--model", str(tmp_path), "--gpus", "0", "--units", "2", "--gpu-memory-utilization",
                        "0.4", "--agents", "2", "--listen", "127.0.0.1:0")
    assert [[(u["gpus"], u["gpu_memory_utilization"]) for u in a["units"]] for a in shared] == [[([0], 0.4)]] * 2
    assert [a["listen"] for a in shared] == ["127.0.0.1:0"] * 2  # the OS picks each one's port
    # no --gpus: the units split vLLM's default device (0.45 each), and so do the agents
    default = group_plan(capsys, "--model", str(tmp_path), "--units", "2", "--agents", "2")
    assert [[(u["gpus"], u["gpu_memory_utilization"]) for u in a["units"]] for a in default] == [[([0], 0.45)]] * 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--units", "3", "--agents", "2"], "the node has 3 units, not a multiple of 2"),
    (["--units", "2", "--agents", "0"], "--agents must be >= 1"),
    (["--units", "2", "--agents", "2", "--workload", "sharegpt-like:n=4"], "--agents splits the node's OpenAI"),
])
def test_what_cannot_be_split(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["agent", "--engine", "vllm", "--fake-executor", "--serve-openai", "127.0.0.1:0", *argv,
                 "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_units_of_their_own_keep_their_settings_under_the_agents_numbers(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The example of two units sharing GPU 0, unit 1 with fewer sequences ([unit.1]), as two agents of one unit:
    agent 1's unit 0 is the node's unit 1, its own setting and its share of GPU 0 with it."""
    agents = group_plan(capsys, "--config", str(EXAMPLES / "gpu0-shared-two-1b.toml"), "--agents", "2")
    assert [[(u["gpus"], u["gpu_memory_utilization"], u["engine_args"]["max_num_seqs"]) for u in a["units"]]
            for a in agents] == [[([0], 0.45, 512)], [([0], 0.45, 128)]]


def test_an_agent_that_would_not_run_the_nodes_units_is_refused(tmp_path: Path) -> None:
    """The check before anything starts: each agent's plan, resolved on its own, against the node's."""
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    argv = ["agent", "--engine", "vllm", "--model", str(tmp_path), "--gpus", "0-3", "--serve-openai", ":0"]
    args = argparse.Namespace(agents=2, serve_openai=":0", workload=None, trace=None, listen="127.0.0.1:7700",
                              node_id="n", argv=argv)
    from agent.engine.vllm.plan import NodeRequest, plan_json, resolve

    plan = resolve(NodeRequest(model=str(tmp_path), gpus="0-3", model_max_len=131_072, tokenizer=True))
    argvs = agent_group.child_argvs(args, plan)
    node = plan_json(plan)["units"]
    assert len(agent_group.child_plans(argvs, node, main)) == 2  # as resolved: the same units
    node[3] = {**node[3], "gpu_memory_utilization": 0.5}
    with pytest.raises(ServeError, match=re.escape("agent 1's unit 1 would not be the node's unit 3 (it differs in "
                                                   "gpu_memory_utilization)")):
        agent_group.child_plans(argvs, node, main)


class Group:
    """``trackside agent ... --agents 2`` as a child process; its stderr lines collected as they come."""

    def __init__(self, tmp: Path, address: str) -> None:
        token = tmp / "token"
        token.write_text("group-token-0123456789\n")
        token.chmod(0o600)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "agent", "--engine", "vllm", "--fake-executor", "--units", "2",
             "--agents", "2", "--serve-openai", address, "--listen", "127.0.0.1:0", "--node-id", "grp",
             "--token-file", str(token)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str, count: int = 1, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(text in line for line in self.lines) < count:
            assert self.proc.poll() is None, "\n".join(self.lines[-40:])
            assert time.monotonic() < deadline, f"no {text!r} (x{count}):\n" + "\n".join(self.lines[-40:])
            time.sleep(0.2)

    def agents(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children() if "agent.cli" in " ".join(p.cmdline())]


def answered_by(address: str, n: int) -> list[str]:
    async def one(k: int) -> str:
        async with httpx.AsyncClient(timeout=60) as http:  # a connection of its own
            r = await http.post(f"http://{address}/v1/completions", json={
                "model": "tiny-llama-fake", "prompt": [9 + k, 8, 7], "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return str(r.headers["x-trackside-node"])

    async def go() -> list[str]:
        return list(await asyncio.gather(*(one(k) for k in range(n))))

    return asyncio.run(go())


@pytest.mark.slow
def test_two_agents_of_one_unit_each_behind_one_port(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    group = Group(tmp_path, address)
    try:
        group.wait_line("2 agents serve one OpenAI port")
        (ready,) = [line for line in group.lines if "2 agents serve one OpenAI port" in line]
        assert f"http://{address}/v1; their telemetry: ws://127.0.0.1:" in ready and ready.count("ws://") == 2
        assert sum("OpenAI API at" in line for line in group.lines) == 2
        assert set(answered_by(address, 16)) == {"grp-0", "grp-1"}
        first = group.agents()
        assert len(first) == 2
        cores = first[0].children(recursive=True)  # its engine core
        assert cores
        os.kill(first[0].pid, signal.SIGKILL)  # an agent dies: the group starts it again
        group.wait_line("exited with code -9: starting it again in 1 s")
        psutil.wait_procs(cores, timeout=10)  # and kills what it left: an engine core holds its GPU memory
        assert not [p.pid for p in cores if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        group.wait_line("trackside agent: OpenAI API at", count=3)
        assert set(answered_by(address, 16)) == {"grp-0", "grp-1"}
        assert len(group.agents()) == 2 and first[1].is_running()
    finally:
        group.proc.send_signal(signal.SIGTERM)
        code = group.proc.wait(120)
    assert code == 0, "\n".join(group.lines[-40:])
    assert any("trackside agent group: stopped (2 agents)" in line for line in group.lines)
    assert sum(line.startswith("trackside agent: stopped:") for line in group.lines) == 2
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and "grp-0" in p.info["cmdline"]]
