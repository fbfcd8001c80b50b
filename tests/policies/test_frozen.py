"""``policies.frozen.fast_init``: the same frozen dataclass, built faster."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from policies.frozen import fast_init


@dataclasses.dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str = "b"
    c: dict[str, int] = dataclasses.field(default_factory=dict)


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class Fast:
    a: int
    b: str = "b"
    c: dict[str, int] = dataclasses.field(default_factory=dict)


def test_the_signature_and_the_instances_are_the_dataclass_ones() -> None:
    assert str(inspect.signature(Fast)) == str(inspect.signature(Plain))
    for args, kwargs in [((1,), {}), ((1, "x"), {}), ((), {"a": 2, "c": {"k": 1}}), ((3,), {"b": "y"})]:
        fast, plain = Fast(*args, **kwargs), Plain(*args, **kwargs)  # type: ignore[arg-type]
        assert dataclasses.astuple(fast) == dataclasses.astuple(plain)
    assert Fast(1) == Fast(1) and Fast(1) != Fast(2)
    assert Fast(1).c is not Fast(1).c, "a default factory runs for every instance"
    assert dataclasses.replace(Fast(1, "x"), a=5) == Fast(5, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fast(1).a = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        Fast()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Fast(1, d=2)  # type: ignore[call-arg]


def test_what_it_cannot_reproduce_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    for cls in (NoSlots, PostInit, KeywordOnly, Mutable):
        with pytest.raises(TypeError):
            fast_init(cls)
