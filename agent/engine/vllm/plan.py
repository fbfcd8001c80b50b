"""A node's vLLM units resolved before any engine starts: each unit's GPUs, memory share and engine arguments.

:func:`resolve` turns what the operator asked for (:class:`NodeRequest`: the ``trackside agent`` flags, the
``--engine-arg`` lines and a node config file's, already merged into one list) into a :class:`NodePlan`: per unit
its :class:`~agent.engine.vllm.placement.UnitPlacement` and the :class:`~agent.engine.vllm.options.EngineOptions` its
engine starts with. ``trackside agent --dry-run`` prints the plan (:func:`plan_json`); a real start runs it. No
engine starts and no CUDA is touched here; typing the engine arguments imports vLLM (its own parser).

Engine arguments apply in order, a later one over an earlier one, each to every unit or (``UNIT:KEY=VALUE``) to
one; a unit's own ``gpu_memory_utilization`` wins over the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.engine.vllm.engine_args import (
    FLAG_FIELDS,
    TRACKSIDE_SETS,
    EngineArg,
    EngineArgError,
    check_field,
    parse_engine_arg,
    shown,
    typed_values,
)
from agent.engine.vllm.options import EngineOptions, engine_kwargs
from agent.engine.vllm.placement import (
    PlacementError,
    UnitPlacement,
    check_unit_ids,
    fake_placements,
    parse_gpus,
    place_units,
)

FAKE_MODEL = "tiny-llama-fake"
"""The fake executor's model (its served name)."""
FAKE_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "async_scheduling", "enable_prefix_caching")
"""What the fake executor's CPU engine takes of the engine arguments (``agent.engine.vllm.cpu``)."""
SAME_ON_EVERY_UNIT = ("tensor_parallel_size", "pipeline_parallel_size", "tokenizer")
"""Engine fields every unit shares (the placement, the one tokenizer the OpenAI intake uses)."""
MAX_DEFAULT_MODEL_LEN = 16384


class PlanError(ValueError):
    """What was asked for cannot run (the message names the flag or engine argument)."""


@dataclass(frozen=True, slots=True)
class NodeRequest:
    """What the operator asked for (``trackside agent --engine vllm`` flags; None: not given)."""

    model: str | None = None
    fake_executor: bool = False
    units: int | None = None
    gpus: str | None = None
    """``all``, ``0-7``, ``0,2,4``; None: vLLM's default device, shared by every unit."""
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    load_format: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    model_max_len: int | None = None
    """The context length the model folder declares (None: unknown)."""
    enforce_eager: bool = False
    async_scheduling: bool = True
    tokenizer: bool = False
    engine_args: tuple[str, ...] = ()
    """``[UNIT:]KEY=VALUE``, in order (a node config file's first)."""
    visible_gpus: Callable[[], int] | None = None
    """How many GPUs ``--gpus all`` means (default: NVML's count)."""


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """One unit, resolved."""

    placement: UnitPlacement
    engine: EngineOptions
    args: tuple[EngineArg, ...] = ()
    """The engine arguments that apply to it, as given (to show JSON configs as written)."""

    @property
    def unit_id(self) -> int:
        return self.placement.unit_id


@dataclass(frozen=True, slots=True)
class NodePlan:
    """Every unit, resolved."""

    units: tuple[UnitPlan, ...]
    fake_executor: bool = False
    gpu_ids: tuple[int, ...] | None = None
    """The GPUs named (``--gpus``); None: vLLM's default device."""
    tokenizer: str | None = None
    """The tokenizer the engines load (a path or a Hugging Face name); None: token ids only."""
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def engines(self) -> tuple[EngineOptions, ...]:
        return tuple(u.engine for u in self.units)

    @property
    def placements(self) -> tuple[UnitPlacement, ...]:
        return tuple(u.placement for u in self.units)


def resolve(request: NodeRequest) -> NodePlan:
    """Each unit's GPUs, memory share and engine options; raises :class:`PlanError`."""
    try:
        return _resolve(request)
    except (EngineArgError, PlacementError) as exc:
        raise PlanError(str(exc)) from None


def _resolve(r: NodeRequest) -> NodePlan:
    args = [parse_engine_arg(item) for item in r.engine_args]
    for arg in args:
        _check(arg, r.fake_executor)
    unit_ids = sorted({a.unit_id for a in args if a.unit_id is not None})
    everyone = [a for a in args if a.unit_id is None]
    values = {i: typed_values([a for a in args if a.unit_id in (None, i)]) for i in unit_ids}
    common = typed_values(everyone)
    tp, pp = r.tensor_parallel_size or 1, r.pipeline_parallel_size or 1
    if r.fake_executor:
        if r.gpus is not None or tp > 1 or pp > 1:
            flag = "--gpus" if r.gpus is not None else "--tensor-parallel-size/--pipeline-parallel-size"
            raise PlanError(f"--fake-executor runs on the CPU, one process a unit: leave out {flag}")
        placements = fake_placements(r.units)
        gpu_ids = None
    else:
        gpu_ids = parse_gpus(r.gpus, r.visible_gpus) if r.gpus is not None else None
        shares = {i: float(v["gpu_memory_utilization"]) for i, v in values.items() if "gpu_memory_utilization" in v}
        placements = place_units(gpu_ids, units=r.units, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 gpu_memory_utilization=r.gpu_memory_utilization, unit_shares=shares)
    check_unit_ids(unit_ids, len(placements))
    warnings = []
    if not r.fake_executor and r.model_max_len is None and r.max_model_len is None:
        warnings.append(f"the model's context length is unknown here: max_model_len {MAX_DEFAULT_MODEL_LEN} "
                        "assumed (give --max-model-len)")
    units = []
    for p in placements:
        unit_args = tuple(a for a in args if a.unit_id in (None, p.unit_id))
        units.append(UnitPlan(p, _engine(r, p, dict(values.get(p.unit_id, common))), unit_args))
    loads_tokenizer = r.tokenizer or "tokenizer" in common
    tokenizer = str(common.get("tokenizer") or r.model) if loads_tokenizer else None
    if r.fake_executor and r.tokenizer:
        from agent.engine.vllm.cpu import tiny_model_dir

        tokenizer = tiny_model_dir()  # the tiny model's own (made here: agent.engine.vllm.tiny_tokenizer)
    return NodePlan(units=tuple(units), fake_executor=r.fake_executor, gpu_ids=gpu_ids, tokenizer=tokenizer,
                    warnings=tuple(warnings))


def _check(arg: EngineArg, fake: bool) -> None:
    check_field(arg)
    name = arg.field
    if name in TRACKSIDE_SETS:
        raise EngineArgError(f"--engine-arg {arg}: {name} is set by {TRACKSIDE_SETS[name]}")
    if name.startswith("data_parallel"):
        raise EngineArgError(f"--engine-arg {arg}: every unit is an engine of its own (trackside dispatches "
                             "between them): --units and --gpus place them")
    if arg.unit_id is None and name in FLAG_FIELDS:
        raise EngineArgError(f"--engine-arg {arg}: {name} has a flag of its own: {FLAG_FIELDS[name]} (in a node "
                             f"config file, the top-level key {name}); for one unit: --engine-arg UNIT:{name}=VALUE")
    if arg.unit_id is not None and name in SAME_ON_EVERY_UNIT:
        raise EngineArgError(f"--engine-arg {arg}: {name} is the same on every unit")
    if fake and name not in FAKE_FIELDS:
        raise EngineArgError(f"--engine-arg {arg}: the fake executor's CPU engine takes only {', '.join(FAKE_FIELDS)}")


def _engine(r: NodeRequest, p: UnitPlacement, values: dict[str, Any]) -> EngineOptions:
    fake = r.fake_executor
    model_len = 4096 if fake else min(MAX_DEFAULT_MODEL_LEN, r.model_max_len or MAX_DEFAULT_MODEL_LEN)
    values.pop("gpu_memory_utilization", None)  # placed already (p.gpu_memory_utilization)
    extra = dict(values)
    own = {name: extra.pop(name) for name in list(extra) if name in EngineOptions.__dataclass_fields__}
    if not fake:
        extra["tensor_parallel_size"] = p.tensor_parallel_size
        extra["pipeline_parallel_size"] = p.pipeline_parallel_size
        if p.explicit:
            extra["device_ids"] = list(p.gpu_ids)
    if r.tokenizer or "tokenizer" in values:
        extra["skip_tokenizer_init"] = False
    return EngineOptions(
        model=r.model or FAKE_MODEL,
        load_format=own.get("load_format", r.load_format),
        gpu_memory_utilization=p.gpu_memory_utilization,
        max_num_batched_tokens=own.get("max_num_batched_tokens", r.max_num_batched_tokens or (2048 if fake else 8192)),
        max_num_seqs=own.get("max_num_seqs", r.max_num_seqs or (64 if fake else 512)),
        max_model_len=own.get("max_model_len", r.max_model_len or model_len),
        enforce_eager=own.get("enforce_eager", r.enforce_eager),
        async_scheduling=own.get("async_scheduling", r.async_scheduling),
        enable_prefix_caching=own.get("enable_prefix_caching", True),
        attention_backend=own.get("attention_backend"),
        extra=extra,
    )


def plan_json(plan: NodePlan, fake_num_blocks: int = 1024) -> dict[str, Any]:
    """The plan as ``--dry-run`` prints it: per unit its GPUs, parallel sizes, memory share and every engine
    argument its engine starts with (``additional_config``, which carries the unit's policy settings and channel
    addresses, is made at the start)."""
    units = []
    for u in plan.units:
        p = u.placement
        if plan.fake_executor:
            e = u.engine
            args: dict[str, Any] = {
                "device": "cpu", "executor": "fake", "model": FAKE_MODEL, "num_blocks": fake_num_blocks,
                **{name: getattr(e, name) for name in FAKE_FIELDS},
            }
        else:
            args = {k: shown(k, v, u.args) for k, v in engine_kwargs(u.engine).items()}
        units.append({
            "unit": p.unit_id, "gpus": list(p.gpu_ids), "tensor_parallel_size": p.tensor_parallel_size,
            "pipeline_parallel_size": p.pipeline_parallel_size,
            "gpu_memory_utilization": None if plan.fake_executor else p.gpu_memory_utilization, "engine_args": args,
        })
    return {
        "units": units,
        "gpus": None if plan.gpu_ids is None else list(plan.gpu_ids),
        "tokenizer": plan.tokenizer,
        "fake_executor": plan.fake_executor,
        "warnings": list(plan.warnings),
    }

