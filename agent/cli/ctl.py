"""``trackside ctl``'s replies as text, and one control request to several agents (``trackside ctl URI,URI,...
ACTION``), such as the agents of one node run with ``trackside agent --agents N`` (``docs/deploy.md``, "Several
agents on one node").

A change (``set-policy``, ``set-dispatch``, ``set-param``) is first sent to every agent as a dry run; only when every
agent accepts it is it applied, on each in turn. So a change one agent would refuse (a parameter its policy does not
have, a unit it does not have) or an agent that cannot be reached changes nothing anywhere. Between the dry runs and
the changes an agent can still refuse (another operator's change came first): each agent's reply is printed, and
the exit status says the worst. Anything else (``status``, ``pause --unit N``...) goes to every agent as it is.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
from websockets.exceptions import WebSocketException

from agent.telemetry import ControlAudit
from agent.telemetry.client import open_session, unreachable
from agent.telemetry.commands import (
    ControlRequest,
    DryRun,
    ErrorReply,
    OkReply,
    PolicyList,
    Reply,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    StatusInfo,
)

EXIT_ERROR_REPLY = 2
EXIT_UNREACHABLE = 1

Outcome = Reply | str
"""An agent's reply, or why it could not be reached."""


def split_uris(text: str) -> list[str]:
    """``ws://a:7700,ws://b:7701`` as a list (one URI: a list of one)."""
    return [uri for uri in (part.strip() for part in text.split(",")) if uri]


async def call_agent(uri: str, token: str, request: ControlRequest, ssl_context: ssl.SSLContext | None = None) -> Reply:
    """One request to one agent, on a connection of its own; its reply."""
    async with open_session(uri, token=token, ssl_context=ssl_context) as session:
        return await session.call(request)


async def _each(uris: Sequence[str], token: str, request: ControlRequest,
                ssl_context: ssl.SSLContext | None) -> list[Outcome]:
    async def one(uri: str) -> Outcome:
        try:
            return await call_agent(uri, token, request, ssl_context)
        except (OSError, TimeoutError, WebSocketException) as exc:
            return unreachable(uri, exc)

    return list(await asyncio.gather(*(one(uri) for uri in uris)))


def ctl_many(uris: Sequence[str], token: str, request: ControlRequest, ssl_context: ssl.SSLContext | None, *,
             as_json: bool) -> int:
    """Send ``request`` to every agent in ``uris`` (a change: dry runs first, see the module), print each reply
    under its URI (``as_json``: one JSON object per line, ``{"uri": ..., "reply": ...}``); the exit status."""
    if isinstance(request, SetBatchPolicy | SetDispatchPolicy | SetParams):
        checks = asyncio.run(_each(uris, token, DryRun(change=request), ssl_context))
        if any(isinstance(o, str | ErrorReply) for o in checks):
            code = _print(uris, checks, as_json)
            print(f"trackside ctl: nothing changed on any of the {len(uris)} agents: not every one accepted the "
                  "change in a dry run", file=sys.stderr)
            return code
    return _print(uris, asyncio.run(_each(uris, token, request, ssl_context)), as_json)


def _print(uris: Sequence[str], outcomes: Sequence[Outcome], as_json: bool) -> int:
    code = 0
    for uri, outcome in zip(uris, outcomes, strict=True):
        if isinstance(outcome, str):
            print(f"trackside ctl: {outcome}", file=sys.stderr)
            code = EXIT_UNREACHABLE
            continue
        if as_json:
            print(msgspec.json.encode({"uri": uri, "reply": outcome}).decode())
        if isinstance(outcome, ErrorReply):
            print(f"trackside ctl: {uri}: error: {outcome.code}: {outcome.message}", file=sys.stderr)
            code = code or EXIT_ERROR_REPLY
        elif not as_json:
            print(f"{uri}: " + render_reply(outcome).replace("\n", "\n  "))
    return code


def render_reply(reply: OkReply) -> str:
    payload = reply.payload
    if isinstance(payload, StatusInfo):
        lines = [f"node {payload.node_id}: dispatch {payload.dispatch_policy} {_params(payload.dispatch_params)}",
                 f"stream: seq {payload.last_seq} (buffered from {payload.oldest_seq}), "
                 f"{payload.num_subscribers} subscribers"
                 + (f" ({payload.num_slow_dropped} closed for not reading)" if payload.num_slow_dropped else "")]
        for u in payload.units:
            lines.append(f"  unit {u.unit_id} [{u.mode}] {u.batch_policy} {_params(u.batch_params)} "
                         f"running {u.num_running} waiting {u.num_waiting}")
        return "\n".join(lines)
    if isinstance(payload, PolicyList):
        return "\n".join(["batch policies:", *(f"  {p.name}: {p.summary}" for p in payload.batch_policies),
                          "dispatch policies:", *(f"  {p.name}: {p.summary}" for p in payload.dispatch_policies)])
    if not isinstance(payload, ControlAudit):
        return "ok"
    targets = []
    for setting in payload.new:
        where = "dispatcher" if setting.unit_id is None else f"unit {setting.unit_id}"
        what = " ".join(x for x in (setting.policy, _params(setting.params), setting.mode or "") if x)
        targets.append(f"{where}: {what}")
    return f"{payload.result}: {payload.action}: " + "; ".join(targets) + (f" ({payload.message})" if payload.message
                                                                             else "")


def _params(params: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else ""
