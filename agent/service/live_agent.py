"""An agent whose units step on their own: the serving that vLLM units and simulated live units share.

:func:`serve_live` serves a :class:`~agent.runtime.live.node.LiveClusterNode` (the live cluster of some units and
their dispatcher) as an agent: the websocket server with its hub (telemetry, control, ``/metrics``), an intake when one
is given (vLLM's OpenAI app on a port), the event-loop watcher, until a stop or the end of a replayed workload.
``trackside agent --engine vllm`` serves vLLM units with it (``agent.service.launch``), and
``trackside agent --runtime live`` simulated units (:func:`run_sim_agent`): the calibrated simulator's units, each
stepping by itself in wall time (:class:`~agent.engine.sim_live.SimLiveUnit`) under the same runtime as vLLM engines,
so engine deaths, restarts with backoff, the hang watchdog, the pending timeout, migration by recompute and control
behave as on a GPU node; with ``serve_openai`` vLLM's OpenAI app serves them too (:func:`start_sim_openai`, the only
part that loads vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TextIO

from agent.engine.live import ENGINE_HANG_S
from agent.engine.sim import SimUnit
from agent.engine.sim_live import SimLiveUnit
from agent.runtime.gc_control import freeze_startup_heap
from agent.runtime.live.cluster import PENDING_TIMEOUT_S, RESTART_ATTEMPTS, LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.restarts import backoff
from agent.service.guard import ConnectionLimits
from agent.service.hub import Hub
from agent.service.loop_watch import watch_loop
from agent.service.server import AgentServer
from agent.workload.types import RequestSpec
from policies.params import ParamValue
from policies.registry import make_batch_policy, make_dispatch_policy

if TYPE_CHECKING:
    from agent.engine.vllm.sim_model import SimTokenizer


class AgentStartError(Exception):
    """A part of the agent did not start: a unit's engine, or the OpenAI front ends (the message says which and
    why)."""


class Intake(Protocol):
    """A way in for requests besides a replayed workload (the OpenAI port); the agent serves until it is stopped."""

    async def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Listen:
    """Where and how the agent's websocket server listens."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    limits: ConnectionLimits | None = None


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop``."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve_live(
    node: LiveClusterNode, hub: Hub, listen: Listen, *, stop: asyncio.Event, banner: Callable[[str], str],
    start_intake: Callable[[], Awaitable[Intake]] | None = None, out: TextIO | None = None,
) -> None:
    """Serve ``node`` through ``hub`` on ``listen`` until ``stop``, or, without an intake, until its replayed
    workload is done; then close the node (its requests end) and let the subscribers catch up. ``banner`` gets the
    server's URL and says what runs (printed first); ``start_intake`` starts the intake once the server is up."""
    out = out if out is not None else sys.stderr  # read now: a default would keep the stderr of the import
    intake: Intake | None = None
    try:
        async with AgentServer(hub, host=listen.host, port=listen.port, ssl_context=listen.tls, gc_control=False,
                               limits=listen.limits) as server:
            print(banner(server.url), file=out, flush=True)
            if start_intake is not None:
                intake = await start_intake()
            freeze_startup_heap()  # units, app and telemetry are up: nothing below traverses them again
            watcher = asyncio.create_task(watch_loop(hub))  # an alert when this loop limits the node
            waits = [asyncio.create_task(stop.wait())]
            if intake is None:
                waits.append(asyncio.create_task(server.workload_done.wait()))
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in [*waits, watcher]:
                task.cancel()
            if intake is not None:
                await intake.stop()
                intake = None
            await node.close()
            await server.drain(2.0)
            print(f"trackside agent: {'workload done' if server.workload_done.is_set() else 'stopped'}: "
                  f"{node.num_finished} finished, {node.num_rejected} refused, {node.num_ended} aborted or failed, "
                  f"{hub.sequencer.last_seq} events", file=out)
    finally:
        if intake is not None:
            with contextlib.suppress(Exception):
                await intake.stop()


@dataclass(frozen=True, slots=True)
class EngineFault:
    """A simulated engine that dies (``kill``) or stops making progress (``hang``) ``at_s`` seconds after the agent
    serves (its replay starts, or with an OpenAI intake, once the port is up)."""

    kind: str
    unit_id: int
    at_s: float


@dataclass(frozen=True, slots=True)
class SimAgentConfig:
    """What ``trackside agent --runtime live`` runs: simulated units (``units``: each unit's maker, called for the
    first start and for every restart) as live units, with their policies and SLOs."""

    units: tuple[Callable[[], SimUnit], ...]
    profile: str
    batch_policy: str
    batch_params: Mapping[str, ParamValue]
    dispatch: str
    dispatch_params: Mapping[str, ParamValue]
    requests: Sequence[RequestSpec]
    """A workload to replay (arrival times from the start of serving), each request fitting the model."""
    ttft_slo_s: float = 0.5
    tpot_slo_s: float = 0.05
    seed: int = 0
    restart: bool = True
    """Restart a unit whose engine died, with backoff (``agent.runtime.live.restarts.backoff``)."""
    restart_attempts: int | None = RESTART_ATTEMPTS
    engine_hang_s: float | None = ENGINE_HANG_S
    pending_timeout_s: float | None = PENDING_TIMEOUT_S
    faults: tuple[EngineFault, ...] = field(default_factory=tuple)
    serve_openai: tuple[str, int] | None = None
    """Serve vLLM's OpenAI app there (needs the vllm extra; :mod:`agent.engine.vllm.sim_model`)."""
    served_model_name: str | None = None
    """The model id OpenAI clients name (default: the profile's name)."""
    openai_args: tuple[str, ...] = ()
    """``vllm serve`` front-end options for the app as ``KEY=VALUE``."""
    openai_reuse_port: bool = False
    openai_frontends: int = 0
    """Serve the app from this many front-end processes (0: this process serves it)."""
    tokenizer: SimTokenizer | None = None
    """The tokenizer that renders requests for the app (``sim_model.sim_tokenizer``; None: the tiny model's)."""
    max_model_len: int = 16384
    """The context the app allows a request (the profile's; at most the tiny tokenizer model's 16,384)."""


async def run_sim_agent(
    config: SimAgentConfig, *, node_id: str, token: str, listen: Listen, read_token: str = "",
    replay_events: int = 65536, slack_sample_ms: float = 250.0, stop: asyncio.Event | None = None,
    install_signals: bool = True, out: TextIO | None = None,
) -> int:
    """Run simulated units under the live runtime until ``stop`` (or SIGINT/SIGTERM) or the end of the workload."""
    out = out if out is not None else sys.stderr  # read now: a default would keep the stderr of the import
    stop = stop or asyncio.Event()
    if install_signals:
        stop_on_signals(stop)
    policies = [make_batch_policy(config.batch_policy, dict(config.batch_params)) for _ in config.units]
    dispatcher = make_dispatch_policy(config.dispatch, dict(config.dispatch_params))
    tokenizer = None
    if config.serve_openai is not None:  # every token is the tokenizer's " ok" (vLLM is loaded only here)
        from agent.engine.vllm.sim_model import sim_tokenizer

        tokenizer = config.tokenizer or sim_tokenizer()
    units = [SimLiveUnit(make, hang_s=config.engine_hang_s, token=tokenizer.token if tokenizer else None)
             for make in config.units]
    handles: list[asyncio.TimerHandle] = []
    try:
        for unit in units:
            unit.start()
        cluster = LiveCluster(units, dispatcher, ttft_slo_s=config.ttft_slo_s, tpot_slo_s=config.tpot_slo_s,
                              restart_delays=backoff if config.restart else None,
                              restart_attempts=config.restart_attempts, pending_timeout_s=config.pending_timeout_s)
        node = LiveClusterNode(cluster, policies, requests=config.requests, seed=config.seed)
        hub = Hub(node, node_id=node_id, profile=config.profile, token=token, read_token=read_token,
                  replay_capacity=replay_events, slack_sample_ms=slack_sample_ms, boot_ns=node.origin_ns)
        loop = asyncio.get_running_loop()

        def arm_faults() -> None:  # from when the agent serves: its replay starts, or its OpenAI port is up
            for fault in config.faults:
                unit = units[fault.unit_id]
                if fault.kind == "kill":
                    why = f"engine killed by --kill-engine {fault.unit_id}@{fault.at_s:g}"
                    handles.append(loop.call_later(fault.at_s, unit.kill, why))
                else:
                    handles.append(loop.call_later(fault.at_s, unit.hang))

        async def start_intake() -> Intake:
            assert tokenizer is not None
            intake = await start_sim_openai(config, cluster, hub, node_id, out, tokenizer)
            arm_faults()
            return intake

        if tokenizer is None:
            arm_faults()

        def banner(url: str) -> str:
            return (f"trackside agent {node_id}: {url} ({len(units)} simulated units of {config.profile} under the "
                    f"live runtime, batch policy {config.batch_policy}, dispatch {dispatcher.name}"
                    f"{f', {len(config.requests)} requests to replay' if config.requests else ''})")

        await serve_live(node, hub, listen, stop=stop, banner=banner, start_intake=start_intake if tokenizer else None,
                         out=out)
    finally:
        for handle in handles:
            handle.cancel()
        for unit in units:
            with contextlib.suppress(Exception):
                await unit.stop()
    return 0


async def start_sim_openai(config: SimAgentConfig, cluster: LiveCluster[SimLiveUnit], hub: Hub, node_id: str,
                           out: TextIO, tokenizer: SimTokenizer) -> Intake:
    """Serve vLLM's OpenAI app over the simulated units on ``config.serve_openai``, rendering requests with
    ``tokenizer`` (:mod:`agent.engine.vllm.sim_model`)."""
    from agent.engine.vllm.openai_app import frontend_tokens
    from agent.engine.vllm.sim_model import check_params, sim_frontend_model
    from agent.service.openai_server import OpenAIServer, ServedModel

    assert config.serve_openai is not None

    def say(text: str) -> None:
        print(f"trackside agent: {text}", file=out, flush=True)

    model = ServedModel(sim_frontend_model(config.max_model_len, tokenizer=tokenizer),
                        config.served_model_name or config.profile, check_params)
    about = (f"model {model.name}: simulated units, every token {tokenizer.token[1]!r}; prompts counted by the "
             f"tokenizer in {tokenizer.folder}")
    if config.openai_frontends:
        from agent.service.frontends import FrontendStartError, start_frontends

        try:
            return await start_frontends(cluster, config.openai_frontends, *config.serve_openai, hub=hub, say=say,
                                         model_name=model.name, frontend_args=frontend_tokens(config.openai_args),
                                         follow_units=config.openai_reuse_port, node_id=node_id, model=model,
                                         about=about)
        except FrontendStartError as exc:
            raise AgentStartError(f"the OpenAI front ends did not start: {exc}") from None
    server = OpenAIServer(cluster, *config.serve_openai, frontend_args=frontend_tokens(config.openai_args),
                          metrics=hub.metrics_text, reuse_port=config.openai_reuse_port, node_id=node_id, say=say,
                          model=model)
    await server.start()
    say(f"OpenAI API at {server.base_url} ({about})")
    return server
