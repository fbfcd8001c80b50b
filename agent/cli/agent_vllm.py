"""``trackside agent --engine vllm``: its flags, what it checks and resolves before any engine starts (``--dry-run``
prints that and stops), then the run (:mod:`agent.service.launch`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.bench.runner import split_params
from agent.cli.agent_live import SIM_LIVE_ONLY, check_live_options, check_port_sharing, refuse_discrete_options
from agent.cli.common import ServeError, agent_tokens, parse_listen
from agent.cli.connections import connection_limits
from agent.engine.profiles import load_profile
from agent.service.server import server_ssl_context
from agent.telemetry.client import host_port
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec
from policies.params import parse_assignments
from policies.registry import make_batch_policy, make_dispatch_policy

if TYPE_CHECKING:
    from agent.service.launch import VllmAgentConfig

VLLM_ONLY = ("model", "fake_executor", "serve_openai", "served_model_name", "tokenizer", "gpu_memory_utilization",
             "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enforce_eager", "gpus",
             "tensor_parallel_size", "pipeline_parallel_size", "engine_arg", "dry_run", "openai_arg", "uvloop",
             "openai_reuse_port", "agents", "openai_frontends")
"""Flags of ``--engine vllm`` only (a simulated agent refuses them)."""


def add_vllm_options(agent: Any) -> None:
    """The ``--engine vllm`` options of ``trackside agent``."""
    v = agent.add_argument_group("vLLM engines (--engine vllm)")
    v.add_argument("--model", metavar="DIR", help="model folder (with config.json) or Hugging Face name")
    v.add_argument("--load-format", default="auto", help="vLLM's load format; dummy: random weights (default auto)")
    v.add_argument("--fake-executor", action="store_true",
                   help="CPU: a tiny built-in model on an executor that runs no model (no GPU, no weights)")
    v.add_argument("--serve-openai", metavar="HOST:PORT",
                   help="serve vLLM's OpenAI app there (HOST defaults to 127.0.0.1; port 0: any free one); also over "
                   "simulated units with --runtime live (the tiny tokenizer renders prompts, every token is ' ok')")
    v.add_argument("--served-model-name",
                   help="the model id OpenAI clients name (default: --model; simulated units: the profile's name)")
    v.add_argument("--sim-tokenizer", metavar="DIR",
                   help="simulated units with --serve-openai: the folder of a Hugging Face tokenizer (the calibrated "
                   "model's) that renders requests, so prompts are counted and chats templated as that model's server "
                   "would (default: the tiny tokenizer, about 1.5 characters of English a token)")
    v.add_argument("--openai-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a vllm serve front-end option for the OpenAI app (repeatable), checked by vLLM: "
                   "chat_template=FILE, api_key=KEY, enable_auto_tool_choice=true, response_role=...")
    v.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=None,
                   help="load the model's tokenizer: text and chat prompts, text back (default: on with "
                   "--serve-openai, off for replays, which send token ids); the fake executor's model has one of its "
                   "own")
    v.add_argument("--gpus", metavar="all|0-7|0,2,4",
                   help="the GPUs the units run on (CUDA's numbers; positions in CUDA_VISIBLE_DEVICES when set), "
                   "cut in order into groups of TP×PP GPUs, one unit each by default: 8 GPUs at TP 4 make 2 units "
                   "on 0-3 and 4-7; each unit's engine gets its own (vLLM's device_ids). Default: vLLM's default "
                   "device, shared by every unit")
    v.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="GPUs per pipeline stage of a unit (default 1)")
    v.add_argument("--pipeline-parallel-size", type=int, metavar="N",
                   help="pipeline stages of a unit (default 1): a unit takes TP×PP GPUs")
    v.add_argument("--gpu-memory-utilization", type=float, metavar="SHARE",
                   help="GPU memory share of each unit (default 0.9 on GPUs of its own; without --gpus 0.9 divided "
                   "by --units). More units than GPU groups share them only with it given, at most 1 per GPU")
    v.add_argument("--engine-arg", action="append", metavar="[UNIT:]KEY=VALUE",
                   help="any vLLM engine argument (a field of AsyncEngineArgs, typed and checked by vLLM's own "
                   "parser), repeatable: kv_cache_dtype=fp8, quantization=fp8, enable_prefix_caching=false, "
                   "dtype=bfloat16, trust_remote_code=true; UNIT: for one unit only (1:max_num_seqs=128). "
                   "Fields with a flag of their own take the flag")
    v.add_argument("--max-num-batched-tokens", type=int, help="largest step in tokens (default 8192; fake 2048)")
    v.add_argument("--max-num-seqs", type=int, help="running requests per unit at most (default 512; fake 64)")
    v.add_argument("--max-model-len", type=int,
                   help="context length (default the model's, at most 16384; fake 4096)")
    v.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (starts faster, steps slower)")
    v.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's async scheduling (default on)")
    v.add_argument("--agents", type=int, metavar="N",
                   help="run the node as N agents of units/N each, one process each, on one shared OpenAI port "
                   "(node ids NODE-i, telemetry ports PORT+i; restarted if they exit; docs/deploy.md, \"Several "
                   "agents on one node\"): one agent's front end is one process")
    v.add_argument("--openai-reuse-port", action="store_true",
                   help="bind --serve-openai's port with SO_REUSEPORT (Linux), so that several agents of one node, "
                   "each on its own GPUs, share one OpenAI port and the kernel spreads the connections between "
                   "them (docs/deploy.md, \"Several agents on one node\")")
    v.add_argument("--openai-frontends", type=int, default=0, metavar="N",
                   help="serve --serve-openai from N front-end processes on one port (SO_REUSEPORT, Linux), which "
                   "render, tokenize and write responses while this process keeps the units, the dispatcher and "
                   "the telemetry; restarted if they exit (default 0: this process serves it; docs/vllm.md, "
                   "\"Several front-end processes for one agent\")")
    v.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=None,
                   help="run the agent's event loop on uvloop, as vllm serve runs its API server (default on; "
                   "--no-uvloop: asyncio's own loop; docs/vllm.md, \"Issue #14 item 8 with the agent on uvloop\")")


def cmd_agent_vllm(args: argparse.Namespace) -> int:
    """``trackside agent --engine vllm``: check what can be checked and resolve every unit before any engine starts
    (``--dry-run``: print that and stop), then run."""
    if importlib.util.find_spec("vllm") is None:
        raise ServeError("--engine vllm needs vLLM: pip install -e '.[vllm]' (vLLM 0.26.0 and torch 2.11.0)")
    if args.dry_run:  # stdout is the plan's JSON: vLLM logs to stderr (read when vLLM is first imported)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    refuse_discrete_options(args, "vLLM engines step by themselves")
    for name in SIM_LIVE_ONLY:
        if getattr(args, name):
            why = ("its model's tokenizer renders a vLLM unit's requests" if name == "sim_tokenizer" else
                   "a vLLM unit's engine core is a process: kill it (status --json gives each unit's engine_pid)")
            raise ServeError(f"--{name.replace('_', '-')} applies to simulated units (--runtime live); {why}")
    if args.runtime == "discrete":
        raise ServeError("--runtime discrete applies to simulated units: vLLM engines step by themselves")
    if args.fake_executor and args.model:
        raise ServeError("--fake-executor runs its own tiny model: leave out --model")
    if not args.fake_executor and not args.model:
        raise ServeError("--engine vllm needs --model DIR (a model folder; with --load-format dummy its config.json "
                         "is enough) or --fake-executor (CPU, no model)")
    warnings: list[str] = []
    model_len = None
    if not args.fake_executor:
        try:
            model_len = model_max_len(args.model)
        except ServeError as exc:
            if not args.dry_run:
                raise
            warnings.append(str(exc))  # a dry run loads nothing: the model may live on another machine
    share = args.gpu_memory_utilization
    if share is not None and not 0 < share <= 1:
        raise ServeError("--gpu-memory-utilization is each unit's share of the GPU memory: in (0, 1]")
    for flag in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                 "pipeline_parallel_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ServeError(f"--{flag.replace('_', '-')} must be >= 1")
    check_live_options(args)
    host, port = parse_listen(args.listen)
    limits = connection_limits(args)
    serve = parse_listen(args.serve_openai, "--serve-openai") if args.serve_openai else None
    if args.openai_reuse_port and serve is None:
        raise ServeError("--openai-reuse-port shares --serve-openai's port: give --serve-openai HOST:PORT")
    check_port_sharing(args)
    if args.openai_frontends and serve is None:
        raise ServeError("--openai-frontends N serves --serve-openai's port: give --serve-openai HOST:PORT")
    requests: Sequence[RequestSpec] = ()
    if args.trace is not None:
        requests = load_trace(args.trace)
    elif args.workload is not None:
        requests = parse_workload(args.workload, seed=args.seed)
    if serve is None and not requests:
        raise ServeError("--engine vllm serves --serve-openai HOST:PORT, replays --workload/--trace, or both")
    token, read_only = agent_tokens(args)
    batch_params, dispatch_params = split_params(parse_assignments(args.param), args.batch_policy, args.dispatch)
    coefficients = None
    if args.profile:
        c = load_profile(args.profile).coefficients
        coefficients = (c.a_s, c.b_s, c.c_s)

    from agent.engine.vllm.placement import visible_gpu_count
    from agent.engine.vllm.plan import NodeRequest, PlanError, plan_json, resolve
    from agent.service.launch import VllmAgentConfig, run_agent
    from agent.service.live_agent import AgentStartError

    request = NodeRequest(
        model=args.model, fake_executor=args.fake_executor, units=args.units, gpus=args.gpus,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        gpu_memory_utilization=share, load_format=args.load_format,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, model_max_len=model_len, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        tokenizer=args.tokenizer if args.tokenizer is not None else serve is not None,
        engine_args=tuple(args.engine_arg or ()),
    )
    try:
        plan = resolve(request)
    except PlanError as exc:
        raise ServeError(str(exc)) from None
    if args.agents is not None and args.agents != 1:
        if args.agents < 1:
            raise ServeError("--agents must be >= 1")
        from agent.cli import agent_group
        from agent.cli.main import main

        argvs = agent_group.child_argvs(args, plan)
        docs = agent_group.child_plans(argvs, plan_json(plan)["units"], main)
        if args.dry_run:
            print(json.dumps({"agents": docs}, indent=2))
            return 0
        return agent_group.run_group(argvs)
    config = VllmAgentConfig(
        units=len(plan.units), batch_policy=args.batch_policy, batch_params=batch_params, dispatch=args.dispatch,
        dispatch_params=dispatch_params, engine=plan.units[0].engine, unit_engines=plan.engines,
        placements=plan.placements, fake_executor=args.fake_executor, coefficients=coefficients,
        ttft_slo_s=args.slo_ttft_ms / 1e3, tpot_slo_s=args.slo_tpot_ms / 1e3, serve_openai=serve,
        served_model_name=args.served_model_name, requests=requests, seed=args.seed, restart=not args.no_restart,
        openai_args=tuple(args.openai_arg or ()), openai_reuse_port=args.openai_reuse_port,
        openai_frontends=args.openai_frontends, uvloop=args.uvloop is not False,
    )
    if args.engine_hang_s is not None:  # 0: no limit
        config = replace(config, engine_hang_s=args.engine_hang_s or None)
    if args.pending_timeout_s is not None:
        config = replace(config, pending_timeout_s=args.pending_timeout_s or None)
    if args.restart_attempts is not None:  # 0: no limit
        config = replace(config, restart_attempts=args.restart_attempts or None)
    if config.openai_args:  # vLLM's parser checks them before any engine starts
        from agent.engine.vllm.openai_app import FrontendArgError, frontend_namespace, frontend_tokens

        try:
            frontend_namespace(config.model_name, config.model_name, frontend_tokens(config.openai_args))
        except FrontendArgError as exc:
            raise ServeError(f"--openai-arg: {exc}") from None
    if args.dry_run:
        print(json.dumps(dry_run_document(args, plan_json(plan, config.fake_num_blocks), config, warnings), indent=2))
        return 0
    if plan.gpu_ids:
        visible = visible_gpu_count()
        if visible and max(plan.gpu_ids) >= visible:
            raise ServeError(f"--gpus {args.gpus}: GPU {max(plan.gpu_ids)} is not visible here ({visible} GPUs: "
                             f"0 to {visible - 1})")
    tls = server_ssl_context(str(args.tls_cert), str(args.tls_key)) if args.tls_cert else None
    if not token:
        print("trackside agent: no --token-file: control is disabled (read-only)", file=sys.stderr)
    try:
        runner: Callable[[Coroutine[Any, Any, int]], int] = asyncio.run
        if args.uvloop is not False:  # what vllm serve runs its API server on (vLLM's own dependency)
            import uvloop

            runner = uvloop.run
        return runner(run_agent(config, node_id=args.node_id, token=token, read_token=read_only, host=host,
                                port=port, tls=tls, replay_events=args.replay_events,
                                slack_sample_ms=args.slack_sample_ms, limits=limits))
    except AgentStartError as exc:
        raise ServeError(str(exc)) from None
    except OSError as exc:  # a port is taken, an address is not ours
        raise ServeError(f"cannot listen: {exc.strerror or exc}") from None


def dry_run_document(args: argparse.Namespace, plan: dict[str, Any], config: VllmAgentConfig,
                     warnings: Sequence[str]) -> dict[str, Any]:
    """What ``--dry-run`` prints: the node as it would start (``plan``: the units, ``agent.engine.vllm.plan``), its
    policies built and checked as a start builds them first."""
    batch = make_batch_policy(config.batch_policy, dict(config.batch_params))
    dispatcher = make_dispatch_policy(config.dispatch, dict(config.dispatch_params))
    serve = config.serve_openai
    return {
        "node_id": args.node_id, "engine": "vllm", "model": config.engine.model,
        "served_model_name": config.model_name, **plan, "warnings": [*warnings, *plan["warnings"]],
        "batch_policy": batch.name, "batch_params": dict(batch.params), "dispatch": dispatcher.name,
        "dispatch_params": dict(dispatcher.params), "profile": args.profile, "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms, "listen": host_port(*parse_listen(args.listen)),
        "serve_openai": host_port(*serve) if serve else None,
        "openai_reuse_port": config.openai_reuse_port,
        "openai_frontends": config.openai_frontends,
        "event_loop": "asyncio" if args.uvloop is False else "uvloop",
        "workload": {"trace": str(args.trace) if args.trace else None, "workload": args.workload,
                     "num_requests": len(config.requests)} if config.requests else None,
        "control": args.token_file is not None, "read_token": args.read_token_file is not None,
        "config": str(args.config) if args.config else None,
        "restart": config.restart, "restart_attempts": config.restart_attempts, "engine_hang_s": config.engine_hang_s,
        "pending_timeout_s": config.pending_timeout_s,
        "openai_args": list(config.openai_args),
    }


def model_max_len(model: str) -> int | None:
    """The context length a model folder's ``config.json`` declares (None: not said, or a hub name); raises
    :class:`ServeError` for a folder without a readable ``config.json``."""
    path = Path(model)
    if not path.exists():
        if model.startswith((".", "/", "~")) or model.count("/") != 1:
            raise ServeError(f"--model {model}: no such folder (nor a Hugging Face name ORG/NAME)")
        return None  # a Hugging Face name: vLLM fetches it
    config = path / "config.json"
    try:
        data = json.loads(config.read_text())
    except OSError:
        raise ServeError(f"--model {model}: no config.json in it (a model folder has one)") from None
    except ValueError as exc:
        raise ServeError(f"--model {model}: config.json is not valid JSON: {exc}") from None
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return value if isinstance(value, int) and value > 0 else None
