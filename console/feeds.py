"""Where the console's events come from: a live agent (with reconnect) or a store file (replay).

Both are :class:`Feed`\\ s: ``async for update in feed.updates()`` yields :class:`FeedUpdate`\\ s, each either a
batch of events (a frame's worth, or a chunk read back from the store) or a change of the feed's connection.
The app runs one async worker per feed and folds the updates into its :class:`~console.model.state.ConsoleState`;
feeds never touch the state or the UI themselves.

* :class:`LiveFeed` wraps :func:`agent.telemetry.client.stream_batches` (batch frames, reconnect with backoff, resume by
  sequence number). Its states: ``connecting`` until the first hello, ``live`` at every hello, ``reconnecting``
  whenever a connection attempt fails (the backoff generator is asked for a delay), ``offline`` when the agent
  refuses the subscription (``AgentError``) or the URI is unusable.
* :class:`ReplayFeed` reads a store (in a worker thread), state ``replay``, following a
  :class:`~console.model.playback.Playback`: the state shows the events up to the replay's position; moving
  forward reads on (a :class:`~console.history.Timeline`), going back (or far forward) starts the state over from
  a rebuild (:func:`~console.history.read_back`; the first update has ``reset``). By default the cursor opens at
  the end of the file, paused: the whole file read back as fast as it reads, as before there was a cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol, cast

import duckdb

from agent.telemetry import Event, NodeHello
from agent.telemetry.client import AgentError, Delays, ResumeFrom, backoff, stream_batches
from console.history import MAX_REBUILD_EVENTS, Timeline, chunks_in_thread, read_back
from console.model.playback import Playback
from console.model.records import Connection
from store.replay import time_span
from store.schema import StoreError, connect

log = logging.getLogger(__name__)

REPLAY_CHUNK = 4096
"""Events per update a replay yields at most."""
REPLAY_LOOKBACK_S = 240.0
"""How far back a replay's rebuild reads every event (the state's default span: 240 buckets of 1 s)."""
REPLAY_TICK_S = 0.05
"""How often a replay looks at its cursor."""


@dataclass(frozen=True, slots=True)
class FeedUpdate:
    """Events from a feed, or a change of its connection (or both: the connection applies first)."""

    source: str
    events: Sequence[Event] = ()
    connection: Connection | None = None
    detail: str = ""
    """Why the connection changed (an error's text), when it says."""
    reset: bool = False
    """The state starts over before these events: forget every event so far (a replay that seeks back)."""


class Feed(Protocol):
    """A source of events for the console."""

    @property
    def source(self) -> str:
        """What it reads (a URI or a file), as shown to the operator."""
        ...

    def updates(self) -> AsyncIterator[FeedUpdate]:
        """Its updates, until it ends (a replay at the end of the file) or is cancelled."""
        ...


class LiveFeed:
    """One agent's event stream, across reconnects."""

    def __init__(
        self,
        uri: str,
        *,
        delays: Delays = backoff,
        open_timeout_s: float = 10.0,
        max_frames: int = 256,
        resume: ResumeFrom = None,
        ssl_context: ssl.SSLContext | None = None,
        token: str = "",
    ):
        self.uri = uri
        self.resume = resume
        self.ssl_context = ssl_context
        """How a ``wss://`` agent's certificate is verified (``--ca-file``; None: the system's trust store)."""
        """Where the stream starts (``stream_batches``' ``resume_after_seq``): None, live only; a recording console
        asks its store for the last position of the hello's run (``ConsoleRecorder.resume_from``)."""
        self._delays = delays
        self._open_timeout_s = open_timeout_s
        self._max_frames = max_frames
        self._token = token
        """Sent with the subscription: an agent with a read token needs it (or its control token)."""

    @property
    def source(self) -> str:
        return self.uri

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        queue: asyncio.Queue[FeedUpdate | None] = asyncio.Queue(self._max_frames)
        yield FeedUpdate(self.uri, connection=Connection.CONNECTING)
        pump = asyncio.create_task(self._pump(queue), name=f"feed {self.uri}")
        try:
            while (update := await queue.get()) is not None:
                yield update
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _pump(self, queue: asyncio.Queue[FeedUpdate | None]) -> None:
        """Read the stream into ``queue`` (bounded: a console that falls behind slows the reads, and the agent
        drops events for it and says so with a ``flow_control`` alert)."""
        uri = self.uri
        stream = cast(  # an async generator (annotated as an iterator): closed explicitly below
            AsyncGenerator[Sequence[Event], None],
            stream_batches(
                uri, resume_after_seq=self.resume, delays=self._retrying(queue), open_timeout_s=self._open_timeout_s,
                ssl_context=self.ssl_context, token=self._token,
            ),
        )
        try:
            async for events in stream:
                if len(events) == 1 and isinstance(events[0], NodeHello):
                    await queue.put(FeedUpdate(uri, events, Connection.LIVE))
                else:
                    await queue.put(FeedUpdate(uri, events))
        except AgentError as exc:
            await queue.put(FeedUpdate(uri, connection=Connection.OFFLINE, detail=str(exc)))
        except Exception as exc:  # a fatal error of the connection (bad URI, refused handshake): say why, stop
            log.warning("%s: %r", uri, exc)
            await queue.put(FeedUpdate(uri, connection=Connection.OFFLINE, detail=str(exc) or type(exc).__name__))
        finally:
            await stream.aclose()  # now, on cancellation too: its connection closes here, not at the loop's end
        await queue.put(None)

    def _retrying(self, queue: asyncio.Queue[FeedUpdate | None]) -> Callable[[], Generator[float]]:
        """The reconnect delays, announcing ``reconnecting`` each time one is taken (a failed attempt)."""
        base = self._delays
        uri = self.uri

        def delays() -> Generator[float]:
            for delay in base():
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(
                        FeedUpdate(uri, connection=Connection.RECONNECTING, detail=f"retrying in {delay:.1f} s")
                    )
                yield delay

        return delays


class ReplayFeed:
    """A store file read back as the event stream it was written from, up to the replay cursor's position."""

    def __init__(
        self,
        path: str | Path,
        *,
        chunk: int = REPLAY_CHUNK,
        playback: Playback | None = None,
        lookback_s: float = REPLAY_LOOKBACK_S,
        max_events: int = MAX_REBUILD_EVENTS,
        tick_s: float = REPLAY_TICK_S,
    ) -> None:
        self.path = Path(path)
        self.playback = playback or Playback()
        """The replay cursor (the app's keys move it; by default at the end, paused)."""
        self.shown_ns: int | None = None
        """The time the state was last brought to (the cursor's, once the feed has caught up; None: not yet)."""
        self._chunk = chunk
        self._lookback_ns = round(lookback_s * 1e9)
        self._max_events = max_events
        self._tick_s = tick_s

    @property
    def source(self) -> str:
        return str(self.path)

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        source = self.source
        yield FeedUpdate(source, connection=Connection.REPLAY)
        try:
            con = await asyncio.to_thread(connect, self.path, read_only=True)
        except StoreError as exc:  # locked by a writer since, or not a store: say why, stop
            yield FeedUpdate(source, connection=Connection.OFFLINE, detail=str(exc))
            return
        try:
            span = await asyncio.to_thread(time_span, con)
            if span is None:
                yield FeedUpdate(source, connection=Connection.REPLAY, detail="end of file")
                return
            async for update in self._follow(con, span):
                yield update
        finally:
            con.close()

    async def _follow(self, con: duckdb.DuckDBPyConnection, span: tuple[int, int]) -> AsyncIterator[FeedUpdate]:
        """Keep the state at the cursor's position until cancelled: read on while it moves forward (by less than
        the lookback), rebuild when it goes back or jumps further."""
        source, playback, chunk = self.source, self.playback, self._chunk
        playback.set_span(*span)
        shown: int | None = None
        timeline = Timeline(iter(()))
        detail = ""
        while True:
            target = playback.position()
            assert target is not None
            reset = shown is None or target < shown or target - shown > self._lookback_ns
            if reset:
                timeline = await asyncio.to_thread(
                    read_back, con, target, lookback_ns=self._lookback_ns, max_events=self._max_events
                )
            if reset or target != shown:
                async for events in chunks_in_thread(partial(timeline.take_until, target, chunk)):
                    yield FeedUpdate(source, events, reset=reset)
                    reset = False
                if reset:
                    yield FeedUpdate(source, reset=True)
                shown = self.shown_ns = target
            now = "end of file" if target >= span[1] else "playing" if playback.playing else "paused"
            if now != detail:
                detail = now
                yield FeedUpdate(source, connection=Connection.REPLAY, detail=detail)
            await asyncio.sleep(self._tick_s)
