"""Parameter schemas: what a policy can be told, with types, ranges, defaults, units.

Every policy declares its parameters once, at class level, as a tuple of :class:`ParamSpec`. The schema
drives validation (CLI ``--param``, hot-swap control messages), ``trackside policies`` and the console's
policy editor. Validation is strict: unknown names and out-of-range values are errors, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

ParamType = Literal["int", "float", "bool", "str"]
ParamValue = int | float | bool | str


class ParamError(ValueError):
    """A parameter name or value that a policy does not accept."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of a policy."""

    name: str
    type: ParamType
    default: ParamValue
    help: str
    unit: str = ""
    """Unit of the value ("ms", "tokens", "" for dimensionless)."""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    live: bool = True
    """Whether the value may change while the policy runs (hot-swap between steps)."""

    def coerce(self, raw: ParamValue) -> ParamValue:
        """Convert ``raw`` (possibly a string from the command line) and check the range."""
        value: ParamValue
        try:
            if self.type == "int":
                if isinstance(raw, bool):
                    raise ValueError
                if isinstance(raw, float):
                    if not raw.is_integer():
                        raise ValueError
                    value = int(raw)
                else:
                    value = int(raw)
            elif self.type == "float":
                if isinstance(raw, bool):
                    raise ValueError
                value = float(raw)
                if value != value:  # NaN
                    raise ValueError
            elif self.type == "bool":
                value = _parse_bool(raw)
            else:
                value = str(raw)
        except (TypeError, ValueError):
            raise ParamError(f"{self.name}: expected {self.type}, got {raw!r}") from None
        if isinstance(value, int | float) and not isinstance(value, bool):
            if self.min is not None and value < self.min:
                raise ParamError(f"{self.name}={value} is below the minimum {self.min:g}{self.unit}")
            if self.max is not None and value > self.max:
                raise ParamError(f"{self.name}={value} is above the maximum {self.max:g}{self.unit}")
        if self.choices and str(value) not in self.choices:
            raise ParamError(f"{self.name}={value!r}: choose one of {', '.join(self.choices)}")
        return value

    def describe_range(self) -> str:
        """Human-readable range, e.g. ``[1, 8192] tokens``."""
        if self.choices:
            return "{" + ", ".join(self.choices) + "}"
        if self.min is None and self.max is None:
            return "any"
        lo = "-inf" if self.min is None else f"{self.min:g}"
        hi = "inf" if self.max is None else f"{self.max:g}"
        return f"[{lo}, {hi}]"


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
