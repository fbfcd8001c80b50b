"""Parameter schemas: what a policy can be told, with types, ranges, defaults, units.

Every policy declares its parameters once, at class level, as a tuple of :class:`ParamSpec`. The schema
drives validation (CLI ``--param``, hot-swap control messages), ``trackside policies`` and the console's
policy editor. Validation is strict: unknown names and out-of-range values are errors, never ignored.

Values are coerced to the schema's type, and only the coerced value goes on (into the policy, the audit, the
reply): a numeric string becomes its number (``"0.5"`` for a float, ``"64"``, ``"64.0"`` or ``"1e3"`` for an int,
which takes only exact integers), anything else is refused. Every numeric parameter has a range (an integer's
finite): a spec without ``min`` and ``max`` cannot be built, so a new policy cannot forget its bounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Final, Literal

ParamType = Literal["int", "float", "bool", "str"]
ParamValue = int | float | bool | str

# Bounds the built-in policies share (an int parameter must have one; these are far above any real setting and
# far below what would hurt: a policy loops, allocates or sums up to them).
MAX_STEP_TOKENS: Final = 1 << 20
"""Tokens of one step (a budget, a chunk cap): 1,048,576, 128 times vLLM's usual ``max_num_batched_tokens``."""
MAX_CONTEXT_TOKENS: Final = 1 << 24
"""Tokens of one request's context: 16,777,216, 16 times the longest context windows of today's models."""
MAX_REQUESTS: Final = 1 << 16
"""Requests held or looked at together (a batch, a waiting scan, a window of finished requests): 65,536, 64 times
vLLM's default ``max_num_seqs`` (a policy allocates or loops over this many)."""
MAX_KV_BLOCKS: Final = 1 << 20
"""KV-cache blocks: 1,048,576 (16,777,216 tokens at 16 per block), more than any GPU holds."""
MAX_EVENTS: Final = 1 << 20
"""A count of finished requests or samples between two recomputations: 1,048,576 (beyond it a policy would never
recompute in a day's run)."""
MAX_SLO_MS: Final = 3_600_000.0
"""A latency target: an hour."""


class ParamError(ValueError):
    """A parameter name or value that a policy does not accept."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of a policy. A numeric one must give ``min`` and ``max`` (finite for an ``int``; a ``float`` may
    say ``math.inf`` where infinity is a setting it takes), and the default must be a valid value: a spec that breaks
    either raises ``ValueError`` when it is built (when its policy's module is imported)."""

    name: str
    type: ParamType
    default: ParamValue
    help: str
    unit: str = ""
    """Unit of the value ("ms", "tokens", "" for dimensionless)."""
    min: float | None = None
    max: float | None = None
    """The range, both ends included; required for ``int`` (finite) and ``float`` parameters."""
    choices: tuple[str, ...] = ()
    live: bool = True
    """Whether the value may change while the policy runs (hot-swap between steps)."""

    def __post_init__(self) -> None:
        if self.type in ("int", "float"):
            lo, hi = self.min, self.max
            if lo is None or hi is None or not lo <= hi:  # NaN too
                raise ValueError(f"parameter {self.name}: a {self.type} parameter needs a min and a max "
                                 f"(got [{lo}, {hi}])")
            if self.type == "int" and not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(f"parameter {self.name}: an int parameter's min and max must be finite")
        try:
            valid = self.coerce(self.default) == self.default
        except ParamError:
            valid = False
        if not valid:
            raise ValueError(f"parameter {self.name}: the default {self.default!r} is not a valid value")

    def coerce(self, raw: ParamValue) -> ParamValue:
        """``raw`` (from a command line or a control message) as the schema's type, its range checked.

        Numbers and numeric strings become the type: an ``int`` takes exact integers only (``3``, ``3.0``, ``"3"``,
        ``"3.0"``, ``"3e2"``; not ``3.5`` nor ``"3.0000000000000001"``), a ``float`` any number but NaN; a ``bool``
        takes true/false/yes/no/on/off/1/0; a ``str`` only a string. Raises :class:`ParamError` otherwise.
        """
        value: ParamValue
        try:
            if self.type == "int":
                value = _parse_int(raw)
            elif self.type == "float":
                value = _parse_float(raw)
            elif self.type == "bool":
                value = _parse_bool(raw)
            elif isinstance(raw, str):
                value = raw
            else:
                raise TypeError(raw)
        except (TypeError, ValueError, OverflowError):
            raise ParamError(f"{self.name}: expected {self.type}, got {_shown(raw)}") from None
        if isinstance(value, int | float) and not isinstance(value, bool):
            given = f"{self.name}={_shown(value)}"
            if self.min is not None and value < self.min:
                raise ParamError(f"{given} is below the minimum {self.format_bound(self.min)}{self.unit}")
            if self.max is not None and value > self.max:
                raise ParamError(f"{given} is above the maximum {self.format_bound(self.max)}{self.unit}")
        if self.choices and str(value) not in self.choices:
            raise ParamError(f"{self.name}={_shown(value)}: choose one of {', '.join(self.choices)}")
        return value

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """``(min, max)`` with None for no bound, an infinite one included: what JSON and the wire say (JSON has no
        infinity)."""
        lo = None if self.min is None or self.min == -math.inf else self.min
        hi = None if self.max is None or self.max == math.inf else self.max
        return lo, hi

    def describe_range(self) -> str:
        """Human-readable range, e.g. ``[1, 8192] tokens``."""
        if self.choices:
            return "{" + ", ".join(self.choices) + "}"
        if self.min is None and self.max is None:
            return "any"
        lo = "-inf" if self.min is None else self.format_bound(self.min)
        hi = "inf" if self.max is None else self.format_bound(self.max)
        return f"[{lo}, {hi}]"

    def format_bound(self, bound: float) -> str:
        """A bound as people write it: an integral one in full (``1048576``, ``3600000``), else ``0.01``, ``1e-06``."""
        return str(int(bound)) if math.isfinite(bound) and float(bound).is_integer() else f"{bound:g}"


def _shown(value: ParamValue, limit: int = 40) -> str:
    """``value`` for an error message: its repr (a string's with quotes), cut to ``limit`` characters."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_int(raw: ParamValue) -> int:
    """An exact integer: an int, an integral float, or a string of one (``"12"``, ``"12.0"``, ``"1.2e1"``)."""
    if isinstance(raw, bool):
        raise TypeError(raw)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float):
        if not raw.is_integer():  # also NaN and the infinities
            raise ValueError(raw)
        return int(raw)
    text = raw.strip()
    try:
        return int(text)
    except ValueError:
        pass
    number = float(text)
    try:
        exact = number.is_integer() and Decimal(text) == Decimal(number)  # "1.0000000000000001" is not 1
    except InvalidOperation:
        exact = False
    if not exact:
        raise ValueError(raw)
    return int(number)


def _parse_float(raw: ParamValue) -> float:
    """A float from a number or a numeric string (not NaN; an infinity only passes a range that ends there)."""
    if isinstance(raw, bool):
        raise TypeError(raw)
    value = float(raw)
    if math.isnan(value):
        raise ValueError(raw)
    return value


def _parse_bool(raw: ParamValue) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def resolve_params(
    policy: str, schema: Sequence[ParamSpec], given: Mapping[str, ParamValue]
) -> dict[str, ParamValue]:
    """Defaults overlaid with ``given``, every value validated against ``schema``."""
    by_name = {spec.name: spec for spec in schema}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        known = ", ".join(by_name) or "none"
        raise ParamError(f"{policy} has no parameter {', '.join(unknown)} (its parameters: {known})")
    values: dict[str, ParamValue] = {spec.name: spec.default for spec in schema}
    for name, raw in given.items():
        values[name] = by_name[name].coerce(raw)
    return values


def parse_assignments(items: Sequence[str]) -> dict[str, str]:
    """Parse ``["name=value", ...]`` as given on a command line."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ParamError(f"expected name=value, got {item!r}")
        out[name.strip()] = value.strip()
    return out
