"""One agent's front end against one per unit: does a node stream more when its units' front ends run in separate
processes? (docs/vllm.md, "One front-end process for the whole node".)

    python -m agent.bench.split_frontends --model .gpu/models/llama32-1b --out DIR      # on the GPU machine
    python -m agent.bench.split_frontends --fake --out DIR                               # CPU: the procedure only

The same units on the same GPU under the same saturating load, served two ways, one after the other:

1. **one agent**: ``trackside agent --engine vllm --units U --gpus 0 --gpu-memory-utilization 0.9/U`` (the units
   share GPU 0), and one ``vllm bench serve`` of ``--prompts`` requests at ``--concurrency`` against its OpenAI port;
2. **U agents**: ``U`` agents of one unit each, on the same GPU with the same memory share, each with its own ports
   and node id, and ``U`` benches at once, each ``--prompts``/U requests at ``--concurrency``/U against its agent.

Only the front end differs: one process (one event loop for the OpenAI app, the dispatcher and every unit's outputs)
against ``U``. The layouts' output throughputs (the tokens of all benches over the longest bench) and each agent's
front-end CPU per output token and event-loop busy share go to ``DIR/compare.json``. With a small model (1B: tens of
thousands of tokens a second from one GPU) one front end is the bottleneck; if the ``U`` agents stream more, it was.
The dispatch policy does nothing in the second layout (one unit per agent): a load balancer's place there is taken
by giving each agent its share of the clients. With ``--shared-port`` the agents of both layouts serve one OpenAI
port instead (``--openai-reuse-port``: the kernel spreads the connections) and one bench loads it, as clients would a
node run that way (``docs/deploy.md``, "Several agents on one node"); each agent's CPU per token is then over all the
layout's tokens (the agents' shares add up to the layout's). ``--fake`` runs the same steps on a CPU with the fake
executor, which checks the procedure; a 2-core machine's numbers mean nothing here (the benches, the agents and the
engines share the cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from agent.bench.proc_cpu import CpuMeter
from agent.bench.vllm_serve_compare import (
    MODEL_NAME,
    Run,
    bench_cmd,
    engine_args,
    prepare,
    python_module,
    read_bench,
    start,
    stop,
    wait_gpu_free,
    wait_healthy,
)

OPENAI_PORT = 8300
LISTEN_PORT = 7800


def openai_port(args: argparse.Namespace, index: int) -> int:
    """Agent ``index``'s OpenAI port: its own, or with ``--shared-port`` the one all agents share."""
    return OPENAI_PORT if args.shared_port else OPENAI_PORT + index


def agent_cmd(args: argparse.Namespace, model: str, units: int, index: int, token_file: Path) -> list[str]:
    """Agent ``index`` of a layout: ``units`` units on GPU 0, each with ``0.9 / --units`` of its memory."""
    cmd = [*python_module("agent.cli"), "agent", "--engine", "vllm", "--units", str(units), "--batch-policy", "vllm",
           "--dispatch", "least_loaded", "--serve-openai", f"127.0.0.1:{openai_port(args, index)}",
           *(["--openai-reuse-port"] if args.shared_port else []),
           "--listen", f"127.0.0.1:{LISTEN_PORT + index}", "--node-id", f"split-{units}x{index}",
           "--token-file", str(token_file), "--pending-timeout-s", "600", *(args.agent_arg or [])]
    if args.fake:
        return [*cmd, "--fake-executor", "--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    share = round(0.9 / args.units, 3)
    return [*cmd, "--model", model, "--gpus", "0", "--gpu-memory-utilization", str(share), *engine_args(args)]


def wait_log(log: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until ``log`` has a line with ``text``; raises if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with code {proc.returncode} before it served")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log.name}: no {text!r} after {timeout_s:.0f} s")
        time.sleep(0.5)


def layout(run: Run, args: argparse.Namespace, model: str, agents: int, token_file: Path) -> dict[str, Any]:
    """Start ``agents`` agents sharing ``--units`` units, load them together, stop them; what was measured. The
    model's folder is the benches' tokenizer too."""
    label = f"{agents}-agent" + ("s" if agents > 1 else "")
    units = args.units // agents
    procs = []
    out: dict[str, Any] = {"agents": agents, "units_per_agent": units}
    try:
        for i in range(agents):  # one after another, as one agent starts its units: engines that start together on
            # one GPU can disturb each other's memory profiling (vLLM reads the GPU's free memory around its own)
            cmd = agent_cmd(args, model, units, i, token_file)
            run.log(f"{label}: agent {i}: {' '.join(cmd)}")
            log = run.out / f"server-{label}-{i}.log"
            procs.append(start(cmd, log))
            if args.shared_port:  # the shared port's /health may be another agent's: this one says when it serves
                wait_log(log, "trackside agent: OpenAI API at", procs[-1], args.start_timeout)
            else:
                wait_healthy(f"http://127.0.0.1:{openai_port(args, i)}/health", procs[-1], args.start_timeout)
        benches = 1 if args.shared_port else agents
        run.log(f"{label}: healthy; {benches} bench(es) of {args.prompts // benches} prompts at concurrency "
                f"{args.concurrency // benches}")
        meters = [CpuMeter(proc.pid) for proc in procs]
        running = [start(bench_cmd(run, f"http://127.0.0.1:{openai_port(args, i)}", model, f"{label}-{i}-saturate",
                                   prompts=args.prompts // benches, rate="inf", concurrency=args.concurrency // benches,
                                   input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio),
                         run.out / f"bench-{label}-{i}-saturate.log") for i in range(benches)]
        ended = []
        for bench in running:
            bench.wait()
            ended.append(time.monotonic())
        summaries = [read_bench(run, f"{label}-{i}-saturate", bench.returncode) for i, bench in enumerate(running)]
        if args.shared_port:  # one bench: every agent's CPU over all its tokens
            tokens = (summaries[0].get("output_throughput") or 0.0) * (summaries[0].get("duration") or 0.0)
            out["cpu"] = [meter.stop(tokens or None, summaries[0].get("duration"), ended[0]) for meter in meters]
        else:
            for summary, meter, end in zip(summaries, meters, ended, strict=True):
                tokens = (summary.get("output_throughput") or 0.0) * (summary.get("duration") or 0.0)
                summary["cpu"] = meter.stop(tokens or None, summary.get("duration"), end)
        out["benches"] = summaries
        if all("output_throughput" in s and s["output_throughput"] for s in summaries):
            tokens = sum(s["output_throughput"] * s["duration"] for s in summaries)
            out["output_tokens"] = round(tokens)
            out["output_throughput"] = round(tokens / max(s["duration"] for s in summaries), 1)
            out["completed"] = sum(s["completed"] for s in summaries)
            run.log(f"{label}: {out['output_throughput']} output tok/s over {out['completed']} requests")
    except Exception as e:  # recorded; the other layout still runs
        out["error"] = repr(e)
        run.log(f"{label}: {e!r}")
    finally:
        for proc in procs:
            stop(proc)
        wait_gpu_free(run)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.abspath(".gpu/models/llama32-1b"), help="a folder with config.json")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--fake", action="store_true", help="CPU: the fake executor (checks the procedure)")
    ap.add_argument("--units", type=int, default=2, help="units on GPU 0, in one agent or one agent each")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.5,
                    help="lengths from LEN*(1-R) to LEN*(1+R) (vllm bench serve's --random-range-ratio), so the "
                    "requests do not finish in waves")
    ap.add_argument("--prompts", type=int, default=2000, help="requests in all, split over the benches")
    ap.add_argument("--concurrency", type=int, default=256, help="in flight in all, split over the benches")
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--shared-port", action="store_true",
                    help="every agent on one OpenAI port (--openai-reuse-port) and one bench against it")
    ap.add_argument("--agent-arg", action="append", metavar="ARG",
                    help="one more argument for every agent (repeatable): --agent-arg=--uvloop")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.units < 2:
        parser().error("--units must be at least 2 (one agent of U units against U agents of one)")
    run = Run(args.out)
    model, token_file = prepare(run, args)
    for agents in (1, args.units):
        run.result[f"{agents}_agents"] = layout(run, args, model, agents, token_file)
        run.save()
    one, many = run.result["1_agents"], run.result[f"{args.units}_agents"]
    if one.get("output_throughput") and many.get("output_throughput"):
        run.result["throughput_ratio"] = round(many["output_throughput"] / one["output_throughput"], 3)
        run.log(f"{args.units} agents / 1 agent, output throughput: {run.result['throughput_ratio']}")
    run.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
