"""Policy plugins: batch and dispatch policies from other installed packages, registered beside the built-in ones.

A package offers policies in the ``trackside.policies`` entry-point group, one entry point per policy class, named as
the policy is (its class attribute ``name``)::

    [project.entry-points."trackside.policies"]
    short_first = "custom_policy.batch:ShortFirst"

:func:`load_plugins` finds them with ``importlib.metadata`` (the distributions installed where ``sys.path`` looks),
imports each, checks it against the policy contract (:func:`policies.registry.check_policy_class`) and registers it
(:func:`policies.registry.add_policy`). The pure registry does no I/O: this module reads the installed packages, and
every process that resolves policy names calls it once, before the first name: ``trackside`` (for ``bench``,
``policies`` and ``agent``) and the policy scheduler in vLLM's engine-core process, a process of its own.

A plugin that cannot be imported or breaks the contract (not a policy class, no usable name, a bad schema, a name that
a built-in policy or another plugin has) is skipped with one line that says which and why (:class:`SkippedPlugin`);
the others load. Two plugins that claim one name are both skipped: which one ran would depend on install order.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from policies.base import BatchPolicy, DispatchPolicy
from policies.registry import BUILTIN_POLICIES, PolicyContractError, PolicyKind, add_policy, check_policy_class

GROUP: Final = "trackside.policies"
"""The entry-point group policy plugins are declared in."""

_MAX_REASON = 300
"""Characters of an exception's message kept in a skipped plugin's line."""


@dataclass(frozen=True, slots=True)
class LoadedPlugin:
    """A plugin policy that was registered."""

    name: str
    kind: PolicyKind
    value: str
    """The entry point's object reference, ``module:Class``."""
    distribution: str
    """The installed distribution that declares it, ``name version``."""


@dataclass(frozen=True, slots=True)
class SkippedPlugin:
    """A plugin entry point that was not registered, and why."""

    name: str
    value: str
    distribution: str
    reason: str

    def __str__(self) -> str:
        """The one line that reports it."""
        if not self.name:  # the distribution's entry points could not be read at all
            return f"policy plugins of {self.distribution} skipped: {self.reason}"
        return f"policy plugin {self.name!r} ({self.value} from {self.distribution}) skipped: {self.reason}"


@dataclass(frozen=True, slots=True)
class PluginReport:
    """What one search for plugins found."""

    loaded: tuple[LoadedPlugin, ...] = ()
    skipped: tuple[SkippedPlugin, ...] = ()

    def origin(self, name: str) -> LoadedPlugin | None:
        """The plugin that registered policy ``name`` (None: a built-in policy, or no such policy)."""
        return next((p for p in self.loaded if p.name == name), None)


def find_entry_points() -> tuple[list[importlib.metadata.EntryPoint], list[SkippedPlugin]]:
    """Every entry point of :data:`GROUP` among the installed distributions (the first of a distribution found twice
    on ``sys.path``), in a stable order (by name, then distribution); and the distributions whose entry points could
    not be read (a malformed ``entry_points.txt``), as skipped plugins without a name."""
    try:
        found = list(importlib.metadata.entry_points(group=GROUP))
        unreadable: list[SkippedPlugin] = []
    except Exception:  # one broken distribution fails the whole scan: read them one by one to name it
        found, unreadable = _each_distribution()
    return sorted(found, key=lambda ep: (ep.name, _distribution(ep), ep.value)), unreadable


def _each_distribution() -> tuple[list[importlib.metadata.EntryPoint], list[SkippedPlugin]]:
    found: list[importlib.metadata.EntryPoint] = []
    unreadable: list[SkippedPlugin] = []
    seen: set[str] = set()
    for dist in importlib.metadata.distributions():
        try:
            name, version = dist.name, dist.version
        except Exception:  # no readable metadata either: not a distribution anything could load
            continue
        key = re.sub(r"[-_.]+", "-", name or "").lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            found.extend(dist.entry_points.select(group=GROUP))
        except Exception as exc:
            unreadable.append(SkippedPlugin(name="", value="", distribution=f"{name} {version}",
                                            reason=f"cannot read its entry points: {_one_line(exc)}"))
    return found, unreadable


def register_plugins(entry_points: Iterable[importlib.metadata.EntryPoint]) -> PluginReport:
    """Import, check and register the policies ``entry_points`` name; what was registered and what was skipped."""
    skipped: list[SkippedPlugin] = []
    found: list[tuple[importlib.metadata.EntryPoint, type[BatchPolicy] | type[DispatchPolicy]]] = []
    for ep in entry_points:
        try:
            obj = ep.load()
        except Exception as exc:  # anything a plugin's import raises, a schema's ValueError included
            skipped.append(_skip(ep, f"cannot import it: {_one_line(exc)}"))
            continue
        try:
            check_policy_class(obj)
        except PolicyContractError as exc:
            skipped.append(_skip(ep, _one_line(exc, with_type=False)))
            continue
        cls: type[BatchPolicy] | type[DispatchPolicy] = obj  # checked just above
        if cls.name != ep.name:
            skipped.append(_skip(ep, f"the entry point is named {ep.name!r} but the class's name is {cls.name!r}: "
                                     "name the entry point as the policy"))
            continue
        found.append((ep, cls))
    claims: dict[str, list[importlib.metadata.EntryPoint]] = defaultdict(list)
    for ep, _ in found:
        claims[ep.name].append(ep)
    loaded: list[LoadedPlugin] = []
    for ep, cls in found:
        rivals = [f"{other.value} from {_distribution(other)}" for other in claims[ep.name] if other is not ep]
        if ep.name in BUILTIN_POLICIES:
            skipped.append(_skip(ep, f"{ep.name!r} is the name of a built-in policy"))
            continue
        if rivals:
            skipped.append(_skip(ep, f"{ep.name!r} is claimed by {', '.join(rivals)} too: both skipped"))
            continue
        try:
            kind = add_policy(cls)
        except PolicyContractError as exc:  # a policy registered in-process under this name
            skipped.append(_skip(ep, _one_line(exc, with_type=False)))
            continue
        loaded.append(LoadedPlugin(name=ep.name, kind=kind, value=ep.value, distribution=_distribution(ep)))
    return PluginReport(loaded=tuple(loaded), skipped=tuple(skipped))


_report: PluginReport | None = None
"""This process's plugins, once searched."""


def load_plugins(warn: Callable[[str], object] | None = None) -> PluginReport:
    """Find and register the installed policy plugins, once per process (later calls return the first report).

    ``warn`` gets one line per skipped plugin, on the first call only (e.g. ``print`` to stderr, or a logger's
    ``warning``).
    """
    global _report
    if _report is None:
        entry_points, unreadable = find_entry_points()
        report = register_plugins(entry_points)
        _report = PluginReport(loaded=report.loaded, skipped=(*unreadable, *report.skipped))
        if warn is not None:
            for skipped in _report.skipped:
                warn(str(skipped))
    return _report


def _distribution(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return "an unknown distribution" if dist is None else f"{dist.name} {dist.version}"


def _skip(ep: importlib.metadata.EntryPoint, reason: str) -> SkippedPlugin:
    return SkippedPlugin(name=ep.name, value=ep.value, distribution=_distribution(ep), reason=reason)


def _one_line(exc: BaseException, *, with_type: bool = True) -> str:
    """An exception as one line of at most ``_MAX_REASON`` characters."""
    text = " ".join(str(exc).split()) or "(no message)"
    if with_type:
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."
