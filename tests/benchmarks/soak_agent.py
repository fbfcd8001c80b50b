"""Soak: does a live agent's memory stay flat while requests pass? (issue #21, item 9)

    python tests/benchmarks/soak_agent.py [--minutes 60] [--sample-s 60] [--rate 10] [--speed 10] [--units 4]

Starts ``trackside agent --units U --workload poisson:n=...,rate=R --speed S`` (R x S requests per second of wall
time: 100 by default) with one ``trackside record`` attached writing a DuckDB file, samples the resident memory
(RSS, from ``/proc``) of both every ``--sample-s`` seconds for ``--minutes``, then stops both and prints the
table and the growth of each after the first five minutes (the target: under 5 MB over an hour), with the trend
(least-squares slope, MiB per hour) and range of the samples after them. Linux only;
asserts nothing. ``--fake-vllm``: vLLM units on the CPU's fake executor instead (``--engine vllm
--fake-executor``; no ``--speed``: ``--rate`` requests per wall second). ``--http`` (with ``--fake-vllm``): no
workload; the agent serves vLLM's OpenAI app (``--serve-openai``) and this script sends it chat completions itself
(Poisson arrivals at ``--rate`` per second, ``--max-tokens`` each, text prompts through the tiny model's
tokenizer and chat template): the path an operator's clients take. It prints how many were answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def growth_after(samples: list[tuple[float, float | None]], warmup_s: float) -> float | None:
    """RSS growth (MiB) from the first sample at or after ``warmup_s`` to the last; None without two such samples."""
    later = [mb for t, mb in samples if t >= warmup_s and mb is not None]
    return later[-1] - later[0] if len(later) >= 2 else None


def trend_after(samples: list[tuple[float, float | None]], warmup_s: float) -> tuple[float, float, float] | None:
    """After ``warmup_s``: the least-squares slope of RSS in MiB per hour, and its lowest and highest sample; None
    without three samples. A process whose memory swings (the recorder's Arrow batches and DuckDB's buffers) can end
    above or below where it started by chance: the slope over every sample tells growth from swing."""
    later = [(t, mb) for t, mb in samples if t >= warmup_s and mb is not None]
    if len(later) < 3:
        return None
    mt = sum(t for t, _ in later) / len(later)
    mm = sum(mb for _, mb in later) / len(later)
    var = sum((t - mt) ** 2 for t, _ in later)
    slope = sum((t - mt) * (mb - mm) for t, mb in later) / var if var else 0.0
    return slope * 3600, min(mb for _, mb in later), max(mb for _, mb in later)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per node second (default 10)")
    ap.add_argument("--speed", type=float, default=10.0, help="node seconds per real second (default 10)")
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--port", type=int, default=7793)
    ap.add_argument("--warmup-min", type=float, default=5.0, help="growth is counted after this (default 5)")
    ap.add_argument("--fake-vllm", action="store_true", help="vLLM units on the fake executor (CPU)")
    ap.add_argument("--http", action="store_true",
                    help="with --fake-vllm: chat completions over the OpenAI API (served on --port + 1)")
    ap.add_argument("--max-tokens", type=int, default=64, help="--http: output tokens per request (default 64)")
    args = ap.parse_args()
    if args.http and not args.fake_vllm:
        ap.error("--http needs --fake-vllm")
    out = Path(tempfile.mkdtemp(prefix="soak-"))
    if args.fake_vllm:
        args.speed = 1.0
    n = int(args.rate * args.speed * args.minutes * 60 * 1.2) + 1000  # more than the soak can use
    url = f"ws://127.0.0.1:{args.port}"
    with contextlib.ExitStack() as logs:
        agent_log = logs.enter_context(open(out / "agent.log", "w"))
        record_log = logs.enter_context(open(out / "record.log", "w"))
        return soak(args, out, n, url, agent_log, record_log)


def soak(args: argparse.Namespace, out: Path, n: int, url: str, agent_log: IO[str], record_log: IO[str]) -> int:
    engine = ["--engine", "vllm", "--fake-executor"] if args.fake_vllm else ["--speed", f"{args.speed:g}"]
    http = f"127.0.0.1:{args.port + 1}"
    work = ["--serve-openai", http] if args.http else ["--workload", f"poisson:n={n},rate={args.rate:g}"]
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--units", str(args.units), *work, *engine,
                              "--listen", f"127.0.0.1:{args.port}"], stdout=subprocess.DEVNULL, stderr=agent_log)
    time.sleep(60 if args.fake_vllm else 8)  # the agent builds its workload (and engines) and starts listening
    recorder = subprocess.Popen([sys.executable, "-m", "agent.cli", "record", "--db", str(out / "soak.duckdb"), url],
                                stdout=subprocess.DEVNULL, stderr=record_log)
    start = time.monotonic()
    rows: list[tuple[float, float | None, float | None]] = []
    stop = threading.Event()
    counts = {"ok": 0, "failed": 0}
    client = threading.Thread(target=lambda: asyncio.run(chat_load(f"http://{http}", args, stop, counts)), daemon=True)
    if args.http:
        client.start()
    try:
        while (elapsed := time.monotonic() - start) < args.minutes * 60:
            rows.append((elapsed, rss_mb(agent.pid), rss_mb(recorder.pid)))
            a, r = rows[-1][1], rows[-1][2]
            print(f"{elapsed / 60:6.1f} min  agent {a if a is None else round(a, 1)} MB  "
                  f"recorder {r if r is None else round(r, 1)} MB", flush=True)
            if agent.poll() is not None or recorder.poll() is not None:
                print("a process ended early: see", out, file=sys.stderr)
                break
            time.sleep(args.sample_s)
        rows.append((time.monotonic() - start, rss_mb(agent.pid), rss_mb(recorder.pid)))
    finally:
        stop.set()
        if args.http:
            client.join(60)
        for proc in (recorder, agent):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (recorder, agent):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    warm = args.warmup_min * 60
    if args.http:
        print(f"\nchat completions: {counts['ok']} answered, {counts['failed']} failed")
    print(f"\nmachine: {os.cpu_count()} CPUs; {args.units} units, {args.rate * args.speed:g} requests per wall second, "
          f"{args.minutes:g} min; files in {out}")
    print("| minute | agent RSS MB | recorder RSS MB |\n|---|---|---|")
    for t, a, r in rows:
        print(f"| {t / 60:.1f} | {a if a is None else f'{a:.1f}'} | {r if r is None else f'{r:.1f}'} |")
    for name, k in (("agent", 1), ("recorder", 2)):
        g = growth_after([(row[0], row[k]) for row in rows], warm)
        trend = trend_after([(row[0], row[k]) for row in rows], warm)
        print(f"{name}: growth after {args.warmup_min:g} min: " + ("n/a" if g is None else f"{g:+.1f} MB")
              + ("" if trend is None else f"; trend {trend[0]:+.1f} MB/hour, range {trend[1]:.1f}-{trend[2]:.1f} MB"))
    return 0


async def chat_load(base: str, args: argparse.Namespace, stop: threading.Event, counts: dict[str, int]) -> None:
    """Chat completions to ``base`` at Poisson arrivals of ``args.rate`` per second until ``stop``; counts answers."""
    import aiohttp

    rng = random.Random(0)
    words = ["the", "a", "GPU", "node", "serves", "tokens", "step", "by", "while", "console", "watches", "slack"]
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(600):  # the OpenAI server starts after the units
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{base}/v1/models") as resp:
                    model = (await resp.json())["data"][0]["id"]
                    break
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"no OpenAI server at {base}")

        async def one() -> None:
            body = {"model": model, "max_tokens": args.max_tokens, "ignore_eos": True, "messages": [
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(8, 120)))}]}
            try:
                async with session.post(f"{base}/v1/chat/completions", data=json.dumps(body),
                                        headers={"Content-Type": "application/json"}) as resp:
                    ok = resp.status == 200 and bool((await resp.json())["choices"])
            except (aiohttp.ClientError, ValueError, KeyError):
                ok = False
            counts["ok" if ok else "failed"] += 1

        while not stop.is_set():
            await asyncio.sleep(rng.expovariate(args.rate))
            task = asyncio.get_running_loop().create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    raise SystemExit(main())
