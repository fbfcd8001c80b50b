"""The policy registry: every batch and dispatch policy by name, with its parameter schema.

The built-in policies are registered here; policies from other packages (plugins, ``docs/extending.md``) are added
beside them through :func:`add_policy` after :func:`check_policy_class` has checked that they keep the policy
contract. Finding those packages is I/O and happens outside this pure package (``agent.plugins``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Final, Literal

from policies.base import BatchPolicy, DispatchPolicy
from policies.batch.exclusive import ExclusiveBatching
from policies.batch.fairbatching import FairBatching, FairBatchingPab
from policies.batch.hybrid import HybridEB
from policies.batch.sarathi import Sarathi
from policies.batch.static import StaticBatching
from policies.batch.vllm_default import VllmDefault
from policies.dispatch.baseline import LeastLoaded, RoundRobin
from policies.dispatch.cascade import CascadeInfer
from policies.dispatch.pab import PabBalancer
from policies.dispatch.sbs import StaggeredBatch
from policies.params import MAX_CONTEXT_TOKENS, ParamSpec, ParamValue

BATCH_POLICIES: dict[str, type[BatchPolicy]] = {
    cls.name: cls
    for cls in (StaticBatching, VllmDefault, Sarathi, FairBatching, FairBatchingPab, ExclusiveBatching, HybridEB)
}
DISPATCH_POLICIES: dict[str, type[DispatchPolicy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, StaggeredBatch, PabBalancer, CascadeInfer)
}

BUILTIN_POLICIES: Final[frozenset[str]] = frozenset(BATCH_POLICIES) | frozenset(DISPATCH_POLICIES)
"""The names of the policies that ship with trackside: a plugin may take none of them."""

PolicyKind = Literal["batch", "dispatch"]

POLICY_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]{0,63}")
"""What a policy name may be (it is typed on command lines, in ``--compare A,B`` lists and ``--param POLICY.NAME=V``):
a letter or digit, then up to 63 letters, digits, ``_``, ``+`` or ``-``."""


class UnknownPolicyError(ValueError):
    """A policy name that is not registered."""


class PolicyContractError(ValueError):
    """A class offered as a policy that breaks the policy contract (``docs/extending.md``); the message says how."""


def check_policy_class(obj: object) -> PolicyKind:
    """The kind of policy ``obj`` is, once checked against the contract every registered policy keeps (the built-ins
    too: ``tests/policies/test_policy_contract.py``).

    ``obj`` must be a concrete subclass of :class:`BatchPolicy` or :class:`DispatchPolicy` (not both) with a ``name``
    that :data:`POLICY_NAME` accepts, a one-line ``summary``, a ``params_schema`` that is a tuple of
    :class:`~policies.params.ParamSpec` with distinct names (a spec checks its own range and default when it is
    built), integer bounds within ``MAX_CONTEXT_TOKENS`` either way, and it must build with its defaults (``cls()``).
    Raises :class:`PolicyContractError` saying what is wrong.
    """
    if not isinstance(obj, type):
        raise PolicyContractError(f"{obj!r} is not a class: a policy is a BatchPolicy or DispatchPolicy subclass")
    batch, dispatch = issubclass(obj, BatchPolicy), issubclass(obj, DispatchPolicy)
    if batch == dispatch:
        what = "both a BatchPolicy and a DispatchPolicy" if batch else "neither a BatchPolicy nor a DispatchPolicy"
        raise PolicyContractError(f"{obj.__qualname__} is {what} subclass")
    kind: PolicyKind = "batch" if batch else "dispatch"
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ()))) or "?"
        raise PolicyContractError(f"{obj.__qualname__} does not implement {missing}")
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not POLICY_NAME.fullmatch(name):
        raise PolicyContractError(f"{obj.__qualname__} has no usable name ({name!r}): give it a class attribute "
                                  "name of letters, digits, _, + or - (at most 64)")
    summary = getattr(obj, "summary", None)
    if not isinstance(summary, str) or not summary.strip() or "\n" in summary:
        raise PolicyContractError(f"{name}: summary must be one line of text (what `trackside policies` shows)")
    _check_schema(name, getattr(obj, "params_schema", None))
    try:
        obj()
    except Exception as exc:  # the policy's own code: whatever it raises breaks the contract
        raise PolicyContractError(f"{name} cannot be built with its default parameters: "
                                  f"{type(exc).__name__}: {exc}") from None
    return kind


def _check_schema(name: str, schema: object) -> None:
    if not isinstance(schema, tuple) or not all(isinstance(spec, ParamSpec) for spec in schema):
        raise PolicyContractError(f"{name}: params_schema must be a tuple of ParamSpec")
    seen: set[str] = set()
    for spec in schema:
        if spec.name in seen:
            raise PolicyContractError(f"{name}: parameter {spec.name} is declared twice")
        seen.add(spec.name)
        if spec.type == "int" and max(abs(spec.min or 0), abs(spec.max or 0)) > MAX_CONTEXT_TOKENS:
            raise PolicyContractError(f"{name}: parameter {spec.name}'s range [{spec.describe_range()}] goes beyond "
                                      f"±{MAX_CONTEXT_TOKENS} (policies.params.MAX_CONTEXT_TOKENS)")


def add_policy(cls: type[BatchPolicy] | type[DispatchPolicy]) -> PolicyKind:
    """Register a policy class beside the built-in ones, after :func:`check_policy_class`; its kind.

    Names are one namespace across both kinds (``--param POLICY.NAME=V`` finds a policy by name alone): a name that
    any registered policy has raises :class:`PolicyContractError`, unless it is this very class (nothing changes).
    """
    kind = check_policy_class(cls)
    holder = BATCH_POLICIES.get(cls.name) or DISPATCH_POLICIES.get(cls.name)
    if holder is cls:
        return kind
    if holder is not None:
        what = "a built-in policy" if cls.name in BUILTIN_POLICIES else f"the policy of {holder.__module__}"
        raise PolicyContractError(f"the name {cls.name!r} is taken by {what}")
    if issubclass(cls, BatchPolicy):
        BATCH_POLICIES[cls.name] = cls
    else:
        DISPATCH_POLICIES[cls.name] = cls
    return kind


def batch_policy_class(name: str) -> type[BatchPolicy]:
    try:
        return BATCH_POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown batch policy {name!r} (known: {', '.join(sorted(BATCH_POLICIES))})"
        ) from None


def dispatch_policy_class(name: str) -> type[DispatchPolicy]:
    try:
        return DISPATCH_POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown dispatch policy {name!r} (known: {', '.join(sorted(DISPATCH_POLICIES))})"
        ) from None


def make_batch_policy(name: str, params: Mapping[str, ParamValue] | None = None) -> BatchPolicy:
    """A new, validated instance of batch policy ``name``."""
    return batch_policy_class(name)(params)


def make_dispatch_policy(name: str, params: Mapping[str, ParamValue] | None = None) -> DispatchPolicy:
    """A new, validated instance of dispatch policy ``name``."""
    return dispatch_policy_class(name)(params)
