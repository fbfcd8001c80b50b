"""The policy registry: every batch and dispatch policy by name, with its parameter schema."""

from __future__ import annotations

from collections.abc import Mapping

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
from policies.params import ParamValue

BATCH_POLICIES: dict[str, type[BatchPolicy]] = {
    cls.name: cls
    for cls in (StaticBatching, VllmDefault, Sarathi, FairBatching, FairBatchingPab, ExclusiveBatching, HybridEB)
}
DISPATCH_POLICIES: dict[str, type[DispatchPolicy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, StaggeredBatch, PabBalancer, CascadeInfer)
}


class UnknownPolicyError(ValueError):
    """A policy name that is not registered."""


def register_batch(cls: type[BatchPolicy]) -> type[BatchPolicy]:
    """Add a batch policy class (usable as a decorator, e.g. by a custom policy module)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    BATCH_POLICIES[cls.name] = cls
    return cls


def register_dispatch(cls: type[DispatchPolicy]) -> type[DispatchPolicy]:
    """Add a dispatch policy class."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    DISPATCH_POLICIES[cls.name] = cls
    return cls


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
