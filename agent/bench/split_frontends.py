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

With ``--frontends K`` it compares instead one agent's OpenAI intake served in its main process against the same
agent's intake in ``K`` front-end processes (``--openai-frontends K``, docs/vllm.md, "Several front-end processes for
one agent"): the same ``--units`` units, one after the other, each loaded by one bench of ``--prompts`` requests at
``--concurrency``:

    python -m agent.bench.split_frontends --frontends 2 --model .gpu/models/llama32-1b --out DIR
    python -m agent.bench.split_frontends --frontends 2 --fake --prompts 200 --concurrency 32 --out DIR

1. **in-process**: ``trackside agent --engine vllm --units U ...`` as in the first layout above;
2. **K front ends**: the same agent with ``--openai-frontends K``.

For each the bench's output tokens a second, TTFT and TPOT (p50, p99), and the CPU per output token of the agent's
main process (its own PID, not its descendants: the engine cores and the front ends are its children), of the front
ends together (their PIDs from the agent's ``OpenAI API at ... PIDs ...`` line) and of the rest of its descendants
(the engine cores), with the main thread's (the main event loop's) busy share over the bench, go to
``DIR/compare.json`` (``in_process``, ``K_frontends``) and to a table on stdout. The CPU is counted from the agent
serving to the bench's end, the bench's own start-up (idle seconds) included, as in the layouts above. What the split
should show is the main process's CPU per token falling; on a 2-core machine (``--fake``) that is all the numbers
say: the bench, the front ends, the main process and the fake engines share two cores, so throughput and latency
there are the cores'. ``--openai-port`` and ``--listen-port`` move every agent's ports (default 8300 and 7800).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from agent.bench.proc_cpu import CpuMeter, descendants
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
READY = "trackside agent: OpenAI API at "
"""The line an agent prints once its OpenAI port takes requests."""
FRONTENDS_READY = re.compile(r"OpenAI API at \S+ \((\d+) front-end processes, PIDs ([\d, ]+)\)")
"""The same line from an agent with ``--openai-frontends``: how many front ends, and their PIDs."""


def openai_port(args: argparse.Namespace, index: int) -> int:
    """Agent ``index``'s OpenAI port: its own, or with ``--shared-port`` the one all agents share."""
    return int(args.openai_port) + (0 if args.shared_port else index)


def agent_cmd(args: argparse.Namespace, model: str, units: int, index: int, token_file: Path) -> list[str]:
    """Agent ``index`` of a layout: ``units`` units on GPU 0, each with ``0.9 / --units`` of its memory."""
    cmd = [*python_module("agent.cli"), "agent", "--engine", "vllm", "--units", str(units), "--batch-policy", "vllm",
           "--dispatch", "least_loaded", "--serve-openai", f"127.0.0.1:{openai_port(args, index)}",
           *(["--openai-reuse-port"] if args.shared_port else []),
           "--listen", f"127.0.0.1:{args.listen_port + index}", "--node-id", f"split-{units}x{index}",
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
                wait_log(log, READY, procs[-1], args.start_timeout)
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
        for i, bench in enumerate(running):
            bench.wait()
            ended.append(bench_ended(run, f"{label}-{i}-saturate"))
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


def frontend_pids(log: str) -> list[int]:
    """The front-end processes' PIDs from an agent's log, by its last ``OpenAI API at URL (K front-end processes,
    PIDs A, B)`` line; [] when it has none (the agent serves the port in its main process)."""
    found = FRONTENDS_READY.findall(log)
    return [int(pid) for pid in found[-1][1].split(",")] if found else []


def frontend_children(pid: int) -> list[int]:
    """The processes below ``pid`` that run ``python -m agent.service.frontend``, from ``/proc`` (Linux)."""
    out = []
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if b"agent.service.frontend" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                out.append(child)
    return out


def bench_ended(run: Run, name: str) -> float:
    """When bench ``name`` ended (``time.monotonic()``): as it saved its result, which is seconds before its process
    exits (the client's teardown); now if it saved none."""
    ended = time.monotonic()
    with contextlib.suppress(OSError):
        ended -= max(0.0, time.time() - (run.out / f"bench-{name}.json").stat().st_mtime)
    return ended


def intake_row(summary: dict[str, Any], main: dict[str, Any], frontends: list[dict[str, Any]]
               ) -> dict[str, Any]:
    """One intake layout's numbers: its bench's (``summary``, :func:`read_bench`'s) and the CPU per output token of
    the agent's main process (``main``, a :class:`CpuMeter` reading of its PID: ``server_s`` is that process alone,
    ``children_s`` everything below it), of its front ends together (``frontends``, one reading each, with whatever
    runs below them) and of the rest below the main process (the engine cores); microseconds."""
    tokens = (summary.get("output_throughput") or 0.0) * (summary.get("duration") or 0.0)

    def per_token(seconds: float) -> float | None:
        return round(1e6 * seconds / tokens, 1) if tokens else None

    def ms(key: str) -> float | None:
        return None if summary.get(key) is None else round(summary[key], 2)

    frontends_s = sum(f["server_s"] + f["children_s"] for f in frontends)
    return {"output_throughput": round(summary.get("output_throughput") or 0.0, 1),
            "completed": summary.get("completed"), "ttft_p50_ms": ms("median_ttft_ms"),
            "ttft_p99_ms": ms("p99_ttft_ms"), "tpot_p50_ms": ms("median_tpot_ms"), "tpot_p99_ms": ms("p99_tpot_ms"),
            "main_us_per_output_token": per_token(main["server_s"]),
            "main_loop_busy": main.get("main_thread_busy_in_bench"),
            "frontends_us_per_output_token": per_token(frontends_s) if frontends else None,
            "frontends_loop_busy": [f.get("main_thread_busy_in_bench") for f in frontends],
            "engines_us_per_output_token": per_token(max(0.0, main["children_s"] - frontends_s))}


INTAKE_COLUMNS = (("tok/s", "output_throughput"), ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"),
                  ("TPOT p50", "tpot_p50_ms"), ("TPOT p99", "tpot_p99_ms"),
                  ("main us/tok", "main_us_per_output_token"), ("main loop", "main_loop_busy"),
                  ("front ends us/tok", "frontends_us_per_output_token"), ("front-end loops", "frontends_loop_busy"),
                  ("engines us/tok", "engines_us_per_output_token"))
"""The table's columns: heading, :func:`intake_row` key (times in ms, CPU in microseconds per output token, loops'
busy shares of the bench's time)."""


def intake_table(rows: dict[str, dict[str, Any]]) -> str:
    """The layouts' :func:`intake_row` numbers as a plain text table, one line per layout ("-": not measured; a list,
    one number per front end, as ``A/B``)."""

    def cell(value: Any) -> str:
        if isinstance(value, list):
            return "/".join(cell(v) for v in value) or "-"
        return "-" if value is None else str(value)

    width = max(len(label) for label in rows)
    lines = [" ".join([" " * width, *(f"{h:>8}" for h, _ in INTAKE_COLUMNS)])]
    for label, row in rows.items():
        cells = [f"{cell(row.get(k)):>{max(8, len(h))}}" for h, k in INTAKE_COLUMNS]
        lines.append(" ".join([f"{label:<{width}}", *cells]))
    return "\n".join(lines)


def intake_layout(run: Run, args: argparse.Namespace, model: str, frontends: int, token_file: Path
                  ) -> dict[str, Any]:
    """Start one agent of ``--units`` units serving its OpenAI port in its main process (``frontends`` 0) or from
    ``frontends`` front-end processes, load it with one bench, stop it; what was measured."""
    label = f"{frontends}-frontends" if frontends else "in-process"
    cmd = agent_cmd(args, model, args.units, 0, token_file)
    if frontends:
        cmd += ["--openai-frontends", str(frontends)]
    out: dict[str, Any] = {"frontends": frontends, "units": args.units, "command": cmd}
    run.log(f"{label}: {' '.join(cmd)}")
    log = run.out / f"server-{label}.log"
    proc = start(cmd, log)
    try:
        wait_log(log, READY, proc, args.start_timeout)
        pids = frontend_pids(log.read_text(errors="replace")) or (frontend_children(proc.pid) if frontends else [])
        if len(pids) != frontends:
            raise RuntimeError(f"{frontends} front ends asked for, PIDs of {len(pids)} found: {pids}")
        out["frontend_pids"] = pids
        run.log(f"{label}: serving (front ends: {pids or 'none'}); one bench of {args.prompts} prompts at "
                f"concurrency {args.concurrency}")
        main, fronts = CpuMeter(proc.pid), [CpuMeter(pid) for pid in pids]
        name = f"{label}-saturate"
        bench = start(bench_cmd(run, f"http://127.0.0.1:{openai_port(args, 0)}", model, name, prompts=args.prompts,
                                rate="inf", concurrency=args.concurrency, input_len=args.input_len,
                                output_len=args.output_len, range_ratio=args.range_ratio),
                      run.out / f"bench-{name}.log")
        bench.wait()
        ended = bench_ended(run, name)
        summary = read_bench(run, name, bench.returncode)
        tokens = (summary.get("output_throughput") or 0.0) * (summary.get("duration") or 0.0)
        out["cpu"] = main.stop(tokens or None, summary.get("duration"), ended)
        out["frontend_cpu"] = [meter.stop(tokens or None, summary.get("duration"), ended) for meter in fronts]
        if frontends and sorted(after := frontend_children(proc.pid)) != sorted(pids):  # one restarted: its CPU
            out["frontend_pids_after"] = after  # before the restart is lost
            run.log(f"{label}: front ends {pids} before the bench, {after} after")
        out["bench"] = summary
        if "error" not in summary:
            out["summary"] = intake_row(summary, out["cpu"], out["frontend_cpu"])
            run.log(f"{label}: {out['summary']}")
    except Exception as e:  # recorded; the other layout still runs
        out["error"] = repr(e)
        run.log(f"{label}: {e!r}")
    finally:
        stop(proc)
        wait_gpu_free(run)
    return out


def compare_intakes(run: Run, args: argparse.Namespace, model: str, token_file: Path) -> None:
    """``--frontends K``: the agent in-process, then with ``K`` front ends; the two side by side."""
    keys = {"in_process": 0, f"{args.frontends}_frontends": args.frontends}
    for key, frontends in keys.items():
        run.result[key] = intake_layout(run, args, model, frontends, token_file)
        run.save()
    rows = {("in-process" if not k else f"{k} front ends"): run.result[key]["summary"]
            for key, k in keys.items() if "summary" in run.result[key]}
    if rows:
        print(intake_table(rows), flush=True)
    if len(rows) == 2:
        one, split = rows.values()
        for ratio, key in (("throughput_ratio", "output_throughput"), ("main_cpu_ratio", "main_us_per_output_token")):
            if one.get(key) and split.get(key):
                run.result[ratio] = round(split[key] / one[key], 3)
        run.log(f"{args.frontends} front ends / in-process: output throughput {run.result.get('throughput_ratio')}, "
                f"main process CPU per output token {run.result.get('main_cpu_ratio')}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.abspath(".gpu/models/llama32-1b"), help="a folder with config.json")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--fake", action="store_true", help="CPU: the fake executor (checks the procedure)")
    ap.add_argument("--units", type=int, default=2, help="units on GPU 0, in one agent or one agent each")
    ap.add_argument("--frontends", type=int, default=0, metavar="K",
                    help="compare instead one agent serving its OpenAI port in its main process against the same "
                    "agent with --openai-frontends K (default 0: one agent against --units agents)")
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
    ap.add_argument("--openai-port", type=int, default=OPENAI_PORT, help="the first agent's OpenAI port")
    ap.add_argument("--listen-port", type=int, default=LISTEN_PORT, help="the first agent's telemetry port")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.frontends < 0 or (args.frontends and args.shared_port):
        parser().error("--frontends takes K >= 1 front ends for one agent, without --shared-port")
    if args.units < (1 if args.frontends else 2):
        parser().error("--units must be at least 2 (one agent of U units against U agents of one)")
    run = Run(args.out)
    model, token_file = prepare(run, args)
    if args.frontends:
        compare_intakes(run, args, model, token_file)
    else:
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
