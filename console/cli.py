"""``python -m console console|demo ...`` (``trackside console`` and ``trackside demo`` hand over to it).

* ``console URI [URI ...]``: live, one feed per agent (``ws://`` or ``wss://``), recording what it receives into
  ``--db`` (default ``console.duckdb`` in the user's data folder; ``--no-record`` to skip; see
  :mod:`console.recorder`); ``console --replay FILE``: a store read back (its SQL screen queries that file).
  ``--token-file`` (the agents' control token: the Policies screen's actions; also sent with the subscriptions, so a
  read token serves an agent that has one), ``--ca-file`` (the CA that ``wss://``
  agents' certificates are verified with, for the feeds and control alike), ``--read-only`` (no control),
  ``--refresh S`` (the most often screens redraw, default 0.1 s), ``--exit-after S`` (leave by itself: CI, smoke
  runs), ``--headless`` (no terminal output; also when stdout is not a terminal), ``--key ID=KEY`` (remap a binding
  by its id), ``--theme NAME`` (``trackside-dark``, ``trackside-light`` or one of Textual's). A replay opens at the
  file's end, paused, or with ``--speed X`` plays from its start at X times the recorded pace; a recording live
  console first shows each agent's last ``--history-s`` seconds from its file.
* ``demo``: starts the simulated agents of a scenario (``--scenario``, :mod:`console.scenarios`) as child processes
  (:mod:`console.demo`) and opens the console on them (:class:`console.demo_app.DemoApp`: it plays the scenario's
  control changes), with the agents' token (control works) and recording into ``--db`` (default ``demo.duckdb`` in
  the user's data folder; ``--no-record`` to skip). On exit the agents get SIGTERM and the recording is written; an
  agent slow to stop is left to stop in the background (said on exit), so the shell is back at once.

Errors in what the user typed (a bad URI, a missing or unreadable file, a bad number) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from agent.telemetry.client import CaFileError, TokenFileError, client_ssl_context, read_token
from console.app import ConsoleApp
from console.demo import KILL_AFTER_S, DemoChildren, DemoError, data_dir, demo_children
from console.demo_app import DemoApp
from console.feeds import Feed, LiveFeed, ReplayFeed
from console.model.playback import MAX_SPEED, MIN_SPEED, Playback
from console.model.state import HISTORY_BUCKETS, ConsoleState
from console.recorder import ConsoleRecorder, RecordError, RecordingFeed
from console.scenarios import (
    DEFAULT_REQUESTS,
    DEFAULT_SCENARIO,
    SCENARIOS,
    UnknownScenarioError,
    describe_scenarios,
    scenario,
)
from console.sql import Database, ReplayDatabase
from console.themes import theme_names
from store.schema import StoreError, connect

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with the command line (one line, exit 2)."""


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def _not_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--read-only", action="store_true", help="watch only: refuse control actions")
    parser.add_argument(
        "--refresh",
        type=_positive,
        default=0.1,
        metavar="S",
        help="redraw screens at most every S seconds (default 0.1)",
    )
    parser.add_argument("--exit-after", type=_positive, metavar="S", help="exit by itself after S seconds")
    parser.add_argument(
        "--headless",
        action="store_true",
        help="run without drawing to the terminal (also when stdout is not a terminal)",
    )
    parser.add_argument(
        "--bucket-s",
        type=_positive,
        default=1.0,
        metavar="S",
        help="width of a heatmap column and of trend bars (default 1 s)",
    )
    parser.add_argument(
        "--window-s",
        type=_positive,
        default=30.0,
        metavar="S",
        help="sliding window of rates and percentiles (default 30 s)",
    )
    parser.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="ID=KEY",
        help="bind KEY to the binding with this id (repeatable; ids are on the help screen)",
    )
    parser.add_argument(
        "--theme",
        choices=theme_names(),
        metavar="NAME",
        help="colour theme: trackside-dark, trackside-light or one of Textual's (default textual-dark; "
        "ctrl+p Theme switches)",
    )


def _add_history_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--history-s",
        type=_not_negative,
        metavar="S",
        help="at each agent's first hello, show its last S seconds recorded in --db first (default: the "
        "heatmap's span, 240 buckets; 0: none)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trackside", description="The trackside operator console.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    con = sub.add_parser(
        "console",
        help="watch live agents, or replay a store",
        description="The operator console on live agents (ws://HOST:PORT ...), recording what it receives to DuckDB, "
        "or on a store file read back (--replay).",
    )
    con.add_argument("uris", nargs="*", metavar="URI", help="agents: ws://HOST:PORT or wss://HOST:PORT")
    con.add_argument("--replay", type=Path, metavar="FILE", help="a DuckDB store (trackside record) to read back")
    con.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="the agents' control token: enables the Policies screen's control actions; or a read token, sent with "
        "the feeds' subscriptions (an agent with --read-token-file streams only with it or its control token)",
    )
    con.add_argument(
        "--ca-file",
        type=Path,
        metavar="PEM",
        help="verify wss:// agents' certificates with the CA certificates in this file, and only them (host names "
        "checked; default: the system's trust store)",
    )
    con.add_argument(
        "--db",
        type=Path,
        metavar="PATH",
        help=f"record what the console receives here (live only; default {data_dir() / 'console.duckdb'})",
    )
    con.add_argument("--no-record", action="store_true", help="do not record (the SQL screen then has no database)")
    con.add_argument(
        "--speed",
        type=_positive,
        metavar="X",
        help="play the replay from its start at X times the recorded pace (default: open at its end, paused; "
        "space plays at 1x)",
    )
    _add_history_option(con)
    _add_view_options(con)

    demo = sub.add_parser(
        "demo",
        help="the console on local simulated agents (a scenario), recording to DuckDB",
        description="Start the simulated agents of a scenario as child processes, open the console on them with "
        "their control token, play the scenario's control changes, record what the console receives; on exit, stop "
        "the agents (in the background when they are slow to).",
        epilog=f"scenarios (--scenario NAME):\n{describe_scenarios()}\n\n--workload, --trace, --units, "
        "--batch-policy, --dispatch and --speed, when given,\nreplace the scenario's settings on each of its agents.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--scenario",
        default=DEFAULT_SCENARIO,
        metavar="NAME",
        help=f"what the demo runs: {', '.join(SCENARIOS)} (default {DEFAULT_SCENARIO}; listed below)",
    )
    src = demo.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        metavar="SPEC",
        help=f"synthetic workload NAME[:key=value,...] (n={DEFAULT_REQUESTS} unless given)",
    )
    src.add_argument("--trace", type=Path, help="trace file instead (Azure CSV or trackside JSONL)")
    demo.add_argument("--units", type=int, help="simulated units of each agent")
    demo.add_argument("--batch-policy", metavar="NAME", help="every agent's batch policy")
    demo.add_argument("--dispatch", metavar="NAME", help="every agent's dispatch policy")
    demo.add_argument(
        "--speed", type=_positive, help="node seconds per real second (default 1; the script's times follow)"
    )
    demo.add_argument("--db", type=Path, metavar="PATH", help=f"record here (default {data_dir() / 'demo.duckdb'})")
    demo.add_argument("--no-record", action="store_true", help="do not record")
    _add_history_option(demo)
    _add_view_options(demo)
    return parser


# -- validation ----------------------------------------------------------------------------------------------------
def check_uri(uri: str) -> str:
    """``uri`` if it is a usable agent address, else a :class:`UsageError` saying why."""
    try:
        parts = urlsplit(uri)
        _ = parts.port  # raises on a port that is not a number or out of range
    except ValueError as exc:
        raise UsageError(f"bad agent URI {uri!r}: {exc}") from None
    if parts.scheme not in ("ws", "wss"):
        raise UsageError(f"bad agent URI {uri!r}: it must start with ws:// or wss://")
    if not parts.hostname:
        raise UsageError(f"bad agent URI {uri!r}: no host")
    return uri


def check_store(path: Path) -> Path:
    """``path`` if it is a store that can be read now (exists, is a trackside store, nobody writes it)."""
    try:
        connect(path, read_only=True).close()
    except StoreError as exc:
        raise UsageError(f"cannot replay {path}: {exc}") from None
    return path


def parse_keymap(items: Sequence[str]) -> dict[str, str]:
    """``--key ID=KEY`` options as a keymap for ``App.set_keymap``."""
    keymap = {}
    for item in items:
        ident, sep, key = item.partition("=")
        if not sep or not ident or not key:
            raise UsageError(f"--key takes ID=KEY, not {item!r}")
        keymap[ident] = key
    return keymap


# -- running ---------------------------------------------------------------------------------------------------------
def make_app(
    feeds: Sequence[Feed],
    args: argparse.Namespace,
    *,
    token: str = "",
    ssl_context: ssl.SSLContext | None = None,
    database: Database | None = None,
    playback: Playback | None = None,
    app_class: Callable[..., ConsoleApp] = ConsoleApp,
) -> ConsoleApp:
    """The console app (``app_class``) for ``feeds`` with the view options of the command line, the control token
    and TLS context, the database of its SQL screen and, for a replay, its cursor."""
    state = ConsoleState(bucket_s=args.bucket_s, window_s=args.window_s)
    return app_class(
        feeds,
        read_only=args.read_only,
        refresh_s=args.refresh,
        exit_after_s=args.exit_after,
        state=state,
        keymap=parse_keymap(args.key),
        token=token,
        ssl_context=ssl_context,
        database=database,
        playback=playback,
        theme=args.theme,
    )


def span_s(args: argparse.Namespace) -> float:
    """How far back the state's pictures reach (s): what a replay rebuilds and, by default, the history shown."""
    return HISTORY_BUCKETS * float(args.bucket_s)


def replay_feed(args: argparse.Namespace) -> ReplayFeed:
    """The replay of ``--replay``: from its start at ``--speed``, or at its end, paused."""
    if args.speed is None:
        playback = Playback()
    else:
        playback = Playback(speed=min(MAX_SPEED, max(MIN_SPEED, args.speed)), playing=True, start="start")
    return ReplayFeed(args.replay, playback=playback, lookback_s=span_s(args))


@contextlib.contextmanager
def open_recording(db: Path | None) -> Iterator[ConsoleRecorder | None]:
    """The console's recorder on ``db`` (None: not recording), closed (everything written, committed) on exit."""
    if db is None:
        yield None
        return
    try:
        recorder = ConsoleRecorder(db)
    except RecordError as exc:
        raise UsageError(f"{exc} (use --db PATH or --no-record)") from None
    with recorder:
        yield recorder


def live_feeds(
    uris: Sequence[str],
    recorder: ConsoleRecorder | None,
    *,
    history_s: float = 0.0,
    ssl_context: ssl.SSLContext | None = None,
    token: str = "",
) -> list[Feed]:
    """One feed per agent (``wss://`` ones verified with ``ssl_context``, ``token`` sent with each subscription);
    with a recorder, each resumes from the store's position and records what it gets, after showing the last
    ``history_s`` seconds the store holds of each of its nodes."""
    if recorder is None:
        return [LiveFeed(uri, ssl_context=ssl_context, token=token) for uri in uris]
    feeds = (LiveFeed(uri, resume=recorder.resume_from, ssl_context=ssl_context, token=token) for uri in uris)
    return [RecordingFeed(feed, recorder, history_s=history_s) for feed in feeds]


def history_s(args: argparse.Namespace) -> float:
    """``--history-s``, by default the state's span."""
    return span_s(args) if args.history_s is None else float(args.history_s)


def run_app(app: ConsoleApp, *, headless: bool) -> int:
    """Run ``app`` until it exits (SIGTERM and SIGHUP make it exit cleanly too); its exit status."""

    async def main() -> int | None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, app.exit, 0)
        return await app.run_async(headless=headless)

    result = asyncio.run(main())
    return 0 if result is None else result


def is_headless(args: argparse.Namespace) -> bool:
    """``--headless``, or no terminal to draw on."""
    return bool(args.headless) or not sys.stdout.isatty()


def cmd_console(args: argparse.Namespace) -> int:
    """``console``: live agents or a replay."""
    if args.replay is not None and args.uris:
        raise UsageError("give agent URIs or --replay FILE, not both")
    if args.replay is None and not args.uris:
        raise UsageError("give at least one agent URI (ws://HOST:PORT) or --replay FILE")
    token = read_token(args.token_file)
    if args.replay is not None:
        if args.ca_file is not None:
            raise UsageError("--ca-file verifies live wss:// agents; a replay connects to none")
        if args.db is not None:
            raise UsageError("--db records a live console; a replay's SQL screen queries the replayed file")
        if args.history_s is not None:
            raise UsageError("--history-s shows a live console's recording; a replay has --speed and its keys")
        database = ReplayDatabase(check_store(args.replay))
        with contextlib.closing(database):
            feed = replay_feed(args)
            app = make_app([feed], args, token=token, database=database, playback=feed.playback)
            return run_app(app, headless=is_headless(args))
    if args.speed is not None:
        raise UsageError("--speed paces a replay (--replay FILE); a live console shows the present")
    uris = [check_uri(u) for u in dict.fromkeys(args.uris)]
    ssl_context = client_ssl_context(args.ca_file)
    db = None if args.no_record else (args.db or data_dir() / "console.duckdb")
    with open_recording(db) as recorder:
        feeds = live_feeds(uris, recorder, history_s=history_s(args), ssl_context=ssl_context, token=token)
        app = make_app(feeds, args, token=token, ssl_context=ssl_context, database=recorder)
        return run_app(app, headless=is_headless(args))


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: the scenario's agents as children, the console on them (recording, playing the script); on exit the
    agents get SIGTERM, the recording is written, and agents slow to stop are left to stop in the background."""
    try:
        chosen = scenario(args.scenario)
    except UnknownScenarioError as exc:
        raise UsageError(str(exc)) from None
    if args.units is not None and args.units < 1:
        raise UsageError("--units must be at least 1")
    if args.trace is not None and not args.trace.is_file():
        raise UsageError(f"no trace file at {args.trace}")
    chosen = chosen.customised(
        workload=args.workload,
        trace=args.trace,
        units=args.units,
        batch_policy=args.batch_policy,
        dispatch=args.dispatch,
        speed=args.speed,
    )
    db = None if args.no_record else (args.db or data_dir() / "demo.duckdb")
    logs = db.parent if db is not None else data_dir()
    with open_recording(db) as recorder, demo_children(chosen.agents, logs=logs) as children:  # the file first
        recording = f"the console records to {db}" if db else "not recording"
        agents = ", ".join(f"{a.node_id} {a.url}" for a in children.agents)
        pids = ", ".join(str(a.proc.pid) for a in children.agents)
        print(
            f"trackside demo: scenario {chosen.name}: agents {agents} (agent pids {pids}); {recording}; logs in {logs}",
            file=sys.stderr,
            flush=True,
        )
        feeds = live_feeds(list(children.urls.values()), recorder, history_s=history_s(args))
        factory = partial(DemoApp, scenario=chosen, urls=children.urls)
        app = make_app(feeds, args, token=children.token, database=recorder, app_class=factory)
        status = run_app(app, headless=is_headless(args))
        children.terminate()  # the agents stop while the recording is written
        if recorder is not None:
            recorder.close()
    print(demo_stopped(children, db), file=sys.stderr)
    return status


def demo_stopped(children: DemoChildren, db: Path | None) -> str:
    """What the demo says on exit: the agents stopped, or which are still stopping (and where their logs are)."""
    recorded = f"; recorded to {db}" if db else ""
    left = children.left_running
    if not left:
        return "trackside demo: stopped the agents" + recorded
    still = "; ".join(f"{a.node_id} (pid {a.proc.pid}, log {a.log})" for a in left)
    return (
        f"trackside demo: still stopping in the background after SIGTERM (killed if still running in "
        f"{KILL_AFTER_S:g} s): {still}{recorded}"
    )


COMMANDS = {"console": cmd_console, "demo": cmd_demo}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; the exit status (2 for a usage error)."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (UsageError, DemoError, TokenFileError, CaFileError) as exc:
        print(f"trackside {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
