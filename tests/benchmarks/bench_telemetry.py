"""Telemetry benchmarks (issue #5): what the stream costs the engines, and the agent -> recorder -> DuckDB rate.

    python tests/benchmarks/bench_telemetry.py cost [--repeat 3] [--units 4] [--trace CSV | --workload SPEC]
    python tests/benchmarks/bench_telemetry.py realtime [--repeat 3] [--limit N] [--start-speed 400]
    python tests/benchmarks/bench_telemetry.py e2e [--repeat 3]
    python tests/benchmarks/bench_telemetry.py recorder [--repeat 3] [--events 500000] [--framing batch|single]

``cost``: the same node (make_node, the Azure code trace by default), as fast as it goes, in six ways:
*bare* (no hooks; ``advance`` one event time at a time, like ``Node.run`` in virtual time); *hub* (``Hub``
attached: conversion, metrics, sequence numbers, replay buffer, no subscriber); *hub+sub* (the same and one
subscription drained after every ``advance``, no sockets); *server* (``AgentServer`` on 127.0.0.1:0 driving
the node on a wall clock far ahead of it, no subscriber); *server+ws* (the same and a websocket subscriber,
``agent.telemetry.client.open_session``, in another process, with batch frames of up to ``DEFAULT_MAX_BATCH`` events);
*server+ws1* (the same subscriber with one event per frame, the version-1 framing). Arrivals are shifted by
one real second so the subscriber is in place before the first event. Unit-steps per second from the first
event to the last.

``realtime``: what an operator sees: the node live on a wall clock, the way ``trackside agent --speed`` runs
it (``AgentServer``, ``gc_control`` on), with telemetry off (the node's hooks detached: no hub work, no
subscriber) and on (hub and one websocket subscriber with batch frames, in another process). For each, the
highest speed at which the node keeps up with the wall clock (its next event never more than
``--lag-limit-s`` late, sampled every 20 ms), doubled or halved from ``--start-speed`` until bracketed and
then bisected to ``--resolution``; with the unit-steps per real second over that run and in its busiest second.

``e2e``: the agent (``AgentServer``, the same node, ``gc_control`` on as in ``trackside agent``) in a child
process; ``agent.cli.serve.record`` with the real ``StoreWriter`` on a temporary DuckDB file in this one.
Step rows committed per second (first write to the final commit), then the store is checked against the
agent's sequencer: every seq 1..last_seq stored once, step rows = steps run, drops counted by the hub.

``recorder``: the recorder alone, fed pre-generated events (a node run in virtual time through a ``Hub``,
repeated up to ``--events``) by a child process that speaks the agent's protocol (hello, the subscribe reply,
then pre-encoded MessagePack frames: batch frames of the subscriber's ``max_batch``, as the agent's sender
cuts them, or with ``--framing single`` one event per frame; flow-controlled by TCP, so nothing can be
dropped).

Prints numbers; asserts nothing. Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node, record
from agent.runtime.node import Node
from agent.service.hub import Hub
from agent.service.server import AgentServer
from agent.telemetry import CODECS, Alert, Event, OkReply, StepEvent, Subscribe, Subscribed
from agent.telemetry.client import DEFAULT_MAX_BATCH
from agent.telemetry.stream import Sequencer, Subscription, parse_control
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec

TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "azure_code_2023.csv"
SPEED = 1e6
"""Wall-clock factor of the served node: the hour of trace would take 3.6 ms, so the node is always behind
its clock and runs flat out (yielding to the loop every ``slice_s``)."""
LEAD_S = 1.0
"""Real seconds between the server's start and the first arrival (time for a subscriber to connect)."""


# -- workload -----------------------------------------------------------------------------------------------
def load_requests(args: argparse.Namespace) -> list[RequestSpec]:
    if args.workload:
        return parse_workload(args.workload, seed=args.seed)[: args.limit]
    return load_trace(args.trace, limit=args.limit)


def make_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(profile=args.profile, units=args.units, batch_policy=args.batch_policy, seed=args.seed)


def shifted(requests: Sequence[RequestSpec], offset_s: float) -> list[RequestSpec]:
    return [replace(r, arrival_s=r.arrival_s + offset_s) for r in requests]


def num_steps(node: Node) -> int:
    return sum(u.num_steps for u in node.units)  # type: ignore[attr-defined]


@dataclass(slots=True)
class Run:
    steps: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.steps / self.wall_s


# -- 1. cost ------------------------------------------------------------------------------------------------
def drive(node: Node, sub: Subscription | None) -> int:
    """Advance ``node`` event time by event time (virtual time); drain ``sub`` after each. Frames popped."""
    popped = 0
    while (t := node.next_event_s()) is not None:
        node.advance(t)
        if sub is not None:
            while sub.pop() is not None:
                popped += 1
    return popped


def run_inline(config: BenchConfig, requests: Sequence[RequestSpec], mode: str) -> Run:
    node = make_node(config, requests)
    hub = sub = None
    if mode != "bare":
        hub = Hub(node, node_id="bench", profile=config.profile)
        hub.attach()
        if mode == "hub+sub":
            sub, _, _ = hub.subscribe(Subscribe(), lambda: None)
    t0 = time.perf_counter()
    popped = drive(node, sub)
    wall = time.perf_counter() - t0
    extra = {} if hub is None else {"events": hub.sequencer.last_seq, "popped": popped, "dropped": hub.num_dropped}
    return Run(num_steps(node), wall, extra)


async def run_served(
    config: BenchConfig,
    requests: Sequence[RequestSpec],
    max_batch: int | None,
    *,
    speed: float = SPEED,
    telemetry: bool = True,
    gc_control: bool = False,
    watch_lag: bool = False,
) -> Run:
    """The node behind an ``AgentServer`` at ``speed`` (default: flat out); with a websocket subscriber asking for
    ``max_batch`` events per frame in another process (None: no subscriber); ``telemetry`` False: the node's hooks
    detached (no hub work at all, the same server loop). ``watch_lag``: sample how late the node's next event is
    against the wall clock (``extra["max_lag_s"]``, real seconds)."""
    node = make_node(config, shifted(requests, speed * LEAD_S))
    hub = Hub(node, node_id="bench", profile=config.profile)
    loop = asyncio.get_running_loop()
    child = parent = None
    if max_batch is not None:
        ctx = mp.get_context("spawn")
        parent, child_end = ctx.Pipe()
        child = ctx.Process(target=_subscriber_main, args=(child_end, max_batch), daemon=True)
        child.start()
        await loop.run_in_executor(None, parent.recv)  # its imports are done
    server = AgentServer(hub, port=0, speed=speed, gc_control=gc_control)
    await server.start()
    if not telemetry:
        node.on_step = node.on_finish = node.on_request = node.on_dispatch = node.on_preempt = None
    lag = LagWatch()
    try:
        if parent is not None:
            parent.send(server.url)
            await loop.run_in_executor(None, parent.recv)  # subscribed
        while server.num_events_processed == 0:
            await asyncio.sleep(0.0005)
        t0 = time.perf_counter()
        watcher = asyncio.create_task(lag.watch(node, speed)) if watch_lag else None
        await server.workload_done.wait()
        wall = time.perf_counter() - t0
        if watcher is not None:
            watcher.cancel()
        await server.drain(30.0)
    finally:
        await server.stop()
    extra: dict[str, Any] = {"events": hub.sequencer.last_seq, "dropped": hub.num_dropped}
    if lag.lags_s:
        extra.update(max_lag_s=max(lag.lags_s), peak_rate=lag.peak_rate())
    if parent is not None and child is not None:
        extra.update(await loop.run_in_executor(None, parent.recv))
        child.join(10)
    return Run(num_steps(node), wall, extra)


@dataclass(slots=True)
class LagWatch:
    """Samples of a live node against the wall clock: how late its next event is, and its steps so far."""

    period_s: float = 0.02
    times_s: list[float] = field(default_factory=list)
    lags_s: list[float] = field(default_factory=list)
    """Real seconds the node's next event was overdue at each sample (0 when it was not)."""
    steps: list[int] = field(default_factory=list)

    async def watch(self, node: Node, speed: float) -> None:
        """Sample until cancelled. Called right after the node processed its first events: its clock started
        then, less the first event's node time (that event is never late), to within the caller's polling."""
        loop = asyncio.get_running_loop()
        origin = loop.time() - node.now_s / speed
        while True:
            now = loop.time()
            due = node.next_event_s()
            self.times_s.append(now)
            self.lags_s.append(0.0 if due is None else max(0.0, now - origin - due / speed))
            self.steps.append(num_steps(node))
            await asyncio.sleep(self.period_s)

    def peak_rate(self, window_s: float = 1.0) -> float:
        """The most steps per second over any ``window_s`` of the run."""
        best, start = 0.0, 0
        for end, t in enumerate(self.times_s):
            while t - self.times_s[start] > window_s:
                start += 1
            if t - self.times_s[start] >= 0.9 * window_s:
                best = max(best, (self.steps[end] - self.steps[start]) / (t - self.times_s[start]))
        return best


def _subscriber_main(conn: Connection, max_batch: int) -> None:
    """Child process: subscribe to the agent whose URL comes through ``conn``; count until it closes."""
    from websockets.exceptions import ConnectionClosed

    from agent.telemetry.client import open_session

    async def main() -> dict[str, Any]:
        conn.send("ready")
        url = conn.recv()
        counts = {"received": 0, "frames": 0, "received_steps": 0, "alerts": 0, "last_seq": 0}
        async with open_session(url) as session:
            await session.call(Subscribe(max_batch=max_batch))
            conn.send("subscribed")
            with contextlib.suppress(ConnectionClosed):
                while True:
                    events = await session.next_batch()
                    counts["frames"] += 1
                    counts["received"] += len(events)
                    counts["received_steps"] += sum(isinstance(e, StepEvent) for e in events)
                    counts["alerts"] += sum(isinstance(e, Alert) for e in events)
                    counts["last_seq"] = max(counts["last_seq"], *(e.seq for e in events))
        return counts

    conn.send(asyncio.run(main()))


def cmd_cost(args: argparse.Namespace) -> None:
    requests = load_requests(args)
    config = make_config(args)
    print(f"workload: {len(requests):,} requests on {args.units} units ({args.batch_policy})")
    modes = ["bare", "hub", "hub+sub", "server", "server+ws", "server+ws1"]
    subscribers = {"server": None, "server+ws": DEFAULT_MAX_BATCH, "server+ws1": 1}
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for i in range(args.repeat):
        order = modes if i % 2 == 0 else modes[::-1]
        for mode in order:
            if mode in subscribers:
                run = asyncio.run(run_served(config, requests, subscribers[mode]))
            else:
                run = run_inline(config, requests, mode)
            runs[mode].append(run)
            print(
                f"run {i + 1} {mode:9}: {run.steps:,} steps in {run.wall_s:.2f} s = {run.rate:,.0f} steps/s "
                f"{run.extra}",
                flush=True,
            )
    base = statistics.median(r.rate for r in runs["bare"])
    print("\nmedians (unit-steps/s, cost relative to bare):")
    for mode in modes:
        rate = statistics.median(r.rate for r in runs[mode])
        spread = ", ".join(f"{r.rate:,.0f}" for r in runs[mode])
        print(f"  {mode:9} {rate:9,.0f}  {100 * (1 - rate / base):+5.1f}%   ({spread})")


# -- 1b. real-time headroom ---------------------------------------------------------------------------------
REALTIME = {"off": (None, False), "on": (DEFAULT_MAX_BATCH, True)}
"""Telemetry off (the node's hooks detached: no hub work, no subscriber) and on (hub and one websocket
subscriber with batch frames, in another process): ``(max_batch, telemetry)`` for :func:`run_served`."""


def realtime_probe(config: BenchConfig, requests: Sequence[RequestSpec], setting: str, speed: float) -> Run:
    """The node live on a wall clock at ``speed``, as ``trackside agent --speed`` runs it (``gc_control`` on)."""
    max_batch, telemetry = REALTIME[setting]
    return asyncio.run(
        run_served(config, requests, max_batch, speed=speed, telemetry=telemetry, gc_control=True, watch_lag=True)
    )


def max_realtime_speed(
    config: BenchConfig,
    requests: Sequence[RequestSpec],
    setting: str,
    *,
    start: float,
    lag_limit_s: float,
    resolution: float,
) -> tuple[float, Run]:
    """The highest speed at which the node keeps up with the wall clock (its next event never more than
    ``lag_limit_s`` late), to within a factor ``1 + resolution``: doubled or halved from ``start`` until
    bracketed, then bisected geometrically. Returns it and its run."""
    ok: tuple[float, Run] | None = None
    too_fast: float | None = None
    speed = start
    while ok is None or too_fast is None or too_fast / ok[0] > 1 + resolution:
        run = realtime_probe(config, requests, setting, speed)
        keeps_up = run.extra["max_lag_s"] <= lag_limit_s
        print(
            f"   {setting:3} speed {speed:7.1f}: {run.rate:9,.0f} steps/s (peak {run.extra['peak_rate']:9,.0f} over "
            f"1 s), max lag {1e3 * run.extra['max_lag_s']:7.1f} ms: {'keeps up' if keeps_up else 'falls behind'}",
            flush=True,
        )
        if keeps_up:
            ok = (speed, run)
        else:
            too_fast = speed
        if ok is None or too_fast is None:
            speed = speed * 2 if too_fast is None else speed / 2
        else:
            speed = (ok[0] * too_fast) ** 0.5
    return ok


def cmd_realtime(args: argparse.Namespace) -> None:
    requests = load_requests(args)
    config = make_config(args)
    print(
        f"workload: {len(requests):,} requests on {args.units} units ({args.batch_policy}); keeping up: the next "
        f"event never more than {1e3 * args.lag_limit_s:g} ms late (sampled every 20 ms)"
    )
    found: dict[str, list[tuple[float, Run]]] = {name: [] for name in REALTIME}
    for i in range(args.repeat):
        for name in list(REALTIME) if i % 2 == 0 else list(REALTIME)[::-1]:
            speed, run = max_realtime_speed(
                config, requests, name, start=args.start_speed, lag_limit_s=args.lag_limit_s, resolution=args.resolution
            )
            found[name].append((speed, run))
            print(
                f"run {i + 1} telemetry {name}: keeps up to speed {speed:.1f}, {run.rate:,.0f} steps/s {run.extra}",
                flush=True,
            )
    print(
        "\nmedians (the fastest speed that keeps up; unit-steps per real second at it, over the run and at its "
        "busiest second):"
    )
    base = statistics.median(speed for speed, _ in found["off"])
    for name, results in found.items():
        speed = statistics.median(s for s, _ in results)
        rate = statistics.median(run.rate for _, run in results)
        peak = statistics.median(run.extra["peak_rate"] for _, run in results)
        runs = ", ".join(f"{s:.0f}: {r.rate:,.0f} / {r.extra['peak_rate']:,.0f}" for s, r in results)
        print(
            f"  telemetry {name:3}: speed {speed:7.1f} ({100 * (1 - speed / base):+5.1f}%), {rate:9,.0f} steps/s, "
            f"peak {peak:9,.0f} ({runs})"
        )


# -- 2. end to end ------------------------------------------------------------------------------------------
class TimedWriter:
    """``StoreWriter`` behind the recorder's interface, timing the first write and every commit, and
    setting ``stop`` once every event up to ``target_seq`` has been written (called from the recorder's
    worker thread, hence ``call_soon_threadsafe``)."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop, stop: asyncio.Event,
                 memory_limit: str | None = None) -> None:
        from store.writer import StoreWriter

        self.inner = StoreWriter(path, memory_limit=memory_limit)
        self._loop, self._stop = loop, stop
        self.first_write_s: float | None = None
        self.done_s = 0.0
        self.num_written = 0
        self.max_seq = 0
        self.target_seq: int | None = None
        self.num_flushes = 0
        self.flush_s = 0.0
        self.write_s = 0.0
        self.last_progress_s = time.monotonic()

    def write(self, events: Sequence[Event]) -> None:
        t0 = time.monotonic()
        if self.first_write_s is None:
            self.first_write_s = t0
        self.inner.write(events)
        self.write_s += time.monotonic() - t0
        self.num_written += len(events)
        self.max_seq = max(self.max_seq, max(e.seq for e in events))
        self.last_progress_s = time.monotonic()
        self.check_done()

    def check_done(self) -> None:
        if self.target_seq is not None and self.max_seq >= self.target_seq:
            self._loop.call_soon_threadsafe(self._stop.set)

    def flush(self) -> None:
        t0 = time.monotonic()
        self.inner.flush()
        self.flush_s += time.monotonic() - t0
        self.num_flushes += 1

    def last_seq(self, node_id: str, boot_ns: int | None = None) -> int:
        return self.inner.last_seq(node_id, boot_ns)

    def close(self) -> None:
        self.inner.close()
        self.done_s = time.monotonic()


async def record_from_child(
    target: Callable[[Connection, dict[str, Any]], None], child_args: dict[str, Any], db: Path, idle_s: float = 20.0,
    memory_limit: str | None = None,
) -> tuple[TimedWriter, dict[str, Any]]:
    """Start ``target`` in a child process (it sends its URL, later its stats), record it into ``db`` (DuckDB's
    ``memory_limit``: None, its default)."""
    loop = asyncio.get_running_loop()
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=target, args=(child_end, child_args), daemon=True)
    child.start()
    url = await loop.run_in_executor(None, parent.recv)
    stop = asyncio.Event()
    holder: list[TimedWriter] = []

    def factory(path: Path) -> TimedWriter:
        holder.append(TimedWriter(path, loop, stop, memory_limit))
        return holder[0]

    async def watch() -> dict[str, Any]:
        stats: dict[str, Any] = await loop.run_in_executor(None, parent.recv)
        writer = holder[0]
        writer.target_seq = stats["last_seq"]
        writer.check_done()
        while not stop.is_set():  # a lost tail would never arrive: give up after idle_s without progress
            if time.monotonic() - writer.last_progress_s > idle_s:
                stats["gave_up"] = True
                stop.set()
            await asyncio.sleep(0.1)
        return stats

    watcher = asyncio.create_task(watch())
    await record([url], db, stop=stop, writer_factory=factory)
    stats = await watcher
    parent.send("stop")
    child.join(30)
    return holder[0], stats


def check_store(db: Path) -> dict[str, Any]:
    """Step rows, and how the stored seqs cover 1..max (duplicates, holes), from every event table."""
    from store.schema import TABLES, connect

    con = connect(db, read_only=True)
    try:
        union = " UNION ALL ".join(f"SELECT seq FROM {t} WHERE seq > 0" for t in TABLES if t != "nodes")
        totals = con.execute(f"SELECT count(*), count(DISTINCT seq), max(seq) FROM ({union})").fetchone()
        step_counts = con.execute("SELECT count(*), count(DISTINCT seq) FROM steps").fetchone()
        assert totals is not None and step_counts is not None
        (rows, distinct, top), (steps, step_distinct) = totals, step_counts
    finally:
        con.close()
    return {
        "store_steps": steps,
        "store_step_dups": steps - step_distinct,
        "store_seqs": distinct,
        "store_rows": rows,
        "store_max_seq": top,
    }


def report_recording(name: str, writer: TimedWriter, stats: dict[str, Any], db: Path) -> float:
    store = check_store(db)
    assert writer.first_write_s is not None
    wall = writer.done_s - writer.first_write_s
    rate = float(store["store_steps"] / wall)
    holes = stats["last_seq"] - store["store_seqs"]
    lossless = holes == 0 and store["store_steps"] == stats["steps"] and store["store_step_dups"] == 0
    print(
        f"{name}: {store['store_steps']:,} step rows ({writer.num_written:,} events) committed in {wall:.2f} s "
        f"= {rate:,.0f} step rows/s, {writer.num_written / wall:,.0f} events/s; "
        f"{'no loss' if lossless else 'LOSS'}: sent seq 1..{stats['last_seq']:,} with {stats['steps']:,} steps, "
        f"stored {store['store_seqs']:,} distinct seqs ({holes:,} missing), {store['store_step_dups']} duplicate "
        f"steps, dropped by the hub: {stats.get('dropped', 0):,}",
        flush=True,
    )
    print(
        f"   writer thread: write {writer.write_s:.2f} s, {writer.num_flushes} flushes {writer.flush_s:.2f} s; "
        f"child: {stats.get('source_rate', 0):,.0f} steps/s over its {stats.get('source_s', 0):.2f} s"
        f"{', GAVE UP WAITING' if stats.get('gave_up') else ''}",
        flush=True,
    )
    return rate


def _agent_main(conn: Connection, opts: dict[str, Any]) -> None:
    """Child process: the live agent (node on a wall clock far ahead of it), then its stream's totals."""

    async def main() -> dict[str, Any]:
        config = BenchConfig(**opts["config"])
        requests = load_trace(Path(opts["trace"])) if opts["trace"] else parse_workload(opts["workload"], seed=0)
        node = make_node(config, shifted(requests, SPEED * LEAD_S))
        hub = Hub(node, node_id="bench", profile=config.profile)
        loop = asyncio.get_running_loop()
        async with AgentServer(hub, port=0, speed=SPEED, gc_control=True) as server:
            conn.send(server.url)
            while server.num_events_processed == 0:
                await asyncio.sleep(0.0005)
            t0 = time.monotonic()
            await server.workload_done.wait()
            source_s = time.monotonic() - t0
            steps = num_steps(node)
            await server.drain(60.0)
            conn.send(
                {
                    "last_seq": hub.sequencer.last_seq,
                    "steps": steps,
                    "dropped": hub.num_dropped,
                    "source_s": source_s,
                    "source_rate": steps / source_s,
                }
            )
            await loop.run_in_executor(None, conn.recv)
        return {}

    asyncio.run(main())


def cmd_e2e(args: argparse.Namespace) -> None:
    opts = {
        "config": {"profile": args.profile, "units": args.units, "batch_policy": args.batch_policy},
        "trace": str(args.trace) if not args.workload else "",
        "workload": args.workload,
    }
    rates = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "e2e.duckdb"
            writer, stats = asyncio.run(record_from_child(_agent_main, opts, db, memory_limit=args.memory_limit))
            rates.append(report_recording(f"e2e run {i + 1}", writer, stats, db))
    print(f"median: {statistics.median(rates):,.0f} step rows/s committed (target 100,000, no loss)")


# -- 3. the recorder alone ----------------------------------------------------------------------------------
def pregenerate(config: BenchConfig, requests: Sequence[RequestSpec], num_events: int) -> tuple[Any, list[Event]]:
    """The hello and ``num_events`` stamped events of a node run through a ``Hub`` (runs repeated)."""
    node = make_node(config, requests)
    hub = Hub(node, node_id="bench", profile=config.profile)
    hub.attach()
    sub, _, _ = hub.subscribe(Subscribe(), lambda: None)
    assert sub is not None
    one_run: list[Event] = []
    while (t := node.next_event_s()) is not None:
        node.advance(t)
        while (event := sub.pop()) is not None:
            one_run.append(event)
    sequencer = Sequencer()
    events = [sequencer.stamp(one_run[k % len(one_run)]) for k in range(num_events)]
    return hub.hello(), events


def encode_frames(events: Sequence[Event], max_batch: int) -> list[bytes]:
    """``events`` as the agent's sender frames them for a subscriber's ``max_batch``: up to that many events
    per ``EventBatch`` frame (fewer where the frame size cap cuts), one event per frame for ``max_batch`` 1."""
    codec = CODECS["msgpack"]
    if max_batch == 1:
        return [codec.encode(e) for e in events]
    frames, start = [], 0
    while start < len(events):
        frame, num = codec.encode_batch(events[start : start + max_batch])
        frames.append(frame)
        start += num
    return frames


def _frames_main(conn: Connection, opts: dict[str, Any]) -> None:
    """Child process: serve pre-encoded frames of pre-generated events to one subscriber, as fast as TCP goes."""
    from websockets.asyncio.server import ServerConnection, serve

    codec = CODECS["msgpack"]
    config = BenchConfig(**opts["config"])
    requests = load_trace(Path(opts["trace"])) if opts["trace"] else parse_workload(opts["workload"], seed=0)
    hello, events = pregenerate(config, requests, opts["events"])
    totals: dict[str, Any] = {
        "last_seq": events[-1].seq,
        "steps": sum(isinstance(e, StepEvent) for e in events),
        "dropped": 0,
    }
    served = asyncio.Event()

    async def handle(ws: ServerConnection) -> None:
        await ws.send(codec.encode(hello))
        request = parse_control(await ws.recv(), fmt="msgpack")
        assert isinstance(request, Subscribe)
        max_batch = request.max_batch if opts["framing"] == "batch" else 1
        frames = encode_frames(events, max_batch)
        totals["frames"] = len(frames)
        await ws.send(codec.encode(OkReply(control_id=request.control_id, payload=Subscribed(last_seq=0))))
        t0 = time.monotonic()
        for frame in frames:
            await ws.send(frame)
        totals["source_s"] = time.monotonic() - t0
        totals["source_rate"] = totals["steps"] / totals["source_s"]
        served.set()
        await ws.wait_closed()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with serve(handle, "127.0.0.1", 0, compression=None, max_size=None) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            conn.send(f"ws://127.0.0.1:{port}")
            await served.wait()
            conn.send(totals)
            await loop.run_in_executor(None, conn.recv)

    asyncio.run(main())


def cmd_recorder(args: argparse.Namespace) -> None:
    opts = {
        "config": {"profile": args.profile, "units": args.units, "batch_policy": args.batch_policy},
        "trace": str(args.trace) if not args.workload else "",
        "workload": args.workload,
        "events": args.events,
        "framing": args.framing,
    }
    rates = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            db = Path(tmp) / "recorder.duckdb"
            if args.profile_out and i == 0:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
                writer, stats = asyncio.run(record_from_child(_frames_main, opts, db, memory_limit=args.memory_limit))
                prof.disable()
                prof.dump_stats(args.profile_out)
            else:
                writer, stats = asyncio.run(record_from_child(_frames_main, opts, db, memory_limit=args.memory_limit))
            rates.append(report_recording(f"recorder run {i + 1}", writer, stats, db))
    print(f"median: {statistics.median(rates):,.0f} step rows/s committed by the recorder alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cost", "realtime", "e2e", "recorder"])
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-policy", default="vllm")
    parser.add_argument("--profile", default="h100-llama31-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--workload", help="a synthetic workload spec instead of the trace (e.g. bursty:n=8000)")
    parser.add_argument("--limit", type=int, help="the first N requests of the workload only")
    parser.add_argument("--start-speed", type=float, default=400.0, help="realtime: the first speed tried")
    parser.add_argument("--lag-limit-s", type=float, default=0.1, help="realtime: the lag that counts as behind")
    parser.add_argument("--resolution", type=float, default=0.05, help="realtime: relative precision of the speed")
    parser.add_argument("--events", type=int, default=500_000, help="recorder: events to replay")
    parser.add_argument("--memory-limit", help="recorder, e2e: DuckDB's memory limit for the store (e.g. 128MB; "
                        "default: DuckDB's own, 80%% of the machine)")
    parser.add_argument("--profile-out", help="recorder: cProfile the recording process's first run into this file")
    parser.add_argument(
        "--framing",
        choices=["batch", "single"],
        default="batch",
        help="recorder: batch frames of the subscriber's max_batch (default), or one event per frame",
    )
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {mp.cpu_count()} cpus, python {platform.python_version()}")
    {"cost": cmd_cost, "realtime": cmd_realtime, "e2e": cmd_e2e, "recorder": cmd_recorder}[args.what](args)


if __name__ == "__main__":
    main()
