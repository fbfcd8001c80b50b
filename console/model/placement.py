"""Where units run: their GPUs and parallel sizes (from the hello's ``UnitStatus``), as short labels.

Pure: the Overview's GPU column (:func:`gpu_label`: ``0,1 TP2``, ``0-3 TP4 PP2``) and the Heatmap's row labels
(:func:`unit_gpus`: ``0-3``). A simulated unit has no GPUs and gets an empty label, so a simulated fleet looks as
it did before placements were shown.
"""

from __future__ import annotations

from collections.abc import Sequence

from console.model.records import NodeInfo, UnitInfo
from console.model.state import ConsoleState


def gpu_ranges(gpu_ids: Sequence[int]) -> str:
    """GPU ids in their order, runs of three or more consecutive ascending ids as a range: ``0-3``, ``0,1``,
    ``4,6``, ``0-2,5``; "" for none."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(gpu_ids) + 1):
        if i < len(gpu_ids) and gpu_ids[i] == gpu_ids[i - 1] + 1:
            continue
        run = gpu_ids[start:i]
        if len(run) >= 3:
            parts.append(f"{run[0]}-{run[-1]}")
        else:
            parts.extend(str(g) for g in run)
        start = i
    return ",".join(parts)


def gpu_label(gpu_ids: Sequence[int], tensor_parallel_size: int = 0, pipeline_parallel_size: int = 0) -> str:
    """A unit's placement in a few characters: its GPUs, then ``TP<n>`` and ``PP<n>`` where a size is above 1:
    ``0,1 TP2``, ``0-3 TP4 PP2``, ``3`` (one GPU); "" for a simulated unit (no GPUs, sizes 0 or 1)."""
    parts = [gpu_ranges(gpu_ids)] if gpu_ids else []
    if tensor_parallel_size > 1:
        parts.append(f"TP{tensor_parallel_size}")
    if pipeline_parallel_size > 1:
        parts.append(f"PP{pipeline_parallel_size}")
    return " ".join(parts)


def unit_label(unit: UnitInfo) -> str:
    """:func:`gpu_label` of a unit of the state."""
    return gpu_label(unit.gpu_ids, unit.tensor_parallel_size, unit.pipeline_parallel_size)


def node_label(node: NodeInfo) -> str:
    """Every GPU the node's units run on, sorted (``0-7``); "" for a simulated node."""
    return gpu_ranges(sorted({g for unit in node.units.values() for g in unit.gpu_ids}))


def unit_gpus(state: ConsoleState) -> dict[tuple[str, int], str]:
    """The :func:`gpu_ranges` of every unit that runs on GPUs, by ``(node_id, unit_id)`` (the Heatmap's labels)."""
    return {
        (node.node_id, unit_id): gpu_ranges(unit.gpu_ids)
        for node in state.nodes.values()
        for unit_id, unit in node.units.items()
        if unit.gpu_ids
    }


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, its last one ``…`` when cut."""
    if len(text) <= width:
        return text
    return text[: width - 1] + "…" if width > 0 else ""
