"""Units' GPUs and parallel sizes on the console: the labels (pure), the state folding them from the hello, the
Overview's GPU column and the Heatmap's row labels (Pilot, on a scripted live feed; a replay keeps the placement
too: tests/console/test_console_replay.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from console_pilot import until
from console_snapshot import picture_of_svg
from serve_harness import run

from agent.telemetry import Event, NodeHello, StepEvent, UnitStatus
from console.app import ConsoleApp
from console.feeds import FeedUpdate
from console.model.fleet import COLUMNS, fleet_rows, shown_columns
from console.model.placement import clip, gpu_label, gpu_ranges, node_label, unit_gpus
from console.model.records import Connection
from console.model.state import ConsoleState
from console.screens.heatmap import HeatmapScreen
from console.widgets import FleetTable, HeatmapView
from console.widgets.heatmap import LABEL_WIDTH
from policies.types import StepMode

S = 1_000_000_000
T0 = 1_800_000_000 * S

Placement = tuple[tuple[int, ...], int, int]
"""A unit's ``gpu_ids``, ``tensor_parallel_size``, ``pipeline_parallel_size``."""
GPU_UNITS: tuple[Placement, ...] = (((0, 1), 2, 1), ((2, 3, 4, 5), 2, 2), ((), 0, 0))
"""u0 on two GPUs (TP2), u1 on four (TP2 x PP2), u2 simulated."""


def hello(node: str = "node-g", placements: Sequence[Placement] = GPU_UNITS, t: int = T0) -> NodeHello:
    return NodeHello(
        node_id=node,
        time_ns=t,
        boot_ns=t,
        profile="meta-llama/Llama-3.1-8B-Instruct",
        dispatch_policy="least_loaded",
        units=tuple(
            UnitStatus(
                unit_id=u,
                batch_policy="vllm",
                num_blocks=100,
                max_num_seqs=8,
                gpu_ids=gpus,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
            )
            for u, (gpus, tp, pp) in enumerate(placements)
        ),
    )


def step(unit: int, t: int, node: str = "node-g") -> StepEvent:
    return StepEvent(
        node_id=node,
        time_ns=t,
        unit_id=unit,
        step_id=t // S,
        measured_ns=20_000_000,
        predicted_ns=20_000_000,
        mode=StepMode.MIXED,
        policy="vllm",
        num_prefill_tokens=0,
        num_decode_tokens=4,
        num_prefill_reqs=0,
        num_decode_reqs=4,
        context_tokens=0,
        budget_tokens=2048,
        kv_used_blocks=10 * (unit + 1),
        num_blocks=100,
        num_running=4,
        num_waiting=0,
        num_preempted=0,
        num_finished=0,
    )


# -- labels ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gpu_ids", "expected"),
    [
        ((), ""),
        ((3,), "3"),
        ((0, 1), "0,1"),
        ((0, 1, 2, 3), "0-3"),
        ((4, 6), "4,6"),
        ((0, 1, 2, 5), "0-2,5"),
        ((0, 1, 2, 4, 5, 6, 7), "0-2,4-7"),
        ((3, 2, 1, 0), "3,2,1,0"),
        ((6, 7, 0, 1, 2), "6,7,0-2"),
    ],
)
def test_gpu_ranges_compact_runs_of_three_or_more_in_their_order(gpu_ids: tuple[int, ...], expected: str) -> None:
    assert gpu_ranges(gpu_ids) == expected


def test_gpu_label_shows_parallel_sizes_above_one() -> None:
    assert gpu_label((0, 1), 2, 1) == "0,1 TP2"
    assert gpu_label((0, 1, 2, 3, 4, 5, 6, 7), 4, 2) == "0-7 TP4 PP2"
    assert gpu_label((2,), 1, 1) == "2"
    assert gpu_label((0, 1), 1, 2) == "0,1 PP2"
    assert gpu_label((), 0, 0) == "", "a simulated unit"
    assert gpu_label((), 2, 0) == "TP2", "sizes without GPU ids"


def test_clip_ends_a_cut_text_with_an_ellipsis() -> None:
    assert clip("0-3 TP4", 16) == "0-3 TP4"
    assert clip("0,2,4,6,8,10,12,14 TP8", 16) == "0,2,4,6,8,10,12…"
    assert clip("abc", 1) == "…" and clip("abc", 0) == ""


# -- the state and the Overview's rows -------------------------------------------------------------------------------
def test_the_hello_places_units_and_the_rows_show_them() -> None:
    state = ConsoleState()
    state.apply([hello()])
    units = state.nodes["node-g"].units
    assert [(u.gpu_ids, u.tensor_parallel_size, u.pipeline_parallel_size) for u in units.values()] == list(GPU_UNITS)
    rows = {r.key: r for r in fleet_rows(state)}
    assert rows["node:node-g"].cell("gpus") == "0-5", "the node: every GPU of its units"
    assert [rows[f"unit:node-g:{u}"].cell("gpus") for u in range(3)] == ["0,1 TP2", "2-5 TP2 PP2", ""]
    assert [COLUMNS[i][0] for i in shown_columns(list(rows.values()))][:3] == ["name", "gpus", "state"]
    assert unit_gpus(state) == {("node-g", 0): "0,1", ("node-g", 1): "2-5"}

    state.apply([hello(placements=(((4, 5, 6, 7), 4, 1),), t=T0 + S)])  # restarted on other GPUs, one unit
    assert unit_gpus(state) == {("node-g", 0): "4-7"}
    assert node_label(state.nodes["node-g"]) == "4-7"


def test_a_simulated_fleet_has_no_gpu_column() -> None:
    state = ConsoleState()
    state.apply([hello(placements=(((), 0, 0), ((), 0, 0)))])
    rows = fleet_rows(state)
    assert all(r.cell("gpus") == "" for r in rows)
    assert "gpus" not in [COLUMNS[i][0] for i in shown_columns(rows)]
    assert unit_gpus(state) == {} and node_label(state.nodes["node-g"]) == ""


# -- the screens (Pilot) ---------------------------------------------------------------------------------------------
class Scripted:
    """A live feed that connects, says hello with GPU placements, sends a few steps, then stays connected."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = events

    @property
    def source(self) -> str:
        return "ws://node-g:7700"

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        yield FeedUpdate(self.source, connection=Connection.CONNECTING)
        yield FeedUpdate(self.source, tuple(self.events), Connection.LIVE)
        await asyncio.Event().wait()  # live until the app stops


def screen_text(app: ConsoleApp, size: tuple[int, int]) -> list[str]:
    return list(picture_of_svg(app.export_screenshot(), *size).text)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)], ids=["80x24", "120x36"])
def test_overview_and_heatmap_show_the_units_gpus(size: tuple[int, int]) -> None:
    events: list[Event] = [hello(), *(step(u, T0 + i * S) for i in range(5) for u in range(3))]

    async def go() -> None:
        app = ConsoleApp([Scripted(events)], clock=None, refresh_s=0.05)
        async with app.run_test(size=size) as pilot:
            table = app.screen.query_one(FleetTable)
            await until(pilot, lambda: len(table.rows_shown) == 4, "the node and its units")
            assert table.columns[table.ordered_columns[1].key].label.plain == "GPUs"
            lines = screen_text(app, size)
            header = next(line for line in lines if "node / unit" in line)
            assert header.split()[:5] == ["node", "/", "unit", "GPUs", "state"], "the GPUs next to the name"
            rows = {line.split()[0]: line for line in lines if line.strip().startswith(("u0", "u1", "u2"))}
            assert rows["u0"].split()[1:4] == ["0,1", "TP2", "running"]
            assert rows["u1"].split()[1:5] == ["2-5", "TP2", "PP2", "running"]
            assert rows["u2"].split()[1] == "running", "a simulated unit: an empty cell"
            assert "node-g" in next(line for line in lines if "0-5" in line), "the node's GPUs"
            assert "TTFT" in header, "the 80-column table still shows the latencies"

            await pilot.press("2")
            assert isinstance(app.screen, HeatmapScreen)
            view = app.screen.query_one(HeatmapView)
            await until(pilot, lambda: view.grid is not None and len(view.grid.rows) == 3, "the heatmap rows")
            assert view.label_width == LABEL_WIDTH + len("gpu2-5") + 1
            lines = screen_text(app, size)
            top = next(i for i, line in enumerate(lines) if line.startswith("policy Δ"))
            labels = [line[: view.label_width] for line in lines[top + 1 : top + 4]]
            assert [label.split() for label in labels] == [["node-g", "u0", "gpu0,1"], ["u1", "gpu2-5"], ["u2"]]
            assert view.num_columns == size[0] - view.label_width and view.num_columns >= 60

    run(go, timeout_s=60)
