"""``trackside demo`` (issue #16): quitting never waits for the agent children, the scenarios resolve, and the
showcase scenario shows a staged dispatcher, an audited policy change, SLO misses and alerts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from console_pilot import fast_delays, text_of, until
from serve_harness import make_hub, make_server, run
from textual.widgets import Static

from console.app import ConsoleApp
from console.cli import build_parser, demo_stopped, main
from console.demo import AgentOptions, DemoChildren, demo_children
from console.demo_app import DemoApp
from console.feeds import LiveFeed
from console.model.queries import summary
from console.model.records import Connection
from console.reaper import kill_after
from console.scenarios import DEFAULT_SCENARIO, SCENARIOS, SHOWCASE, scenario
from console.screens.stages import NO_STAGES, StagesScreen

STUBBORN_AGENT = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"trackside agent {sys.argv[1]}: ws://127.0.0.1:9 (a fake that ignores SIGTERM)", flush=True)
time.sleep(30)
"""


@dataclass(frozen=True, slots=True)
class StubbornAgent:
    """An agent child that prints its URL line (of a port nobody listens on) and ignores SIGTERM for 30 s."""

    node_id: str

    def argv(self, listen: str, token_file: Path) -> list[str]:
        return [sys.executable, "-c", STUBBORN_AGENT, self.node_id]


# -- quitting -------------------------------------------------------------------------------------------------------
def sockets_to(port: int) -> int:
    """This process's TCP sockets whose peer is ``port`` on this machine (Linux: /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        found += link.startswith("socket:[") and link[8:-1] in inodes
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the sockets from Linux's /proc")
def test_a_live_feed_closes_its_connection_before_it_ends() -> None:
    """A quitting console's feeds close their connections in their own tasks, before the app returns: left to
    websockets' iterator, the close waited for the iterator to be collected, and an exiting console (in a terminal)
    never sent it, so that the demo's agent waited 10 s (websockets' close timeout) for it, and the demo for the
    agent."""

    async def go() -> tuple[int, int]:
        async with make_server(make_hub()) as server:
            updates = LiveFeed(server.url).updates()
            async for update in updates:
                if update.connection == Connection.LIVE:
                    break
            before = sockets_to(server.port)
            await updates.aclose()  # what cancelling the feed's worker does
            return before, sockets_to(server.port)  # no await in between: closed by aclose itself

    assert run(go) == (1, 0)


def test_quit_gives_the_shell_back_and_leaves_an_agent_that_ignores_sigterm_to_the_watchdog(tmp_path: Path) -> None:
    async def go() -> tuple[DemoChildren, float]:
        with demo_children([StubbornAgent("stubborn")], logs=tmp_path, kill_after_s=2.0) as children:
            app = ConsoleApp([LiveFeed(children.agents[0].url, delays=fast_delays)])
            async with app.run_test() as pilot:
                await pilot.pause(0.2)
                pressed = time.monotonic()
                await pilot.press("q")
            children.terminate()
        return children, time.monotonic() - pressed

    children, quit_s = asyncio.run(go())
    agent = children.agents[0]
    assert quit_s < 3.0, f"quit took {quit_s:.1f} s: it waited for the agent"  # about 0.6 s; generous: shared CI
    assert children.left_running == (agent,) and agent.proc.poll() is None, "still stopping, in the background"
    said = demo_stopped(children, None)
    assert "stubborn" in said and str(agent.log) in said and "background" in said
    assert agent.proc.wait(timeout=15) == -signal.SIGKILL, "the watchdog kills it kill_after_s after SIGTERM"


def test_the_watchdog_leaves_a_process_that_exits_in_time_alone() -> None:
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    assert kill_after(5.0, [quick.pid]) == 0
    assert quick.wait(timeout=5) == 0


# -- scenarios ------------------------------------------------------------------------------------------------------
def test_an_unknown_scenario_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--scenario", "nope"]) == 2
    err = capsys.readouterr().err
    assert err == "trackside demo: error: no scenario 'nope': choose one of showcase, steady\n"


def test_the_help_lists_each_scenario_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for name, known in SCENARIOS.items():
        assert sum(line.split()[:1] == [name] for line in lines) == 1, name
        assert any(line.strip() == f"{name:<10} {known.summary}" for line in lines)
    assert DEFAULT_SCENARIO == "showcase" and scenario("steady").agents[0].node_id == "demo"


def test_a_scenario_takes_the_settings_given_on_every_agent() -> None:
    showcase = scenario("showcase")
    assert showcase.customised() is showcase
    changed = showcase.customised(units=2, speed=5.0, workload="poisson:rate=10")
    assert [(a.units, a.speed, a.workload) for a in changed.agents] == [(2, 5.0, "poisson:rate=10,n=100000")] * 2
    assert [a.dispatch for a in changed.agents] == ["least_loaded", "cascade"]
    traced = showcase.customised(trace=Path("t.csv"))
    assert all(a.trace == Path("t.csv") and a.workload is None for a in traced.agents)
    argv = AgentOptions(node_id="n", params=("a=1",), slo_tpot_ms=60.0).argv("127.0.0.1:0", Path("tok"))
    assert argv[argv.index("--param") + 1] == "a=1" and argv[argv.index("--slo-tpot-ms") + 1] == "60"
    assert "--slo-ttft-ms" not in argv


# -- the showcase, live -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_showcase_shows_stages_an_audited_change_slo_misses_and_alerts(tmp_path: Path) -> None:
    """The showcase's agents at 10x: within seconds the staged node reports stages, the script's changes are applied
    and audited, unit 1 of plain fails and comes back (alerts), and requests miss their SLOs."""
    fast = SHOWCASE.customised(speed=10.0)

    async def go() -> None:
        with demo_children(fast.agents, logs=tmp_path) as children:
            feeds = [LiveFeed(url, delays=fast_delays) for url in children.urls.values()]
            app = DemoApp(feeds, scenario=fast, urls=children.urls, token=children.token)
            async with app.run_test(size=(120, 36)) as pilot:
                state = app.state
                await until(pilot, lambda: len(app.script_results) == len(fast.script), "the script", 60)
                assert all(r.ok for r in app.script_results), [r.describe() for r in app.script_results]
                await until(pilot, lambda: {"unit_failed", "unit_restarted"} <= {a.code for a in state.alerts},
                            "the alerts of the failed unit", 20)
                await until(pilot, lambda: any(a.action == "set_batch_policy" for a in state.audits), "the audit", 20)
                assert {u.batch_policy for u in state.nodes["plain"].units.values()} == {"vllm", "sarathi"}
                await until(pilot, lambda: (summary(state, "plain").slo_attainment or 1.0) < 1.0, "SLO misses", 20)
                await until(pilot, lambda: state.nodes["staged"].stages is not None, "the stages", 20)
                await pilot.press("5")
                await until(pilot, lambda: isinstance(app.screen, StagesScreen), "the Stages screen")
                app.refresh_views(force=True)
                await pilot.pause()
                heading = text_of(app.screen.query_one("#stages-title", Static))
                assert heading.startswith("staged") and "cascade" in heading and NO_STAGES not in heading
            children.terminate()

    asyncio.run(go())
