"""``trackside agent``'s websocket connection flags (simulated and vLLM units alike), and the
:class:`~agent.service.guard.ConnectionLimits` they make."""

from __future__ import annotations

import argparse

from agent.cli.common import ServeError
from agent.service.guard import ConnectionLimits, parse_origins

_DEFAULTS = ConnectionLimits()


def add_connection_options(agent: argparse.ArgumentParser) -> None:
    """The connection flags of ``trackside agent`` (each a key of a node config file too)."""
    c = agent.add_argument_group("websocket connections")
    c.add_argument("--max-anonymous-connections", type=int, default=_DEFAULTS.max_anonymous, metavar="N",
                   help="open connections without a token at most (default %(default)s); beyond it a new one is "
                   "refused at the handshake with HTTP 503. A client that presents the control or read token at "
                   "connect (Authorization: Bearer TOKEN, as ctl and the console's control do) counts under "
                   "--max-token-connections instead")
    c.add_argument("--max-token-connections", type=int, default=_DEFAULTS.max_token, metavar="N",
                   help="open connections that presented the agent's token at connect at most (default %(default)s)")
    c.add_argument("--subscriber-timeout-s", type=float, default=_DEFAULTS.subscriber_timeout_s, metavar="S",
                   help="close a connection that has read nothing for this long while the agent had frames for it "
                   "(a send blocked that long), with close code 1008 'subscriber too slow', counted in status and "
                   "/metrics (default %(default)g; 0: never)")
    c.add_argument("--allow-origin", action="append", default=[], metavar="URL",
                   help="a web page origin (https://grafana.example.com[:PORT]) whose scripts may connect "
                   "(repeatable). A browser always sends its page's Origin: without this flag every browser is "
                   "refused (HTTP 403), so no web page open on the operator's machine can read the telemetry; "
                   "clients that send no Origin (ctl, console, record) are not affected")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The limits the flags say; raises :class:`ServeError` for a value out of range."""
    if args.max_anonymous_connections < 0 or args.max_token_connections < 0:
        raise ServeError("--max-anonymous-connections and --max-token-connections must be >= 0")
    if not args.subscriber_timeout_s >= 0:
        raise ServeError("--subscriber-timeout-s must be >= 0 (0: never)")
    try:
        origins = parse_origins(args.allow_origin)
    except ValueError as exc:
        raise ServeError(f"--allow-origin: {exc}") from None
    return ConnectionLimits(max_anonymous=args.max_anonymous_connections, max_token=args.max_token_connections,
                            subscriber_timeout_s=args.subscriber_timeout_s or None, allow_origins=origins)
