"""What ``trackside demo`` runs: its scenarios (``--scenario NAME``), each a set of agents and a script.

A :class:`Scenario` is the agents the demo starts (:class:`~console.demo.AgentOptions`: workload, units, policies,
SLOs) and the control changes the demo then sends through the console's own control client
(:func:`console.control.send_control`), each at a node time: so a first look shows, within half a minute, what the
product is for. The script's changes are real control requests with the demo's token: each is applied by its agent,
audited (the Policies screen's audit log, a marker on the Heatmap) and, for a failed or recovered unit, alerted.

* ``showcase`` (the default): ``plain``, 4 units of vLLM's policy behind least-loaded dispatch on bursty traffic with
  long prompts (about 25 req/s, gaps with cv 6), whose worst-per-token TPOT misses its 60 ms target for about a
  third of the requests while prefills share steps with decodes; ``staged``, 4 units of FairBatching behind
  CascadeInfer (length stages, migrations) on 35 req/s of widely spread prompt lengths. The script fails unit 1 of
  ``plain`` at 8 s (its load moves to the other three), swaps units 2 and 3 of ``plain`` to Sarathi at 14 s (chunked
  prefill: their misses stop, beside units 0 and 1 still on vLLM's policy) and brings unit 1 back at 22 s.
* ``steady``: the quiet demo of before, one agent ``demo`` (4 units, vLLM's policy, least-loaded, bursty at
  40 req/s with the lengths of the H100 calibration), nothing scripted.

The settings were chosen with ``trackside bench`` (e.g. ``--workload 'bursty:rate=25,cv=6,...' --compare
vllm,sarathi --slo-tpot-ms 60``: 67% against 97% SLO attainment) and by watching the demo; the simulator and the
policies are as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.telemetry import ControlRequest, FailUnit, RecoverUnit, SetBatchPolicy
from console.demo import AgentOptions

DEFAULT_REQUESTS: Final = 100_000
"""Requests of a workload given on the command line without ``n=`` (a long demo)."""


@dataclass(frozen=True, slots=True)
class ScriptedChange:
    """A control request the demo sends to one of its agents at a node time."""

    at_s: float
    """Node seconds after the demo starts (wall seconds: this over the agents' speed)."""
    node_id: str
    request: ControlRequest
    what: str
    """What it does, in a few words (said in the console's notification)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """The agents the demo starts and the changes it sends them."""

    name: str
    summary: str
    """One line for ``--help``."""
    agents: tuple[AgentOptions, ...]
    script: tuple[ScriptedChange, ...] = ()

    def customised(
        self,
        *,
        workload: str | None = None,
        trace: Path | None = None,
        units: int | None = None,
        batch_policy: str | None = None,
        dispatch: str | None = None,
        speed: float | None = None,
    ) -> Scenario:
        """This scenario with the settings given (not None) replacing the scenario's on every agent."""
        changes: dict[str, object] = {}
        if workload is not None or trace is not None:
            changes |= {"workload": with_requests(workload) if workload is not None else None, "trace": trace}
        for name, value in (("units", units), ("batch_policy", batch_policy), ("dispatch", dispatch), ("speed", speed)):
            if value is not None:
                changes[name] = value
        if not changes:
            return self
        agents = tuple(dataclasses.replace(agent, **changes) for agent in self.agents)  # type: ignore[arg-type]
        return dataclasses.replace(self, agents=agents)


def with_requests(workload: str, num_requests: int = DEFAULT_REQUESTS) -> str:
    """``workload`` with ``n=num_requests`` unless it says how many."""
    if "n=" in workload:
        return workload
    return workload + (f",n={num_requests}" if ":" in workload else f":n={num_requests}")


_LONG_PROMPTS: Final = "prompt=lognormal(6.5,1,lo=4,hi=8192),output=lognormal(5.5,1,lo=4,hi=2048)"
SHOWCASE: Final = Scenario(
    name="showcase",
    summary="two nodes (one staged: CascadeInfer), bursts, SLO misses, a failed unit, a policy swap",
    agents=(
        AgentOptions(
            node_id="plain",
            workload=f"bursty:rate=25,cv=6,n=60000,{_LONG_PROMPTS}",
            units=4,
            batch_policy="vllm",
            dispatch="least_loaded",
            slo_tpot_ms=60.0,
        ),
        AgentOptions(
            node_id="staged",
            workload="poisson:rate=35,n=84000,prompt=lognormal(6,1.5)",
            units=4,
            batch_policy="fairbatching",
            dispatch="cascade",
            params=("min_partition_samples=8", "repartition_interval_s=5"),
            slo_tpot_ms=30.0,
        ),
    ),
    script=(
        ScriptedChange(8.0, "plain", FailUnit(unit_id=1, reason="the demo's script"), "unit 1 of plain fails"),
        ScriptedChange(
            14.0, "plain", SetBatchPolicy(policy="sarathi", unit_ids=(2, 3)), "units 2 and 3 of plain swap to sarathi"
        ),
        ScriptedChange(22.0, "plain", RecoverUnit(unit_id=1), "unit 1 of plain comes back"),
    ),
)
STEADY: Final = Scenario(
    name="steady",
    summary="one quiet node (vLLM, least-loaded, 40 req/s): every SLO met, nothing scripted",
    agents=(AgentOptions(node_id="demo", workload=with_requests("bursty")),),
)
SCENARIOS: Final[dict[str, Scenario]] = {scenario.name: scenario for scenario in (SHOWCASE, STEADY)}
"""Every scenario by name, the default first."""
DEFAULT_SCENARIO: Final = SHOWCASE.name


class UnknownScenarioError(Exception):
    """A scenario name that is not one of :data:`SCENARIOS` (one line, exit 2)."""


def scenario(name: str) -> Scenario:
    """The scenario called ``name``; :class:`UnknownScenarioError` naming the known ones otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise UnknownScenarioError(f"no scenario {name!r}: choose one of {', '.join(SCENARIOS)}") from None


def describe_scenarios() -> str:
    """One line per scenario, for ``--help``."""
    return "\n".join(f"  {s.name:<10} {s.summary}" for s in SCENARIOS.values())
