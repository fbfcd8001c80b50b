"""The CPU a server uses while a benchmark runs against it, from ``/proc`` (Linux): the process, its descendants (an
engine core), its main thread, sampled by a thread of the measuring process so that each second's busy share can be
read (issue #14 item 8: is the front end's event loop the bottleneck at saturation?)."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children...), from ``/proc`` (Linux); [] elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = entry.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stat_cpu_s(stat: str) -> float | None:
    """User plus system CPU seconds so far from a ``/proc`` ``stat`` file; None when it is gone."""
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds of one process so far (``/proc/PID/stat``); None when it is gone."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def thread_cpu_s(pid: int, tid: int) -> float | None:
    """User plus system CPU seconds of one thread of ``pid`` so far (``/proc/PID/task/TID/stat``); None when gone."""
    return _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")


def window_shares(samples: list[tuple[float, float]], start: float, end: float, width: float = 1.0) -> list[float]:
    """The busy share (CPU seconds per wall second) in each whole ``width``-second window from ``start`` to ``end``,
    from cumulative ``(monotonic time, CPU seconds)`` samples, interpolated linearly between them; windows the
    samples do not cover are left out."""
    if len(samples) < 2:
        return []

    def at(t: float) -> float | None:
        for (t0, c0), (t1, c1) in itertools.pairwise(samples):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return None

    out = []
    a = start
    while a + width <= end + 1e-9:
        lo, hi = at(a), at(a + width)
        if lo is not None and hi is not None:
            out.append(round((hi - lo) / width, 3))
        a += width
    return out


def spread(shares: list[float]) -> dict[str, float] | None:
    """Median, 90th percentile and maximum of per-window busy shares."""
    if not shares:
        return None
    ranked = sorted(shares)
    return {"p50": ranked[len(ranked) // 2], "p90": ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))],
            "max": ranked[-1]}


class CpuMeter:
    """CPU seconds of a server process and of its descendants from the meter's creation to :meth:`stop`; and, sampled
    every ``interval_s`` by a thread of this process, the CPU of the server's main thread (where both servers run
    their event loop: vLLM's API server and the agent) and of the descendants, so that the share of each second
    they were busy during the bench can be read: a front end whose loop is busy near 1.0 while the engine waits
    is the bottleneck."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.wall_s = time.monotonic()
        self.own = cpu_s(pid) or 0.0
        self.kids = {k: cpu_s(k) or 0.0 for k in descendants(pid)}
        self.threads = self._threads()
        self.interval_s = interval_s
        self.main: list[tuple[float, float]] = []
        self.children: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="cpu-meter", daemon=True)
        self._sampler.start()

    def _threads(self) -> dict[str, float]:
        """CPU seconds by thread name (threads of one name summed) of the server process."""
        out: dict[str, float] = {}
        for task in Path(f"/proc/{self.pid}/task").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                name = (task / "comm").read_text().strip()
                out[name] = out.get(name, 0.0) + (thread_cpu_s(self.pid, int(task.name)) or 0.0)
        return out

    def _sample(self) -> None:
        """Every ``interval_s``, and once more when :meth:`stop` is called, so that the samples reach past any time
        taken before it (a window that ends when the bench ended is covered)."""
        last = dict(self.kids)
        while True:
            done = self._done.is_set()
            t = time.monotonic()
            main = thread_cpu_s(self.pid, self.pid)
            for k in last:
                last[k] = cpu_s(k) or last[k]  # a descendant that died keeps what it had used
            if main is not None:
                self.main.append((t, main))
            self.children.append((t, sum(last.values())))
            if done:
                return
            self._done.wait(self.interval_s)

    def stop(self, output_tokens: float | None, bench_s: float | None = None, bench_end: float | None = None
             ) -> dict[str, Any]:
        """``server_s`` (the process itself: the front end), ``children_s`` (its descendants that lived through the
        run: the engine core), each per output token in microseconds, and the share of the wall time.

        The wall time includes the bench client's own start-up (seconds of importing vLLM while the server idles),
        so ``server_busy`` understates how busy the server was under load; ``server_busy_in_bench`` divides by the
        bench's measured duration instead (the idle seconds' CPU counted in: a slight overstatement).

        With ``bench_s`` and ``bench_end`` (when the bench ended, ``time.monotonic()``), the sampled shares over the
        bench's own seconds: ``main_thread_busy_in_bench`` (the server's event-loop thread), ``main_thread_busy_1s``
        and ``children_busy_1s`` (p50, p90 and max over its whole seconds, with every second's share in
        ``*_series``), and ``threads_s``, the server's CPU seconds by thread name over the meter's life."""
        self._done.set()
        self._sampler.join()
        wall = max(1e-9, time.monotonic() - self.wall_s)
        own = (cpu_s(self.pid) or self.own) - self.own
        kids = sum(max(0.0, (cpu_s(k) or v) - v) for k, v in self.kids.items())
        out: dict[str, Any] = {"wall_s": round(wall, 2), "server_s": round(own, 2), "children_s": round(kids, 2),
                               "server_busy": round(own / wall, 3)}
        if bench_s:
            out["server_busy_in_bench"] = round(own / bench_s, 3)
            out["children_busy_in_bench"] = round(kids / bench_s, 3)
        if output_tokens:
            out["server_us_per_output_token"] = round(1e6 * own / output_tokens, 1)
            out["children_us_per_output_token"] = round(1e6 * kids / output_tokens, 1)
        if bench_s and bench_end is not None:
            start = bench_end - bench_s
            whole = window_shares(self.main, start, bench_end, bench_s)
            if whole:
                out["main_thread_busy_in_bench"] = whole[0]
            for key, samples in (("main_thread", self.main), ("children", self.children)):
                series = window_shares(samples, start, bench_end)
                out[f"{key}_busy_1s"] = spread(series)
                out[f"{key}_busy_series"] = series
        now = self._threads()
        used = {name: round(now[name] - self.threads.get(name, 0.0), 2) for name in now}
        out["threads_s"] = dict(sorted(((n, s) for n, s in used.items() if s >= 0.01), key=lambda x: -x[1])[:8])
        return out
