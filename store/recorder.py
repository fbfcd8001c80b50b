"""The recorder: agents' events into the store, for ``trackside record`` and for a recording console alike.

:class:`Recorder` owns an event writer (:class:`store.writer.StoreWriter`, or anything with its interface,
:class:`EventWriter`) and a thread that writes to it. Frames of events are handed to it in one of two ways:

* :meth:`Recorder.record` never waits: beyond ``max_backlog`` events queued or being written, a frame is dropped
  and counted. The console's way: its UI never waits for the database, and it shows the present.
* ``await`` :meth:`Recorder.put` waits while ``max_frames`` frames are queued: the readers stop reading, TCP slows
  the agents' senders, whose queues drop the oldest events, which the reader fetches again
  (:func:`record_agents`, ``trackside record``: nothing is lost while the agents still buffer it).

Either way what is stored is each connection's hello, the stream's events (``seq`` > 0) and its ``gap`` alerts (the
writer keeps each as a row of ``gaps``: the events the agent no longer buffered when the stream resumed); other
per-subscriber notices (flow control) are not stored. The thread writes whole frames, up to ``batch_size`` events per
``write``, and commits at least every ``flush_s`` seconds; with ``retention_s`` it deletes events older than that, at
the start and then every tenth of it (at most an hour apart). :meth:`Recorder.close` writes what is queued, commits and
closes the writer. Durability is the writer's: a commit returns when it is durable, so a recorder killed loses nothing
it committed, and what it had not committed the agent's replay buffer still holds.

Resume: :meth:`Recorder.resume_from` is where a stream starts (``stream_batches``' ``resume_after_seq``), the last
committed ``seq`` in the run a hello announces (0 for a run the writer has not seen: the agent then sends
everything it still buffers). A recorder restarted on the same file so continues where the last one stopped,
without duplicates and, while the agent's replay buffer reaches back that far, without a gap.

Errors: a failed ``write``, commit or prune is logged and kept (:attr:`Recorder.error`, :attr:`Recorder.failure`);
its pending events are not stored (the writer drops them whole), later ones still are. :func:`record_agents`
stops on it and raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol, Self

import duckdb

from agent.telemetry import Alert, AlertCode, Event, NodeHello
from agent.telemetry.client import stream_batches
from store.schema import StoreError
from store.writer import StoreWriter

log = logging.getLogger(__name__)

BATCH_SIZE = 8192
"""Events per ``write`` at most (whole frames: the last frame of a write may take it beyond)."""
MAX_BACKLOG = 1_000_000
"""Events queued or being written at most for :meth:`Recorder.record`; beyond, frames are dropped (and counted)
rather than the memory grown."""
MAX_FRAMES = 64
"""Frames queued and not yet taken by the writer thread at most for :meth:`Recorder.put`; then it waits."""
MAX_PRUNE_INTERVAL_S = 3600.0
"""Retention: events are deleted every tenth of the retention period, and at least this often."""


class EventWriter(Protocol):
    """What a recorder writes through: :class:`store.writer.StoreWriter`'s recorder interface."""

    def write(self, events: Sequence[Event]) -> None: ...
    def flush(self) -> None: ...
    def last_seq(self, node_id: str, boot_ns: int | None = None) -> int: ...
    def prune(self, older_than_ns: int) -> int: ...
    def close(self) -> None: ...


class Recorder:
    """Writes the frames it is handed to ``writer`` in a thread of its own, in batches, committing regularly."""

    def __init__(
        self,
        writer: EventWriter,
        *,
        flush_s: float = 1.0,
        batch_size: int = BATCH_SIZE,
        max_backlog: int = MAX_BACKLOG,
        max_frames: int = MAX_FRAMES,
        retention_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        name: str = "recorder",
    ) -> None:
        if flush_s <= 0:
            raise ValueError("flush_s must be positive")
        self.flush_s = flush_s
        self.batch_size = batch_size
        self.max_backlog = max_backlog
        """Events queued or being written at most before :meth:`record` drops frames."""
        self.max_frames = max_frames
        """Frames queued at most before :meth:`put` waits."""
        self.retention_s = retention_s
        """Events older than this are deleted (s; None: everything is kept)."""
        self._writer = writer
        self._clock = clock
        self._wall_clock_ns = wall_clock_ns
        self._lock = threading.Lock()
        """Held around every writer call (the writer is not thread-safe; resume positions are read from the loop)."""
        self._queue: queue.SimpleQueue[Sequence[Event] | None] = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self._backlog = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.num_written = 0
        """Events handed to the writer (committed at the next flush)."""
        self.num_dropped = 0
        """Events :meth:`record` dropped because the writer fell :attr:`max_backlog` behind."""
        self.num_flushes = 0
        self.error = ""
        """The last write, commit or prune error ("" while none)."""
        self.failure: Exception | None = None
        """That error itself (None while none)."""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the loop's side ------------------------------------------------------------------------------------------
    def record(self, events: Sequence[Event]) -> None:
        """Queue a frame's events for the writer (hellos, stream events and gaps; other notices are left out). Never
        waits: a frame that would put the writer more than :attr:`max_backlog` events behind is dropped and counted."""
        stored = _stored(events)
        if not stored or self._closed:
            return
        with self._count_lock:
            if self._backlog + len(stored) > self.max_backlog:
                self.num_dropped += len(stored)
                return
            self._backlog += len(stored)
        self._queue.put(stored)

    async def put(self, events: Sequence[Event]) -> None:
        """Queue a frame's events for the writer (as :meth:`record`), first waiting while :attr:`max_frames`
        frames are queued. After :meth:`close`, nothing is queued."""
        stored = _stored(events)
        if not stored:
            return
        while True:
            with self._count_lock:
                if self._closed:
                    return
                if self._queue.qsize() < self.max_frames:
                    self._backlog += len(stored)
                    break
                loop = asyncio.get_running_loop()
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
            await waiter
        self._queue.put(stored)

    def resume_from(self, hello: NodeHello) -> int:
        """Where a stream starts in the run ``hello`` announces: after the last committed ``seq`` (0: none)."""
        with self._lock:
            return self._writer.last_seq(hello.node_id, hello.boot_ns)

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of this process to the store being written, for reads (from any thread; close it when done):
        it sees what is committed. The file is locked to other processes while the recorder writes it, so readers
        beside the recorder (the advisor of ``trackside record``) go through this. Raises :class:`StoreError` for a
        writer that is not a :class:`StoreWriter`, or once it is closed."""
        if not isinstance(self._writer, StoreWriter):
            raise StoreError(f"the recorder's writer ({type(self._writer).__name__}) cannot be read")
        with self._lock:
            return self._writer.cursor()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, commit, close the writer (idempotent)."""
        if self._closed:
            return
        with self._count_lock:
            self._closed = True
        self._queue.put(None)
        self._wake_waiters()
        self._thread.join(timeout_s)
        self._call(self._writer.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the writer thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        last_flush = self._clock()
        next_prune = last_flush if self.retention_s else math.inf
        done = False
        while not done:
            batch, done = self._take()
            if batch:
                self._call(self._writer.write, batch)
                self.num_written += len(batch)
                with self._count_lock:  # only now: a batch being written still counts as behind
                    self._backlog -= len(batch)
            now = self._clock()
            if done or now - last_flush >= self.flush_s:
                self._call(self._writer.flush)
                self.num_flushes += 1
                last_flush = self._clock()
            if self.retention_s and not done and now >= next_prune:
                self._call(self._prune, self.retention_s)
                next_prune = now + min(self.retention_s / 10, MAX_PRUNE_INTERVAL_S)

    def _take(self) -> tuple[list[Event], bool]:
        """The events of the queued frames, whole frames until :attr:`batch_size` events or more (waiting at most a
        quarter of ``flush_s`` for a first one), and whether the recorder was closed after them."""
        batch: list[Event] = []
        done = False
        try:
            item = self._queue.get(timeout=self.flush_s / 4)
            while True:
                if item is None:
                    done = True
                    break
                batch.extend(item)
                if len(batch) >= self.batch_size:
                    break
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        if batch:
            self._wake_waiters()
        return batch, done

    def _wake_waiters(self) -> None:
        """Let every :meth:`put` waiting look at the queue again (from any thread)."""
        with self._count_lock:
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, waiter)

    def _prune(self, retention_s: float) -> None:
        cutoff_ns = self._wall_clock_ns() - round(retention_s * 1e9)
        num = self._writer.prune(cutoff_ns)
        log.info("pruned %d rows older than %s s", num, retention_s)

    def _call(self, method: Callable[..., object], *args: object) -> None:
        with self._lock:
            try:
                method(*args)
            except Exception as exc:  # the pending events are dropped; later ones are still written
                self.error = str(exc)
                self.failure = exc
                log.error("recorder: %s", exc)


def _stored(events: Sequence[Event]) -> list[Event]:
    """What a recorder stores of a frame: hellos, stream events and ``gap`` alerts, not the other per-subscriber
    notices (``seq`` 0)."""
    return [e for e in events if e.seq or isinstance(e, NodeHello) or is_gap(e)]


def is_gap(event: Event) -> bool:
    """Whether ``event`` is a ``gap`` alert: events the agent no longer buffered for a resume (stored as a row of
    ``gaps``)."""
    return isinstance(event, Alert) and not event.seq and event.code == AlertCode.GAP


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s failed: %s", task.get_name(), task.exception(), exc_info=task.exception())


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


# -- following agents -----------------------------------------------------------------------------------------
OnHello = Callable[[str, NodeHello], None]
"""Told of each hello an agent sends (its URI, the hello): the start of a connection."""
OnNotice = Callable[[str, Event], None]
"""Told of each notice an agent sends (its URI, the notice): a ``gap`` is also stored, the others are not."""


def log_notice(uri: str, notice: Event) -> None:
    log.warning("%s: %s", uri, getattr(notice, "message", notice))


async def follow(uri: str, recorder: Recorder, *, on_hello: OnHello | None = None,
                 on_notice: OnNotice = log_notice, ssl_context: ssl.SSLContext | None = None, token: str = "") -> None:
    """Put one agent's stream into ``recorder`` a frame at a time, until cancelled: its hellos, stream events and
    ``gap`` alerts (every notice also goes to ``on_notice``). It starts where the store stops in the hello's run, and
    events the agent dropped for it are fetched again (the store keeps one copy of each). Raises ``AgentError`` when the
    agent refuses the subscription, ``CertificateError`` when a ``wss://`` agent's certificate does not verify with
    ``ssl_context`` (None: the system's trust store). ``token`` goes with the subscription (an agent with a read token
    needs it, or its control token)."""
    async for events in stream_batches(uri, resume_after_seq=recorder.resume_from, refetch_dropped=True,
                                       ssl_context=ssl_context, token=token):
        first = events[0]
        if isinstance(first, NodeHello):
            if on_hello is not None:
                on_hello(uri, first)
            await recorder.put(events)  # the store starts (or continues) this run's rows at its hello
            continue
        stored = [e for e in events if e.seq]
        if len(stored) < len(events):
            for notice in events:
                if not notice.seq:
                    on_notice(uri, notice)
            stored = _stored(events)  # with its gaps, in stream order
        if stored:
            await recorder.put(stored)


async def record_agents(
    uris: Sequence[str],
    db: Path,
    *,
    stop: asyncio.Event,
    writer_factory: Callable[[Path], EventWriter] | None = None,
    flush_s: float = 1.0,
    batch_size: int = BATCH_SIZE,
    retention_s: float | None = None,
    on_hello: OnHello | None = None,
    on_notice: OnNotice = log_notice,
    ssl_context: ssl.SSLContext | None = None,
    token: str = "",
    companion: Callable[[Recorder], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Follow every agent in ``uris`` into the store ``db`` (a :class:`StoreWriter` unless ``writer_factory`` says
    otherwise) until ``stop``; then write what was received, commit and close.

    ``companion(recorder)``, when given, runs as a task beside the agents' streams (the advisor of ``trackside record``,
    which reads the store through :meth:`Recorder.cursor`): it is cancelled and awaited before the store closes; its
    failure is logged, never stops the recording.

    Frames go to the writer whole (up to ``batch_size`` events per ``write``), committed at least every
    ``flush_s``. Each agent is resumed where the store stops in its current run, and events an agent dropped for
    this recorder are fetched again (duplicates are stored once). ``retention_s``: delete events older than that,
    at the start and then every tenth of it (at most an hour apart). ``ssl_context`` verifies ``wss://`` agents (None:
    the system's trust store); ``token`` is sent to every agent (:func:`follow`). Raises ``StoreError``
    (``StoreLockedError``: another process writes it) when the store cannot be opened, ``AgentError`` when an agent
    refuses the subscription, ``CertificateError`` when an agent's certificate does not verify, and a writer's error
    (after closing) when a write, commit or prune failed.
    """
    recorder = Recorder((writer_factory or StoreWriter)(db), flush_s=flush_s, batch_size=batch_size,
                        retention_s=retention_s, name=f"recorder {db.name}")
    tasks = [asyncio.create_task(follow(uri, recorder, on_hello=on_hello, on_notice=on_notice, ssl_context=ssl_context,
                                        token=token))
             for uri in uris]
    beside = asyncio.create_task(companion(recorder), name="recorder companion") if companion is not None else None
    if beside is not None:
        beside.add_done_callback(_log_failure)
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), flush_s / 4)
            for task in tasks:
                error = task.exception() if task.done() else None
                if error is not None:
                    raise error
            if recorder.failure is not None:
                raise recorder.failure
    finally:
        for task in tasks:
            task.cancel()
        if beside is not None:
            beside.cancel()
        await asyncio.gather(*tasks, *([beside] if beside is not None else []), return_exceptions=True)
        recorder.close()
    if recorder.failure is not None:
        raise recorder.failure
