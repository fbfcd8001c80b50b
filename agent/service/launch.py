"""``trackside agent --engine vllm``: start vLLM units and serve them as the agent's node.

The units start one after another (on one GPU each takes its share of the memory, ``gpu_memory_utilization``),
then :class:`~agent.runtime.live.node.LiveClusterNode` wraps them and their dispatcher for the agent's hub and
websocket server (telemetry, control, ``/metrics``: the same stream as simulated units), and, with
``serve_openai``, :class:`~agent.service.openai_server.OpenAIServer` takes requests from any OpenAI client. A
workload given instead (or as well) is replayed at its arrival times. With ``fake_executor`` the units run the
tiny model of :mod:`agent.engine.vllm.cpu` on the fake executor: no GPU, no weights (tests, trying it out).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from agent.engine.live import ENGINE_HANG_S
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.placement import UnitPlacement
from agent.engine.vllm.plan import FAKE_MODEL
from agent.engine.vllm.unit import VllmUnit
from agent.runtime.live.cluster import PENDING_TIMEOUT_S, RESTART_ATTEMPTS, LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.restarts import backoff
from agent.service.guard import ConnectionLimits
from agent.service.hub import Hub
from agent.service.live_agent import AgentStartError, Listen, serve_live, stop_on_signals
from agent.workload.types import RequestSpec
from policies.params import ParamValue
from policies.registry import make_batch_policy, make_dispatch_policy

LIVE_HISTORY = 1024
"""Step records, raw step messages and outcomes each unit of a live agent keeps (``VllmUnit(history=...)``). The
agent reads only their counts and the last step message; the stream and the recorder have the rest. A unit's own
default (``agent.engine.vllm.unit.HISTORY``, 20,000 each) is for runs that read their records back (``trackside
bench``, the GPU validation): about 1 KB per step, 80 MB for four units once full, which a slow engine fills over
hours (issue #21's soak, docs/benchmarks.md)."""


@dataclass(frozen=True, slots=True)
class VllmAgentConfig:
    """What ``trackside agent --engine vllm`` runs."""

    units: int
    batch_policy: str
    batch_params: Mapping[str, ParamValue]
    dispatch: str
    dispatch_params: Mapping[str, ParamValue]
    engine: EngineOptions
    """Every unit's engine (``gpu_memory_utilization`` is each unit's share)."""
    unit_engines: tuple[EngineOptions, ...] = ()
    """Each unit's engine, when the units differ (``agent.engine.vllm.plan``); empty: ``engine`` for every unit."""
    placements: tuple[UnitPlacement, ...] = ()
    """Each unit's GPUs and parallel sizes, for the units' description in the hello and status (empty: not said)."""
    fake_executor: bool = False
    fake_num_blocks: int = 1024
    """KV blocks of a fake-executor unit."""
    coefficients: tuple[float, float, float] | None = None
    """The policies' prior step model (a profile's); None: the scheduler's default (H100, Llama-3.1-8B)."""
    ttft_slo_s: float = 0.5
    tpot_slo_s: float = 0.05
    serve_openai: tuple[str, int] | None = None
    served_model_name: str | None = None
    openai_args: tuple[str, ...] = ()
    """``vllm serve`` front-end options for the OpenAI app as ``KEY=VALUE`` (``chat_template=FILE``...)."""
    openai_reuse_port: bool = False
    """Bind the OpenAI port with ``SO_REUSEPORT``: several agents of one node share it (Linux spreads connections)."""
    openai_frontends: int = 0
    """Front-end processes serving the OpenAI port (``agent.service.frontends``); 0: the agent's own process."""
    uvloop: bool = True
    """The event loop the front-end processes run (the agent's own is its caller's)."""
    requests: Sequence[RequestSpec] = field(default_factory=tuple)
    """A workload to replay (arrival times from the start of serving)."""
    seed: int = 0
    restart: bool = True
    """Restart a unit whose engine died, with backoff (``agent.runtime.live.restarts.backoff``)."""
    restart_attempts: int | None = RESTART_ATTEMPTS
    """Restart attempts after a failure before giving up (the unit stays failed until ``recover-unit``); None: no
    limit."""
    engine_hang_s: float | None = ENGINE_HANG_S
    """An engine core that makes no step for this long while its unit has requests is killed and its unit failed
    (``VllmUnit.hang_s``); None: never."""
    pending_timeout_s: float | None = PENDING_TIMEOUT_S
    """A request no unit took within this long is rejected (``LiveCluster.pending_timeout_s``); None: no limit."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or (FAKE_MODEL if self.fake_executor else self.engine.model)


def build_units(config: VllmAgentConfig) -> list[VllmUnit]:
    """The units (not started), each with the batch policy and the SLO defaults."""
    settings = UnitSettings(policy=config.batch_policy, params=dict(config.batch_params),
                            coefficients=config.coefficients, ttft_slo_s=config.ttft_slo_s,
                            tpot_slo_s=config.tpot_slo_s)
    units = []
    for i in range(config.units):
        kwargs: dict[str, Any] = {}
        engine = config.unit_engines[i] if config.unit_engines else config.engine
        if config.fake_executor:
            from agent.engine.vllm.cpu import cpu_vllm_config
            from agent.engine.vllm.fake_executor import FakeExecutor

            e = engine
            kwargs = {"vllm_config": cpu_vllm_config(
                max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
                max_model_len=e.max_model_len, async_scheduling=e.async_scheduling,
                num_blocks=config.fake_num_blocks, prefix_caching=e.enable_prefix_caching,
                tokenizer=e.extra.get("skip_tokenizer_init") is False,
            ), "executor_class": FakeExecutor}
        units.append(VllmUnit(i, engine, settings, hang_s=config.engine_hang_s, history=LIVE_HISTORY, **kwargs))
    return units


def start_units(units: Sequence[VllmUnit], out: TextIO | None = None) -> None:
    """Start the engines one after another (each measures the free GPU memory the previous ones left)."""
    out = out if out is not None else sys.stderr  # read now: a default would keep the stderr of the import
    for unit in units:
        t = time.monotonic()
        try:
            unit.start()
        except Exception as exc:  # vLLM's reason, on one line: the model, the memory, the device...
            raise AgentStartError(f"unit {unit.unit_id} did not start: {type(exc).__name__}: {exc}") from exc
        print(f"trackside agent: unit {unit.unit_id} started in {time.monotonic() - t:.1f} s "
              f"({unit.num_blocks} KV blocks of {unit.block_size} tokens)", file=out, flush=True)


async def start_openai(config: VllmAgentConfig, cluster: LiveCluster[VllmUnit], hub: Hub, node_id: str,
                       out: TextIO) -> Any:
    """Serve the OpenAI port: in this process, or from ``config.openai_frontends`` front-end processes."""
    from agent.engine.vllm.openai_app import frontend_tokens

    assert config.serve_openai is not None
    args = frontend_tokens(config.openai_args)

    def say(text: str) -> None:
        print(f"trackside agent: {text}", file=out, flush=True)

    openai: Any
    if config.openai_frontends:
        from agent.service.frontends import FrontendStartError, start_frontends

        try:
            return await start_frontends(cluster, config.openai_frontends, *config.serve_openai, hub=hub, say=say,
                                         model_name=config.model_name, frontend_args=args,
                                         follow_units=config.openai_reuse_port, node_id=node_id, uvloop=config.uvloop)
        except FrontendStartError as exc:
            raise AgentStartError(f"the OpenAI front ends did not start: {exc}") from None
    from agent.service.openai_server import OpenAIServer

    openai = OpenAIServer(cluster, *config.serve_openai, model_name=config.model_name, frontend_args=args,
                          metrics=hub.metrics_text, reuse_port=config.openai_reuse_port, node_id=node_id, say=say)
    await openai.start()
    say(f"OpenAI API at {openai.base_url}")
    return openai


def runnable(requests: Sequence[RequestSpec], max_model_len: int) -> list[RequestSpec]:
    """The requests whose prompt and output fit the model's length."""
    return [r for r in requests if r.prompt_tokens + r.output_tokens <= max_model_len]


async def run_agent(
    config: VllmAgentConfig, *, node_id: str, token: str, host: str, port: int, tls: ssl.SSLContext | None = None,
    read_token: str = "", replay_events: int = 65536, slack_sample_ms: float = 250.0, stop: asyncio.Event | None = None,
    install_signals: bool = True, out: TextIO | None = None, limits: ConnectionLimits | None = None,
) -> int:
    """Start the units and serve them until ``stop`` (or SIGINT/SIGTERM), or until a replayed workload is done when
    there is no OpenAI intake. Returns the exit status."""
    out = out if out is not None else sys.stderr  # read now: a default would keep the stderr of the import
    stop = stop or asyncio.Event()
    if install_signals:
        stop_on_signals(stop)
    # Policies are built (and checked) before any engine starts; the agent keeps one copy per unit.
    policies = [make_batch_policy(config.batch_policy, dict(config.batch_params)) for _ in range(config.units)]
    dispatcher = make_dispatch_policy(config.dispatch, dict(config.dispatch_params))
    units = build_units(replace(config, batch_params=dict(policies[0].params)))
    try:
        start_units(units, out)
        model_config = units[0].llm.model_config
        requests = runnable(config.requests, int(model_config.max_model_len))
        if len(requests) < len(config.requests):
            print(f"trackside agent: {len(config.requests) - len(requests)} requests longer than the model's "
                  f"{model_config.max_model_len} tokens left out", file=out)
        cluster = LiveCluster(units, dispatcher, ttft_slo_s=config.ttft_slo_s, tpot_slo_s=config.tpot_slo_s,
                              restart_delays=backoff if config.restart else None,
                              restart_attempts=config.restart_attempts,
                              pending_timeout_s=config.pending_timeout_s)
        node = LiveClusterNode(cluster, policies, requests=requests, vocab=int(model_config.get_vocab_size()),
                               seed=config.seed)
        hub = Hub(node, node_id=node_id, profile=config.model_name, token=token, read_token=read_token,
                  replay_capacity=replay_events, slack_sample_ms=slack_sample_ms, boot_ns=node.origin_ns,
                  placements={p.unit_id: p for p in config.placements})

        def banner(url: str) -> str:
            loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]  # asyncio, or uvloop (--uvloop)
            return (f"trackside agent {node_id}: {url} ({len(units)} vLLM units of {config.model_name}, "
                    f"batch policy {config.batch_policy}, dispatch {dispatcher.name}, {loop_name} event loop"
                    f"{f', {len(requests)} requests to replay' if requests else ''})")

        openai = (lambda: start_openai(config, cluster, hub, node_id, out)) if config.serve_openai else None
        await serve_live(node, hub, Listen(host, port, tls, limits), stop=stop, banner=banner, start_intake=openai,
                         out=out)
    finally:
        for unit in units:
            with contextlib.suppress(Exception):
                await unit.stop()
    return 0
