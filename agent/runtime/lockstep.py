"""Lockstep groups of a simulated node (:class:`agent.runtime.node.Node`): which units step together as one instance
(seed 000's DP+EP instances), given as unit ids and checked before the node starts."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def lockstep_groups_of(unit_ids: Collection[int], lockstep: bool,
                       groups: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...]:
    """The groups as unit ids: one group of every unit with ``lockstep``, none without, else ``groups`` checked
    (known units, none in two groups, no empty group); ``ValueError`` for both or a bad group."""
    if groups is None:
        return (tuple(unit_ids),) if lockstep else ()
    if lockstep:
        raise ValueError("give lockstep=True (one group of every unit) or lockstep_groups, not both")
    out = tuple(tuple(members) for members in groups)
    flat = [unit_id for ids in out for unit_id in ids]
    if not all(out):
        raise ValueError("a lockstep group needs at least one unit")
    if unknown := [u for u in flat if u not in unit_ids]:
        raise ValueError(f"lockstep groups name unit {unknown[0]}, which the node does not have")
    if len(set(flat)) < len(flat):
        raise ValueError(f"unit {next(u for u in flat if flat.count(u) > 1)} is in two lockstep groups")
    return out
