"""A real agent on loopback for the server, client and CLI tests: helpers shared by those test modules."""

from __future__ import annotations

import asyncio
import socket
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import duckdb

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.service.hub import Hub
from agent.service.server import AgentServer
from agent.telemetry import Event, StepEvent
from agent.workload.spec import parse_workload
from policies.types import StepMode
from store.writer import StoreWriter

TOKEN = "t0ken-for-tests"
T = TypeVar("T")


def make_hub(
    *, units: int = 4, workload: str = "poisson:n=400,rate=40", batch_policy: str = "vllm",
    dispatch: str = "least_loaded", replay_capacity: int = 65536, max_queued: int = 4096, token: str = TOKEN,
    node_id: str = "test-node",
) -> Hub:
    config = BenchConfig(units=units, batch_policy=batch_policy, dispatch=dispatch)
    node = make_node(config, parse_workload(workload, seed=1))
    return Hub(node, node_id=node_id, profile=config.profile, token=token, replay_capacity=replay_capacity,
               max_queued=max_queued)


def make_server(
    hub: Hub, *, speed: float = 20.0, port: int = 0, gc_control: bool = False, **kwargs: object
) -> AgentServer:
    return AgentServer(hub, port=port, speed=speed, gc_control=gc_control, **kwargs)  # type: ignore[arg-type]


def run(factory: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    """Run a coroutine in a fresh loop, failing (not hanging) after ``timeout_s``."""

    async def main() -> T:
        return await asyncio.wait_for(factory(), timeout_s)

    return asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class NotingWriter:
    """A :class:`StoreWriter` that notes what a recorder wrote through it (``events``, appended from the recorder's
    thread), so that a test waits until the recorder has what it must store instead of sleeping and hoping:
    ``record(..., writer_factory=writers.make)`` with ``writers = NotingWriters()``."""

    def __init__(self, path: Path) -> None:
        self.inner = StoreWriter(path)
        self.events: list[Event] = []

    def write(self, events: Sequence[Event]) -> None:
        self.inner.write(events)
        self.events.extend(events)

    def flush(self) -> None:
        self.inner.flush()

    def last_seq(self, node_id: str, boot_ns: int | None = None) -> int:
        return self.inner.last_seq(node_id, boot_ns)

    def prune(self, older_than_ns: int) -> int:
        return self.inner.prune(older_than_ns)

    def close(self) -> None:
        self.inner.close()


class NotingWriters:
    """The :class:`NotingWriter`\\ s a recorder made (``make`` is its ``writer_factory``), the latest last."""

    def __init__(self) -> None:
        self.made: list[NotingWriter] = []

    def make(self, path: Path) -> NotingWriter:
        self.made.append(NotingWriter(path))
        return self.made[-1]

    def wrote(self, predicate: Callable[[Event], bool]) -> bool:
        """Whether the latest writer wrote an event for which ``predicate`` holds."""
        return bool(self.made) and any(predicate(e) for e in list(self.made[-1].events))


EVENT_TABLES = ("steps", "requests", "request_events", "unit_loads", "audits", "alerts", "stage_boundaries")


def stored_runs(db: Path) -> dict[int, list[int]]:
    """Every stored stream position of a store file, per run (``boot_ns``) and sorted; slack samples hold one row
    per sampled request, counted once; notices (seq 0) left out."""
    parts = [f"SELECT boot_ns, seq FROM {t}" for t in EVENT_TABLES]
    parts.append("SELECT DISTINCT boot_ns, seq FROM slack_samples")
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(" UNION ALL ".join(parts)).fetchall()
    finally:
        con.close()
    runs: dict[int, list[int]] = defaultdict(list)
    for boot, seq in rows:
        if seq > 0:
            runs[boot].append(seq)
    return {boot: sorted(seqs) for boot, seqs in runs.items()}


def stored_seqs(db: Path) -> list[int]:
    """Every stored stream position of a store file, whatever its run, sorted."""
    return sorted(seq for seqs in stored_runs(db).values() for seq in seqs)


def step_events(n: int, reasons_size: int = 1) -> list[StepEvent]:
    """``n`` step events of node ``n``, seq 1.., with ``reasons_size`` reasons (about 16 bytes each in MessagePack)."""
    reasons = {f"r{i:05d}": float(i) for i in range(reasons_size)}
    return [StepEvent(seq=i + 1, node_id="n", time_ns=i, unit_id=0, step_id=i, measured_ns=1, predicted_ns=1,
                      mode=StepMode.DECODE, policy="vllm", num_prefill_tokens=0, num_decode_tokens=1,
                      num_prefill_reqs=0, num_decode_reqs=1, context_tokens=1, budget_tokens=1, kv_used_blocks=0,
                      num_blocks=1, num_running=1, num_waiting=0, num_preempted=0, num_finished=0, reasons=reasons)
            for i in range(n)]
