"""Screenshots of the console's seven screens for docs/console.md: SVGs in this folder.

    python docs/screenshots/make_screenshots.py [--size 160x48] [--seconds 100] [--out DIR] [--theme NAME]

Simulates three nodes for ``--seconds`` of node time (through the agent's hub, into a store in a temporary
folder, as ``trackside record`` would have written it): ``node-a``, 4 units of vLLM's policy behind least-loaded
dispatch on a bursty workload (40 requests/s), unit 1 swapped to Sarathi half-way and an SLO alert; ``node-b``, 2
units of FairBatching with PAB behind PAB dispatch (20/s); ``node-c``, 4 units of FairBatching behind CascadeInfer
(length stages, migrations; 35/s, short and long prompts) with slack samples every 250 ms and unit loads at most
every 100 ms. About 140,000 events: fewer than a replay reads back at once (``console.history.MAX_REBUILD_EVENTS``),
so every screen shows the whole run. Then replays the store into the console, headless at ``--size``, and writes
each screen with ``App.export_screenshot(simplify=True)``. Node time 0 is a fixed instant and clock times are shown
in UTC, so the same arguments give the same files (but for the time the SQL screen's query took).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from textual.pilot import Pilot
from textual.widgets import TextArea

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.service.hub import Hub
from agent.telemetry import Alert, Event, OkReply, SetBatchPolicy
from agent.workload.spec import parse_workload
from console.app import MODE_TITLES, ConsoleApp
from console.feeds import ReplayFeed
from console.screens.sql import SqlScreen
from console.sql import ReplayDatabase
from store.writer import StoreWriter

ORIGIN_NS: Final = 1_800_000_000_000_000_000
"""Node time 0 of every node (2027-01-15 08:00 UTC)."""
TOKEN: Final = "screenshots"
HERE: Final = Path(__file__).resolve().parent


def simulate(
    node_id: str,
    config: BenchConfig,
    workload: str,
    run_s: float,
    *,
    slack_sample_ms: float = 0.0,
    unit_load_min_interval_ms: float = 0.0,
    swap_unit_at_s: float | None = None,
) -> list[Event]:
    """One node's hello and event stream for ``run_s`` seconds of node time."""
    node = make_node(config, parse_workload(workload, seed=1))
    hub = Hub(
        node,
        node_id=node_id,
        profile=config.profile,
        token=TOKEN,
        replay_capacity=1 << 24,
        slack_sample_ms=slack_sample_ms,
        unit_load_min_interval_ms=unit_load_min_interval_ms,
        get_time_ns=lambda: ORIGIN_NS + round(node.now_s * 1e9),
    )
    hub.attach()
    hello = hub.hello()
    if swap_unit_at_s is not None:
        hub.node.advance(swap_unit_at_s)
        reply = hub.handle(SetBatchPolicy(policy="sarathi", unit_ids=(1,), token=TOKEN), who="operator")
        assert isinstance(reply, OkReply), reply
        hub.node.advance(swap_unit_at_s + 5.0)
        hub.publish(
            Alert(
                node_id=node_id,
                time_ns=hub.origin.ns(hub.node.now_s),
                code="slo_breach",
                severity="warning",
                unit_id=2,
                message="unit 2 is missing its TPOT target",
            )
        )
    hub.node.advance(run_s)
    return [hello, *hub.replay.since(0).events]


def build_store(path: Path, run_s: float) -> int:
    """The three nodes' events in a new store at ``path``; how many. Requests keep arriving past the end (the
    screenshots show the nodes busy, not draining)."""
    nodes = [
        simulate(
            "node-a",
            BenchConfig(units=4, batch_policy="vllm", dispatch="least_loaded"),
            f"bursty:n={round(40 * (run_s + 60))},rate=40",
            run_s,
            swap_unit_at_s=run_s / 2,
        ),
        simulate(
            "node-b",
            BenchConfig(units=2, batch_policy="fairbatching+pab", dispatch="pab"),
            f"poisson:n={round(20 * (run_s + 60))},rate=20",
            run_s,
        ),
        simulate(
            "node-c",
            BenchConfig(
                units=4,
                batch_policy="fairbatching",
                dispatch="cascade",
                params={"min_partition_samples": "8", "repartition_interval_s": "5"},
            ),
            f"poisson:n={round(35 * (run_s + 60))},rate=35,prompt=lognormal(mu=6,sigma=1.5)",
            run_s,
            slack_sample_ms=250.0,
            unit_load_min_interval_ms=100.0,  # CascadeInfer reports loads at every dispatch: 10 a second is plenty
        ),
    ]
    with StoreWriter(path) as writer:
        for events in nodes:
            writer.write(events)
        writer.flush()
    return sum(len(events) for events in nodes)


SCREENS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "overview": ("1", ("down", "down")),
    "heatmap": ("2", ("b", "down", *["left"] * 20)),
    "steps": ("3", (*["u"] * 7, *["left"] * 8)),
    "slack": ("4", ("down",)),
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
    parser.add_argument("--seconds", type=float, default=100.0, help="node time simulated (100 s)")
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
        num_events = build_store(store, args.seconds)
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
