"""What a trackside unit tells its scheduler inside vLLM's engine-core process.

The settings travel in ``vllm_config.additional_config["trackside"]`` (a plain dict, so it survives vLLM's
config hashing and the spawn into the engine-core process) and are read back with :func:`unit_settings`.
This module imports no vLLM: the agent side builds the dict, the scheduler side reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

KEY = "trackside"
"""The key of our settings in ``additional_config``."""


@dataclass(frozen=True, slots=True)
class UnitSettings:
    """One vLLM engine run as a trackside unit."""

    unit_id: int = 0
    policy: str = "vllm"
    """Batch policy name (``policies.registry.BATCH_POLICIES``)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    coefficients: tuple[float, float, float] | None = None
    """Prior step model ``(a_s, b_s, c_s)`` the policy plans with; None: the default profile's."""
    mixed_interference: float = 0.0
    online_fit: bool = True
    """Refine the step model from measured steps (recursive least squares, as the simulated units do)."""
    ttft_slo_s: float = 0.5
    """SLOs of a request that carries none in ``SamplingParams.extra_args``."""
    tpot_slo_s: float = 0.05
    step_addr: str | None = None
    """zmq address the scheduler PUSHes step records to (the agent binds a PULL there); None: kept in memory."""
    control_addr: str | None = None
    """zmq address the scheduler binds a PULL socket on for control messages; None: no control channel."""
    agent_pid: int | None = None
    """The agent process: the engine core stops when it is gone (:mod:`agent.engine.vllm.lifeline`); None, or the
    engine core's own PID (an engine run in the agent's process): nothing watched."""

    def as_config(self) -> dict[str, Any]:
        """The dict to put under ``additional_config[KEY]``."""
        d = asdict(self)
        d["params"] = dict(self.params)
        d["coefficients"] = list(self.coefficients) if self.coefficients is not None else None
        return d


def unit_settings(additional_config: Mapping[str, Any] | None) -> UnitSettings:
    """Read :class:`UnitSettings` back from ``additional_config`` (defaults when absent)."""
    raw = dict((additional_config or {}).get(KEY) or {})
    known = set(UnitSettings.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown trackside settings: {', '.join(unknown)}")
    coefs = raw.get("coefficients")
    if coefs is not None:
        if len(coefs) != 3:
            raise ValueError(f"coefficients must be (a_s, b_s, c_s), got {coefs!r}")
        raw["coefficients"] = tuple(float(c) for c in coefs)
    raw["params"] = dict(raw.get("params") or {})
    return UnitSettings(**raw)
