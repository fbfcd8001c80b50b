"""A store read back for the console's view at one time, then on from there (STYLE example 13).

The state model's history is bounded (its time buckets span ``history_buckets * bucket_s``, the steps, slack and
stage books keep the last so many entries), so its view at time ``T`` needs each node's stream over the last
``lookback`` before ``T`` and, from before that, only what the state keeps for longer: the nodes' hellos (units,
policies), control audits (policy changes and their markers), alerts and stage layouts (:data:`CARRIED_KINDS`).
:func:`read_back` gives a :class:`Timeline` that starts there (bounded by ``max_events`` too: when the last minutes
hold more, the window starts later); taking it up to ``T`` rebuilds the state, taking more reads on. Each node's
events come in stream order, up to its first event later than asked for, the nodes interleaved by time. A replay
that seeks rebuilds its state this way; a recording console loads its history so (:mod:`console.recorder`).
Everything here reads DuckDB: call it from a worker thread (:func:`chunks_in_thread`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from typing import Final

import duckdb

from agent.telemetry import Event
from store.replay import node_ids as stored_node_ids
from store.replay import recent_start, replay

CARRIED_KINDS: Final = frozenset({"hello", "audit", "alert", "stage_boundaries"})
"""Event kinds a rebuild also reads from before its window: what the state keeps beyond its time buckets."""
MAX_REBUILD_EVENTS: Final = 200_000
"""Rows a rebuild reads at most from its window (about 1.8 s of reading and folding on a 2-core machine)."""


def _time(event: Event) -> int:
    return event.time_ns


def read_back(
    con: duckdb.DuckDBPyConnection,
    at_ns: int,
    *,
    lookback_ns: int,
    max_events: int = MAX_REBUILD_EVENTS,
    node_ids: Collection[str] | None = None,
) -> Timeline:
    """A timeline from which the state is rebuilt as it was at ``at_ns`` (``take_until(at_ns)``), then read on: for
    each node (of ``node_ids``; None: every stored node), the :data:`CARRIED_KINDS` before the window, then its
    stream from the window's start. The window is the last ``lookback_ns`` before ``at_ns``, or shorter, to hold
    at most ``max_events`` rows."""
    nodes = stored_node_ids(con) if node_ids is None else sorted(node_ids)
    start_ns = at_ns - lookback_ns
    bounded = recent_start(con, at_ns, max_events, node_ids=nodes) if nodes else None
    if bounded is not None:
        start_ns = max(start_ns, bounded)
    streams = [
        itertools.chain(
            replay(con, kinds=CARRIED_KINDS, node_ids=(node,), end_ns=start_ns),
            replay(con, node_ids=(node,), start_ns=start_ns),
        )
        for node in nodes
    ]
    return Timeline(heapq.merge(*streams, key=_time))


def rebuild_events(
    con: duckdb.DuckDBPyConnection,
    at_ns: int,
    *,
    lookback_ns: int,
    max_events: int = MAX_REBUILD_EVENTS,
    node_ids: Collection[str] | None = None,
) -> Iterator[Event]:
    """What the state needs to show the store as it was at ``at_ns`` (:func:`read_back`, up to ``at_ns``)."""
    timeline = read_back(con, at_ns, lookback_ns=lookback_ns, max_events=max_events, node_ids=node_ids)
    while chunk := timeline.take_until(at_ns, 4096):
        yield from chunk


class Timeline:
    """Events of several nodes' streams, merged by time, taken up to a time at a time. Each node's stream order is
    kept, so a node's events are taken up to its first one that is later than asked for (a step's time is its
    start, a little before events published ahead of it; an audit is stamped with the agent's wall clock): what a
    live console had received by then, and the same whether reached at once or bit by bit."""

    def __init__(self, events: Iterator[Event]) -> None:
        self._events = events
        self._held: Event | None = None
        """The first event not taken yet (read, but after the last time asked for)."""

    def take_until(self, end_ns: int, limit: int) -> list[Event]:
        """The next events with ``time_ns <= end_ns``, at most ``limit``; [] when the next one is later (or none
        is left)."""
        taken: list[Event] = []
        held = self._held
        if held is not None:
            if held.time_ns > end_ns:
                return taken
            taken.append(held)
            self._held = None
        for event in self._events:
            if event.time_ns > end_ns:
                self._held = event
                break
            taken.append(event)
            if len(taken) >= limit:
                break
        return taken


async def chunks_in_thread(take: Callable[[], list[Event]]) -> AsyncIterator[list[Event]]:
    """``take()`` called in a worker thread until it returns nothing: the database is read off the event loop."""
    while chunk := await asyncio.to_thread(take):
        yield chunk


def take(events: Iterator[Event], limit: int) -> Callable[[], list[Event]]:
    """A ``take`` for :func:`chunks_in_thread`: the next ``limit`` events of ``events``."""
    return lambda: list(itertools.islice(events, limit))
