"""The console of ``trackside demo``: the console app, plus its scenario's script (:mod:`console.scenarios`).

Once the app is ready, a timer per scripted change fires at the change's node time over its agent's speed, and a
worker sends it through the console's control client (:func:`console.control.send_control`, the Policies screen's
way) with the demo's token. The agent applies it and publishes the audit (and, for a unit failed or recovered, the
alert), which the feed brings in like any other event; the result is also said in a notification
(``demo: unit 3 of plain fails: applied``) and kept in :attr:`DemoApp.script_results`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from console.app import ConsoleApp
from console.control import ControlResult, send_control
from console.feeds import Feed
from console.scenarios import Scenario, ScriptedChange


class DemoApp(ConsoleApp):
    """The console on the demo's agents (``urls``: each node's), playing ``scenario``'s script."""

    def __init__(self, feeds: Sequence[Feed], *, scenario: Scenario, urls: Mapping[str, str], **options: Any) -> None:
        super().__init__(feeds, **options)
        self.scenario = scenario
        self.urls = dict(urls)
        """Each agent's URL by its node id."""
        self.script_results: list[ControlResult] = []
        """The script's results so far, in the order they came back."""

    def on_ready(self) -> None:
        """Start the script's clock (the agents started just before the console)."""
        speeds = {agent.node_id: agent.speed for agent in self.scenario.agents}
        for change in self.scenario.script:
            delay_s = change.at_s / speeds.get(change.node_id, 1.0)
            self.set_timer(delay_s, partial(self._send, change), name=f"demo script {change.what}")

    def _send(self, change: ScriptedChange) -> None:
        self.run_worker(self._play(change), name=f"demo script {change.what}", group="demo", exit_on_error=False)

    async def _play(self, change: ScriptedChange) -> None:
        uri = self.urls.get(change.node_id)
        if uri is None:
            self.notify(f"{change.what}: no agent {change.node_id}", title="demo", severity="error")
            return
        result = await send_control(uri, self.token, change.request)
        self.script_results.append(result)
        self.notify(
            f"{change.what}: {result.describe()}", title="demo", severity="information" if result.ok else "error"
        )
