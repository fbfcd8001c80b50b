"""A recorded window of one node's traffic, read back for a replay (``trackside whatif``, ``trackside export``).

What a replay needs from the store, as plain rows: every request that **arrived** in ``[start_ns, end_ns)`` (its
``request_arrived`` event: arrival time, prompt length, SLO targets) joined with how it ended (its ``requests`` row:
first token, finish, output length, unit, or a refusal), the node's shape as its hello said it, the batch policy each
unit ran at the window's start (its first step in the window), the dispatcher then (the hello's, changed by the
``set_dispatch`` changes applied before the window), and the changes applied inside the window (a replay holds the
starting policies, so each one is a reason to trust it less).

A window holds one run of the agent (``boot_ns``): a replay is one continuous simulation. When the selection spans
several runs, :func:`recorded_window` says which and asks for a narrower window. Requests that arrived but had not
finished when the recording stopped have no outcome: they are counted (``num_unfinished``) and left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agent.telemetry import NodeHello
from store.convert import event_from_row
from store.queries import Db, _dicts, _open, _window
from store.schema import StoreError


@dataclass(frozen=True, slots=True)
class WindowRequest:
    """One request that arrived in the window, as recorded. Times are wall-clock ns (the agent's clock)."""

    request_id: str
    arrival_ns: int
    prompt_tokens: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    refused: bool
    """Refused at intake (by the dispatcher or a unit's admission control): no output length is known."""
    output_tokens: int | None = None
    unit_id: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    num_preemptions: int = 0
    max_tpot_ms: float | None = None
    """The worst per-token TPOT (None: a single output token, or a store older than schema version 2)."""


@dataclass(frozen=True, slots=True)
class Change:
    """A control change applied inside the window (from ``audits``)."""

    time_ns: int
    action: str
    unit_ids: tuple[int, ...]
    new: str
    """The new settings, as the audit's JSON text."""


@dataclass(frozen=True, slots=True)
class RecordedWindow:
    node_id: str
    boot_ns: int
    start_ns: int
    """The window's start: ``start_ns`` as asked, else the first arrival."""
    end_ns: int
    """The window's end: ``end_ns`` as asked, else one past the last arrival."""
    hello: NodeHello
    """The node's hello of this run (the last one before the window's end)."""
    requests: tuple[WindowRequest, ...]
    """Finished and refused requests, in arrival order."""
    num_unfinished: int
    """Requests that arrived in the window and have no outcome in the store."""
    unit_policies: dict[int, str]
    """The batch policy each unit ran at the window's start (its first step in it; the hello's for a unit
    that took no step)."""
    dispatch_policy: str
    changes: tuple[Change, ...] = ()
    steps_in_window: int = 0
    nodes_in_store: dict[str, int] = field(default_factory=dict)


_REQUESTS_SQL = """
    SELECT a.request_id, a.time_ns AS arrival_ns, a.prompt_tokens, a.ttft_slo_ms, a.tpot_slo_ms,
           r.refused, r.output_tokens, r.unit_id, r.first_token_ns, r.time_ns AS finish_ns, r.num_preemptions,
           r.max_tpot_ms
    FROM request_events a
    LEFT JOIN requests r ON r.node_id = a.node_id AND r.boot_ns = a.boot_ns AND r.request_id = a.request_id
    WHERE a.kind = 'request_arrived' AND a.node_id = ? AND a.boot_ns = ? AND {where}
    QUALIFY row_number() OVER (PARTITION BY a.request_id ORDER BY r.seq NULLS LAST) = 1
    ORDER BY a.time_ns, a.seq
"""


def recorded_window(db: Db, *, node_id: str | None = None, start_ns: int | None = None,
                    end_ns: int | None = None) -> RecordedWindow:
    """The requests of ``node_id`` (the only node when None) that arrived in ``[start_ns, end_ns)``, with what a
    replay needs. Raises :class:`StoreError` with a one-line reason (no such node, no arrivals, several runs)."""
    if start_ns is not None and end_ns is not None and end_ns <= start_ns:
        raise StoreError("the window's end must be later than its start")
    con, owned = _open(db)
    try:
        nodes = {str(n): int(c) for n, c in con.execute(
            "SELECT node_id, count(*) FROM request_events WHERE kind = 'request_arrived' GROUP BY ALL ORDER BY 1"
        ).fetchall()}
        if node_id is None:
            if len(nodes) != 1:
                raise StoreError(
                    "the store has no recorded arrivals" if not nodes else
                    f"the store has {len(nodes)} nodes ({', '.join(nodes)}): name one with --node"
                )
            node_id = next(iter(nodes))
        elif node_id not in nodes:
            raise StoreError(f"no arrivals of node {node_id!r} in the store"
                             + (f" (it has {', '.join(nodes)})" if nodes else ""))
        params: list[Any] = [node_id]
        where = _window("time_ns", start_ns, end_ns, params)
        boots = con.execute(
            f"SELECT boot_ns, count(*), min(time_ns), max(time_ns) FROM request_events "
            f"WHERE kind = 'request_arrived' AND node_id = ? AND {where} GROUP BY ALL ORDER BY 1", params
        ).fetchall()
        if not boots:
            raise StoreError(f"no request of node {node_id!r} arrived in the window")
        if len(boots) > 1:
            runs = "; ".join(f"{_iso(lo)} to {_iso(hi)} ({n:,} requests)" for _, n, lo, hi in boots)
            raise StoreError(f"the window spans {len(boots)} runs of the agent ({runs}): narrow it with --since/"
                             "--until "
                             "to one run (a replay is one continuous run)")
        boot_ns, _, first_ns, last_ns = boots[0]
        start = start_ns if start_ns is not None else int(first_ns)
        end = end_ns if end_ns is not None else int(last_ns) + 1
        requests = _requests(con, node_id, int(boot_ns), start, end)
        hello = _hello(con, node_id, int(boot_ns), end)
        unit_policies = {int(u): str(p) for u, p in con.execute(
            "SELECT unit_id, arg_min(policy, time_ns) FROM steps WHERE node_id = ? AND boot_ns = ? AND time_ns >= ? "
            "AND time_ns < ? GROUP BY ALL", [node_id, boot_ns, start, end]
        ).fetchall()}
        for unit in hello.units:
            unit_policies.setdefault(unit.unit_id, unit.batch_policy)
        steps = con.execute("SELECT count(*) FROM steps WHERE node_id = ? AND boot_ns = ? AND time_ns >= ? AND "
                            "time_ns < ?", [node_id, boot_ns, start, end]).fetchone()
        audits = _dicts(con.execute(
            "SELECT time_ns, action, unit_ids, old, new FROM audits WHERE node_id = ? AND boot_ns = ? AND result = "
            "'applied' AND action <> 'post_alert' AND time_ns < ? ORDER BY time_ns, seq",  # an alert changes nothing
            [node_id, boot_ns, end]
        ))
    finally:
        if owned:
            con.close()
    changes = tuple(Change(a["time_ns"], a["action"], tuple(a["unit_ids"]), a["new"]) for a in audits
                    if a["time_ns"] >= start)
    finished = tuple(r for r in requests if r is not None)
    return RecordedWindow(
        node_id=node_id, boot_ns=int(boot_ns), start_ns=start, end_ns=end, hello=hello, requests=finished,
        num_unfinished=len(requests) - len(finished), unit_policies=unit_policies,
        dispatch_policy=_dispatch_at(start, hello, audits),
        changes=changes, steps_in_window=int(steps[0]) if steps else 0, nodes_in_store=nodes,
    )


def _requests(con: Any, node_id: str, boot_ns: int, start: int, end: int) -> list[WindowRequest | None]:
    """Every arrival of the window: a :class:`WindowRequest`, or None for one with no outcome yet."""
    params: list[Any] = [node_id, boot_ns]
    where = _window("a.time_ns", start, end, params)
    out: list[WindowRequest | None] = []
    for row in _dicts(con.execute(_REQUESTS_SQL.format(where=where), params)):
        if row["refused"] is None:
            out.append(None)
            continue
        out.append(WindowRequest(
            request_id=row["request_id"], arrival_ns=row["arrival_ns"], prompt_tokens=row["prompt_tokens"],
            ttft_slo_ms=row["ttft_slo_ms"], tpot_slo_ms=row["tpot_slo_ms"], refused=bool(row["refused"]),
            output_tokens=row["output_tokens"], unit_id=row["unit_id"], first_token_ns=row["first_token_ns"],
            finish_ns=None if row["refused"] else row["finish_ns"], num_preemptions=row["num_preemptions"] or 0,
            max_tpot_ms=row["max_tpot_ms"],
        ))
    return out


def _hello(con: Any, node_id: str, boot_ns: int, end: int) -> NodeHello:
    rows = _dicts(con.execute(
        "SELECT * FROM nodes WHERE node_id = ? AND boot_ns = ? ORDER BY (time_ns < ?) DESC, "
        "CASE WHEN time_ns < ? THEN -time_ns ELSE time_ns END LIMIT 1", [node_id, boot_ns, end, end]
    ))
    if not rows:
        raise StoreError(f"the store has no hello of node {node_id!r} for this run (recorded without its first frame?)")
    hello = event_from_row("nodes", rows[0])
    assert isinstance(hello, NodeHello)
    return hello


def _dispatch_at(start: int, hello: NodeHello, audits: list[dict[str, Any]]) -> str:
    """The dispatcher at ``start``: what the first dispatch change from then on replaced, else what the last one
    before set, else the hello's."""
    moves = [a for a in audits if a["action"] == "set_dispatch_policy"]
    later = [a for a in moves if a["time_ns"] >= start]
    if later:
        return _policy_of(later[0]["old"]) or hello.dispatch_policy
    if moves:
        return _policy_of(moves[-1]["new"]) or hello.dispatch_policy
    return hello.dispatch_policy


def _policy_of(settings_json: str) -> str:
    try:
        settings = json.loads(settings_json)
    except ValueError:
        return ""
    return next((str(s["policy"]) for s in settings if isinstance(s, dict) and s.get("policy")), "")


def _iso(ns: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
