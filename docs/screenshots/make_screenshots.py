"""Screenshots of the console's seven screens for docs/console.md and the README: SVGs in this folder.

    python docs/screenshots/make_screenshots.py [--scenario showcase] [--size 160x48] [--seconds 90] [--out DIR]
                                                [--theme NAME]

They show ``trackside demo``'s default scenario (:data:`console.scenarios.SHOWCASE`): its agents, with the same
workloads, units, policies, parameters, SLOs and seed, are simulated for ``--seconds`` of node time through the
agent's hub, headless and in virtual time, into a store in a temporary folder (as the demo's console would have
recorded them), and the scenario's script is applied at its node times through the hub's control path with a
token (the same requests, audited and alerted as the demo's). Then the store is replayed into the console, headless at
``--size``, and each screen is written with ``App.export_screenshot(simplify=True)``. Node time 0 is a fixed
instant and clock times are shown in UTC, so the same arguments give the same files (but for the time the SQL
screen's query took).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Final

import msgspec
from textual.pilot import Pilot
from textual.widgets import TextArea

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.service.hub import Hub
from agent.telemetry import Event, OkReply
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from console.app import MODE_TITLES, ConsoleApp
from console.demo import AgentOptions
from console.feeds import ReplayFeed
from console.scenarios import DEFAULT_SCENARIO, SCENARIOS, Scenario, ScriptedChange
from console.screens.sql import SqlScreen
from console.sql import ReplayDatabase
from policies.params import parse_assignments
from store.writer import StoreWriter

ORIGIN_NS: Final = 1_800_000_000_000_000_000
"""Node time 0 of every node (2027-01-15 08:00 UTC)."""
TOKEN: Final = "screenshots"
HERE: Final = Path(__file__).resolve().parent


def simulate(options: AgentOptions, script: list[ScriptedChange], run_s: float) -> list[Event]:
    """One agent's hello and event stream for ``run_s`` seconds of node time, the ``script``'s changes (its own)
    applied at their times, as ``trackside agent`` with these options (seed 0) and the demo would have run it."""
    slos = {"ttft_slo_ms": options.slo_ttft_ms, "tpot_slo_ms": options.slo_tpot_ms}
    config = BenchConfig(
        units=options.units,
        batch_policy=options.batch_policy,
        dispatch=options.dispatch,
        params=parse_assignments(options.params),
        **{name: value for name, value in slos.items() if value is not None},  # None: the agent's default
    )
    requests = load_trace(options.trace) if options.trace else parse_workload(str(options.workload), seed=0)
    node = make_node(config, requests)
    hub = Hub(node, node_id=options.node_id, profile=config.profile, token=TOKEN, replay_capacity=1 << 24,
              get_time_ns=lambda: ORIGIN_NS + round(node.now_s * 1e9))
    hub.attach()
    hello = hub.hello()
    for change in sorted(script, key=lambda c: c.at_s):
        hub.node.advance(change.at_s)
        request = msgspec.structs.replace(change.request, token=TOKEN, control_id=uuid.uuid4().hex)
        reply = hub.handle(request, who="trackside demo")
        assert isinstance(reply, OkReply), reply
    hub.node.advance(run_s)
    return [hello, *hub.replay.since(0).events]


def build_store(path: Path, scenario: Scenario, run_s: float) -> int:
    """The scenario's agents' events in a new store at ``path``; how many."""
    nodes = [
        simulate(options, [c for c in scenario.script if c.node_id == options.node_id], run_s)
        for options in scenario.agents
    ]
    with StoreWriter(path) as writer:
        for events in nodes:
            writer.write(events)
        writer.flush()
    return sum(len(events) for events in nodes)


SCREENS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "overview": ("1", ("down", "down")),
    "heatmap": ("2", ("k", "down", *["left"] * 20)),
    "steps": ("3", ("left",) * 8),
    "slack": ("4", ("u",) * 7),
    "stages": ("5", ()),
    "policies": ("6", ("down", "down")),
    "sql": ("7", ("ctrl+j",)),
}
"""Each screen: its key, and the keys pressed on it before the screenshot."""


async def settled(pilot: Pilot[int], *, title: str) -> str:
    """The screen's SVG once two in a row are the same."""
    app = pilot.app
    await pilot.wait_for_scheduled_animations()
    before = ""
    for _ in range(200):
        await pilot.pause(0.05)
        now = app.export_screenshot(simplify=True, title=title)
        if now == before:
            return now
        before = now
    raise RuntimeError("the screen kept changing")


async def shoot(store: Path, size: tuple[int, int], out: Path, theme: str | None) -> list[Path]:
    database = ReplayDatabase(store)
    written = []
    try:
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=database)
        async with app.run_test(size=size) as pilot:
            if theme is not None:
                app.theme = theme
            while not any(s.detail == "end of file" for s in app.state.sources.values()):
                await pilot.pause(0.05)
            app.refresh_views(force=True)
            for name, (key, keys) in SCREENS.items():
                await pilot.press(key)
                screen = app.screen
                if isinstance(screen, SqlScreen):
                    screen.query_one(TextArea).cursor_blink = False
                await pilot.press(*keys)
                while isinstance(screen, SqlScreen) and (screen.running or screen.last_result is None):
                    await pilot.pause(0.05)  # the query has not come back yet
                path = out / f"{name}.svg"
                svg = await settled(pilot, title=f"trackside — {MODE_TITLES[name]}")
                path.write_text(svg, encoding="utf-8")
                written.append(path)
    finally:
        database.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="160x48", help="columns x rows (160x48)")
    parser.add_argument("--scenario", default=DEFAULT_SCENARIO, choices=SCENARIOS, help="the demo's scenario")
    parser.add_argument("--seconds", type=float, default=90.0, help="node time simulated (90 s)")
    parser.add_argument("--out", type=Path, default=HERE, help="where the SVGs go (this folder)")
    parser.add_argument("--theme", help="a theme's name (the console's default)")
    args = parser.parse_args(argv)
    columns, _, rows = args.size.partition("x")
    size = (int(columns), int(rows))
    os.environ["TZ"] = "UTC"  # clock times are local: the same files anywhere
    time.tzset()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "screenshots.duckdb"
        start = time.perf_counter()
        num_events = build_store(store, SCENARIOS[args.scenario], args.seconds)
        print(f"simulated {num_events:,} events in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        cwd = Path.cwd()
        os.chdir(folder)  # the header and the SQL screen name the store: a short relative name
        try:
            written = asyncio.run(shoot(Path(store.name), size, out, args.theme))
        finally:
            os.chdir(cwd)
    for path in written:
        print(f"{path} {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
