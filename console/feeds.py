"""Where the console's events come from: a live agent (with reconnect) or a store file (replay).

Both are :class:`Feed`\\ s: ``async for update in feed.updates()`` yields :class:`FeedUpdate`\\ s, each either a
batch of events (a frame's worth, or a chunk read back from the store) or a change of the feed's connection.
The app runs one async worker per feed and folds the updates into its :class:`~console.state.ConsoleState`;
feeds never touch the state or the UI themselves.

* :class:`LiveFeed` wraps :func:`agent.client.stream_batches` (batch frames, reconnect with backoff, resume by
  sequence number). Its states: ``connecting`` until the first hello, ``live`` at every hello, ``reconnecting``
  whenever a connection attempt fails (the backoff generator is asked for a delay), ``offline`` when the agent
  refuses the subscription (``AgentError``) or the URI is unusable.
* :class:`ReplayFeed` reads a store through :func:`store.replay.areplay` (in a worker thread), state ``replay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from agent.client import AgentError, Delays, ResumeFrom, backoff, stream_batches
from agent.protocol import Event, NodeHello
from console.model import Connection
from store.replay import areplay
from store.schema import StoreError

log = logging.getLogger(__name__)

REPLAY_CHUNK = 4096
"""Events per update a replay yields at most."""


@dataclass(frozen=True, slots=True)
class FeedUpdate:
    """Events from a feed, or a change of its connection (or both: the connection applies first)."""

    source: str
    events: Sequence[Event] = ()
    connection: Connection | None = None
    detail: str = ""
    """Why the connection changed (an error's text), when it says."""


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
    ):
        self.uri = uri
        self.resume = resume
        """Where the stream starts (``stream_batches``' ``resume_after_seq``): None, live only; a recording console
        asks its store for the last position of the hello's run (``ConsoleRecorder.resume_from``)."""
        self._delays = delays
        self._open_timeout_s = open_timeout_s
        self._max_frames = max_frames

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
                uri, resume_after_seq=self.resume, delays=self._retrying(queue), open_timeout_s=self._open_timeout_s
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
    """A store file read back as the event stream it was written from."""

    def __init__(self, path: str | Path, *, chunk: int = REPLAY_CHUNK) -> None:
        self.path = Path(path)
        self._chunk = chunk

    @property
    def source(self) -> str:
        return str(self.path)

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        source = self.source
        yield FeedUpdate(source, connection=Connection.REPLAY)
        batch: list[Event] = []
        try:
            async for event in areplay(self.path):
                batch.append(event)
                if len(batch) >= self._chunk:
                    yield FeedUpdate(source, tuple(batch))
                    batch = []
        except StoreError as exc:  # locked by a writer since, or not a store: say why, stop
            yield FeedUpdate(source, connection=Connection.OFFLINE, detail=str(exc))
            return
        if batch:
            yield FeedUpdate(source, tuple(batch))
        yield FeedUpdate(source, connection=Connection.REPLAY, detail="end of file")
