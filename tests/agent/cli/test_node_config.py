"""Node config files (``trackside agent --config``) as command-line arguments, GPU placement of vLLM units (pure:
no vLLM needed), the new flags' help and refusals for simulated units, and the units' GPUs in the hello."""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_errors import error_of

from agent.bench.runner import BenchConfig
from agent.cli.node_config import NodeConfigError, config_argv, expand_node_config
from agent.cli.serve import agent_parser, main, make_node, with_node_config
from agent.engine.vllm.placement import PlacementError, parse_gpus, place_units
from agent.service.hub import Hub
from agent.workload.spec import parse_workload


def write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path



# -- config files -------------------------------------------------------------------------------------------
def test_a_config_file_is_the_flags_it_names_put_before_the_command_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
model = "/models/m"
gpus = [0, 1, 2, 3]
tensor-parallel-size = 2
async_scheduling = false
enforce_eager = true
tokenizer = false
param = ["eb.alpha=0.5", "beta=2"]
trace = "t.csv"

[unit.1]
max_num_seqs = 64

[engine]
kv_cache_dtype = "fp8"
enable_prefix_caching = false
hf_overrides = {rope_theta = 1000}
""")
    assert config_argv(path, agent_parser) == [
        "--model", "/models/m", "--gpus", "0,1,2,3", "--tensor-parallel-size", "2", "--no-async-scheduling",
        "--enforce-eager", "--no-tokenizer", "--param", "eb.alpha=0.5", "--param", "beta=2", "--trace", "t.csv",
        "--engine", "vllm", "--engine-arg", "kv_cache_dtype=fp8", "--engine-arg", "enable_prefix_caching=false",
        "--engine-arg", 'hf_overrides={"rope_theta": 1000}', "--engine-arg", "1:max_num_seqs=64",
    ]
    argv = ["--config", str(path), "--units", "3", "--workload", "poisson:n=5"]
    expanded = expand_node_config(argv, agent_parser)
    assert "--trace" not in expanded  # the command line's --workload replaces the file's --trace
    assert expanded[-len(argv):] == argv
    args = agent_parser().parse_args(expanded)
    assert (args.units, args.workload, args.trace, args.gpus, args.tensor_parallel_size) == (
        3, "poisson:n=5", None, "0,1,2,3", 2)
    assert args.engine == "vllm" and not args.async_scheduling and args.enforce_eager and args.tokenizer is False
    assert with_node_config(["ctl", "--config", "x"]) == ["ctl", "--config", "x"]  # only the agent reads a file
    assert with_node_config(["agent", "--units", "2"]) == ["agent", "--units", "2"]


@pytest.mark.parametrize(("text", "message"), [
    ("unitz = 2", "unitz: unknown key (not a `trackside agent` flag"),
    ('units = "two"', "argument --units: invalid int value: 'two'"),
    ('fake_executor = "yes"', "fake_executor: a switch: true or false"),
    ("units = [1, 2]", "units: takes one value, not a list"),
    ('config = "other.toml"', "cannot name another"),
    ('engine_arg = ["a=1"]', "engine arguments go in the [engine] table"),
    ("[unit.x]\nmax_num_seqs = 2", "unit.x: not a unit number"),
    ('engine = "gpu"', "argument --engine: invalid choice: 'gpu'"),
    ("units = ", "not valid TOML"),
])
def test_what_a_config_file_may_not_say(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                        message: str) -> None:
    path = write(tmp_path, text)
    error = error_of(capsys, "--config", str(path), "--workload", "poisson:n=5")
    assert message in error and str(path) in error
    with pytest.raises(NodeConfigError, match="No such file"):
        config_argv(tmp_path / "missing.toml", agent_parser)


# -- placement ----------------------------------------------------------------------------------------------
def test_gpu_lists() -> None:
    assert parse_gpus("0-7") == tuple(range(8))
    assert parse_gpus("0,2,4") == (0, 2, 4)
    assert parse_gpus("4-5,0") == (4, 5, 0)
    assert parse_gpus("all", lambda: 3) == (0, 1, 2)
    for bad, message in (("0-x", "not a GPU number"), ("3-1", "not a range"), ("0,0", "GPU 0 named twice"),
                         ("", "an empty item"), ("all", "no GPU is visible")):
        with pytest.raises(PlacementError, match=message):
            parse_gpus(bad, lambda: 0)


def test_units_on_gpu_groups() -> None:
    def layout(gpus: tuple[int, ...] | None, **kw: object) -> list[tuple[tuple[int, ...], float]]:
        return [(p.gpu_ids, p.gpu_memory_utilization) for p in place_units(gpus, **kw)]  # type: ignore[arg-type]

    eight = tuple(range(8))
    assert layout(eight) == [((i,), 0.9) for i in range(8)]
    assert layout(eight, tensor_parallel_size=4) == [((0, 1, 2, 3), 0.9), ((4, 5, 6, 7), 0.9)]
    assert layout(eight, tensor_parallel_size=2, pipeline_parallel_size=2) == [((0, 1, 2, 3), 0.9),
                                                                                ((4, 5, 6, 7), 0.9)]
    assert layout(None, units=2) == [((0,), 0.45), ((0,), 0.45)]  # vLLM's default device, shared as before
    assert layout((0,), units=2, gpu_memory_utilization=0.45) == [((0,), 0.45), ((0,), 0.45)]
    assert layout((0, 1), units=4, unit_shares={0: 0.3, 1: 0.3, 2: 0.6, 3: 0.6}) == [
        ((0,), 0.3), ((1,), 0.3), ((0,), 0.6), ((1,), 0.6)]
    for gpus, kw, message in (
        (eight, {"tensor_parallel_size": 3}, "names 8 GPUs: not a multiple of the 3"),
        (eight, {"units": 3, "tensor_parallel_size": 4}, "needs 12 GPUs and --gpus names 8"),
        ((0, 1, 2, 3), {"units": 2}, "uses 2 of the 4 GPUs"),
        ((0,), {"units": 2}, "explicit --gpu-memory-utilization"),
        ((0,), {"units": 3, "gpu_memory_utilization": 0.4}, "GPU 0 over-committed: units 0, 1, 2 would take"),
        (None, {"units": 2, "gpu_memory_utilization": 0.9}, "GPU 0 over-committed"),
        ((0,), {"units": 2, "gpu_memory_utilization": 0.45, "unit_shares": {1: 0.6}}, "0.45 \\+ 0.6 = 1.05"),
        ((0,), {"unit_shares": {3: 0.5}}, "a setting for unit 3, but the node has 1 unit"),
    ):
        with pytest.raises(PlacementError, match=message):
            place_units(gpus, **kw)  # type: ignore[arg-type]


# -- the command line ---------------------------------------------------------------------------------------
def test_simulated_units_take_none_of_it(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in (["--dry-run"], ["--gpus", "0"], ["--tensor-parallel-size", "2"], ["--engine-arg", "dtype=half"]):
        assert error_of(capsys, "--workload", "poisson:n=5", *flag) == f"{flag[0]} applies to --engine vllm"
    for flag in (["--engine-hang-s", "5"], ["--pending-timeout-s", "5"], ["--restart-attempts", "3"]):
        assert error_of(capsys, "--workload", "poisson:n=5", *flag) == (
            f"{flag[0]} applies to live units: --engine vllm, or simulated units with --runtime live")


def test_help_explains_the_node_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["agent", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--gpus all|0-7|0,2,4", "--tensor-parallel-size N", "--pipeline-parallel-size N",
                 "--engine-arg [UNIT:]KEY=VALUE", "--config FILE", "--dry-run"):
        assert flag in text
    assert "8 GPUs at TP 4 make 2 units on 0-3 and 4-7" in text
    assert "typed and checked by vLLM's own parser" in text


def test_the_hello_says_each_units_gpus() -> None:
    from agent.engine.vllm.placement import UnitPlacement

    node = make_node(BenchConfig(units=2), parse_workload("poisson:n=5", seed=1))
    placements = {0: UnitPlacement(0, (0, 1, 2, 3), 4), 1: UnitPlacement(1, (4, 5, 6, 7), 4)}
    hello = Hub(node, node_id="n", profile="p", placements=placements).hello()
    assert [(u.gpu_ids, u.tensor_parallel_size, u.pipeline_parallel_size) for u in hello.units] == [
        ((0, 1, 2, 3), 4, 1), ((4, 5, 6, 7), 4, 1)]
    plain = Hub(node, node_id="n", profile="p").hello()  # simulated: not said
    assert [(u.gpu_ids, u.tensor_parallel_size) for u in plain.units] == [((), 0), ((), 0)]
