"""The intake comparison of the split-front-ends benchmark (``--frontends K``, :mod:`agent.bench.split_frontends`):
the front ends' PIDs from the agent's startup line or from ``/proc``, and one layout's numbers and table from
made-up bench summaries and CPU readings; no agent, no vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.bench.split_frontends import frontend_children, frontend_pids, intake_row, intake_table

READY = "trackside agent: OpenAI API at http://127.0.0.1:19300/v1"


def test_the_front_ends_pids_come_from_the_agents_startup_line() -> None:
    log = ("trackside agent: unit 0 started in 3.1 s (4096 KV blocks of 16 tokens)\n"
           f"{READY} (2 front-end processes, PIDs 123, 4567)\n")
    assert frontend_pids(log) == [123, 4567]
    assert frontend_pids(f"{READY} (1 front-end processes, PIDs 89)\n") == [89]
    assert frontend_pids(f"{READY}\n") == []  # served in the main process
    assert frontend_pids("") == []
    # a restarted agent's log holds two lines: the last one is the running agent's
    assert frontend_pids(f"{READY} (2 front-end processes, PIDs 1, 2)\n{READY} (2 front-end processes, PIDs 3, 4)"
                         ) == [3, 4]


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc (Linux)")
def test_front_ends_are_found_among_the_children_by_their_module() -> None:
    code = "import sys, time; print('up', flush=True); time.sleep(30)"
    children = [subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True)
                for argv in (["-m", "agent.service.frontend", "--index", "0"], ["agent.service.frontends"], [])]
    try:
        for child in children:  # each has exec'd: its cmdline is its own
            assert child.stdout is not None and child.stdout.readline() == "up\n"
        assert frontend_children(children[0].pid) == []  # none below it
        found = frontend_children(os.getpid())
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert children[0].pid in found and children[1].pid not in found and children[2].pid not in found


def cpu(server_s: float, children_s: float = 0.0, busy: float | None = None) -> dict[str, Any]:
    """A :class:`~agent.bench.proc_cpu.CpuMeter` reading, the keys :func:`intake_row` reads."""
    return {"server_s": server_s, "children_s": children_s, "main_thread_busy_in_bench": busy}


SUMMARY = {"completed": 200, "duration": 10.0, "output_throughput": 2000.0, "median_ttft_ms": 12.345,
           "p99_ttft_ms": 80.0, "median_tpot_ms": 3.21, "p99_tpot_ms": 9.876}


def test_a_layouts_row_puts_the_cpu_per_token_on_the_main_process_the_front_ends_and_the_engines() -> None:
    # 20000 tokens; the main process used 4 s itself, 12 s below it, of which the two front ends' 3 + 2.5 + 0.5
    row = intake_row(SUMMARY, cpu(4.0, 12.0, busy=0.4), [cpu(3.0, busy=0.3), cpu(2.5, 0.5, busy=0.25)])
    assert row == {"output_throughput": 2000.0, "completed": 200, "ttft_p50_ms": 12.35, "ttft_p99_ms": 80.0,
                   "tpot_p50_ms": 3.21, "tpot_p99_ms": 9.88, "main_us_per_output_token": 200.0,
                   "main_loop_busy": 0.4, "frontends_us_per_output_token": 300.0, "frontends_loop_busy": [0.3, 0.25],
                   "engines_us_per_output_token": 300.0}
    inproc = intake_row(SUMMARY, cpu(8.0, 6.0, busy=0.9), [])  # everything below it is the engines
    assert (inproc["main_us_per_output_token"], inproc["frontends_us_per_output_token"],
            inproc["frontends_loop_busy"], inproc["engines_us_per_output_token"]) == (400.0, None, [], 300.0)
    nothing = intake_row({"completed": 0, "duration": 1.0, "output_throughput": None}, cpu(1.0), [])
    assert nothing["main_us_per_output_token"] is None and nothing["ttft_p50_ms"] is None


def test_the_table_has_one_line_per_layout_and_columns_that_line_up() -> None:
    rows = {"in-process": intake_row(SUMMARY, cpu(8.0, 6.0, busy=0.9), []),
            "2 front ends": intake_row(SUMMARY, cpu(4.0, 12.0, busy=0.4), [cpu(3.0, busy=0.3), cpu(3.0, busy=0.25)])}
    lines = intake_table(rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1, lines
    assert lines[1].startswith("in-process ") and lines[2].startswith("2 front ends ")
    assert "main us/tok" in lines[0] and "0.3/0.25" in lines[2]
    assert lines[1].split()[-3:] == ["-", "-", "300.0"]  # no front ends: their columns empty

