"""Where the vLLM agent's front-end CPU per output token goes: engine side (A) against HTTP side (B), on the CPU
(needs the vllm extra, and py-spy: ``pip install py-spy``, not a project dependency).

    python tests/benchmarks/bench_frontend_split.py [--side trackside|plain|both] [--rounds 2] [--prompts 1000]
        [--concurrency 64] [--input-len 64] [--output-len 128] [--rate 500]

For sizing a front end split in two: the agent's main process keeping the engine side, several processes serving
HTTP. Each run starts one server on a free port, with the fake executor and the tiny model (a step costs a few
milliseconds, so the front end is what saturates):

* **trackside**: ``trackside agent --engine vllm --fake-executor --units 1 --serve-openai ...`` (uvloop, the
  agent's default);
* **plain**: vLLM's own OpenAI app over one fake-executor ``AsyncLLM`` with vLLM's scheduler, on uvloop
  (``bench_openai_intake.py --serve-plain PORT --plain-scheduler vllm --uvloop``).

It then runs one saturating ``vllm bench serve`` against it (random prompts, ``--ignore-eos``, ``--request-rate inf``
under ``--max-concurrency``) while ``py-spy record --format raw --threads`` samples the server process (py-spy's
default mode: idle threads left out, the process paused for each sample, no native frames) and the process's own
CPU (utime + stime from ``/proc``, its engine core apart) is read every 50 ms. Each sampled stack is put in a bucket
(:data:`RULES`), walking from the leaf towards the root; the first frame that matches a rule decides, so the
innermost trackside or vLLM family that owns the work gets it and generic frames (asyncio, logging, pydantic,
msgspec, transformers, ``vllm/outputs.py``...) are charged to it:

* **A**, the engine side: vLLM's ``AsyncLLM`` output handler, zmq receive and msgpack decode, ``OutputProcessor``
  (detokenizing, building ``RequestOutput``), the rest of ``vllm/v1/engine``; trackside's ``VllmUnit``,
  ``LiveRequest``, ``RequestStream``'s producer side (``_push``...), ``LiveCluster`` and the dispatcher
  (``agent/runtime/``), the telemetry hub, step records;
* **B**, the HTTP side: vLLM's OpenAI serving (``vllm/entrypoints``), the renderer and prompt tokenizing (also on
  the tokenizer thread), trackside's ``engine_client.py`` and ``openai_server.py`` middleware, ``RequestStream``'s
  consumer side (``__anext__``, ``ready``: it runs in the HTTP task), uvicorn, h11, httptools, starlette, fastapi,
  anyio;
* **C**, no anchor on the stack: almost only the event loop with no Python frame above it.

Samples of threads other than the main thread whose leaf is a blocking wait (the engine monitor in ``select``, idle
pool workers) are dropped: py-spy counts them active, but they use next to no CPU.

It prints a Markdown table, one row per run: output tokens (the bench's ``total_output_tokens``), output tok/s, the
server process's CPU µs per output token over the bench's measured window, the A, B and C samples and shares,
A/(A+B), and each side's µs per token (its share × the CPU µs per token); then each run's sub-buckets (% of the
samples kept). The raw stacks, bench results and server logs stay in a temporary folder, named at the end.

Caveats: py-spy's shares are shares of non-idle samples, not of CPU time (a thread runnable but not running counts
as active); C is partly idle (the loop waiting in ``epoll``, counted active): A/(A+B) leaves it out; garbage
collection is charged to the frame that allocated, so it sits in A or B, not in a bucket of its own; py-spy pauses the
process for each sample, which costs throughput and some CPU; the fake executor on a few CPU cores is not a GPU (the
engine core shares the cores with the front end and the client; batch sizes, hence per-token costs, differ).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.bench.proc_cpu import cpu_s
from agent.bench.vllm_serve_compare import MODEL_NAME, start, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]

Bucket = Literal["A", "B", "C"]
BUCKETS: tuple[Bucket, ...] = ("A", "B", "C")
Predicate = Callable[[str, str], bool]
"""Whether a frame, given as (function, path) the way py-spy prints them, belongs to a rule's family."""

REQUESTS = "agent/runtime/live/requests.py"
UNIT = "agent/engine/vllm/unit.py"
STREAM_PULL = ("__anext__", "ready", "__aiter__", "wait")
"""``RequestStream``'s consumer side: it runs in the HTTP task, reading what the engine side pushed."""

RULES: tuple[tuple[Bucket, str, Predicate], ...] = (
    ("B", "B RequestStream.__anext__/ready (the consumer, in the HTTP task)",
     lambda f, p: p.endswith(REQUESTS) and f.rsplit(".", 1)[-1] in STREAM_PULL),
    ("A", "A RequestStream push (_push/_put/_finish)", lambda f, p: p.endswith(REQUESTS)),
    ("A", "A LiveCluster / dispatcher (agent/runtime/, agent/policies/)",
     lambda f, p: p.startswith(("agent/runtime/", "agent/policies/", "agent/dispatch"))),
    ("A", "A telemetry hub (agent/service/hub.py)", lambda f, p: p.startswith("agent/service/hub.py")),
    ("A", "A VllmUnit._read_steps (step records)", lambda f, p: p.endswith(UNIT) and f == "VllmUnit._read_steps"),
    ("A", "A VllmUnit._output / LiveRequest",
     lambda f, p: (p.endswith(UNIT) and f == "VllmUnit._output") or "LiveRequest" in f),
    ("A", "A VllmUnit other (submit, _generate, watch)", lambda f, p: p.endswith(UNIT)),
    # (before the OutputProcessor rule: RequestOutputCollector is defined in output_processor.py too)
    ("B", "B AsyncLLM.generate / RequestOutputCollector.get (plain: the per-request consumer)",
     lambda f, p: p.startswith("vllm/v1/engine/")
     and (f == "AsyncLLM.generate" or f.startswith("RequestOutputCollector.get"))),
    ("A", "A vLLM OutputProcessor (detokenize, RequestOutput creation)",
     lambda f, p: p.startswith(("vllm/v1/engine/output_processor.py", "vllm/v1/engine/detokenizer.py",
                                "vllm/v1/engine/logprobs.py"))),
    ("A", "A vLLM output_handler's own lines",
     lambda f, p: "output_handler" in f and p.startswith("vllm/v1/engine/async_llm.py")),
    ("A", "A zmq recv + msgpack decode (process_outputs_socket, zmq/, serial_utils)",
     lambda f, p: (p.startswith("vllm/v1/engine/core_client.py") and "process_outputs_socket" in f)
     or p.startswith(("zmq/", "vllm/v1/serial_utils.py"))),
    ("A", "A vLLM metrics / stat loggers", lambda f, p: p.startswith("vllm/v1/metrics/")),
    ("A", "A other vllm/v1/engine (AsyncLLM.add_request, InputProcessor, core_client)",
     lambda f, p: p.startswith("vllm/v1/engine/")),
    ("B", "B RoutedEngineClient (engine_client.py)", lambda f, p: p.endswith("agent/engine/vllm/engine_client.py")),
    ("B", "B TracksideMiddleware (openai_server.py)", lambda f, p: p.endswith("agent/service/openai_server.py")),
    ("B", "B renderer / prompt tokenization",
     lambda f, p: p.startswith("vllm/renderers/") or f.startswith("PreTrainedTokenizerBase.__call__")),
    ("B", "B vLLM OpenAI serving (vllm/entrypoints)", lambda f, p: p.startswith("vllm/entrypoints/")),
    ("B", "B uvicorn / httptools / h11", lambda f, p: p.startswith(("uvicorn/", "h11/", "httptools/"))),
    ("B", "B starlette / fastapi / anyio", lambda f, p: p.startswith(("starlette/", "fastapi/", "anyio/"))),
)
"""(bucket, sub-bucket, predicate), tried in this order on each frame from the leaf towards the root: the first
frame any rule matches decides, and of the rules the first that matches it."""

C_LOOP = "C event loop with no Python frame on top"
C_OTHER = "C other, unanchored"
LOOP_LEAVES = ("Runner.run", "run")
"""A stack with no anchor whose leaf is one of these is the event loop itself (uvloop, libuv) running: C_LOOP."""

WAITS = ("_PollLikeSelector.select", "select (selectors.py", "_worker (concurrent/futures/thread.py:81)",
         "Condition.wait", "Event.wait", "wait (multiprocessing/connection.py")
"""A non-main thread's sample whose leaf frame contains one of these is a thread blocked in a wait: dropped."""

MAIN_THREAD = "MainThread"
FRAME = re.compile(r"(.*) \((.*):\d+\)$")


# -- the pure part: collapsed stacks in, buckets out ------------------------------------------------------------


def parse_frame(frame: str) -> tuple[str, str]:
    """``"Func.name (path/file.py:123)"`` as ``(function, path)``; a frame without a location as ``(frame, "")``."""
    m = FRAME.match(frame)
    return (m.group(1), m.group(2)) if m else (frame, "")


def parse_line(line: str) -> tuple[str, list[str], int] | None:
    """One line of ``py-spy record --format raw --threads`` (``thread (TID): NAME;frame;...;leaf COUNT``, root
    first) as ``(thread name, frames root first, count)``; None for a blank line."""
    line = line.rstrip("\n")
    if not line.strip():
        return None
    stack, count = line.rsplit(" ", 1)
    thread, *frames = stack.split(";")
    return thread.split(": ", 1)[-1], frames, int(count)


def is_blocked_wait(thread: str, frames: Sequence[str]) -> bool:
    """A sample of a thread other than the main one, blocked in a wait (:data:`WAITS`)."""
    return thread != MAIN_THREAD and bool(frames) and any(w in frames[-1] for w in WAITS)


def classify_stack(frames: Sequence[str]) -> tuple[Bucket, str]:
    """``(bucket, sub-bucket)`` of one stack (root first): the first frame from the leaf that a rule matches."""
    for frame in reversed(frames):
        func, path = parse_frame(frame)
        for bucket, label, matches in RULES:
            if matches(func, path):
                return bucket, label
    if frames and parse_frame(frames[-1])[0] in LOOP_LEAVES:
        return "C", C_LOOP
    return "C", C_OTHER


@dataclass
class Split:
    """Samples of one profile by bucket, by sub-bucket and by thread (the kept ones), and how many were dropped."""

    buckets: Counter[str] = field(default_factory=Counter)
    sub_buckets: Counter[str] = field(default_factory=Counter)
    threads: Counter[str] = field(default_factory=Counter)
    dropped: int = 0

    @property
    def kept(self) -> int:
        return sum(self.buckets.values())

    def share(self, bucket: Bucket) -> float:
        """A bucket's share of the samples kept, 0-1."""
        return self.buckets[bucket] / self.kept if self.kept else 0.0

    def sub_share(self, label: str) -> float:
        """A sub-bucket's share of the samples kept, 0-1."""
        return self.sub_buckets[label] / self.kept if self.kept else 0.0

    @property
    def engine_of_engine_and_http(self) -> float:
        """A / (A + B): C left out."""
        ab = self.buckets["A"] + self.buckets["B"]
        return self.buckets["A"] / ab if ab else 0.0


def classify_lines(lines: Iterable[str]) -> Split:
    """The :class:`Split` of a collapsed-stack profile given line by line."""
    split = Split()
    for line in lines:
        parsed = parse_line(line)
        if parsed is None:
            continue
        thread, frames, count = parsed
        if is_blocked_wait(thread, frames):
            split.dropped += count
            continue
        bucket, label = classify_stack(frames)
        split.buckets[bucket] += count
        split.sub_buckets[label] += count
        split.threads[thread] += count
    return split


def classify_text(text: str) -> Split:
    return classify_lines(text.splitlines())


@dataclass
class RunResult:
    """One profiled bench run: its load, the server process's CPU over the bench's window, and the split."""

    name: str
    side: str
    output_tokens: int
    bench_s: float
    output_tok_s: float
    cpu_s: float
    split: Split

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.cpu_s / self.output_tokens if self.output_tokens else float("nan")

    def us_per_token(self, bucket: Bucket) -> float:
        """The bucket's share × the process's CPU µs per output token."""
        return self.split.share(bucket) * self.cpu_us_per_token


def results_table(runs: Sequence[RunResult]) -> str:
    """One Markdown row per run."""
    head = ("run", "side", "out tokens", "bench s", "out tok/s", "CPU s (bench window)", "CPU µs/tok", "A samples",
            "B samples", "C samples", "A %", "B %", "C %", "A/(A+B) %", "A µs/tok", "B µs/tok", "C µs/tok")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s = r.split
        cells = [r.name, r.side, str(r.output_tokens), f"{r.bench_s:.2f}", f"{r.output_tok_s:.0f}", f"{r.cpu_s:.2f}",
                 f"{r.cpu_us_per_token:.1f}", *(str(s.buckets[b]) for b in BUCKETS),
                 *(f"{100 * s.share(b):.1f}" for b in BUCKETS), f"{100 * s.engine_of_engine_and_http:.1f}",
                 *(f"{r.us_per_token(b):.1f}" for b in BUCKETS)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def breakdown_table(runs: Sequence[RunResult]) -> str:
    """Each sub-bucket's % of the samples kept, one column per run: A's, B's and C's, each largest first (summed
    over the runs), with the buckets' totals."""
    totals: Counter[str] = Counter()
    for r in runs:
        totals.update({label: r.split.sub_share(label) for label in r.split.sub_buckets})
    rows = ["| sub-bucket | " + " | ".join(r.name for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for bucket in BUCKETS:
        labels = sorted((label for label in totals if label.startswith(bucket + " ")), key=lambda x: -totals[x])
        rows += ["| " + label + " | " + " | ".join(f"{100 * r.split.sub_share(label):.1f}" for r in runs) + " |"
                 for label in labels]
        if bucket != "C":
            rows.append(f"| **{bucket} total** | " + " | ".join(f"**{100 * r.split.share(bucket):.1f}**"
                                                             for r in runs) + " |")
    return "\n".join(rows)


# -- the runs ----------------------------------------------------------------------------------------------------

Side = Literal["trackside", "plain"]
BENCH_TIMEOUT_S = 1800.0
HEALTH_TIMEOUT_S = 300.0
SETTLE_S = 2.0
CPU_INTERVAL_S = 0.05


def find_py_spy() -> str | None:
    """py-spy on ``PATH``, or next to this Python (a virtualenv's ``bin`` that is not on ``PATH``)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(side: Side, port: int, concurrency: int, token: Path) -> list[str]:
    if side == "trackside":
        return [sys.executable, "-m", "agent.cli", "agent", "--engine", "vllm", "--fake-executor", "--units", "1",
                "--serve-openai", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--node-id", "p",
                "--token-file", str(token), "--served-model-name", MODEL_NAME, "--max-num-seqs", str(concurrency),
                "--max-num-batched-tokens", "2048"]
    return [sys.executable, str(ROOT / "tests" / "benchmarks" / "bench_openai_intake.py"), "--serve-plain", str(port),
            "--concurrency", str(concurrency), "--plain-scheduler", "vllm", "--uvloop"]


def bench_cmd(port: int, tokenizer: str, out: Path, name: str, *, prompts: int, concurrency: int, input_len: int,
              output_len: int) -> list[str]:
    """A saturating ``vllm bench serve`` whose result lands in ``out`` as ``bench-NAME.json``."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", MODEL_NAME,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--request-rate", "inf",
            "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
            "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(out), "--result-filename",
            f"bench-{name}.json", "--max-concurrency", str(concurrency)]


class CpuTrace:
    """A process's CPU seconds (utime + stime), read every ``interval_s`` by a thread of this one until
    :meth:`stop`, so that the CPU over any window inside can be read (interpolated linearly)."""

    def __init__(self, pid: int, interval_s: float = CPU_INTERVAL_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-trace", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            used = cpu_s(self.pid)
            if used is not None:
                self.samples.append((time.monotonic(), used))
            if self._done.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def at(self, t: float) -> float:
        for (t0, c0), (t1, c1) in pairwise(self.samples):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        raise RuntimeError(f"no CPU reading of pid {self.pid} around t={t:.2f} (readings cover "
                           f"{self.samples[0][0] if self.samples else 'nothing'} to "
                           f"{self.samples[-1][0] if self.samples else ''})")


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"({path} unreadable)"


def profiled_run(args: argparse.Namespace, side: Side, name: str, out: Path, py_spy: str, tokenizer: str,
                 token: Path) -> RunResult:
    """Start the server, run the bench against it under py-spy, stop everything (also on failure)."""
    port = free_port()
    log = out / f"server-{name}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name}: server on port {port} (log {log})", flush=True)
    server = start(server_cmd(side, port, args.concurrency, token), log, ROOT)
    bench: subprocess.Popen[bytes] | None = None
    spy: subprocess.Popen[bytes] | None = None
    trace: CpuTrace | None = None
    stacks = out / f"stacks-{name}.txt"
    result = out / f"bench-{name}.json"
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server, HEALTH_TIMEOUT_S)
        time.sleep(SETTLE_S)
        trace = CpuTrace(server.pid)
        bench = start(bench_cmd(port, tokenizer, out, name, prompts=args.prompts, concurrency=args.concurrency,
                                input_len=args.input_len, output_len=args.output_len), out / f"bench-{name}.log", ROOT)
        # the bench client spends its first seconds importing: the server idles, and idle threads are not sampled
        spy = start([py_spy, "record", "--pid", str(server.pid), "--rate", str(args.rate), "--format", "raw",
                     "--threads", "--output", str(stacks)], out / f"py-spy-{name}.log")
        try:
            bench.wait(BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name}: the bench ran past {BENCH_TIMEOUT_S:.0f} s") from None
        stop(spy, 60)  # SIGINT: py-spy writes its stacks and exits
        trace.stop()
        if server.poll() is not None:
            raise RuntimeError(f"{name}: the server exited with {server.returncode}:\n{tail(log)}")
        if not result.exists():
            raise RuntimeError(f"{name}: vllm bench serve exited with {bench.returncode}, no result:\n"
                               f"{tail(out / f'bench-{name}.log')}")
        if not stacks.exists() or not stacks.stat().st_size:
            raise RuntimeError(f"{name}: py-spy wrote no stacks:\n{tail(out / f'py-spy-{name}.log')}")
        res = json.loads(result.read_text())
        if res.get("completed") != args.prompts:
            raise RuntimeError(f"{name}: {res.get('completed')} of {args.prompts} requests completed")
        # the bench saves its result as its measured window ends: the window's end on this clock
        end = time.monotonic() - (time.time() - result.stat().st_mtime)
        window_cpu = trace.at(end) - trace.at(end - res["duration"])
        return RunResult(name, side, int(res["total_output_tokens"]), float(res["duration"]),
                         float(res["output_throughput"]), window_cpu, classify_text(stacks.read_text()))
    finally:
        for proc in (spy, bench):
            if proc is not None:
                stop(proc, 60)
        if trace is not None:
            trace.stop()
        stop(server)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("trackside", "plain", "both"), default="both",
                    help="which server to profile: the trackside agent, vLLM's own OpenAI app (plain), or both, "
                         "alternating plain, trackside in each round (default both)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side (default 2)")
    ap.add_argument("--prompts", type=int, default=1000, help="requests per run (default 1000)")
    ap.add_argument("--concurrency", type=int, default=64,
                    help="the bench's --max-concurrency, also the server's max_num_seqs (default 64)")
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens per request (default 64)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    ap.add_argument("--rate", type=int, default=500, help="py-spy's samples per second (default 500)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    py_spy = find_py_spy()
    if py_spy is None:
        print(f"py-spy not found on PATH nor next to {sys.executable}: pip install py-spy "
              "(it is not a project dependency)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not installed: this benchmark needs the vllm extra", file=sys.stderr)
        return 2
    from agent.engine.vllm.cpu import tiny_model_dir

    tokenizer = tiny_model_dir()
    out = Path(tempfile.mkdtemp(prefix="bench-frontend-split-"))
    token = out / "token"
    token.write_text("bench-frontend-split-token-0123456789")
    token.chmod(0o600)
    sides: tuple[Side, ...] = ("plain", "trackside") if args.side == "both" else (args.side,)
    runs: list[RunResult] = []
    for r in range(args.rounds):
        for side in sides:
            runs.append(profiled_run(args, side, f"{side}-{r + 1}", out, py_spy, tokenizer, token))
    print(f"\npy-spy {args.rate} Hz; {args.prompts} prompts of {args.input_len} tokens, {args.output_len} output "
          f"tokens each, at most {args.concurrency} at a time; CPU: the server process over the bench's window\n")
    print(results_table(runs))
    print()
    for run in runs:
        threads = ", ".join(f"{t} {n}" for t, n in run.split.threads.most_common())
        print(f"{run.name}: {run.split.kept} samples kept ({threads}), {run.split.dropped} dropped (non-main threads "
              "blocked in a wait)")
    print(f"\nSub-buckets, % of the samples kept:\n\n{breakdown_table(runs)}")
    print(f"\nraw stacks, bench results and logs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
