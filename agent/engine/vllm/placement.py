"""Which GPUs each vLLM unit runs on, and its share of their memory (pure: no vLLM, no CUDA).

A unit is one engine of ``tensor_parallel_size × pipeline_parallel_size`` GPUs (its *group*). Given GPUs
(``--gpus 0-7``), the list is cut into consecutive groups and, by default, each group runs one unit with 0.9 of its
memory: 8 GPUs at TP 4 make 2 units on ``[0..3]`` and ``[4..7]``. More units than groups share them (unit ``i``
on group ``i % groups``) only with an explicit memory share per unit, and no GPU may be promised more than all of
its memory. Without GPUs named every unit runs on vLLM's default device (the first TP×PP visible GPUs) and the
units split 0.9 of its memory, as ``trackside agent`` always did.

GPU numbers are those of the agent's machine as CUDA numbers them: with ``CUDA_VISIBLE_DEVICES`` set they index
the GPUs it lists, as vLLM's own ``device_ids`` do (``vllm/engine/arg_utils.py``, ``_resolve_device_ids``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

DEDICATED_SHARE = 0.9
"""A unit's default share of the memory of GPUs it has to itself (vLLM's default)."""
MAX_GPU_ID = 4095


class PlacementError(ValueError):
    """A GPU list or a layout that cannot run (the message names the flag and what to change)."""


@dataclass(frozen=True, slots=True)
class UnitPlacement:
    """Where one unit runs."""

    unit_id: int
    gpu_ids: tuple[int, ...]
    """Its GPUs, one per TP×PP rank, in rank order; empty on the CPU (the fake executor)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = DEDICATED_SHARE
    """The share of each of its GPUs' memory the engine may take."""
    explicit: bool = False
    """Whether the GPUs were named (``--gpus``: the engine gets them as ``device_ids``) or are vLLM's default."""


def parse_gpus(spec: str, visible: Callable[[], int] | None = None) -> tuple[int, ...]:
    """``all``, ``0-7``, ``0,2,4`` or ``0-3,6`` as GPU numbers, in the order given. ``all`` asks ``visible`` (by
    default :func:`visible_gpu_count`) how many there are."""
    text = spec.strip()
    if text == "all":
        count = (visible or visible_gpu_count)()
        if count < 1:
            raise PlacementError("--gpus all: no GPU is visible on this machine (NVML finds none); name them, "
                                 "e.g. --gpus 0-7")
        return tuple(range(count))
    out: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise PlacementError(f"--gpus {spec}: {part.strip() or 'an empty item'!r} is not a GPU number or a "
                                 "range A-B (the form: all, 0-7, 0,2,4)")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo or hi > MAX_GPU_ID:
            raise PlacementError(f"--gpus {spec}: {part.strip()!r} is not a range of GPU numbers")
        out.extend(range(lo, hi + 1))
    repeated = sorted({g for g in out if out.count(g) > 1})
    if repeated:
        raise PlacementError(f"--gpus {spec}: GPU {', '.join(map(str, repeated))} named twice")
    return tuple(out)


def visible_gpu_count() -> int:
    """GPUs this process may use, without initialising CUDA: the entries of ``CUDA_VISIBLE_DEVICES`` when it is
    set, else NVML's count (0 when NVML is missing or finds no GPU)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([x for x in listed.split(",") if x.strip()])
    try:
        # vLLM's way to NVML (the nvidia-ml-py bindings it depends on): reads the driver, creates no CUDA context.
        from vllm.utils.import_utils import import_pynvml

        pynvml = import_pynvml()
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: nothing visible
        return 0


def place_units(
    gpu_ids: tuple[int, ...] | None, *, units: int | None = None, tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
    unit_shares: Mapping[int, float] | None = None,
) -> tuple[UnitPlacement, ...]:
    """Each unit's GPUs and memory share (see the module's docstring); raises :class:`PlacementError`.

    ``gpu_ids`` None: vLLM's default device for every unit. ``units`` None: one per group of named GPUs (1 without
    GPUs). ``gpu_memory_utilization`` is every unit's share, ``unit_shares`` one unit's (it wins)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise PlacementError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    if units is not None and units < 1:
        raise PlacementError("--units must be >= 1")
    world = tp * pp
    per_unit = dict(unit_shares or {})
    if gpu_ids is None:
        n = units or 1
        groups = [tuple(range(world))]
        default = round(DEDICATED_SHARE / n, 3)
    else:
        if len(gpu_ids) % world:
            raise PlacementError(f"--gpus names {len(gpu_ids)} GPUs: not a multiple of the {world} a unit takes "
                                 f"(tensor parallel {tp} × pipeline parallel {pp})")
        groups = [gpu_ids[i:i + world] for i in range(0, len(gpu_ids), world)]
        n = units or len(groups)
        if n < len(groups):
            raise PlacementError(f"--units {n} × {world} GPUs each uses {n * world} of the {len(gpu_ids)} GPUs "
                                 f"--gpus names: name only those, or leave out --units (one unit per "
                                 f"{world} GPUs)")
        shared = n > len(groups)
        if shared and gpu_memory_utilization is None and any(i not in per_unit for i in range(n)):
            raise PlacementError(
                f"--units {n} × {world} GPUs each needs {n * world} GPUs and --gpus names {len(gpu_ids)}: units "
                "share a GPU only with an explicit --gpu-memory-utilization (each unit's share of the memory; the "
                "shares on one GPU add up to at most 1)")
        default = DEDICATED_SHARE
    check_unit_ids(per_unit, n)
    out = []
    for i in range(n):
        share = per_unit.get(i, gpu_memory_utilization if gpu_memory_utilization is not None else default)
        if not 0 < share <= 1:
            raise PlacementError(f"unit {i}: --gpu-memory-utilization is each unit's share of the GPU memory: "
                                 f"in (0, 1], not {share:g}")
        out.append(UnitPlacement(unit_id=i, gpu_ids=groups[i % len(groups)], tensor_parallel_size=tp,
                                 pipeline_parallel_size=pp, gpu_memory_utilization=share,
                                 explicit=gpu_ids is not None))
    check_memory(out)
    return tuple(out)


def check_unit_ids(unit_ids: Iterable[int], units: int) -> None:
    """Refuse a setting for a unit the node does not have."""
    beyond = sorted(i for i in unit_ids if not 0 <= i < units)
    if beyond:
        raise PlacementError(f"a setting for unit {beyond[0]}, but the node has {units} unit"
                             f"{'s' if units != 1 else ''} (0 to {units - 1})")


def check_memory(placements: list[UnitPlacement] | tuple[UnitPlacement, ...]) -> None:
    """Refuse a layout that promises a GPU more than all of its memory."""
    on: dict[int, list[UnitPlacement]] = {}
    for p in placements:
        for g in p.gpu_ids:
            on.setdefault(g, []).append(p)
    for gpu, units in sorted(on.items()):
        total = sum(p.gpu_memory_utilization for p in units)
        if total > 1 + 1e-9:
            shares = " + ".join(f"{p.gpu_memory_utilization:g}" for p in units)
            names = ", ".join(str(p.unit_id) for p in units)
            raise PlacementError(f"GPU {gpu} over-committed: units {names} would take {shares} = {total:.3g} of its "
                                 "memory (at most 1): lower --gpu-memory-utilization or give the units more GPUs")


def fake_placements(units: int | None) -> tuple[UnitPlacement, ...]:
    """The fake executor's units: on the CPU, no GPU."""
    n = units or 1
    if n < 1:
        raise PlacementError("--units must be >= 1")
    return tuple(UnitPlacement(unit_id=i, gpu_ids=(), gpu_memory_utilization=round(DEDICATED_SHARE / n, 3))
                 for i in range(n))
