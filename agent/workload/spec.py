"""Named workload presets and the CLI syntax ``NAME[:key=value,...]`` (:func:`parse_workload`).

Default loads are sized for 4 data-parallel H100 units of Llama-3.1-8B, which saturate at about 82
requests/s on sharegpt-like lengths (each unit: 5,900 output tokens/s, 1,000 requests in 48.5 s, see
``calibration/README.md``). The presets aim at roughly half of the saturation load.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from agent.workload.synthetic import (
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
from agent.workload.types import RequestSpec, WorkloadError
from agent.workload.types import require as _require

ArrivalKind = Literal["poisson", "gamma", "all-at-once"]


@dataclass(frozen=True, slots=True)
class Preset:
    """Defaults behind a workload name; every field can be overridden in the spec string."""

    summary: str
    """What the workload stands for, in a few words."""
    num_requests: int
    prompt: LengthDistribution
    output: LengthDistribution
    arrival: ArrivalKind = "poisson"
    rate_rps: float = 40.0
    """Mean arrival rate, requests per second (unused for all-at-once)."""
    cv: float = 2.0
    """Coefficient of variation of the gaps (gamma arrivals only)."""

    @property
    def description(self) -> str:
        """One line for ``--help``: the summary, then every default (lengths in the spec syntax)."""
        arrivals = {
            "poisson": f"Poisson {self.rate_rps:g} req/s",
            "gamma": f"gamma arrivals {self.rate_rps:g} req/s cv={self.cv:g}",
            "all-at-once": "all at t=0",
        }[self.arrival]
        return (
            f"{self.summary}: prompt={self.prompt}, output={self.output}, {arrivals}, n={self.num_requests}"
        )


_SHAREGPT_PROMPT = Lognormal(5.2, 1.0, lo=4, hi=4096)
_SHAREGPT_OUTPUT = Lognormal(5.2, 0.9, lo=4, hi=2048)

PRESETS: dict[str, Preset] = {
    "sharegpt-like": Preset(
        "chat, the lengths of the H100 calibration baseline", 2000, _SHAREGPT_PROMPT, _SHAREGPT_OUTPUT
    ),
    "longbench-like": Preset(
        "long-context QA/summarization-like (LongBench), median prompt 6K tokens",
        800,
        Lognormal(8.7, 0.5, lo=1000, hi=15000),
        Gamma(100.0, 0.5, lo=8, hi=1024),
        rate_rps=8.0,
    ),
    "numina-like": Preset(
        "math reasoning (NuminaMath-like), short problems and long chains of thought",
        600,
        Gamma(100.0, 0.5, lo=16, hi=1024),
        Gamma(1500.0, 0.8, lo=32, hi=8192),
        rate_rps=6.0,
    ),
    "bursty": Preset(
        "sharegpt-like lengths, bursty arrivals",
        2000,
        _SHAREGPT_PROMPT,
        _SHAREGPT_OUTPUT,
        arrival="gamma",
        cv=4.0,
    ),
}
"""Named workloads. Default rates put 4 H100 units of Llama-3.1-8B at moderate load (calibration/):
sharegpt-like 40 req/s of ~82 sustainable (20.6 req/s a unit); longbench-like 8 req/s, ~54K prompt
tokens/s of ~106K (26.6K a unit); numina-like 6 req/s, ~9K output tokens/s, ~2.2K a unit where the step-time
fit allows about 5K at 1-2K tokens of context."""

ARRIVAL_KINDS: dict[str, Preset] = {
    "poisson": Preset("Poisson arrivals", 1000, _SHAREGPT_PROMPT, _SHAREGPT_OUTPUT),
    "gamma": Preset(
        "gamma-distributed gaps (cv=1 is Poisson-like, cv>1 bursty)",
        1000,
        _SHAREGPT_PROMPT,
        _SHAREGPT_OUTPUT,
        arrival="gamma",
    ),
    "all-at-once": Preset(
        "offline batch, like the calibration throughput run",
        1000,
        _SHAREGPT_PROMPT,
        _SHAREGPT_OUTPUT,
        arrival="all-at-once",
    ),
}
"""Generic arrival processes, usable as workload names with ``prompt=`` and ``output=`` keys (default lengths:
sharegpt-like)."""


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A resolved synthetic workload: everything :func:`generate` needs except the seed."""

    num_requests: int
    arrivals: ArrivalProcess
    prompt: LengthDistribution
    output: LengthDistribution
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    name: str = field(default="", compare=False)
    """The name it was parsed from (display only)."""

    def generate(self, *, seed: int) -> list[RequestSpec]:
        """The requests of this workload for ``seed``."""
        return generate(
            self.num_requests,
            self.arrivals,
            self.prompt,
            self.output,
            seed=seed,
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
        )

    def __str__(self) -> str:
        """The canonical spec string; :func:`parse_workload_spec` reads it back to an equal spec."""
        arrivals = self.arrivals
        if isinstance(arrivals, GammaArrivals):
            head = f"gamma:rate={arrivals.rate_rps!r},cv={arrivals.cv!r},"
        elif isinstance(arrivals, PoissonArrivals):
            head = f"poisson:rate={arrivals.rate_rps!r},"
        else:
            head = "all-at-once:"
        slos = "".join(
            f",{k}={v!r}"
            for k, v in (("ttft_slo_ms", self.ttft_slo_ms), ("tpot_slo_ms", self.tpot_slo_ms))
            if v is not None
        )
        return f"{head}n={self.num_requests},prompt={self.prompt},output={self.output}{slos}"


def describe_presets() -> list[tuple[str, str]]:
    """``(name, one-line description)`` of every workload name, presets first, for ``--help``."""
    return [(name, preset.description) for name, preset in (PRESETS | ARRIVAL_KINDS).items()]


def parse_workload(spec: str, *, seed: int) -> list[RequestSpec]:
    """Generate the workload written as ``NAME[:key=value,...]`` (see :func:`parse_workload_spec`)."""
    return parse_workload_spec(spec).generate(seed=seed)


# ---------------------------------------------------------------------------------------- spec strings

_KEYS = ("n", "rate", "cv", "prompt", "output", "ttft_slo_ms", "tpot_slo_ms")
_DISTRIBUTIONS: dict[str, tuple[type[LengthDistribution], tuple[str, ...], bool]] = {
    "lognormal": (Lognormal, ("mu", "sigma"), True),
    "uniform": (Uniform, ("lo", "hi"), False),
    "fixed": (Fixed, ("tokens",), False),
    "geometric": (Geometric, ("mean",), True),
    "gamma": (Gamma, ("mean", "cv"), True),
}
_WHOLE_PARAMS = frozenset({"lo", "hi", "tokens"})
_CALL = re.compile(r"([a-z]+)\((.*)\)", re.DOTALL)


def parse_workload_spec(spec: str) -> WorkloadSpec:
    """Resolve ``NAME[:key=value,...]`` without sampling anything.

    NAME is a preset (sharegpt-like, longbench-like, numina-like, bursty) or an arrival process (poisson,
    gamma, all-at-once). Keys: ``n`` (requests), ``rate`` (requests/s), ``cv`` (gap coefficient of
    variation; on a Poisson preset it switches to gamma arrivals), ``prompt`` and ``output`` (length
    distributions, see :func:`parse_length`), ``ttft_slo_ms`` and ``tpot_slo_ms``. Example:
    ``bursty:rate=12,cv=3,n=2000``. Any mistake raises :class:`WorkloadError` listing what is valid.
    """
    head, _, rest = spec.partition(":")
    name = head.strip().lower()
    preset = PRESETS.get(name) or ARRIVAL_KINDS.get(name)
    if preset is None:
        valid = ", ".join(known for known, _ in describe_presets())
        raise WorkloadError(f"unknown workload {name!r} (valid: {valid})")
    allowed = [key for key in _KEYS if not (key == "cv" and name == "poisson")]
    if preset.arrival == "all-at-once":
        allowed = [key for key in allowed if key not in ("rate", "cv")]
    context = f"workload {spec!r}"
    values: dict[str, str] = {}
    for item in _split_top_level(rest, context) if rest.strip() else []:
        key, equals, value = (part.strip() for part in item.partition("="))
        if key not in allowed:
            raise WorkloadError(
                f"{context}: unknown key {key!r} (valid keys for {name}: {', '.join(allowed)})"
            )
        _require(bool(equals and value), f"{context}: {key} needs a value ({key}=...)")
        _require(key not in values, f"{context}: {key} is given twice")
        values[key] = value
    number = {
        key: _positive_number(values[key], f"{context}: {key}")
        for key in ("rate", "cv", "ttft_slo_ms", "tpot_slo_ms")
        if key in values
    }
    num_requests = _whole(values["n"], f"{context}: n") if "n" in values else preset.num_requests
    _require(num_requests >= 1, f"{context}: n must be >= 1 (got {num_requests})")
    arrivals: ArrivalProcess = AllAtOnce()
    if preset.arrival == "gamma" or "cv" in values:
        arrivals = GammaArrivals(number.get("rate", preset.rate_rps), number.get("cv", preset.cv))
    elif preset.arrival == "poisson":
        arrivals = PoissonArrivals(number.get("rate", preset.rate_rps))
    return WorkloadSpec(
        num_requests=num_requests,
        arrivals=arrivals,
        prompt=parse_length(values["prompt"], context) if "prompt" in values else preset.prompt,
        output=parse_length(values["output"], context) if "output" in values else preset.output,
        ttft_slo_ms=number.get("ttft_slo_ms"),
        tpot_slo_ms=number.get("tpot_slo_ms"),
        name=name,
    )


def parse_length(text: str, context: str = "length") -> LengthDistribution:
    """A length distribution written like a call: ``lognormal(5.2,1.0)``, ``uniform(16,4096)``,
    ``fixed(128)``, ``geometric(200)``, ``gamma(300,2)``; lognormal, geometric and gamma also take
    ``lo=`` and ``hi=`` (clip bounds, tokens), and any argument may be named (``gamma(mean=300,cv=2)``).
    """
    match = _CALL.fullmatch(text.strip().lower().replace(" ", ""))
    if match is None or match.group(1) not in _DISTRIBUTIONS:
        valid = ", ".join(_usage(kind) for kind in _DISTRIBUTIONS)
        raise WorkloadError(f"{context}: bad length distribution {text!r} (valid: {valid})")
    kind, arguments = match.groups()
    cls, positional, clipped = _DISTRIBUTIONS[kind]
    names = positional + (("lo", "hi") if clipped else ())
    bad = f"{context}: bad arguments in {text!r} (usage: {_usage(kind)})"
    kwargs: dict[str, float] = {}
    for index, argument in enumerate(_split_top_level(arguments, context) if arguments else []):
        key, _, raw = argument.rpartition("=")
        if not key:
            _require(index < len(positional) and len(kwargs) == index, bad)  # positional ones come first
            key = positional[index]
        _require(key in names and key not in kwargs, bad)
        where = f"{context}: {kind} {key}"
        kwargs[key] = _whole(raw, where) if key in _WHOLE_PARAMS else _finite(raw, where)
    missing = [name for name in positional if name not in kwargs]
    _require(not missing, f"{context}: {text!r} is missing {', '.join(missing)} (usage: {_usage(kind)})")
    try:
        return cls(**kwargs)
    except WorkloadError as error:
        raise WorkloadError(f"{context}: {error}") from None


def _usage(kind: str) -> str:
    _, positional, clipped = _DISTRIBUTIONS[kind]
    return f"{kind}({','.join(positional)}{',lo=,hi=' if clipped else ''})"


def _split_top_level(text: str, context: str) -> list[str]:
    """Split on the commas that are not inside parentheses."""
    items: list[str] = []
    depth = start = 0
    for index, char in enumerate(text):
        depth += 1 if char == "(" else -1 if char == ")" else 0
        _require(depth >= 0, f"{context}: unbalanced ')'")
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    _require(depth == 0, f"{context}: unbalanced '('")
    items.append(text[start:])
    _require(all(item.strip() for item in items), f"{context}: empty item between commas")
    return items


def _finite(raw: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise WorkloadError(f"{where} must be a number (got {raw.strip()!r})") from None
    _require(math.isfinite(value), f"{where} must be finite (got {raw.strip()!r})")
    return value


def _positive_number(raw: str, where: str) -> float:
    value = _finite(raw, where)
    _require(value > 0, f"{where} must be > 0 (got {raw.strip()!r})")
    return value


def _whole(raw: str, where: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise WorkloadError(f"{where} must be a whole number (got {raw.strip()!r})") from None
