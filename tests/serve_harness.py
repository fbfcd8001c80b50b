"""A real agent on loopback for the server, client and CLI tests: helpers shared by those test modules."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agent.bench import BenchConfig
from agent.cli_serve import make_node
from agent.hub import Hub
from agent.server import AgentServer
from agent.workload.spec import parse_workload

TOKEN = "t0ken-for-tests"
T = TypeVar("T")


def make_hub(
    *, units: int = 4, workload: str = "poisson:n=400,rate=40", batch_policy: str = "vllm",
    dispatch: str = "least_loaded", replay_capacity: int = 65536, max_queued: int = 4096, token: str = TOKEN,
) -> Hub:
    config = BenchConfig(units=units, batch_policy=batch_policy, dispatch=dispatch)
    node = make_node(config, parse_workload(workload, seed=1))
    return Hub(node, node_id="test-node", profile=config.profile, token=token, replay_capacity=replay_capacity,
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
