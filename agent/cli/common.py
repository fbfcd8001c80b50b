"""What the ``trackside`` commands share: the error they exit 2 with, ``HOST:PORT`` parsing, the agent's tokens, the
policy plugins, comma-separated lists and UTC times in their output."""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from agent.plugins import PluginReport, load_plugins
from agent.telemetry.client import read_token


class ServeError(Exception):
    """A problem with what the user asked for (printed as one line, exit 2)."""


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` as (host, port): an IPv6 host in brackets (``[::1]:7700``), no host for 127.0.0.1, port 0 for
    one the system picks; anything else raises :class:`ServeError` saying what to write."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ServeError(f"{flag} takes HOST:PORT (port 0-65535; IPv6 in brackets: [::1]:7700), not {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host or "[" in host or "]" in host:
        raise ServeError(f"{flag} takes an IPv6 address in brackets, then its port ([::1]:7700), not {text!r}")
    return host or "127.0.0.1", int(port)


def agent_tokens(args: argparse.Namespace) -> tuple[str, str]:
    """``trackside agent``'s control token and read token (``--token-file``, ``--read-token-file``; "" without the
    file); raises :class:`ServeError` when they are the same token (the read one would then control too)."""
    token, read = read_token(args.token_file), read_token(args.read_token_file)
    if read and read == token:
        raise ServeError("--read-token-file holds the control token: give read-only clients a token of their own")
    return token, read


def csv_items(text: str) -> list[str]:
    """The non-empty items of a comma-separated list (``--compare vllm, sarathi,``: two), stripped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def utc_text(ns: int) -> str:
    """Wall-clock ns as ``2026-11-26 10:00:00`` (UTC), as the commands print times."""
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def load_policy_plugins() -> PluginReport:
    """The installed policy plugins registered (:func:`agent.plugins.load_plugins`, once per process): each one skipped
    is a warning line on stderr the first time."""
    return load_plugins(warn=lambda line: print(f"trackside: warning: {line}", file=sys.stderr, flush=True))
