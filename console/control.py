"""Sending one control request to an agent and reading its reply, as the Policies screen's workers do.

Each request opens its own connection (:func:`agent.telemetry.client.open_session`: a hello, then the request with the
console's token and a fresh ``control_id``, a random UUID, then the reply; the agent applies a ``control_id`` once),
so control never shares the feed's subscription and a slow or lost agent costs only that request: it ends as a
:class:`ControlResult` that says why, never as an exception. The agent also publishes an ``audit`` event for every
action (applied, dry run or rejected); the console's feed brings it into the state, where the audit log shows it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Final

from websockets.exceptions import WebSocketException

from agent.telemetry import ControlAudit, ControlRequest, DryRun, ErrorReply, ProtocolError
from agent.telemetry.client import open_session, unreachable

UNREACHABLE: Final = "unreachable"
"""The code of a result whose request got no reply (no connection, a timeout, a refused handshake)."""


@dataclass(frozen=True, slots=True)
class ControlResult:
    """An agent's answer to one request, or why there was none."""

    uri: str
    request: ControlRequest
    ok: bool
    audit: ControlAudit | None = None
    """The agent's audit of the action (applied or dry run); None for an error."""
    code: str = ""
    """The error reply's code, or :data:`UNREACHABLE`."""
    message: str = ""

    @property
    def is_dry_run(self) -> bool:
        return isinstance(self.request, DryRun)

    def describe(self) -> str:
        """One line for the operator: ``applied: ...``, ``dry run: ...``, ``rejected: code: message``."""
        if self.ok:
            result = self.audit.result.replace("_", " ") if self.audit else "ok"
            return f"{result}: {self.request.__struct_config__.tag}"
        if self.code == UNREACHABLE:
            return f"not sent: {self.message}"
        return f"rejected: {self.code}: {self.message}"


async def send_control(
    uri: str,
    token: str,
    request: ControlRequest,
    *,
    open_timeout_s: float = 5.0,
    timeout_s: float = 10.0,
    ssl_context: ssl.SSLContext | None = None,
) -> ControlResult:
    """Send ``request`` to the agent at ``uri`` with ``token``; its reply as a :class:`ControlResult`. ``ssl_context``
    verifies a ``wss://`` agent (``--ca-file``; None: the system's trust store)."""
    try:
        async with open_session(uri, token=token, open_timeout_s=open_timeout_s, ssl_context=ssl_context) as session:
            reply = await session.call(request, timeout_s)
    except (OSError, TimeoutError, WebSocketException, ProtocolError) as exc:
        return ControlResult(uri, request, ok=False, code=UNREACHABLE, message=unreachable(uri, exc))
    if isinstance(reply, ErrorReply):
        return ControlResult(uri, request, ok=False, code=reply.code, message=reply.message)
    audit = reply.payload if isinstance(reply.payload, ControlAudit) else None
    return ControlResult(uri, request, ok=True, audit=audit)
