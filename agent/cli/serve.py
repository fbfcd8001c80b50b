"""``trackside agent``, ``trackside ctl`` and ``trackside record``: the live agent, its control, its recorder.

``agent`` runs simulated units live (wall clock, ``--speed`` times real time; ``--runtime live``: each stepping by
itself under the runtime of vLLM units, ``agent.service.live_agent``) behind the websocket server, or
(``--engine vllm``) vLLM engines, optionally behind an OpenAI-compatible intake (``agent.service.launch``);
``ctl`` sends one control request and prints the reply (exit 2 with one line on an error reply, 1 when the
agent cannot be reached); ``record`` subscribes to agents and writes their events to a store through
:mod:`store.recorder` (the recorder a live console uses too), resuming each agent where the store stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from websockets.exceptions import InvalidURI, WebSocketException

from agent.bench.runner import TOPOLOGIES, BenchConfig, build_node, split_params
from agent.cli.agent_live import LIVE_ONLY, SIM_LIVE_ONLY, SIM_OPENAI, add_live_options, cmd_agent_sim_live
from agent.cli.agent_vllm import VLLM_ONLY, add_vllm_options, cmd_agent_vllm
from agent.cli.common import ServeError, agent_tokens, csv_items, load_policy_plugins, parse_listen
from agent.cli.connections import add_connection_options, connection_limits
from agent.cli.ctl import EXIT_ERROR_REPLY, EXIT_UNREACHABLE, call_agent, ctl_many, render_reply, split_uris
from agent.cli.node_config import NodeConfigError, expand_node_config
from agent.engine.profiles import load_profile
from agent.runtime.node import Node
from agent.service.guard import ConnectionLimits
from agent.service.hub import Hub
from agent.service.server import AgentServer, server_ssl_context
from agent.telemetry import (
    ControlRequest,
    DrainUnit,
    DryRun,
    ErrorReply,
    Event,
    FailUnit,
    ListPolicies,
    NodeHello,
    PauseUnit,
    RecoverUnit,
    ResumeUnit,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    Status,
)
from agent.telemetry.client import (
    AgentError,
    CaFileError,
    CertificateError,
    TokenFileError,
    client_ssl_context,
    read_token,
    unreachable,
)
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec
from policies.params import parse_assignments

if TYPE_CHECKING:
    from agent.cli.advisor import Advisor, AdvisorSettings
    from store.recorder import EventWriter

RECORDER_MEMORY_LIMIT = "128MB"
"""What ``trackside record`` lets DuckDB keep in memory by default (docs/benchmarks.md, "A live agent's memory")."""
log = logging.getLogger("trackside")


def add_serve_commands(sub: Any) -> None:
    """Add ``agent``, ``ctl`` and ``record`` to the ``trackside`` subparsers."""
    agent = sub.add_parser(
        "agent", help="run simulated units or vLLM engines live behind the websocket server",
        description="Run a node live (wall clock) and serve its telemetry, control and /metrics on a websocket. "
        "--engine sim (default) replays a workload through simulated units (--runtime live: under the runtime "
        "vLLM engines run, with engine deaths and restarts); --engine vllm runs vLLM engines as "
        "units (their steps scheduled by the batch policy, requests placed by the dispatch policy) and serves "
        "them over the OpenAI API (--serve-openai), replays a workload, or both: the same telemetry and "
        "control as simulated units. Stops on SIGINT/SIGTERM, or when the workload ends (without "
        "--serve-openai).",
        epilog="Example: trackside agent --engine vllm --model /models/Llama-3.1-8B-Instruct --units 2 "
        "--gpu-memory-utilization 0.45 --batch-policy fairbatching --dispatch sbs --serve-openai 127.0.0.1:8000. "
        "On a CPU: trackside agent --engine vllm --fake-executor --units 2 --serve-openai 127.0.0.1:8000. "
        "An 8-GPU node, a 70B model as 2 units of TP 4: trackside agent --engine vllm --model /models/Llama-3.1-70B "
        "--gpus 0-7 --tensor-parallel-size 4 --engine-arg kv_cache_dtype=fp8 --serve-openai 0.0.0.0:8000 --dry-run "
        "(prints the units, their GPUs and engine arguments as JSON). Node config files: examples/nodes/.",
    )
    add_agent_arguments(agent)

    ctl = sub.add_parser("ctl", help="send one control request to an agent and print the reply")
    ctl.add_argument("uri", help="ws://HOST:PORT or wss://HOST:PORT (IPv6: ws://[::1]:7700); several agents "
                     "(the agents of one node): URI,URI,... (a change is applied only if every agent accepts it in "
                     "a dry run first)")
    ctl.add_argument("--token-file", type=Path,
                     help="the agent's control token; for status and policies its read token does too")
    add_ca_file_option(ctl)
    ctl.add_argument("--json", action="store_true", help="print the reply as JSON")
    ctl.add_argument("--dry-run", action="store_true", help="validate a set-* change without applying it")
    actions = ctl.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("status", help="the node: dispatcher, units, their modes and policies")
    actions.add_parser("policies", help="every batch and dispatch policy with its parameters")
    sp = actions.add_parser("set-policy", help="swap the batch policy of some units (default every unit)")
    sp.add_argument("--unit", type=int, action="append", help="unit id (repeatable; default every unit)")
    sp.add_argument("name")
    sp.add_argument("--param", action="append", default=[], metavar="K=V")
    sd = actions.add_parser("set-dispatch", help="swap the dispatch policy")
    sd.add_argument("name")
    sd.add_argument("--param", action="append", default=[], metavar="K=V")
    pa = actions.add_parser("set-param", help="change live parameters of the batch (or dispatch) policy")
    pa.add_argument("--unit", type=int, action="append")
    pa.add_argument("--dispatch", action="store_true", help="change the dispatcher's parameters")
    pa.add_argument("assignments", nargs="+", metavar="K=V")
    modes = {"pause": "stop a unit's steps (its requests wait on it) and close it to new requests",
             "drain": "close a unit to new requests; it finishes its own", "resume": "open a paused or drained unit"}
    for mode, what in modes.items():
        actions.add_parser(mode, help=what).add_argument("--unit", type=int, required=True)
    fail = actions.add_parser(
        "fail-unit", help="take a unit out as a failure would: its requests go on other units, it stays failed "
        "(a vLLM engine keeps running, not restarted) until recover-unit")
    fail.add_argument("--unit", type=int, required=True)
    fail.add_argument("--reason", default="", help="said in the unit_failed alert and the unit's failure")
    actions.add_parser(
        "recover-unit", help="bring a failed unit back, empty (a vLLM unit whose engine is dead is restarted now)",
    ).add_argument("--unit", type=int, required=True)

    rec = sub.add_parser("record", help="subscribe to agents and write their events to a store")
    rec.add_argument("uris", nargs="+", metavar="URI")
    rec.add_argument("--db", type=Path, required=True)
    rec.add_argument("--token-file", type=Path,
                     help="a token for agents that have a read token (their read token, or their control token); "
                     "with --advise-every, the control token lets the advisor post its recommendations as alerts "
                     "(and --autopilot apply them)")
    add_ca_file_option(rec)
    rec.add_argument("--flush-s", type=float, default=1.0, help="flush at least this often (default 1 s)")
    rec.add_argument("--memory-limit", default=RECORDER_MEMORY_LIMIT, metavar="SIZE",
                     help="what DuckDB may keep in memory, its cache of the growing file included (DuckDB's sizes: "
                     f"128MB, 2GB...; default {RECORDER_MEMORY_LIMIT}; 'default': DuckDB's own, 80%% of the machine)")
    rec.add_argument("--retention", type=_duration_s, metavar="DURATION",
                     help="keep this much history (e.g. 7d, 12h, 1h30m): older events are deleted at the start "
                     "and then every tenth of it, at most an hour apart (default: keep everything)")
    add_advisor_options(rec)


def add_advisor_options(rec: argparse.ArgumentParser) -> None:
    """``trackside record``'s advisor and autopilot (``agent.cli.advisor``)."""
    adv = rec.add_argument_group(
        "advisor", "every period, replay each node's last window of recorded traffic under other policies (the "
        "what-if of `trackside whatif`); when a candidate beats the running policy by more than --advise-min-gain "
        "and the replay of the running policy is within 10% of the record (goodput, SLO attainment), post a "
        "`recommendation` alert on the node's stream (the console's Overview lists it; it needs the agent's control "
        "token in --token-file, else it is only printed). Nothing is applied without --autopilot. Each period's "
        "outcome is a line on stderr")
    adv.add_argument("--advise-every", type=_duration_s, metavar="DURATION",
                     help="run the advisor every DURATION of wall-clock time (e.g. 5m; at least 10s); off without it")
    adv.add_argument("--advise-window", type=_duration_s, metavar="DURATION",
                     help="the window replayed: the last DURATION of each node's traffic up to its latest recorded "
                     "arrival, by the node's clock (default: the period)")
    adv.add_argument("--advise-compare", metavar="P1,P2,...",
                     help="candidate batch policies (default every built-in one)")
    adv.add_argument("--advise-dispatch", metavar="D1,D2,...",
                     help="candidate dispatch policies (default the one the node runs)")
    adv.add_argument("--advise-min-gain", type=float, default=0.05, metavar="FRACTION",
                     help="the least effective-RPS gain over the replayed running policy worth a recommendation "
                     "(default 0.05; a replay further from the record than that needs its own error's worth)")
    adv.add_argument("--advise-jobs", type=int, metavar="N",
                     help="replays at once, in worker processes at a lower priority (default half the CPUs)")
    adv.add_argument("--autopilot", action="store_true",
                     help="apply a recommendation (needs --advise-every and the control token in --token-file): its "
                     "dry run first (refused: nothing applied, an alert says why), then the swap, audited by the "
                     "agent; after a full window, roll back to the last good policy if SLO attainment dropped by "
                     "more than --rollback-drop (audited too, with an alert that says why). At most one swap per "
                     "node and period, none while a rollback check is pending")
    adv.add_argument("--rollback-drop", type=float, default=0.05, metavar="FRACTION",
                     help="--autopilot: the drop in SLO attainment (absolute: 0.05 is 5 points) over the window after "
                     "a swap, against the window that recommended it, that rolls the swap back (default 0.05)")


def add_ca_file_option(parser: argparse.ArgumentParser) -> None:
    """A client's ``--ca-file``: the CA that ``wss://`` agents' certificates are verified with."""
    parser.add_argument("--ca-file", type=Path, metavar="PEM",
                        help="verify wss:// agents' certificates with the CA certificates in this file, and only "
                        "them (host names checked; default: the system's trust store)")


def add_agent_arguments(agent: argparse.ArgumentParser) -> None:
    """The flags of ``trackside agent`` (every one a key of a node config file, ``agent.cli.node_config``)."""
    agent.add_argument("--config", type=Path, metavar="FILE",
                       help="a node config file (TOML): every flag as a key, an [engine] table of engine arguments, "
                       "[unit.N] tables for one unit's; the command line overrides it (docs/vllm.md)")
    agent.add_argument("--dry-run", action="store_true",
                       help="--engine vllm: resolve the units, each unit's GPUs and engine arguments and the "
                       "tokenizer, print them as JSON and exit (starts nothing, needs no GPU or model)")
    agent.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                       help="sim: simulated units (default); vllm: vLLM engines (needs the vllm extra)")
    src = agent.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="SPEC", help="synthetic workload NAME[:key=value,...]")
    src.add_argument("--trace", type=Path, help="trace file (Azure CSV or trackside JSONL)")
    agent.add_argument("--units", type=int, help="DP units (default 4 simulated; vLLM engines: one per TP×PP GPUs "
                       "of --gpus, else 1)")
    agent.add_argument("--batch-policy", default="vllm", help="per-step batch policy (default vllm)")
    agent.add_argument("--dispatch", default="least_loaded", help="dispatch policy (default least_loaded)")
    agent.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                       help="policy parameter (repeatable); POLICY.NAME=VALUE targets one policy")
    agent.add_argument("--profile",
                       help="calibration profile (default h100-llama31-8b), or a file from `trackside calibrate`; "
                       "for vLLM engines the policies' prior step model (default: the scheduler's)")
    agent.add_argument("--seed", type=int, default=0, help="random seed of the synthetic workload")
    agent.add_argument("--slo-ttft-ms", type=float, default=500.0, help="TTFT target in ms (default 500)")
    agent.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT target in ms (default 50)")
    agent.add_argument("--topology", choices=TOPOLOGIES, default="colocated",
                       help="colocated (default) or disaggregated prefill and decode pools")
    agent.add_argument("--prefill-units", type=int, help="disaggregated: units in the prefill pool (default half)")
    agent.add_argument("--lockstep", action="store_true", help="DP+EP: all units step together")
    agent.add_argument("--instance-size", type=int, default=0, metavar="M",
                       help="seed 000's instances: consecutive groups of M units step in lockstep, the instances out "
                       "of phase (default 0: none)")
    agent.add_argument("--migration", choices=("live", "recompute"),
                       help="how moved requests' KV travels (default live; live units move requests by recompute)")
    agent.add_argument("--listen", default="127.0.0.1:7700", metavar="HOST:PORT", help="default 127.0.0.1:7700")
    agent.add_argument("--token-file", type=Path, help="control token (without it, control is disabled)")
    agent.add_argument("--read-token-file", type=Path,
                       help="read-only token for dashboards: with it, status, policies and the event stream need this "
                       "token or the control token (without it they need none); it can change nothing")
    agent.add_argument("--speed", type=float, default=1.0, help="node seconds per real second (default 1)")
    agent.add_argument("--node-id", default=socket.gethostname())
    agent.add_argument("--replay-events", type=int, default=65536, help="events kept for resumes")
    agent.add_argument("--slack-sample-ms", type=float, default=250.0, metavar="MS",
                       help="node time between slack samples of the running requests (default 250, 0: off)")
    agent.add_argument("--tls-cert", type=Path)
    agent.add_argument("--tls-key", type=Path)
    add_connection_options(agent)
    add_live_options(agent)
    add_vllm_options(agent)


def agent_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``trackside agent``'s flags on a parser of their own (no ``--help``): what a node config file may say."""
    parser = parser_class(prog="trackside agent", add_help=False)
    add_agent_arguments(parser)
    return parser


# -- agent --------------------------------------------------------------------------------------------------
def make_node(config: BenchConfig, requests: Sequence[RequestSpec], *, keep_finished: bool = True) -> Node:
    """Fresh simulated units and dispatcher for ``config`` (requests too long for the model are dropped);
    ``keep_finished=False`` for a live agent (``Node.states`` then holds only the requests in flight)."""
    profile = load_profile(config.profile)
    batch_params, dispatch_params = split_params(config.params, config.batch_policy, config.dispatch)
    runnable = [r for r in requests if r.prompt_tokens < profile.max_model_len]
    return build_node(config, profile, runnable, batch_params, dispatch_params, keep_finished=keep_finished)




def cmd_agent(args: argparse.Namespace, console: object = None) -> int:
    if (args.units is not None and args.units < 1) or args.speed <= 0:
        raise ServeError("--units must be >= 1 and --speed > 0")
    if not args.slack_sample_ms >= 0:
        raise ServeError("--slack-sample-ms must be >= 0 (0: no slack samples)")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ServeError("--tls-cert and --tls-key go together")
    if args.engine == "vllm":
        return cmd_agent_vllm(args)
    live = args.runtime == "live"
    given = [name for name in VLLM_ONLY if getattr(args, name) not in (None, False, [])]
    if args.load_format != "auto":
        given.append("load_format")
    if given and given[0] in SIM_OPENAI and not live:
        raise ServeError(f"--{given[0].replace('_', '-')} on simulated units needs --runtime live (vLLM's OpenAI "
                         "app over units that step by themselves in wall time), or --engine vllm")
    given = [name for name in given if not (live and name in SIM_OPENAI)]
    if given or not args.async_scheduling:
        flag = "--" + (given[0] if given else "no_async_scheduling").replace("_", "-")
        raise ServeError(f"{flag} applies to --engine vllm")
    if not live:
        given = [name for name in (*LIVE_ONLY, *SIM_LIVE_ONLY) if getattr(args, name) not in (None, False, [])]
        if given:
            whose = ("simulated units with --runtime live" if given[0] in SIM_LIVE_ONLY
                     else "live units: --engine vllm, or simulated units with --runtime live")
            raise ServeError(f"--{given[0].replace('_', '-')} applies to {whose}")
    if args.workload is None and args.trace is None and not (live and args.serve_openai):
        raise ServeError("simulated units replay a workload: give --workload SPEC or --trace FILE (with --runtime "
                         "live, --serve-openai HOST:PORT takes requests instead)")
    args.units = 4 if args.units is None else args.units
    args.profile = args.profile or "h100-llama31-8b"
    host, port = parse_listen(args.listen)
    token, read_only = agent_tokens(args)
    requests: Sequence[RequestSpec] = ()
    if args.trace is not None:
        requests = load_trace(args.trace)
    elif args.workload is not None:
        requests = parse_workload(args.workload, seed=args.seed)
    config = BenchConfig(profile=args.profile, units=args.units, batch_policy=args.batch_policy,
                         dispatch=args.dispatch, params=parse_assignments(args.param), ttft_slo_ms=args.slo_ttft_ms,
                         tpot_slo_ms=args.slo_tpot_ms, seed=args.seed, topology=args.topology,
                         prefill_units=args.prefill_units, lockstep=args.lockstep,
                         instance_size=args.instance_size, migration=args.migration or "live")
    try:
        config.roles()
        config.lockstep_groups()
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if live:
        return cmd_agent_sim_live(args, config, requests, host=host, port=port, token=token, read_token=read_only)
    node = make_node(config, requests, keep_finished=False)  # it may run for months: in flight only
    hub = Hub(node, node_id=args.node_id, profile=args.profile, token=token, read_token=read_only,
              replay_capacity=args.replay_events, slack_sample_ms=args.slack_sample_ms)
    tls = server_ssl_context(str(args.tls_cert), str(args.tls_key)) if args.tls_cert else None
    limits = connection_limits(args)
    if not token:
        print("trackside agent: no --token-file: control is disabled (read-only)", file=sys.stderr)
    try:
        return asyncio.run(_serve(hub, node, host, port, args.speed, tls, limits))
    except OSError as exc:  # the port is taken, the address is not ours
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def _serve(
    hub: Hub, node: Node, host: str, port: int, speed: float, tls: Any, limits: ConnectionLimits | None = None
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AgentServer(hub, host=host, port=port, speed=speed, ssl_context=tls, limits=limits) as server:
        print(f"trackside agent {hub.node_id}: {server.url} ({len(node.units)} units, "
              f"{len(node.arrivals)} requests, speed {speed:g})", file=sys.stderr, flush=True)
        done = asyncio.create_task(server.workload_done.wait())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([done, stopped], return_when=asyncio.FIRST_COMPLETED)
        for task in (done, stopped):
            task.cancel()
        await server.drain(2.0)
        print(f"trackside agent: {'workload done' if server.workload_done.is_set() else 'stopped'}: "
              f"{node.num_finished} finished, {node.num_rejected} refused, {len(node.unfinished())} in flight, "
              f"{hub.sequencer.last_seq} events", file=sys.stderr)
    return 0




# -- ctl ----------------------------------------------------------------------------------------------------
def ctl_request(args: argparse.Namespace) -> ControlRequest:
    """The request ``trackside ctl`` sends for its parsed arguments."""
    action = args.action
    units = tuple(args.unit or ()) if action in ("set-policy", "set-param") else ()
    request: ControlRequest
    if action == "status":
        request = Status()
    elif action == "policies":
        request = ListPolicies()
    elif action == "set-policy":
        request = SetBatchPolicy(policy=args.name, params=dict(parse_assignments(args.param)), unit_ids=units)
    elif action == "set-dispatch":
        request = SetDispatchPolicy(policy=args.name, params=dict(parse_assignments(args.param)))
    elif action == "set-param":
        request = SetParams(target="dispatch" if args.dispatch else "batch",
                            params=dict(parse_assignments(args.assignments)), unit_ids=units)
    elif action == "pause":
        request = PauseUnit(unit_id=args.unit)
    elif action == "drain":
        request = DrainUnit(unit_id=args.unit)
    elif action == "fail-unit":
        request = FailUnit(unit_id=args.unit, reason=args.reason)
    elif action == "recover-unit":
        request = RecoverUnit(unit_id=args.unit)
    else:
        request = ResumeUnit(unit_id=args.unit)
    if args.dry_run:
        if not isinstance(request, SetBatchPolicy | SetDispatchPolicy | SetParams):
            raise ServeError(f"--dry-run applies to set-policy, set-dispatch and set-param, not {action}")
        request = DryRun(change=request)
    return request


def cmd_ctl(args: argparse.Namespace, console: object = None) -> int:
    token = read_token(args.token_file)
    ssl_context = client_ssl_context(args.ca_file)
    request = ctl_request(args)
    uris = split_uris(args.uri)
    if len(uris) != 1:  # several agents (trackside agent --agents N): a change everywhere or nowhere
        return ctl_many(uris, token, request, ssl_context, as_json=args.json)
    try:
        reply = asyncio.run(call_agent(args.uri, token, request, ssl_context))
    except (OSError, TimeoutError, WebSocketException) as exc:
        print(f"trackside ctl: {unreachable(args.uri, exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(msgspec.json.encode(reply).decode())
    if isinstance(reply, ErrorReply):
        print(f"trackside ctl: error: {reply.code}: {reply.message}", file=sys.stderr)
        return EXIT_ERROR_REPLY
    if not args.json:
        print(render_reply(reply))
    return 0


# -- record -------------------------------------------------------------------------------------------------
def _duration_s(text: str) -> float:
    from store.cli import duration_s  # lazily, as the recorder: the store loads only when recording

    return duration_s(text)


def cmd_record(args: argparse.Namespace, console: object = None) -> int:
    ssl_context = client_ssl_context(args.ca_file)
    token = read_token(args.token_file)
    advise = advisor_settings(args, token)
    limit = None if args.memory_limit == "default" else args.memory_limit
    return asyncio.run(record(args.uris, args.db, flush_s=args.flush_s, retention_s=args.retention,
                              install_signals=True, ssl_context=ssl_context, token=token, advise=advise,
                              memory_limit=limit))


def advisor_settings(args: argparse.Namespace, token: str) -> AdvisorSettings | None:
    """The advisor ``trackside record``'s flags ask for (None: none); raises :class:`ServeError` for flags that do
    not go together, ``UnknownPolicyError`` for a candidate that does not exist."""
    from agent.cli.advisor import MIN_PERIOD_S, AdvisorSettings, default_jobs
    from policies.registry import batch_policy_class, dispatch_policy_class

    if args.advise_every is None:
        given = [flag for flag, value in (("--advise-window", args.advise_window),
                                          ("--advise-compare", args.advise_compare),
                                          ("--advise-dispatch", args.advise_dispatch),
                                          ("--advise-jobs", args.advise_jobs), ("--autopilot", args.autopilot or None))
                 if value is not None]
        if given:
            raise ServeError(f"{given[0]} needs --advise-every DURATION (the advisor's period)")
        return None
    if args.advise_every < MIN_PERIOD_S:
        raise ServeError(f"--advise-every must be at least {MIN_PERIOD_S:g}s (a what-if takes seconds)")
    if args.autopilot and not token:
        raise ServeError("--autopilot needs --token-file with the agents' control token")
    if args.advise_jobs is not None and args.advise_jobs < 1:
        raise ServeError("--advise-jobs must be >= 1")
    if not (args.advise_min_gain >= 0 and 0 < args.rollback_drop <= 1):
        raise ServeError("--advise-min-gain must be >= 0 and --rollback-drop in (0, 1]")
    load_policy_plugins()
    compare = tuple(csv_items(args.advise_compare or ""))
    dispatch = tuple(csv_items(args.advise_dispatch or ""))
    for name in compare:
        batch_policy_class(name)
    for name in dispatch:
        dispatch_policy_class(name)
    return AdvisorSettings(every_s=args.advise_every, window_s=args.advise_window, compare=compare, dispatch=dispatch,
                           min_gain=args.advise_min_gain, autopilot=args.autopilot, rollback_drop=args.rollback_drop,
                           jobs=args.advise_jobs or default_jobs())


async def record(
    uris: Sequence[str], db: Path, *, flush_s: float = 1.0, writer_factory: Callable[[Path], EventWriter] | None = None,
    stop: asyncio.Event | None = None, install_signals: bool = False, retention_s: float | None = None,
    ssl_context: ssl.SSLContext | None = None, token: str = "", advise: AdvisorSettings | None = None,
    advisor: Advisor | None = None, memory_limit: str | None = None,
) -> int:
    """``trackside record`` without its command line: :func:`store.recorder.record_agents` until ``stop`` (or a
    signal), saying which node each agent is and logging the agents' notices; the exit status (2 when an agent
    refuses the subscription, a URI is not an agent's, or the store cannot be opened, e.g. another process writes it;
    1 when a ``wss://`` agent's certificate does not verify with ``ssl_context``). ``token`` goes with every
    subscription (agents with a read token need it, or their control token). ``advise``: run the advisor beside
    (``agent.cli.advisor``; with ``token``, it posts its recommendations with it), or ``advisor``, one made already.
    ``memory_limit``: DuckDB's, for the store the default writer opens (``store.schema.connect``)."""
    from store.recorder import Recorder, record_agents  # lazily: the store is optional for everything else
    from store.schema import StoreError, StoreLockedError

    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    if advisor is None and advise is not None:
        from agent.cli.advisor import Advisor, SessionControl

        advisor = Advisor(advise, control=SessionControl(token, ssl_context) if token else None)
    on_hello = _print_hello
    companion = None
    if advisor is not None:
        from agent.cli.advisor_window import advise_beside

        adv = advisor

        def on_hello(uri: str, hello: NodeHello) -> None:
            _print_hello(uri, hello)
            adv.watch(uri, hello)

        async def companion(recorder: Recorder) -> None:
            await advise_beside(recorder, adv)

        print(f"trackside record: advisor: every {adv.settings.every_s:g} s on the last {adv.settings.window:g} s of "
              f"each node's traffic" + (", autopilot on" if adv.settings.autopilot else
                                        "" if adv.control is not None else
                                        " (no --token-file: recommendations are printed here only)"),
              file=sys.stderr, flush=True)
    if writer_factory is None and memory_limit is not None:
        from store.writer import StoreWriter

        def writer_factory(path: Path) -> EventWriter:
            return StoreWriter(path, memory_limit=memory_limit)

    try:
        await record_agents(uris, db, stop=stop, writer_factory=writer_factory, flush_s=flush_s,
                            retention_s=retention_s, on_hello=on_hello, on_notice=_log_notice,
                            ssl_context=ssl_context, token=token, companion=companion)
    except StoreLockedError as exc:
        print(f"trackside record: error: cannot record to {db}: {exc.holder or 'another process'} has it open, and "
              "DuckDB allows one writer per file: stop that process or give another --db", file=sys.stderr)
        return EXIT_ERROR_REPLY
    except (AgentError, StoreError) as exc:
        print(f"trackside record: error: {exc}", file=sys.stderr)
        return EXIT_ERROR_REPLY
    except CertificateError as exc:
        print(f"trackside record: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except InvalidURI as exc:
        print(f"trackside record: error: {unreachable(exc.uri, exc)}", file=sys.stderr)
        return EXIT_ERROR_REPLY
    return 0


def _print_hello(uri: str, hello: NodeHello) -> None:
    print(f"trackside record: {uri}: node {hello.node_id}", file=sys.stderr)


def _log_notice(uri: str, notice: Event) -> None:
    log.warning("%s: %s", uri, getattr(notice, "message", notice))


SERVE_COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "agent": cmd_agent, "ctl": cmd_ctl, "record": cmd_record,
}
HANDLED_ERRORS: tuple[type[Exception], ...] = (ServeError, AgentError, TokenFileError, CaFileError)
"""Errors the ``trackside`` main prints as one line with exit status 2 (besides its own)."""


def with_node_config(argv: Sequence[str] | None) -> list[str]:
    """The command line (``sys.argv[1:]`` for None) with a ``trackside agent --config FILE``'s settings put before
    the agent's own arguments (:mod:`agent.cli.node_config`); raises :class:`NodeConfigError`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "agent":
        return args
    return ["agent", *expand_node_config(args[1:], agent_parser)]


def main(argv: Sequence[str] | None = None) -> int:
    """These three commands alone (``python -m agent.cli.serve``), with ``trackside``'s error handling."""
    from agent.engine.profiles import UnknownProfileError
    from agent.workload.types import WorkloadError
    from policies.params import ParamError
    from policies.registry import UnknownPolicyError

    errors: tuple[type[Exception], ...] = (
        *HANDLED_ERRORS, WorkloadError, ParamError, UnknownPolicyError, UnknownProfileError,
    )
    parser = argparse.ArgumentParser(prog="trackside")
    add_serve_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    try:
        argv = with_node_config(argv)
    except NodeConfigError as exc:
        print(f"trackside agent: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.argv = argv  # as given, the config file expanded (trackside agent --agents starts its agents with it)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "agent":
        load_policy_plugins()
    try:
        return SERVE_COMMANDS[args.command](args, None)
    except errors as exc:
        message = str(exc.args[0]) if exc.args else str(exc)
        print(f"trackside {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
