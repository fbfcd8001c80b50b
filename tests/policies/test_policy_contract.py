"""The policy contract a registered policy keeps (issue #18): every built-in keeps it, and a class offered as a plugin
that breaks it is refused with a message that says how, before it reaches the registry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import pytest

from policies.base import BatchPolicy, DispatchPolicy
from policies.batch.vllm_default import VllmDefault
from policies.dispatch.baseline import RoundRobin
from policies.params import ParamSpec
from policies.registry import (
    BATCH_POLICIES,
    BUILTIN_POLICIES,
    DISPATCH_POLICIES,
    PolicyContractError,
    add_policy,
    check_policy_class,
    make_batch_policy,
)
from policies.types import DispatchDecision, PendingRequest, StepPlan, UnitLoad, UnitView

ALL = [(name, cls) for registry in (BATCH_POLICIES, DISPATCH_POLICIES) for name, cls in registry.items()]


@pytest.fixture
def registries() -> Iterator[None]:
    """The registries as they were after the test."""
    batch, dispatch = dict(BATCH_POLICIES), dict(DISPATCH_POLICIES)
    yield
    BATCH_POLICIES.clear()
    BATCH_POLICIES.update(batch)
    DISPATCH_POLICIES.clear()
    DISPATCH_POLICIES.update(dispatch)


@pytest.mark.parametrize(("name", "cls"), ALL, ids=[name for name, _ in ALL])
def test_every_registered_policy_keeps_the_contract_plugins_are_held_to(
    name: str, cls: type[BatchPolicy] | type[DispatchPolicy]
) -> None:
    assert check_policy_class(cls) == ("batch" if name in BATCH_POLICIES else "dispatch")
    assert cls.name == name and name in BUILTIN_POLICIES


class Renamed(VllmDefault):
    name: ClassVar[str] = "renamed"
    summary: ClassVar[str] = "vllm under another name"


class NoName(VllmDefault):
    name: ClassVar[str] = ""


class CommaName(VllmDefault):
    name: ClassVar[str] = "a,b"


class NoSummary(VllmDefault):
    name: ClassVar[str] = "no_summary"
    summary: ClassVar[str] = ""


class Abstract(BatchPolicy):
    name: ClassVar[str] = "abstract"
    summary: ClassVar[str] = "never plans"


class Both(BatchPolicy, DispatchPolicy):
    name: ClassVar[str] = "both"
    summary: ClassVar[str] = "a batch and a dispatch policy at once"

    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        raise NotImplementedError

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        raise NotImplementedError


class SchemaNotSpecs(VllmDefault):
    name: ClassVar[str] = "schema_dicts"
    summary: ClassVar[str] = "a schema of dicts"
    params_schema = ({"name": "x", "type": "int"},)  # type: ignore[assignment]


class SchemaTwice(VllmDefault):
    name: ClassVar[str] = "schema_twice"
    summary: ClassVar[str] = "a parameter declared twice"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (*VllmDefault.params_schema, VllmDefault.params_schema[0])


class SchemaHuge(VllmDefault):
    name: ClassVar[str] = "schema_huge"
    summary: ClassVar[str] = "an integer bound far beyond any real setting"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (ParamSpec("n", "int", 0, "count", min=0, max=2**40),)


class BreaksOnBuild(RoundRobin):
    name: ClassVar[str] = "breaks_on_build"
    summary: ClassVar[str] = "configure() fails"

    def configure(self) -> None:
        raise RuntimeError("no state for you")


@pytest.mark.parametrize(("obj", "message"), [
    (object(), "is not a class"),
    (int, "neither a BatchPolicy nor a DispatchPolicy"),
    (Both, "both a BatchPolicy and a DispatchPolicy"),
    (Abstract, "does not implement plan"),
    (NoName, "has no usable name"),
    (CommaName, "has no usable name ('a,b')"),
    (NoSummary, "summary must be one line"),
    (SchemaNotSpecs, "params_schema must be a tuple of ParamSpec"),
    (SchemaTwice, "parameter max_num_batched_tokens is declared twice"),
    (SchemaHuge, "goes beyond"),
    (BreaksOnBuild, "cannot be built with its default parameters: RuntimeError: no state for you"),
], ids=lambda v: getattr(v, "__name__", str(v)[:20]))
def test_a_class_that_breaks_the_contract_is_refused_saying_how(obj: object, message: str) -> None:
    with pytest.raises(PolicyContractError) as info:
        check_policy_class(obj)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_checked_policy_is_added_beside_the_built_ins_once(registries: None) -> None:
    assert "renamed" not in BATCH_POLICIES
    assert add_policy(Renamed) == "batch"
    assert BATCH_POLICIES["renamed"] is Renamed and "renamed" not in DISPATCH_POLICIES
    assert make_batch_policy("renamed", {"max_num_batched_tokens": 64}).params["max_num_batched_tokens"] == 64
    assert add_policy(Renamed) == "batch"  # the same class again changes nothing


def test_a_name_taken_in_either_registry_is_refused(registries: None) -> None:
    class Clash(RoundRobin):
        name: ClassVar[str] = "vllm"  # a batch policy's name, offered as a dispatch policy
        summary: ClassVar[str] = "round robin"

    class Other(VllmDefault):
        name: ClassVar[str] = "renamed"
        summary: ClassVar[str] = "another renamed"

    with pytest.raises(PolicyContractError, match="'vllm' is taken by a built-in policy"):
        add_policy(Clash)
    add_policy(Renamed)
    with pytest.raises(PolicyContractError, match=f"'renamed' is taken by the policy of {__name__}"):
        add_policy(Other)
    assert "vllm" not in DISPATCH_POLICIES and BATCH_POLICIES["renamed"] is Renamed


def test_request_views_fields_keep_their_order() -> None:
    """The hot loops of ``vllm``, ``sarathi`` and ``fairbatching`` unpack a ``RequestView`` by position (one
    unpacking instead of up to nine field reads per request per step): a field added, removed or moved must update
    them, and this test with them."""
    from policies.types import RequestView

    assert RequestView._fields == ("request_id", "arrival_s", "prompt_tokens", "computed_tokens", "output_tokens",
                                   "ttft_slo_s", "tpot_slo_s", "first_token_s", "num_preemptions")
