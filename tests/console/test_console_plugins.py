"""A plugin policy swapped in from the console (issue #18): the Policies screen offers what the agent's hello lists,
a plugin's policy and its parameters included, and applies it like a built-in one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from console_pilot import fast_delays, until
from plugin_sandbox import PluginSandbox, plugin_sandbox
from serve_harness import TOKEN, make_hub, make_server, run
from textual.widgets import Select

from agent.plugins import load_plugins
from console.app import ConsoleApp
from console.feeds import LiveFeed
from console.screens.confirm import ConfirmScreen
from console.screens.policies import PoliciesScreen
from console.screens.policy_edit import PolicyEditScreen
from console.widgets.policy_table import PolicyTable


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSandbox]:
    with plugin_sandbox(tmp_path, monkeypatch) as box:
        box.add_good()
        load_plugins()
        yield box


def test_the_console_swaps_a_unit_to_a_plugin_policy(sandbox: PluginSandbox) -> None:
    async def go() -> None:
        hub = make_hub(units=2, workload="poisson:n=20000,rate=5")
        async with make_server(hub, speed=1.0) as server:
            app = ConsoleApp([LiveFeed(server.url, delays=fast_delays)], refresh_s=0.25, token=TOKEN)
            async with app.run_test(size=(100, 30)) as pilot:
                await pilot.press("6")
                screen = app.screen
                assert isinstance(screen, PoliciesScreen)
                table = screen.query_one(PolicyTable)
                await until(pilot, lambda: table.select_key("unit:test-node:1"), "unit 1's row")
                await pilot.pause()
                await pilot.press("e")
                form = app.screen
                assert isinstance(form, PolicyEditScreen)
                form.query_one("#edit-policy", Select).value = "plugin_fcfs"
                await until(pilot, lambda: form.chosen_policy == "plugin_fcfs", "the plugin chosen")
                await pilot.pause()
                form.inputs["plugin_knob"].value = "6"
                await pilot.press("ctrl+s")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
                await pilot.press("y")
                await until(pilot, lambda: hub.node.units[1].policy.name == "plugin_fcfs", "the swap applied")
        assert hub.node.units[1].policy.params["plugin_knob"] == 6 and hub.node.units[0].policy.name == "vllm"

    run(go, timeout_s=90)
