"""Parameter schemas (issue #16): every numeric parameter of every registered policy is bounded, values are coerced to
the schema's type or refused, and docs/policies.md lists the bounds the code has."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from policies.params import ParamError, ParamSpec, ParamValue
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"
ALL = [(name, cls) for registry in (BATCH_POLICIES, DISPATCH_POLICIES) for name, cls in registry.items()]


@pytest.mark.parametrize(("name", "cls"), ALL, ids=[name for name, _ in ALL])
def test_every_numeric_parameter_has_a_range_and_every_integer_a_finite_one(name: str, cls: type) -> None:
    for spec in cls.params_schema:
        if spec.type not in ("int", "float"):
            continue
        assert spec.min is not None and spec.max is not None, f"{name}.{spec.name} has no range"
        assert spec.min <= spec.default <= spec.max, f"{name}.{spec.name}"
        if spec.type == "int":
            assert math.isfinite(spec.min) and math.isfinite(spec.max), f"{name}.{spec.name}"
            assert spec.max <= 1 << 24, f"{name}.{spec.name}: a maximum far beyond any real setting"
            with pytest.raises(ParamError, match="above the maximum"):
                spec.coerce(2**63 - 1)


def test_a_spec_without_bounds_or_with_a_bad_default_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="needs a min and a max"):
        ParamSpec("budget", "int", 0, "tokens", min=0)
    with pytest.raises(ValueError, match="needs a min and a max"):
        ParamSpec("weight", "float", 1.0, "x", max=2.0)
    with pytest.raises(ValueError, match="finite"):
        ParamSpec("budget", "int", 0, "tokens", min=0, max=math.inf)
    with pytest.raises(ValueError, match="default"):
        ParamSpec("budget", "int", 10, "tokens", min=0, max=8)
    with pytest.raises(ValueError, match="default"):
        ParamSpec("mode", "str", "fast", "x", choices=("slow",))
    assert ParamSpec("frac", "float", 0.5, "x", min=0.0, max=math.inf).coerce("inf") == math.inf


INT = ParamSpec("n", "int", 8, "count", min=0, max=1 << 20)
FLOAT = ParamSpec("w", "float", 0.5, "weight", min=0.0, max=10.0)


@pytest.mark.parametrize(("spec", "raw", "value"), [
    (INT, 12, 12), (INT, 12.0, 12), (INT, "12", 12), (INT, " 12 ", 12), (INT, "12.0", 12), (INT, "1.2e1", 12),
    (FLOAT, "0.5", 0.5), (FLOAT, 2, 2.0), (FLOAT, " 1e-1 ", 0.1),
])
def test_numbers_and_numeric_strings_become_the_schemas_type(spec: ParamSpec, raw: ParamValue, value: object) -> None:
    coerced = spec.coerce(raw)
    assert coerced == value and type(coerced) is type(value)


@pytest.mark.parametrize(("spec", "raw"), [
    (INT, 12.5), (INT, "12.5"), (INT, "12.0000000000000001"), (INT, "0x10"), (INT, True), (INT, "inf"),
    (INT, "nan"), (INT, "1" * 5000), (INT, 1e300), (INT, 1 << 21), (INT, -1),
    (FLOAT, "nan"), (FLOAT, "inf"), (FLOAT, "lots"), (FLOAT, True), (FLOAT, 10**400), (FLOAT, 10.5),
    (ParamSpec("mode", "str", "a", "x", choices=("a", "b")), 1),
], ids=lambda v: str(v)[:24])
def test_anything_else_is_refused_in_a_short_message(spec: ParamSpec, raw: ParamValue) -> None:
    with pytest.raises(ParamError) as info:
        spec.coerce(raw)
    assert len(str(info.value)) < 120


def bounds_table() -> str:
    """The table of docs/policies.md ("Parameters and their bounds"), as the registry says it."""
    rows = ["| policy | parameter | type | default | range | unit | changes |", "|---|---|---|---|---|---|---|"]
    for name, cls in ALL:
        for spec in cls.params_schema:
            if spec.type in ("int", "float"):
                span = spec.describe_range()
            elif spec.type == "bool":
                span = "true, false"
            else:
                span = ", ".join(spec.choices) or "any"
            default = str(spec.default).lower() if isinstance(spec.default, bool) else str(spec.default)
            rows.append(f"| `{name}` | `{spec.name}` | {spec.type} | {default} | {span} | {spec.unit} | "
                        f"{'live' if spec.live else 'restart'} |")
    return "\n".join(rows) + "\n"


def test_the_docs_list_every_parameters_bounds() -> None:
    assert bounds_table() in DOCS.read_text(), (
        "docs/policies.md's parameter table is out of date; regenerate it with "
        "python -c 'import sys; sys.path.insert(0, \"tests/policies\"); import test_param_schema as t; "
        "print(t.bounds_table())'"
    )
