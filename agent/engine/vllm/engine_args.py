"""Engine arguments as the operator gives them (``--engine-arg [UNIT:]KEY=VALUE``), typed by vLLM's own parser.

Any field of ``vllm.AsyncEngineArgs`` that ``vllm serve`` takes is an engine argument; its value is parsed by the
argument parser vLLM builds for it (``AsyncEngineArgs.add_cli_args``), so types, choices, human-readable numbers
(``32k``), JSON configs and dotted keys (``compilation_config.mode=3``) are exactly ``vllm serve``'s. ``true`` and
``false`` turn a switch on and off (``--KEY`` / ``--no-KEY``); a JSON list gives a list field its items.

Some fields are trackside's to set: :data:`TRACKSIDE_SETS` names the flag that sets each instead, and
:data:`FLAG_FIELDS` are the fields that have a ``trackside agent`` flag of their own.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

FLAG_FIELDS: dict[str, str] = {
    name: "--" + name.replace("_", "-") for name in (
        "load_format", "gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
        "enforce_eager", "async_scheduling", "tensor_parallel_size", "pipeline_parallel_size",
    )
}
"""Engine fields with a ``trackside agent`` flag of their own (for every unit); per unit, an engine argument."""

TRACKSIDE_SETS: dict[str, str] = {
    "model": "--model",
    "device_ids": "--gpus",
    "skip_tokenizer_init": "--tokenizer",
    "served_model_name": "--served-model-name",
    "scheduler_cls": "--batch-policy (trackside's policy scheduler)",
    "additional_config": "trackside (it carries each unit's policy settings)",
}
"""Fields trackside sets itself, and what sets them."""


class EngineArgError(ValueError):
    """An engine argument that is unknown, misspelt or of the wrong type (the message names it)."""


@dataclass(frozen=True, slots=True)
class EngineArg:
    """One ``[UNIT:]KEY=VALUE``."""

    key: str
    """The field, ``_`` for ``-``; a dotted key sets one entry of a JSON config (``compilation_config.mode``)."""
    text: str
    """The value as given."""
    unit_id: int | None = None
    """Only this unit (None: every unit)."""

    @property
    def field(self) -> str:
        """The ``AsyncEngineArgs`` field it sets."""
        return self.key.partition(".")[0]

    def __str__(self) -> str:
        unit = "" if self.unit_id is None else f"{self.unit_id}:"
        return f"{unit}{self.key}={self.text}"


def parse_engine_arg(item: str) -> EngineArg:
    """``KEY=VALUE`` or ``UNIT:KEY=VALUE`` (the key's ``-`` read as ``_``); raises :class:`EngineArgError`."""
    head, sep, text = item.partition("=")
    unit, colon, key = head.rpartition(":")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise EngineArgError(f"--engine-arg takes [UNIT:]KEY=VALUE, not {item!r}")
    if colon and not unit.strip().isdigit():
        raise EngineArgError(f"--engine-arg {item}: {unit!r} is not a unit number (UNIT:KEY=VALUE)")
    return EngineArg(key=key, text=text, unit_id=int(unit) if colon else None)


@cache
def known_fields() -> frozenset[str]:
    """The ``AsyncEngineArgs`` fields vLLM's parser takes."""
    return frozenset(vars(_parser().parse_args([])))


def check_field(arg: EngineArg) -> None:
    """Raise :class:`EngineArgError` for a key that is not an engine argument."""
    if arg.field not in known_fields():
        raise EngineArgError(f"--engine-arg {arg}: unknown engine argument {arg.key!r} (not a field of vLLM "
                             "0.26.0's AsyncEngineArgs that `vllm serve` takes; `vllm serve --help=all` lists them)")


def typed_values(args: Sequence[EngineArg]) -> dict[str, Any]:
    """The values of ``args`` as vLLM types them, by field; a later argument overrides an earlier one (entries of
    a JSON config given by dotted keys add up). Raises :class:`EngineArgError` naming the argument at fault."""
    if not args:
        return {}  # vLLM's parser is not even built
    tokens: list[str] = []
    for arg in args:
        check_field(arg)
        tokens += _tokens(arg)
    namespace = _parse(tokens, "--engine-arg: ")
    fields = dict.fromkeys(arg.field for arg in args)
    return {name: getattr(namespace, name) for name in fields}


def shown(field: str, value: Any, args: Sequence[EngineArg] = ()) -> Any:
    """``value`` as JSON can show it: scalars, lists and dicts as they are, enums by value; a config object (a
    JSON config vLLM parsed) as ``args`` gave it (their JSON, dotted keys as nested entries), else as text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return shown(field, value.value)
    if isinstance(value, list | tuple | set | frozenset):
        return [shown(field, v) for v in value]
    if isinstance(value, dict):
        return {str(k): shown(field, v) for k, v in value.items()}
    given: Any = None
    for arg in args:
        if arg.field != field:
            continue
        if "." not in arg.key:
            given = _json_or_text(arg.text)
            continue
        if not isinstance(given, dict):
            given = {}
        entry = given
        *path, last = arg.key.split(".")[1:]
        for name in path:
            entry = entry.setdefault(name, {})
        entry[last] = _json_or_text(arg.text)
    return given if given is not None else str(value)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# -- vLLM's parser ------------------------------------------------------------------------------------------
def _tokens(arg: EngineArg) -> list[str]:
    """The ``vllm serve`` arguments that say ``arg``: a switch for true/false, the items of a JSON list."""
    dotted = "." in arg.key
    option = "--" + (arg.key if dotted else arg.key.replace("_", "-"))
    text = arg.text.strip()
    if not dotted and text.lower() in ("true", "false"):
        switch = [option] if text.lower() == "true" else ["--no-" + arg.key.replace("_", "-")]
        if _parses(switch):
            return switch
        # not a switch (a text field that takes the word): pass it on as the value
    tokens = [option, arg.text]
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if isinstance(items, list):
            tokens = [option, *(x if isinstance(x, str) else json.dumps(x) for x in items)]
    if not _parses(tokens) and not dotted and _parses([option]):
        raise EngineArgError(f"--engine-arg {arg}: {arg.key} is a switch: give true or false")
    _parse(tokens, f"--engine-arg {arg}: ")
    return tokens


def _parses(tokens: list[str]) -> bool:
    try:
        _parser().parse_args(tokens)
    except _ParseError:
        return False
    return True


def _parse(tokens: list[str], context: str) -> Any:
    try:
        return _parser().parse_args(tokens)
    except _ParseError as exc:
        raise EngineArgError(f"{context}{exc}") from None


class _ParseError(Exception):
    pass


@cache
def _parser() -> Any:
    """vLLM's ``vllm serve`` engine-argument parser, raising instead of exiting (built once, ~1 s)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):  # type: ignore[misc]
        def error(self, message: str) -> Any:  # argparse's documented override: raise instead of exit
            raise _ParseError(message.removeprefix("argument "))

    with describable_platform():
        return AsyncEngineArgs.add_cli_args(Parser(prog="--engine-arg", allow_abbrev=False, add_help=False))


@contextmanager
def describable_platform() -> Iterator[None]:
    """Where vLLM detects no device (this CUDA build on a machine without a GPU), its parser cannot be built: the
    default ``DeviceConfig`` fails to infer a device type. ``vllm bench`` switches to the CPU platform for that
    (``vllm/entrypoints/cli/main.py``); we name the CPU as the undetected platform's device type while the parser
    is built, and only then, so no engine of this process ever sees it."""
    from vllm import platforms

    platform = platforms.current_platform
    if not platform.is_unspecified():
        yield
        return
    platform.device_type = "cpu"
    try:
        yield
    finally:
        del platform.device_type
