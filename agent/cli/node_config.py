"""Node config files: ``trackside agent --config node.toml``.

A node config file is TOML. Every ``trackside agent`` flag is a key (``-`` or ``_``: ``batch_policy`` or
``batch-policy``); an ``[engine]`` table holds engine arguments (any ``vllm.AsyncEngineArgs`` field, as
``--engine-arg``; a table means ``engine = "vllm"``), and a ``[unit.N]`` table holds unit N's own::

    model = "/models/Llama-3.1-8B-Instruct"
    gpus = "0-7"                 # or [0, 1, 2, 3, 4, 5, 6, 7]
    tensor_parallel_size = 1
    serve_openai = "0.0.0.0:8000"

    [engine]
    kv_cache_dtype = "fp8"
    enable_prefix_caching = true

    [unit.1]
    max_num_seqs = 256

The file becomes command-line arguments put before the command line's own (:func:`expand_node_config`), so the
command line overrides the file: a flag given on both takes the command line's value, an engine argument given
on both the command line's (``--workload``/``--trace`` on the command line replace the file's either); within the
file a ``[unit.N]`` table comes after ``[engine]``. A switch the file turns on (``enforce_eager = true``) stays on.
Relative paths are relative to the current folder.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

ENGINE_TABLE = "engine"
UNIT_TABLE = "unit"
SOURCES = ("workload", "trace")
"""The flags of which the agent takes one: given on the command line, the file's are left out."""


class NodeConfigError(Exception):
    """A node config file that cannot be read or says something ``trackside agent`` does not take."""


class _Raising(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's documented override: raise instead of exit
        raise NodeConfigError(message)


ParserFactory = Callable[[type[argparse.ArgumentParser]], argparse.ArgumentParser]
"""Builds ``trackside agent``'s flags on a parser of the given class (``agent.cli.serve.agent_parser``)."""


def expand_node_config(argv: Sequence[str], agent_parser: ParserFactory) -> list[str]:
    """``trackside agent``'s arguments (after ``agent``) with the settings of its ``--config`` file, if any, put
    before them. Raises :class:`NodeConfigError`."""
    pre = _Raising(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=Path)
    for name in SOURCES:
        pre.add_argument("--" + name)
    given, _ = pre.parse_known_args(list(argv))
    if given.config is None:
        return list(argv)
    skip = SOURCES if any(getattr(given, name) is not None for name in SOURCES) else ()
    return [*config_argv(given.config, agent_parser, skip=skip), *argv]


def config_argv(path: Path, agent_parser: ParserFactory, *, skip: Sequence[str] = ()) -> list[str]:
    """The command-line arguments that say what the file at ``path`` says (checked by the agent's parser)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise NodeConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise NodeConfigError(f"--config {path}: not valid TOML: {exc}") from None
    parser = agent_parser(_Raising)
    defaults = vars(parser.parse_args([]))
    tokens: list[str] = []
    units: list[str] = []  # after every [engine] argument, wherever the file has them: a unit's own win
    for key, value in data.items():
        name = key.replace("-", "_")
        where = f"{path}: {key}"
        if name == ENGINE_TABLE and isinstance(value, dict):
            tokens += ["--engine", "vllm", *_engine_args(value, where)]
        elif name == UNIT_TABLE:
            units += _unit_tables(value, where)
        elif name == "config":
            raise NodeConfigError(f"{where}: a node config file cannot name another")
        elif name == "engine_arg":
            raise NodeConfigError(f"{where}: engine arguments go in the [engine] table (one unit's in [unit.N])")
        elif name not in defaults:
            raise NodeConfigError(f"{where}: unknown key (not a `trackside agent` flag; engine arguments go in the "
                                  "[engine] table)")
        elif name not in skip:
            tokens += _flag(name, value, defaults[name], where)
    tokens += units
    try:
        parser.parse_args(tokens)
    except NodeConfigError as exc:
        raise NodeConfigError(f"{path}: {exc}") from None
    return tokens


def _flag(name: str, value: Any, default: Any, where: str) -> list[str]:
    option = "--" + name.replace("_", "-")
    if isinstance(default, bool):  # a switch: on, off (--no-NAME where it is on by default), or as it is
        if not isinstance(value, bool):
            raise NodeConfigError(f"{where}: a switch: true or false")
        return [] if value == default else [option] if value else ["--no-" + name.replace("_", "-")]
    if isinstance(value, bool) and default is None:  # a switch whose default depends on other flags
        return [option] if value else ["--no-" + name.replace("_", "-")]
    if isinstance(value, bool | dict):
        raise NodeConfigError(f"{where}: takes a value, not {_kind(value)}")
    if isinstance(value, list):
        if name == "gpus":
            return [option, ",".join(str(v) for v in value)]
        if not isinstance(default, list):  # only repeatable flags (--param) take a list
            raise NodeConfigError(f"{where}: takes one value, not a list")
        return [token for v in value for token in (option, _text(v, where))]
    return [option, _text(value, where)]


def _engine_args(table: dict[str, Any], where: str, unit: str = "") -> list[str]:
    tokens = []
    for key, value in table.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | dict):
            text = json.dumps(value)
        else:
            text = _text(value, f"{where}.{key}")
        tokens += ["--engine-arg", f"{unit}{key}={text}"]
    return tokens


def _unit_tables(value: Any, where: str) -> list[str]:
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise NodeConfigError(f"{where}: one table per unit, [unit.N] (N the unit's number, from 0)")
    tokens = []
    for unit, table in value.items():
        if not unit.isdigit():
            raise NodeConfigError(f"{where}.{unit}: not a unit number ([unit.0], [unit.1], ...)")
        tokens += _engine_args(table, f"{where}.{unit}", unit=f"{int(unit)}:")
    return tokens


def _text(value: Any, where: str) -> str:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise NodeConfigError(f"{where}: takes a string or a number, not {_kind(value)}")


def _kind(value: Any) -> str:
    return {bool: "true/false", dict: "a table", list: "a list"}.get(type(value), type(value).__name__)
