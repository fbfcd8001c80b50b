"""What a workload is: a list of :class:`RequestSpec`, and the one error type workload code raises.

A workload is plain data, known before a run starts: when each request arrives (seconds from the start of
the workload) and how many prompt and output tokens it has. Trace loaders and synthetic generators both
produce it; the node runtime and the simulator consume it. Nothing here does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class WorkloadError(ValueError):
    """A workload that cannot be built: a bad trace line, a bad spec string, an out-of-range parameter.

    The message is one line meant for the user as is (the CLI prints it without a traceback). For trace
    files it reads ``path:line: what is wrong (the offending value)``.
    """


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before it reaches a node.

    Construction checks the invariants below and raises :class:`WorkloadError` when one does not hold.
    """

    request_id: str
    """Unique within the workload, e.g. ``"r000042"`` (zero-padded index in file or generation order)."""
    arrival_s: float
    """Seconds from the start of the workload, >= 0. Synthetic arrivals start at their first gap; traces
    with absolute timestamps (Azure CSV) are rebased so that the first arrival is 0.0; JSONL files carry
    relative times already and are taken as written."""
    prompt_tokens: int
    """Prompt length in tokens, >= 1."""
    output_tokens: int
    """Tokens to generate, >= 1. The simulator knows it; policies do not."""
    ttft_slo_ms: float | None = None
    """Per-request time-to-first-token SLO in milliseconds; ``None`` means the run's default."""
    tpot_slo_ms: float | None = None
    """Per-request time-per-output-token SLO in milliseconds; ``None`` means the run's default."""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise WorkloadError("request_id must not be empty")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0.0):
            raise WorkloadError(f"{self.request_id}: arrival_s must be finite and >= 0 ({self.arrival_s!r})")
        if self.prompt_tokens < 1:
            raise WorkloadError(f"{self.request_id}: prompt_tokens must be >= 1 ({self.prompt_tokens!r})")
        if self.output_tokens < 1:
            raise WorkloadError(f"{self.request_id}: output_tokens must be >= 1 ({self.output_tokens!r})")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0.0):
                raise WorkloadError(f"{self.request_id}: {name} must be finite and > 0 ({value!r})")


def request_id_for(index: int) -> str:
    """The default id of the request at ``index`` (0-based) in file or generation order: ``r000042``."""
    return f"r{index:06d}"


def require(ok: bool, message: str) -> None:
    """Raise :class:`WorkloadError` with ``message`` unless ``ok``."""
    if not ok:
        raise WorkloadError(message)
