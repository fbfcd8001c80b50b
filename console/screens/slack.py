"""Slack: for one unit, the distribution of slack over its running requests at the latest sample, the requests
nearest to a miss, the urgent count and the aggregate progress against the TPOT target; below, the selected
request's envelope (tokens done over time against its deadline line)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import Footer, Header, Static

from console.model.metrics import HeatMetric
from console.model.render import fmt_age
from console.model.slack import SlackSummary, envelope, slack_summary
from console.model.state import ConsoleState
from console.screens.base import UnitScreen
from console.widgets.envelope_chart import EnvelopeChart, envelope_heading
from console.widgets.nearest_requests import NearestRequests
from console.widgets.slack_distribution import SlackDistribution


class SlackScreen(UnitScreen):
    """A unit's slack and one request's envelope; ``u`` picks the unit, the arrows the request."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("u", "cycle_unit(1)", "Next unit", id="slack.next_unit", tooltip="Show the next unit's slack"),
        Binding(
            "U",
            "cycle_unit(-1)",
            "Previous unit",
            show=False,
            id="slack.previous_unit",
            tooltip="Show the previous unit's slack",
        ),
        Binding(
            "down",
            "move(1)",
            "Next request",
            show=False,
            id="slack.next_request",
            tooltip="Select the request with the next larger slack",
        ),
        Binding(
            "up",
            "move(-1)",
            "Previous request",
            show=False,
            id="slack.previous_request",
            tooltip="Select the request with the next smaller slack",
        ),
        Binding(
            "home",
            "nearest",
            "Nearest",
            id="slack.nearest",
            tooltip="Select the request nearest to a miss, following it as samples come",
        ),
    ]

    def __init__(self) -> None:
        super().__init__()
        # self.unit: the unit shown (None: the first with a slack sample, else the first)
        self.request: str | None = None
        """The selected request; None: whichever is nearest to a miss at the latest sample."""
        self.summary: SlackSummary | None = None
        """The unit's latest sample, summed up, as last drawn."""
        self._following: bool | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="slack-title", classes="pane-title")
        with Horizontal(id="slack-top"):
            yield SlackDistribution(id="slack-distribution")
            yield NearestRequests(id="slack-nearest")
        yield Static(id="slack-envelope-title", classes="pane-title")
        yield EnvelopeChart(id="slack-envelope")
        yield Footer()

    @property
    def selected(self) -> str | None:
        """The request whose envelope is drawn: the chosen one, else the nearest to a miss."""
        if self.request is not None:
            return self.request
        return self.summary.rows[0].request_id if self.summary is not None and self.summary.rows else None

    def redraw(self) -> None:
        """Summarise the unit's latest sample and draw the selected request's envelope."""
        state = self._state
        if state is None:
            return
        units = self._units()
        if self.unit not in units:
            sampled = [key for key in units if key in state.slack.latest]
            self.unit = sampled[0] if sampled else units[0] if units else None
            self.request = None
        title = self.query_one("#slack-title", Static)
        if self.unit is None:
            title.update(Text("Slack · no units yet"))
            self.summary = None
            self._draw(state, "")
            return
        node_id, unit_id = self.unit
        sample = state.slack.latest.get(self.unit)
        if sample is None:
            self.summary = None
        else:
            step = state.steps.latest(node_id, unit_id)
            urgent = step.reasons.get("urgent_decodes") if step is not None else None
            policy_urgent = urgent if isinstance(urgent, int) and not isinstance(urgent, bool) else None
            unit = state.nodes[node_id].units.get(unit_id)
            batch = unit.latest.get(HeatMetric.BATCH) if unit is not None else None  # from another instant
            self.summary = slack_summary(sample, state.slack.tpot_ms(node_id), policy_urgent, batch_size=batch)
        self.query_one(SlackDistribution).show(self.summary)
        parts = [f"{node_id} u{unit_id} ({units.index(self.unit) + 1}/{len(units)})"]
        if sample is not None:
            parts.append(f"sample {fmt_age((state.now_ns - sample.time_ns) / 1e9)}")
            parts.append(f"every {sample.sample_period_ms:g} ms")
        if node_id not in state.slack.tpot_slo_ms:
            parts.append("TPOT target assumed")
        title.update(Text(" · ".join(parts)))
        self._draw(state, node_id)

    def _draw(self, state: ConsoleState, node_id: str) -> None:
        rows = self.summary.rows if self.summary is not None else ()
        self.query_one(NearestRequests).show(rows, self.selected)
        request = self.selected
        trace = state.slack.traces.get((node_id, request)) if request is not None else None
        env = envelope(trace, state.slack.tpot_ms(node_id)) if trace is not None else None
        heading = envelope_heading(env, state.now_ns)
        if request is not None and request not in {r.request_id for r in rows}:
            heading += " · not in the latest sample"
        self.query_one("#slack-envelope-title", Static).update(Text(heading))
        self.query_one(EnvelopeChart).show(env, state.now_ns)
        following = self.request is None
        if following != self._following:  # "nearest" is greyed out while following: tell the footer
            self._following = following
            self.refresh_bindings()

    def forget_selection(self) -> None:
        """A new unit: follow its request nearest to a miss."""
        self.request = None

    # -- actions ---------------------------------------------------------------------------------------------------

    def action_move(self, delta: int) -> None:
        """Select the request ``delta`` rows down the list (least slack first)."""
        rows = self.summary.rows if self.summary is not None else ()
        if not rows:
            return
        ids = [r.request_id for r in rows]
        at = ids.index(self.selected) if self.selected in ids else 0
        self.request = ids[min(len(ids) - 1, max(0, at + delta))]
        self.redraw()

    def action_nearest(self) -> None:
        """Follow the request nearest to a miss."""
        self.request = None
        self.redraw()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``nearest`` is greyed out while following it; the unit keys while there is at most one unit."""
        if action == "nearest" and self.request is None:
            return None
        return super().check_action(action, parameters)
