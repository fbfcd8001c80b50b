"""The CPU meter of the GPU comparison (issue #14 item 8, :mod:`agent.bench.proc_cpu`): what it puts on the server's
side, on its descendants' (the engine core) and on its main thread (the event loop), from ``/proc``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.bench.proc_cpu import CpuMeter, descendants, spread, window_shares


class Burner:
    """A child process that burns ``seconds`` of CPU in its main thread once told to (:meth:`burn`), then idles."""

    def __init__(self, seconds: float) -> None:
        code = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
                f"while time.process_time() - t < {seconds}: pass\nprint('burnt', flush=True)\ntime.sleep(30)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.pid = self.proc.pid

    def burn(self) -> None:
        """Start the burn and wait until it is done (however long a loaded machine takes)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "burnt\n"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_cpu_meter_puts_a_busy_child_on_the_children_side() -> None:
    child = Burner(0.4)
    try:
        assert child.pid in descendants(os.getpid())
        meter = CpuMeter(os.getpid())
        # it burns its 0.4 s of CPU; this process waits, idle, until it has (a 1.5 s sleep did not always cover its
        # start and 0.4 s of CPU on a loaded machine)
        child.burn()
        cpu = meter.stop(output_tokens=1000, bench_s=0.5)
    finally:
        child.kill()
    assert cpu["children_s"] >= 0.2 and cpu["server_s"] < 0.2
    assert cpu["children_us_per_output_token"] == pytest.approx(1e3 * cpu["children_s"], rel=0.05)
    assert 0 <= cpu["server_busy"] < 0.2
    # over a bench of 0.5 s the child's 0.4 s or more is a busy share near 1, the wall time's share under 0.4
    assert cpu["children_busy_in_bench"] == pytest.approx(cpu["children_s"] / 0.5, rel=0.05)
    assert cpu["children_busy_in_bench"] >= 0.4


def test_window_shares_are_the_cpu_used_in_each_second_from_cumulative_samples() -> None:
    # Half a core for 4 s, then a whole core for 4 s, sampled every 0.25 s.
    samples = [(t / 4, min(t / 4, 4) * 0.5 + max(0.0, t / 4 - 4)) for t in range(33)]
    assert window_shares(samples, 0.0, 8.0) == [0.5] * 4 + [1.0] * 4
    assert window_shares(samples, 3.5, 5.5) == [0.75, 1.0]  # interpolated across the change, a partial window left out
    assert window_shares(samples, 0.0, 8.0, width=8.0) == [0.75]
    assert window_shares(samples, 6.0, 12.0) == [1.0, 1.0]  # seconds past the last sample are not guessed
    assert window_shares(samples[:1], 0.0, 8.0) == []
    assert spread([0.2, 0.9, 0.5, 0.4]) == {"p50": 0.5, "p90": 0.9, "max": 0.9}
    assert spread([]) is None


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_the_cpu_meter_samples_the_servers_main_thread_over_the_bench() -> None:
    server = Burner(0.6)
    try:
        time.sleep(0.5)  # its start-up's CPU falls before the bench
        meter = CpuMeter(server.pid, interval_s=0.02)
        time.sleep(0.1)
        began = time.monotonic()
        server.burn()  # the bench: its main thread burns 0.6 s of CPU
        ended = time.monotonic()
        time.sleep(0.1)
        cpu = meter.stop(output_tokens=1000, bench_s=ended - began, bench_end=ended)
    finally:
        server.kill()
    busy = cpu["main_thread_busy_in_bench"]
    assert busy >= 0.5 * 0.6 / (ended - began) and busy <= 1.05
    assert busy == pytest.approx(cpu["server_s"] / (ended - began), rel=0.25)  # all of its CPU is the main thread's
    assert cpu["children_busy_1s"] is None or cpu["children_busy_1s"]["max"] < 0.1  # it has no children
    assert max(cpu["threads_s"].values()) >= 0.5


def test_a_bench_that_ended_just_before_the_meter_stopped_is_covered() -> None:
    """The meter samples once more as it stops: a window ending between its last periodic sample and the stop (a
    bench's end, read just before) has its main-thread share, instead of none."""
    meter = CpuMeter(os.getpid(), interval_s=30.0)  # one periodic sample only: at the start
    time.sleep(0.3)
    out = meter.stop(None, bench_s=0.2, bench_end=time.monotonic())
    assert "main_thread_busy_in_bench" in out and 0.0 <= out["main_thread_busy_in_bench"] <= 1.5
    assert len(meter.main) == 2
