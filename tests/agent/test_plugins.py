"""Policy plugins (issue #18): policies of other packages, found through the ``trackside.policies`` entry points,
registered beside the built-ins, listed, benched and hot-swapped into a running agent; a broken one is one line and
skipped. Nothing is installed: the distributions are fake ones on ``sys.path`` (``tests/plugin_sandbox.py``)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_sandbox import PluginSandbox, plugin_sandbox
from serve_harness import TOKEN, free_port, make_hub, make_server, run

from agent.cli.main import main
from agent.cli.serve import main as serve_main
from agent.plugins import load_plugins
from agent.telemetry import ListPolicies, OkReply, PolicyList
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES, make_batch_policy

ROOT = Path(__file__).resolve().parents[2]
SMALL_JSONL = ROOT / "examples" / "traces" / "small.jsonl"

BROKEN = {
    "ts_broken_import": "import nosuch_module_for_a_test\n",
    "ts_broken_policies": '''
        from typing import ClassVar

        from policies.batch.vllm_default import VllmDefault
        from policies.params import ParamSpec


        class NotAPolicy:
            name = "not_a_policy"


        class Vllm(VllmDefault):
            name: ClassVar[str] = "vllm"
            summary: ClassVar[str] = "a second vllm"


        class Twin(VllmDefault):
            name: ClassVar[str] = "twin"
            summary: ClassVar[str] = "the first twin"


        class Misnamed(VllmDefault):
            name: ClassVar[str] = "misnamed"
            summary: ClassVar[str] = "its entry point has another name"


        class Duplicated(VllmDefault):
            name: ClassVar[str] = "duplicated"
            summary: ClassVar[str] = "a parameter declared twice"
            params_schema = (*VllmDefault.params_schema, VllmDefault.params_schema[0])
    ''',
    "ts_broken_schema": '''
        from typing import ClassVar

        from policies.batch.vllm_default import VllmDefault
        from policies.params import ParamSpec


        class Unbounded(VllmDefault):
            name: ClassVar[str] = "unbounded"
            summary: ClassVar[str] = "an int parameter without a range"
            params_schema = (ParamSpec("budget", "int", 0, "tokens"),)
    ''',
    "ts_twin": '''
        from typing import ClassVar

        from policies.batch.vllm_default import VllmDefault


        class Twin(VllmDefault):
            name: ClassVar[str] = "twin"
            summary: ClassVar[str] = "the second twin"
    ''',
}
"""Modules of plugins that break the contract, each in its own way (see :func:`add_broken`)."""

BROKEN_LINES = {
    "import_error": ("(ts_broken_import:Policy from ts-broken 0.1) skipped: cannot import it: ModuleNotFoundError: No "
                     "module named 'nosuch_module_for_a_test'",),
    "not_a_policy": ("skipped: NotAPolicy is neither a BatchPolicy nor a DispatchPolicy subclass",),
    "vllm": ("skipped: 'vllm' is the name of a built-in policy",),
    "twin": ("skipped: 'twin' is claimed by ", " too: both skipped"),
    "alias": ("skipped: the entry point is named 'alias' but the class's name is 'misnamed'",),
    "duplicated": ("skipped: duplicated: parameter max_num_batched_tokens is declared twice",),
    "unbounded": ("skipped: cannot import it: ValueError: parameter budget: ", "needs a min and a max"),
}
"""Fragments of the line each broken entry point gets, by entry point name."""


def add_broken(sandbox: PluginSandbox) -> None:
    sandbox.add("ts-broken", {
        "import_error": "ts_broken_import:Policy", "not_a_policy": "ts_broken_policies:NotAPolicy",
        "vllm": "ts_broken_policies:Vllm", "twin": "ts_broken_policies:Twin", "alias": "ts_broken_policies:Misnamed",
        "duplicated": "ts_broken_policies:Duplicated", "unbounded": "ts_broken_schema:Unbounded",
    }, BROKEN)
    sandbox.add("ts-twin", {"twin": "ts_twin:Twin"}, {})


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSandbox]:
    (tmp_path / "site").mkdir()
    with plugin_sandbox(tmp_path / "site", monkeypatch) as box:
        yield box


async def ctl(*argv: str) -> int:
    """``trackside ctl`` in a thread (it runs its own event loop)."""
    return await asyncio.to_thread(serve_main, ["ctl", *argv])


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("trackside: warning: policy plugin")]


def test_a_plugin_is_listed_beside_the_built_ins_saying_where_it_comes_from(
    sandbox: PluginSandbox, capsys: pytest.CaptureFixture[str]
) -> None:
    sandbox.add_good()
    assert main(["policies", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    batch = {p["name"]: p for p in listed["batch"]}
    dispatch = {p["name"]: p for p in listed["dispatch"]}
    assert batch["plugin_fcfs"]["module"] == "ts_good_plugin" and batch["plugin_fcfs"]["plugin"] == "ts-good-plugin 0.1"
    assert dispatch["plugin_spread"]["module"] == "ts_good_plugin"
    assert batch["vllm"]["module"] == "policies.batch.vllm_default" and batch["vllm"]["plugin"] is None
    knob = next(p for p in batch["plugin_fcfs"]["params"] if p["name"] == "plugin_knob")
    assert (knob["min"], knob["max"], knob["default"]) == (0, 10, 3)
    assert main(["policies"]) == 0
    text = capsys.readouterr().out
    assert ("  plugin_fcfs: vLLM's default, from a plugin\n      [plugin] ts_good_plugin:PluginFcfs from "
            "ts-good-plugin 0.1\n") in text
    assert "  plugin_spread: least loaded, from a plugin\n      [plugin] ts_good_plugin:PluginSpread" in text
    assert text.count("[plugin]") == 2


def test_each_broken_plugin_is_one_line_and_skipped_and_the_good_ones_load(
    sandbox: PluginSandbox, capsys: pytest.CaptureFixture[str]
) -> None:
    sandbox.add_good()
    add_broken(sandbox)
    assert main(["policies", "--json"]) == 0
    out, err = capsys.readouterr()
    lines = warnings(err)
    assert len(lines) == len(BROKEN_LINES) + 1, err  # both twins
    for name, fragments in BROKEN_LINES.items():
        mine = [line for line in lines if line.startswith(f"trackside: warning: policy plugin '{name}' (")]
        assert len(mine) == (2 if name == "twin" else 1), (name, lines)
        assert all(f in line for line in mine for f in fragments), (fragments, mine)
    assert "Traceback" not in err
    listed = {p["name"] for kind in ("batch", "dispatch") for p in json.loads(out)[kind]}
    assert {"plugin_fcfs", "plugin_spread"} <= listed
    assert not listed & {"not_a_policy", "twin", "misnamed", "alias", "duplicated", "unbounded"}
    assert BATCH_POLICIES["vllm"].__module__ == "policies.batch.vllm_default"


def test_plugins_are_searched_once_per_process_and_reported_once(sandbox: PluginSandbox) -> None:
    sandbox.add_good()
    sandbox.add("ts-broken", {"import_error": "ts_broken_import:Policy"}, {"ts_broken_import": BROKEN[
        "ts_broken_import"]})
    said: list[str] = []
    first = load_plugins(warn=said.append)
    assert [(p.name, p.kind) for p in first.loaded] == [("plugin_fcfs", "batch"), ("plugin_spread", "dispatch")]
    assert len(said) == len(first.skipped) == 1 and said[0].startswith("policy plugin 'import_error'")
    assert load_plugins(warn=said.append) is first and len(said) == 1
    assert first.origin("plugin_fcfs") is not None and first.origin("vllm") is None


def test_a_distribution_whose_entry_points_do_not_parse_is_one_line(
    sandbox: PluginSandbox, capsys: pytest.CaptureFixture[str]
) -> None:
    sandbox.add_good()
    sandbox.add("ts-garbled", {})
    (sandbox.root / "ts_garbled-0.1.dist-info" / "entry_points.txt").write_text("[trackside.policies]\nno_value\n")
    assert main(["policies"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "warning" in line] == [
        "trackside: warning: policy plugins of ts-garbled 0.1 skipped: cannot read its entry points: TypeError: "
        "Pair.__new__() missing 1 required positional argument: 'value'"]
    assert "[plugin] ts_good_plugin:PluginFcfs" in out


def test_bench_runs_plugin_policies_against_the_built_ins(sandbox: PluginSandbox, tmp_path: Path) -> None:
    sandbox.add_good()
    out = tmp_path / "runs.json"
    code = main(["bench", "--trace", str(SMALL_JSONL), "--units", "2", "--compare", "vllm,plugin_fcfs",
                 "--dispatch", "least_loaded,plugin_spread", "--param", "plugin_fcfs.plugin_knob=5", "--json", str(out),
                 "--no-progress"])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert {(r["batch_policy"], r["dispatch"]) for r in runs} == {
        (b, d) for b in ("vllm", "plugin_fcfs") for d in ("least_loaded", "plugin_spread")}
    assert all(r["summary"]["completed"] + r["summary"]["rejected"] == r["summary"]["requests"] > 0 for r in runs)
    assert {r["params"].get("plugin_knob") for r in runs if r["batch_policy"] == "plugin_fcfs"} == {5}


def test_a_running_agent_hot_swaps_to_plugin_policies(
    sandbox: PluginSandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sandbox.add_good()
    add_broken(sandbox)
    load_plugins()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)

    async def go() -> None:
        hub = make_hub(units=2, workload="poisson:n=300,rate=30")
        hello = hub.hello()
        assert "plugin_fcfs" in [p.name for p in hello.batch_policies]
        assert "plugin_spread" in [p.name for p in hello.dispatch_policies]
        knob = next(p for p in hello.batch_policies if p.name == "plugin_fcfs").params[-1]
        assert (knob.name, knob.min, knob.max) == ("plugin_knob", 0, 10)
        async with make_server(hub, speed=10.0) as server:
            listed = hub.handle(ListPolicies(), who="test")
            assert isinstance(listed, OkReply) and isinstance(listed.payload, PolicyList)
            for argv in (["set-policy", "--unit", "1", "plugin_fcfs", "--param", "plugin_knob=7"],
                         ["set-dispatch", "plugin_spread"], ["set-param", "--unit", "1", "plugin_knob=2"]):
                assert await ctl(server.url, "--token-file", str(token), *argv) == 0, argv
            assert [u.policy.name for u in hub.node.units] == ["vllm", "plugin_fcfs"]
            assert hub.node.units[1].policy.params["plugin_knob"] == 2 and hub.node.dispatcher.name == "plugin_spread"
            await server.workload_done.wait()
        node = hub.node
        assert node.num_finished + node.num_rejected == len(node.arrivals) and not node.unfinished()

    run(go, timeout_s=60)
    out = capsys.readouterr().out
    assert "applied: set_batch_policy: unit 1: plugin_fcfs (" in out
    assert "applied: set_dispatch_policy: dispatcher: plugin_spread" in out


def test_trackside_agent_loads_plugins_and_outlives_a_broken_one(sandbox: PluginSandbox, tmp_path: Path) -> None:
    """The command itself, in a process of its own, as the README's user runs it."""
    sandbox.add_good()
    add_broken(sandbox)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--units", "2", "--workload", "poisson:n=100000,rate=5",
         "--batch-policy", "plugin_fcfs", "--listen", f"127.0.0.1:{port}", "--token-file", str(token)],
        cwd=ROOT, env=sandbox.env(), stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        said: list[str] = []
        while not said or (said[-1] and f":{port}" not in said[-1]):  # up to the line that says where it listens
            said.append(proc.stderr.readline())
        url = f"ws://127.0.0.1:{port}"
        codes = [main(["ctl", url, "--token-file", str(token), "set-dispatch", "plugin_spread"]),
                 main(["ctl", url, "--token-file", str(token), "set-policy", "--unit", "0", "plugin_fcfs", "--param",
                       "plugin_knob=9"]),
                 main(["ctl", url, "status"])]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert len([line for line in said if line.startswith("trackside: warning: policy plugin")]) == len(BROKEN_LINES) + 1
    assert "trackside agent" in said[-1] and f":{port}" in said[-1], said
    assert codes == [0, 0, 0]
    assert proc.returncode == 0


def test_a_plugin_policy_is_built_like_a_built_in_one(sandbox: PluginSandbox) -> None:
    """After loading, the registry's own functions (what control, bench and the vLLM scheduler call) know it."""
    sandbox.add_good()
    assert "plugin_fcfs" not in BATCH_POLICIES
    load_plugins()
    assert make_batch_policy("plugin_fcfs", {"plugin_knob": "4"}).params["plugin_knob"] == 4
    assert DISPATCH_POLICIES["plugin_spread"].__module__ == "ts_good_plugin"

