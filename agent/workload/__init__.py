"""The workload layer: what requests arrive when, from trace files or seeded synthetic generators.

``load_trace`` reads the Azure LLM inference trace (CSV) or the project's JSONL; ``parse_workload`` turns
a CLI spec such as ``bursty:rate=12,n=2000`` into requests. Both return ``list[RequestSpec]``.
"""

from __future__ import annotations

from agent.workload.spec import (
    ARRIVAL_KINDS,
    PRESETS,
    Preset,
    WorkloadSpec,
    describe_presets,
    parse_length,
    parse_workload,
    parse_workload_spec,
)
from agent.workload.synthetic import (
    MAX_LENGTH_TOKENS,
    AllAtOnce,
    ArrivalProcess,
    Fixed,
    Gamma,
    GammaArrivals,
    Geometric,
    LengthDistribution,
    Lognormal,
    PoissonArrivals,
    Uniform,
    generate,
)
from agent.workload.traces import (
    load_azure_csv,
    load_jsonl,
    load_trace,
    parse_azure_timestamp,
    write_jsonl,
)
from agent.workload.types import RequestSpec, WorkloadError

__all__ = [
    "ARRIVAL_KINDS",
    "MAX_LENGTH_TOKENS",
    "PRESETS",
    "AllAtOnce",
    "ArrivalProcess",
    "Fixed",
    "Gamma",
    "GammaArrivals",
    "Geometric",
    "LengthDistribution",
    "Lognormal",
    "PoissonArrivals",
    "Preset",
    "RequestSpec",
    "Uniform",
    "WorkloadError",
    "WorkloadSpec",
    "describe_presets",
    "generate",
    "load_azure_csv",
    "load_jsonl",
    "load_trace",
    "parse_azure_timestamp",
    "parse_length",
    "parse_workload",
    "parse_workload_spec",
    "write_jsonl",
]
