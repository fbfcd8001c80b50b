"""Issue #14 item 8 on a GPU: trackside's OpenAI intake against plain ``vllm serve``, then a killed engine core.

    python -m agent.bench.vllm_serve_compare --model DIR --out DIR          # on the GPU machine
    python -m agent.bench.vllm_serve_compare --fake --out DIR               # CPU: the same steps, fake executor

One run, one model, one GPU, the same engine settings on both sides:

1. **plain**: ``vllm serve MODEL`` (vLLM's own server and scheduler), then ``vllm bench serve`` twice: a
   saturating run (``--request-rate inf`` under ``--max-concurrency``: output throughput) and a Poisson run at a
   fixed rate (TTFT p50/p99 at a load the engine keeps up with). The server is stopped.
2. **trackside**: ``trackside agent --engine vllm --gpus 0 --batch-policy vllm --serve-openai ...`` (our scheduler
   with vLLM's default policy, the dispatcher and vLLM's OpenAI app over our engine client), the same two runs.
3. **kill**: on the same agent, a ``vllm bench serve`` of ``--kill-prompts`` concurrent requests; once half of
   them run on the unit and ``--kill-after`` seconds more, the unit's engine core (its ``engine_pid`` from
   ``trackside ctl status --json``) gets SIGKILL. With one unit
   the requests wait at the dispatcher until the restarted engine takes them by recompute; the bench's
   ``completed``/``failed`` count what was lost. The unit's mode is polled every 0.5 s (failed, then active).

Each bench run also records the CPU time its server used (``cpu``: the server process, the front end, and its
descendants, the engine core among them, from ``/proc``; per output token), so that a gap in throughput can be put
on the front end or on the engine side; and, sampled every 0.1 s, the share of each of the bench's seconds that the
server's main thread (both servers' event loop) and its descendants were busy (:mod:`agent.bench.proc_cpu`). A loop
busy near 1.0 while the engine core idles is a front end that cannot keep up.

``--rate-prompts 0`` leaves the Poisson run out; ``--trackside-first`` runs the agent's side before plain's, so that
two calls in turn can undo an order effect (a warmer GPU, a filled compile cache).

Both servers get the model folder with a tokenizer made here (:mod:`agent.engine.vllm.tiny_tokenizer`, filled to
the model's vocabulary) when the folder has none, so text prompts work with dummy weights and no download.
Everything goes to ``--out`` as it is measured (``compare.json``, the bench's result files, each server's log),
so a run cut short keeps what it had. ``--fake`` runs the same steps on a CPU with the fake executor; its "plain"
side is then a second trackside agent (no ``vllm serve`` can start without a GPU), which checks the procedure,
not vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from agent.bench.proc_cpu import CpuMeter

MODEL_NAME = "model"
SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


class Run:
    """The state of one comparison: where results go, what was measured so far."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        out.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        (self.out / "compare.json").write_text(json.dumps(self.result, indent=1))

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def python_module(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def model_with_tokenizer(model: str) -> str:
    """``model``, or a copy of its ``config.json`` with a tokenizer made here when it has none."""
    if (Path(model) / "tokenizer.json").exists() or (Path(model) / "tokenizer_config.json").exists():
        return model
    from agent.engine.vllm.tiny_tokenizer import main as write_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="trackside-model-"))
    shutil.copy(Path(model) / "config.json", folder / "config.json")
    write_tokenizer([str(folder)])
    return str(folder)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Seconds until ``url`` answers 200; raises if the process exits or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 40.0) -> None:
    """SIGINT, then SIGKILL of the whole process group (engine cores included)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def nvidia_smi(query: str) -> str | None:
    """``nvidia-smi --query-gpu=QUERY`` of GPU 0 (None without one)."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def wait_gpu_free(run: Run, timeout_s: float = 60.0) -> None:
    """Until GPU 0 has under 2 GiB in use (the last server's processes are gone), at most ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        used = nvidia_smi("memory.used")
        if used is None or float(used.split(",")[0]) < 2048:
            return
        time.sleep(1.0)
    run.log(f"GPU memory still in use after {timeout_s:.0f} s: {nvidia_smi('memory.used')} MiB")


def start(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    """``cmd`` in a session of its own (``stop`` ends its whole group), its output appended to ``log``; ``env``
    added to this process's environment."""
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                env={**os.environ, **env} if env else None)


PHASE_SEEDS = {"saturate": 0, "poisson": 1, "kill": 2}
"""The random dataset's seed per phase: the same prompts on both servers, other prompts in each phase. With one seed
every phase replayed the first phase's prompts, and the engine's prefix cache (on by default) answered them: the
Poisson run's TTFT was that of cache hits (the GPU run of 2026-11-26 on an H100 had it so)."""


def bench_cmd(run: Run, base_url: str, tokenizer: str, name: str, *, prompts: int, rate: str,
              concurrency: int | None, input_len: int, output_len: int, range_ratio: float = 0.0) -> list[str]:
    """A ``vllm bench serve`` command whose result lands in ``run.out`` as ``bench-NAME.json``; the prompts' seed
    is the phase's (:data:`PHASE_SEEDS`, by the name's last part)."""
    seed = PHASE_SEEDS.get(name.rsplit("-", 1)[-1], len(PHASE_SEEDS))
    cmd = [*python_module("vllm.entrypoints.cli.main"), "bench", "serve", "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(prompts), "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(run.out), "--result-filename", f"bench-{name}.json",
           "--ready-check-timeout-sec", "600"]
    if range_ratio:
        cmd += ["--random-range-ratio", str(range_ratio)]
    return cmd + (["--max-concurrency", str(concurrency)] if concurrency else [])


def metered(run: Run, server: subprocess.Popen[bytes] | None, base_url: str, tokenizer: str, name: str,
            **kwargs: Any) -> dict[str, Any]:
    """:func:`bench`, with the ``server``'s CPU time over the run (``cpu``) when there is one."""
    meter = CpuMeter(server.pid) if server is not None else None
    summary = bench(run, base_url, tokenizer, name, **kwargs)
    if meter is not None:
        tokens = summary.get("output_throughput")
        duration = summary.get("duration")
        summary["cpu"] = meter.stop(tokens * duration if tokens and duration else None, duration,
                                    summary.pop("ended", None))
        run.log(f"  {name}: cpu {summary['cpu']}")
    return summary


TTFT_METRIC = "vllm:time_to_first_token_seconds_bucket"


def ttft_buckets(base_url: str) -> dict[float, float] | None:
    """The server's own TTFT histogram (``vllm:time_to_first_token_seconds``, which ``vllm serve`` and the agent
    both export), cumulative counts by upper bound, summed over its label sets; None when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
            return parse_ttft_buckets(response.read().decode())
    except OSError:
        return None


def parse_ttft_buckets(text: str) -> dict[float, float] | None:
    """:func:`ttft_buckets` from a Prometheus text exposition (read by ``prometheus_client``'s parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == TTFT_METRIC:
                bound = float(sample.labels["le"])  # "+Inf" included
                out[bound] = out.get(bound, 0.0) + float(sample.value)
    return out or None


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The ``q`` quantile (0-1) of what a cumulative histogram gained between two scrapes, interpolated linearly
    within its bucket as Prometheus's ``histogram_quantile`` does (seconds); None without observations. Coarse:
    the answer is only as fine as the buckets (vLLM's: 1, 5, 10, 20, 40, 60, 80, 100, 250, 500 ms...)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / max(count - below, 1e-12))
        lower, below = bound, count
    return lower


def bench(run: Run, base_url: str, tokenizer: str, name: str, *, prompts: int, rate: str, concurrency: int | None,
          input_len: int, output_len: int, range_ratio: float = 0.0) -> dict[str, Any]:
    """One ``vllm bench serve`` run to its end; its summary, with the server's own TTFT over the run
    (``server_ttft_ms``: p50 and p99 from its histogram) beside the client's, so that a tail can be put inside the
    server's request path (queueing, scheduling, the first step) or outside it (HTTP, tokenizing, streaming back)."""
    run.log(f"bench {name}: {prompts} prompts, rate {rate}, concurrency {concurrency}")
    before = ttft_buckets(base_url)
    proc = start(bench_cmd(run, base_url, tokenizer, name, prompts=prompts, rate=rate, concurrency=concurrency,
                           input_len=input_len, output_len=output_len, range_ratio=range_ratio),
                 run.out / f"bench-{name}.log")
    proc.wait()
    summary = read_bench(run, name, proc.returncode)
    with contextlib.suppress(OSError):  # the bench saved its result as it ended, before its exit: the closer end
        summary["ended"] = time.monotonic() - (time.time() - (run.out / f"bench-{name}.json").stat().st_mtime)
    after = ttft_buckets(base_url)
    if after is not None:
        p50, p99 = (histogram_quantile(q, before or {}, after) for q in (0.5, 0.99))
        summary["server_ttft_ms"] = {"p50": None if p50 is None else round(p50 * 1e3, 1),
                                     "p99": None if p99 is None else round(p99 * 1e3, 1),
                                     "count": int(after.get(float("inf"), 0.0) - (before or {}).get(float("inf"), 0.0))}
        run.log(f"  {name}: server's own TTFT {summary['server_ttft_ms']}")
    return summary


def read_bench(run: Run, name: str, code: int) -> dict[str, Any]:
    path = run.out / f"bench-{name}.json"
    if not path.exists():
        return {"error": f"vllm bench serve exited with {code}, no result (see bench-{name}.log)"}
    raw = json.loads(path.read_text())
    summary = {k: raw.get(k) for k in SUMMARY_KEYS}
    run.log(f"  {name}: " + ", ".join(f"{k}={summary[k]:.1f}" if isinstance(summary[k], float) else
                                         f"{k}={summary[k]}" for k in SUMMARY_KEYS[:9]))
    return summary


def engine_args(args: argparse.Namespace) -> list[str]:
    """What both servers are given (flag names shared by ``vllm serve`` and ``trackside agent --engine vllm``)."""
    out = ["--load-format", "dummy", "--served-model-name", MODEL_NAME,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len), "--async-scheduling"]
    return out + (["--enforce-eager"] if args.eager else [])


def agent_cmd(args: argparse.Namespace, model: str, port: int, token_file: Path, listen: int, policy: str
              ) -> list[str]:
    cmd = [*python_module("agent.cli"), "agent", "--engine", "vllm", "--units", "1", "--batch-policy", policy,
           "--dispatch", "least_loaded", "--serve-openai", f"127.0.0.1:{port}", "--listen", f"127.0.0.1:{listen}",
           "--token-file", str(token_file), "--pending-timeout-s", "600"]
    cmd += args.agent_arg or []
    if args.fake:
        return [*cmd, "--fake-executor", "--served-model-name", MODEL_NAME, "--max-num-seqs",
                str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return [*cmd, "--model", model, "--gpus", "0", *engine_args(args)]


def plain_cmd(args: argparse.Namespace, model: str, port: int) -> list[str]:
    """``vllm serve`` with the engine flags the agent gets too."""
    return [*python_module("vllm.entrypoints.cli.main"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--gpu-memory-utilization", "0.9", *engine_args(args)]


def without_flag(cmd: list[str], flag: str) -> list[str]:
    """``cmd`` without ``flag`` and its value."""
    return [a for i, a in enumerate(cmd) if a != flag and (i == 0 or cmd[i - 1] != flag)]


def status(listen: int, token_file: Path) -> dict[str, Any]:
    done = subprocess.run([*python_module("agent.cli"), "ctl", f"ws://127.0.0.1:{listen}", "--token-file",
                           str(token_file), "--json", "status"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ctl status failed: {done.stderr[-500:]}")
    return dict(json.loads(done.stdout)["payload"])


def side(run: Run, args: argparse.Namespace, label: str, cmd: list[str], port: int, tokenizer: str, *, keep: bool
         ) -> subprocess.Popen[bytes] | None:
    """Start a server, run both benches on it; the server (``keep``) or None (stopped, or it failed)."""
    run.log(f"{label}: starting: {' '.join(cmd)}")
    proc = start(cmd, run.out / f"server-{label}.log")
    run.result[label] = {"command": cmd}
    try:
        measured = _side(run, args, label, proc, port, tokenizer)
    except Exception as e:  # recorded; the next side still runs
        run.result[label]["error"] = repr(e)
        run.log(f"{label}: {e!r}")
        measured = False
    run.save()
    if keep and measured:
        return proc
    stop(proc)
    wait_gpu_free(run)
    return None


def _side(run: Run, args: argparse.Namespace, label: str, proc: subprocess.Popen[bytes], port: int,
          tokenizer: str) -> bool:
    run.result[label]["start_s"] = round(wait_healthy(f"http://127.0.0.1:{port}/health", proc, args.start_timeout), 1)
    run.log(f"{label}: healthy after {run.result[label]['start_s']} s")
    base = f"http://127.0.0.1:{port}"
    run.result[label]["saturate"] = metered(run, proc, base, tokenizer, f"{label}-saturate", prompts=args.prompts,
                                            rate="inf", concurrency=args.concurrency, input_len=args.input_len,
                                            output_len=args.output_len, range_ratio=args.range_ratio)
    run.save()
    if args.rate_prompts <= 0:
        return True
    run.result[label]["poisson"] = metered(run, proc, base, tokenizer, f"{label}-poisson", prompts=args.rate_prompts,
                                           rate=str(args.rate), concurrency=None, input_len=args.input_len,
                                           output_len=args.output_len, range_ratio=args.range_ratio)
    run.save()
    return True


def kill_test(run: Run, args: argparse.Namespace, port: int, listen: int, token_file: Path, tokenizer: str
              ) -> None:
    before = status(listen, token_file)
    pid = int(before["units"][0]["engine_pid"])
    load = start(bench_cmd(run, f"http://127.0.0.1:{port}", tokenizer, "kill", prompts=args.kill_prompts, rate="inf",
                           concurrency=args.kill_prompts, input_len=args.input_len,
                           output_len=args.kill_output_len), run.out / "bench-kill.log")
    t0 = time.monotonic()  # the bench takes a while to start: kill once its requests are on the engine
    while load.poll() is None and time.monotonic() - t0 < 180:
        unit = status(listen, token_file)["units"][0]
        if int(unit.get("num_running") or 0) >= args.kill_prompts // 2:
            break
        time.sleep(0.2)
    run.log(f"kill: {unit.get('num_running')} running on the unit")
    time.sleep(args.kill_after)
    if load.poll() is not None:  # nothing left to lose: the measurement would say nothing
        run.result["kill"] = {"skipped": "the load ended before the kill: more --kill-prompts or --kill-output-len",
                              "bench": read_bench(run, "kill", load.returncode)}
        run.save()
        return
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    run.log(f"kill: SIGKILL to engine core {pid} under load")
    modes: list[tuple[float, str, int | None]] = []
    while load.poll() is None and time.monotonic() - t_kill < args.kill_timeout:
        try:
            unit = status(listen, token_file)["units"][0]
            mode, engine_pid = str(unit.get("mode")), unit.get("engine_pid")
            if not modes or modes[-1][1:] != (mode, engine_pid):
                modes.append((round(time.monotonic() - t_kill, 2), mode, engine_pid))
                run.log(f"kill: +{modes[-1][0]} s unit 0 {mode}, engine {engine_pid}")
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, IndexError) as e:
            modes.append((round(time.monotonic() - t_kill, 2), f"status error: {e}", None))
        time.sleep(0.5)
    if load.poll() is None:
        stop(load, 5)
    summary = read_bench(run, "kill", load.returncode or 0)
    run.result["kill"] = {"engine_pid": pid, "prompts": args.kill_prompts, "kill_after_s": args.kill_after,
                          "modes": modes, "bench": summary,
                          "lost": args.kill_prompts - int(summary.get("completed") or 0)}
    run.save()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.abspath(".gpu/models/llama31-8b"), help="a folder with config.json")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--fake", action="store_true", help="CPU: the fake executor on both sides")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs on either side")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=600, help="saturating run: requests")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="prompt and output lengths drawn from LEN*(1-R) to LEN*(1+R) (vllm bench serve's "
                    "--random-range-ratio; default 0: one length, so a saturating run's requests finish together, "
                    "in waves)")
    ap.add_argument("--concurrency", type=int, default=256, help="saturating run: at most this many in flight")
    ap.add_argument("--rate", type=float, default=20.0, help="Poisson run: requests/s")
    ap.add_argument("--rate-prompts", type=int, default=300, help="Poisson run: requests (0: no Poisson run)")
    ap.add_argument("--kill-prompts", type=int, default=200)
    ap.add_argument("--kill-output-len", type=int, default=256)
    ap.add_argument("--kill-after", type=float, default=2.0,
                    help="seconds after half the kill run's requests are running on the unit")
    ap.add_argument("--kill-timeout", type=float, default=240.0)
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--deadline-s", type=float, default=480.0, help="no kill test after this many seconds")
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--agent-arg", action="append", metavar="ARG",
                    help="one more argument for the agent's command (repeatable): --agent-arg=--uvloop")
    ap.add_argument("--trackside-first", action="store_true",
                    help="the agent's side before plain's (its kill test, if any, right after it)")
    return ap


def prepare(run: Run, args: argparse.Namespace) -> tuple[str, Path]:
    """The model folder, which is also the tokenizer's (``--fake``: the fake executor's tiny model), and a control
    token file for the agents; the settings, model and GPU go on record."""
    if args.fake:
        from agent.engine.vllm.cpu import tiny_model_dir

        model = tiny_model_dir()
    else:
        model = model_with_tokenizer(args.model)
    run.result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    run.result["model"] = model
    token_file = Path(tempfile.mkdtemp(prefix="trackside-token-")) / "token"
    token_file.write_text("bench-" + os.urandom(8).hex())
    token_file.chmod(0o600)
    run.result["gpu"] = nvidia_smi("name,memory.total,driver_version")  # not torch: no CUDA context here
    run.save()
    return model, token_file


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = Run(args.out)
    model, token_file = prepare(run, args)
    tokenizer = model
    deadline = time.monotonic() + args.deadline_s
    # No vllm serve without a GPU: with --fake a second agent stands in for it.
    plain = agent_cmd(args, model, 8100, token_file, 7701, "vllm") if args.fake else plain_cmd(args, model, 8100)
    if not args.skip_plain and not args.trackside_first:
        side(run, args, "plain", plain, 8100, tokenizer, keep=False)
    ours = agent_cmd(args, model, 8200, token_file, 7700, "vllm")
    keep = not args.skip_kill
    proc = side(run, args, "trackside", ours, 8200, tokenizer, keep=keep)
    if "error" in run.result["trackside"] and "--gpus" in ours:  # placement is new on a GPU: once more without it
        no_gpus = without_flag(ours, "--gpus")
        run.result["trackside_with_gpus"] = run.result.pop("trackside")
        proc = side(run, args, "trackside", no_gpus, 8200, tokenizer, keep=keep)
    if proc is not None:
        try:
            if time.monotonic() > deadline:
                run.result["kill"] = {"skipped": "out of time"}
            else:
                kill_test(run, args, 8200, 7700, token_file, tokenizer)
        except Exception as e:  # recorded, the servers still stop
            run.result["kill_error"] = repr(e)
        finally:
            stop(proc)
            wait_gpu_free(run)
    if not args.skip_plain and args.trackside_first:
        side(run, args, "plain", plain, 8100, tokenizer, keep=False)
    plain, ours = run.result.get("plain", {}), run.result["trackside"]
    if "saturate" in plain and "output_throughput" in plain["saturate"] and "output_throughput" in ours["saturate"]:
        run.result["output_throughput_ratio"] = round(
            ours["saturate"]["output_throughput"] / plain["saturate"]["output_throughput"], 4)
        run.log(f"output throughput ratio trackside/plain: {run.result['output_throughput_ratio']}")
    run.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
