"""``trackside agent``'s flags for units that step on their own (vLLM engines, and simulated units with
``--runtime live``), and the simulated agent under the live runtime (:mod:`agent.service.live_agent`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agent.bench.runner import BenchConfig, split_params, unit_makers
from agent.cli.common import ServeError, parse_listen
from agent.cli.connections import connection_limits
from agent.engine.profiles import load_profile
from agent.runtime.live.cluster import RESTART_ATTEMPTS
from agent.telemetry.client import host_port
from agent.workload.types import RequestSpec

if TYPE_CHECKING:
    from agent.engine.vllm.sim_model import SimTokenizer

LIVE_ONLY = ("no_restart", "restart_attempts", "engine_hang_s", "pending_timeout_s")
"""Flags of live units (``--engine vllm``, or ``--runtime live``): a simulated agent on the discrete-event node
refuses them."""
SIM_LIVE_ONLY = ("kill_engine", "hang_engine", "sim_tokenizer")
"""Flags of simulated units under the live runtime only."""
SIM_OPENAI = ("serve_openai", "served_model_name", "openai_arg", "openai_reuse_port", "openai_frontends",
              "sim_tokenizer")
"""Flags of the vLLM group that simulated units take under the live runtime too: vLLM's OpenAI app in front of them
(``agent.engine.vllm.sim_model``)."""
DISCRETE_ONLY = {"topology": "colocated", "prefill_units": None, "lockstep": False, "instance_size": 0,
                 "migration": None, "speed": 1.0}
"""Flags of simulated units on the discrete-event node only, with their defaults (a live runtime refuses any other
value): the node decides when each unit steps (lockstep), moves KV between units (disaggregated pools, live
migration) and runs at any speed; live units step by themselves in wall time and move requests by recompute."""


def add_live_options(agent: argparse.ArgumentParser) -> None:
    """The options of live units: restarts, the hang watchdog, the pending timeout, and simulated faults."""
    v = agent.add_argument_group("live units (--engine vllm, or simulated units with --runtime live)")
    v.add_argument("--runtime", choices=("discrete", "live"),
                   help="simulated units: discrete (default), the discrete-event node decides when each unit steps "
                   "(--speed, lockstep, disaggregated pools, migrations that move KV); live, each unit steps by "
                   "itself in wall time under the runtime that vLLM units run (engine deaths, restarts with backoff, "
                   "the hang watchdog, the pending timeout, migration by recompute; --serve-openai puts vLLM's OpenAI "
                   "app in front, with the vllm extra). vLLM units are always live")
    v.add_argument("--no-restart", action="store_true",
                   help="leave a unit whose engine died failed (default: restart it, after 1 s doubling to 60 s)")
    v.add_argument("--restart-attempts", type=int, metavar="N",
                   help="give up restarting a failed unit after N attempts that could not start an engine (it stays "
                   f"failed until `ctl recover-unit`; default {RESTART_ATTEMPTS}, about 5 minutes of backoff; 0: never "
                   "give up)")
    v.add_argument("--engine-hang-s", type=float, metavar="S",
                   help="an engine that makes no step for this long while its unit has requests is hung: it is "
                   "killed and its unit failed like a dead one (default 60; 0: never)")
    v.add_argument("--pending-timeout-s", type=float, metavar="S",
                   help="a request no unit took within this long is rejected (default 30; 0: it waits for ever)")
    v.add_argument("--kill-engine", action="append", default=[], metavar="UNIT@S",
                   help="--runtime live: the simulated engine of UNIT dies S seconds after the agent serves (with "
                   "--serve-openai: once the OpenAI port is up), as an engine core killed by the OS would "
                   "(repeatable): the unit fails, its requests go on elsewhere by recompute, and it is restarted "
                   "unless --no-restart")
    v.add_argument("--hang-engine", action="append", default=[], metavar="UNIT@S",
                   help="--runtime live: the simulated engine of UNIT stops making progress S seconds after the agent "
                   "serves, without dying (repeatable): the watchdog kills it after --engine-hang-s")


def check_live_options(args: argparse.Namespace) -> None:
    """Raise :class:`ServeError` for a live option out of range."""
    if args.restart_attempts is not None and args.restart_attempts < 0:
        raise ServeError("--restart-attempts must be >= 0 (0: no limit)")
    for flag in ("engine_hang_s", "pending_timeout_s"):
        if getattr(args, flag) is not None and not getattr(args, flag) >= 0:
            raise ServeError(f"--{flag.replace('_', '-')} must be >= 0 (0: no limit)")


def refuse_discrete_options(args: argparse.Namespace, why: str) -> None:
    """Raise :class:`ServeError` naming the first discrete-event-node flag given (``why``: what runs instead)."""
    for name, default in DISCRETE_ONLY.items():
        if getattr(args, name) != default:
            raise ServeError(f"--{name.replace('_', '-')} applies to simulated units on the discrete-event node "
                             f"(--engine sim, --runtime discrete): {why}")


def parse_faults(args: argparse.Namespace, units: int) -> tuple[tuple[str, int, float], ...]:
    """``--kill-engine`` and ``--hang-engine`` as (kind, unit, seconds), checked against ``units``."""
    faults = []
    for kind, flag, given in (("kill", "--kill-engine", args.kill_engine), ("hang", "--hang-engine", args.hang_engine)):
        for text in given or ():
            unit, sep, at = text.partition("@")
            try:
                unit_id, at_s = int(unit), float(at)
            except ValueError:
                unit_id, at_s = -1, -1.0
            if not sep or not 0 <= unit_id < units or not at_s >= 0:
                raise ServeError(f"{flag} takes UNIT@SECONDS with a unit of 0 to {units - 1} and seconds >= 0, "
                                 f"not {text!r}")
            faults.append((kind, unit_id, at_s))
    return tuple(faults)


def check_port_sharing(args: argparse.Namespace) -> None:
    """:class:`ServeError` for ``--openai-reuse-port`` or ``--openai-frontends`` where the kernel does not spread a
    shared port's connections, or a negative ``--openai-frontends``."""
    if args.openai_frontends < 0:
        raise ServeError("--openai-frontends must be >= 0 (0: this process serves the OpenAI port)")
    spreads = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")
    if args.openai_reuse_port and not spreads:
        raise ServeError("--openai-reuse-port needs Linux: only its kernel spreads a port's connections between "
                         "the processes that share it")
    if args.openai_frontends > 1 and not spreads:
        raise ServeError("--openai-frontends N > 1 needs Linux: the front ends share one port (SO_REUSEPORT)")


def sim_openai_options(args: argparse.Namespace) -> tuple[str, int] | None:
    """``--serve-openai``'s address for simulated units, its companions checked (vLLM's parser checks
    ``--openai-arg``); :class:`ServeError` where vLLM is missing."""
    if not args.serve_openai:
        for name in SIM_OPENAI[1:]:
            if getattr(args, name):
                raise ServeError(f"--{name.replace('_', '-')} goes with --serve-openai HOST:PORT")
        return None
    if importlib.util.find_spec("vllm") is None:
        raise ServeError("--serve-openai serves vLLM's own OpenAI app, also over simulated units: pip install -e "
                         "'.[vllm]' (vLLM 0.26.0)")
    check_port_sharing(args)
    if args.openai_arg:
        from agent.engine.vllm.openai_app import FrontendArgError, frontend_namespace, frontend_tokens

        try:
            frontend_namespace("simulated", "simulated", frontend_tokens(args.openai_arg))
        except FrontendArgError as exc:
            raise ServeError(f"--openai-arg: {exc}") from None
    return parse_listen(args.serve_openai, "--serve-openai")


def load_sim_tokenizer(args: argparse.Namespace) -> SimTokenizer | None:
    """``--sim-tokenizer``'s tokenizer, loaded once here (the agent renders with it); :class:`ServeError` where the
    folder has none."""
    if not args.sim_tokenizer:
        return None
    from agent.engine.vllm.sim_model import sim_tokenizer

    try:
        return sim_tokenizer(args.sim_tokenizer)
    except ValueError as exc:
        raise ServeError(f"--sim-tokenizer {exc}") from None


def cmd_agent_sim_live(args: argparse.Namespace, bench: BenchConfig, requests: Sequence[RequestSpec], *,
                       host: str, port: int, token: str, read_token: str) -> int:
    """``trackside agent --runtime live``: ``bench``'s simulated units, each stepping by itself, under the live
    runtime (:func:`agent.service.live_agent.run_sim_agent`)."""
    from agent.service.live_agent import AgentStartError, EngineFault, Listen, SimAgentConfig, run_sim_agent
    from agent.service.server import server_ssl_context

    refuse_discrete_options(args, "with --runtime live each unit steps by itself in wall time")
    check_live_options(args)
    serve = sim_openai_options(args)
    tokenizer = load_sim_tokenizer(args)
    faults = tuple(EngineFault(*f) for f in parse_faults(args, bench.units))
    given: dict[str, Any] = {name: getattr(args, name) or None  # 0: no limit
             for name in ("engine_hang_s", "pending_timeout_s", "restart_attempts") if getattr(args, name) is not None}
    profile = load_profile(bench.profile)
    batch, dispatch = split_params(bench.params, bench.batch_policy, bench.dispatch)
    config = SimAgentConfig(
        units=unit_makers(bench, profile), profile=bench.profile, batch_policy=bench.batch_policy, batch_params=batch,
        dispatch=bench.dispatch, dispatch_params=dispatch, ttft_slo_s=bench.ttft_slo_ms / 1e3,
        tpot_slo_s=bench.tpot_slo_ms / 1e3, seed=bench.seed,
        requests=[r for r in requests if r.prompt_tokens < profile.max_model_len],  # as the discrete node's agent
        restart=not args.no_restart, faults=faults, serve_openai=serve, served_model_name=args.served_model_name,
        openai_args=tuple(args.openai_arg or ()), openai_reuse_port=args.openai_reuse_port,
        openai_frontends=args.openai_frontends, tokenizer=tokenizer, max_model_len=profile.max_model_len,
        **given)
    tls = server_ssl_context(str(args.tls_cert), str(args.tls_key)) if args.tls_cert else None
    if not token:
        print("trackside agent: no --token-file: control is disabled (read-only)", file=sys.stderr)
    listen = Listen(host, port, tls, connection_limits(args))
    try:
        return asyncio.run(run_sim_agent(config, node_id=args.node_id, token=token, read_token=read_token,
                                         listen=listen, replay_events=args.replay_events,
                                         slack_sample_ms=args.slack_sample_ms))
    except AgentStartError as exc:
        raise ServeError(str(exc)) from None
    except OSError as exc:  # a port is taken (the agent's or the OpenAI one), an address is not ours
        where = host_port(host, port) + (f" or {host_port(*serve)}" if serve else "")
        raise ServeError(f"cannot listen on {where}: {exc.strerror or exc}") from None
