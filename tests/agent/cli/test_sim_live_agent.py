"""``trackside agent --runtime live``: simulated units under the runtime vLLM units run, as an operator runs it (a child
process, real websockets, ``trackside ctl`` and ``trackside record`` into a DuckDB file), and what it refuses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from agent_errors import error_of
from agent_process import WS_LINE, AgentProcess
from serve_harness import run, wait_for

from agent.cli.node_config import config_argv
from agent.cli.serve import agent_parser, record
from store.queries import sql

NUM = 24


def trace(path: Path) -> Path:
    """24 requests over about 3 s, long enough that a unit holds some when its engine dies at 1 s, and some arrive
    after it is back (the first restart is 1 s after the death)."""
    path.write_text("".join(json.dumps({"request_id": f"w{i:02d}", "arrival_s": 0.3 + i * 0.12,
                                        "prompt_tokens": 200 + 37 * i % 300, "output_tokens": 120 + 9 * i % 60})
                            + "\n" for i in range(NUM)))
    return path


def test_an_engine_killed_under_load_loses_nothing_and_comes_back(tmp_path: Path) -> None:
    """Unit 1's simulated engine dies while it serves: its requests go on unit 0 by recompute, every request
    finishes once, the unit is restarted and serves again with the batch policy set on it before; the recorder stores
    it all and SQL reads it as for any agent."""
    proc = AgentProcess(tmp_path, "--runtime", "live", "--trace", str(trace(tmp_path / "trace.jsonl")), "--dispatch",
                        "round_robin", "--kill-engine", "1@1", "--slack-sample-ms", "100", simulated=True)
    assert any("2 simulated units of h100-llama31-8b under the live runtime" in line
               for line in proc.lines() if WS_LINE.match(line)), proc.lines()
    db = tmp_path / "store.duckdb"
    try:
        async def go() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(record([proc.ws_url], db, flush_s=0.2, stop=stop))
            code, out = await asyncio.to_thread(proc.ctl, "status")
            assert code == 0, out
            units = json.loads(out)["payload"]["units"]
            assert [(u["unit_id"], u["engine_pid"]) for u in units] == [(0, None), (1, None)]
            code, out = await asyncio.to_thread(proc.ctl, "set-policy", "sarathi", "--unit", "1")
            assert code == 0, out
            await wait_for(lambda: proc.proc.poll() is not None, timeout_s=60, what="the workload's end")
            await asyncio.sleep(1.0)  # the recorder's last flush
            stop.set()
            assert await task == 0

        run(go, timeout_s=90)
    finally:
        assert proc.stop() == 0
    lines = proc.lines()
    failed = [line for line in lines if line.startswith("unit 1 failed: engine killed by --kill-engine 1@1")]
    assert len(failed) == 1, lines
    moved = int(failed[0].split("(")[1].split()[0])
    assert moved >= 1, failed  # the kill found requests on the unit
    assert "unit 1 restarted (attempt 1)" in lines, lines
    assert any(line.startswith(f"trackside agent: workload done: {NUM} finished, 0 refused, 0 aborted or failed")
               for line in lines), lines

    rows = sql(db, "SELECT count(*), count(DISTINCT request_id), bool_and(NOT refused), sum(output_tokens) "
                   "FROM requests").rows
    assert rows == [(NUM, NUM, True, sum(120 + 9 * i % 60 for i in range(NUM)))]
    migrated = sql(db, "SELECT count(*), min(from_unit_id), max(from_unit_id), min(unit_id), min(reason) "
                       "FROM request_events WHERE kind = 'request_migrated'").rows
    assert migrated == [(moved, 1, 1, 0, "unit_failed:recompute")]
    alerts = sql(db, "SELECT code FROM alerts WHERE unit_id = 1 ORDER BY seq").rows
    assert [a[0] for a in alerts if a[0].startswith("unit_")] == ["unit_failed", "unit_restarted"]
    after = sql(db, "SELECT count(*), list(DISTINCT policy) FROM steps WHERE unit_id = 1 AND time_ns > (SELECT "
                    "max(time_ns) FROM alerts WHERE code = 'unit_restarted')").rows
    assert after[0][0] > 0 and after[0][1] == ["sarathi"]  # it served again, with the policy set before it died
    assert sql(db, "SELECT list(DISTINCT policy) FROM steps WHERE unit_id = 0").rows == [(["vllm"],)]
    slack = sql(db, "SELECT count(*) FROM slack_samples WHERE request_id IS NOT NULL").rows
    assert slack[0][0] > 0


def test_what_the_live_runtime_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    live = ("--workload", "poisson:n=5", "--runtime", "live")
    discrete_only = "applies to simulated units on the discrete-event node (--engine sim, --runtime discrete)"
    for flag in (["--lockstep"], ["--speed", "2"], ["--migration", "live"], ["--topology", "disaggregated"],
                 ["--instance-size", "2"], ["--prefill-units", "1"]):
        assert error_of(capsys, *live, *flag).startswith(f"{flag[0]} {discrete_only}"), flag
    for bad in ("9@1", "1", "x@1", "1@-2"):
        assert error_of(capsys, *live, "--kill-engine", bad) == (
            f"--kill-engine takes UNIT@SECONDS with a unit of 0 to 3 and seconds >= 0, not {bad!r}")
    assert error_of(capsys, *live, "--pending-timeout-s", "-1") == "--pending-timeout-s must be >= 0 (0: no limit)"
    assert error_of(capsys, "--workload", "poisson:n=5", "--kill-engine", "0@1") == (
        "--kill-engine applies to simulated units with --runtime live")
    assert error_of(capsys, "--workload", "poisson:n=5", "--no-restart") == (
        "--no-restart applies to live units: --engine vllm, or simulated units with --runtime live")
    # around the OpenAI port (test_sim_openai.py serves it)
    assert error_of(capsys, *live, "--served-model-name", "x") == (
        "--served-model-name goes with --serve-openai HOST:PORT")
    assert error_of(capsys, *live, "--sim-tokenizer", "x") == "--sim-tokenizer goes with --serve-openai HOST:PORT"
    assert error_of(capsys, "--workload", "poisson:n=5", "--sim-tokenizer", "x") == (
        "--sim-tokenizer applies to simulated units with --runtime live")
    assert error_of(capsys, "--runtime", "live") == (
        "simulated units replay a workload: give --workload SPEC or --trace FILE (with --runtime live, --serve-openai "
        "HOST:PORT takes requests instead)")
    assert error_of(capsys, *live, "--openai-frontends", "2") == "--openai-frontends goes with --serve-openai HOST:PORT"
    assert error_of(capsys, "--workload", "poisson:n=5", "--openai-frontends", "2") == (
        "--openai-frontends on simulated units needs --runtime live (vLLM's OpenAI app over units that step by "
        "themselves in wall time), or --engine vllm")


def test_a_node_config_file_says_it_too(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('runtime = "live"\nunits = 2\nkill_engine = ["1@20", "0@30"]\nhang_engine = ["1@40"]\n'
                    'engine_hang_s = 5\nno_restart = true\nworkload = "poisson:n=5"\n')
    assert config_argv(path, agent_parser) == [
        "--runtime", "live", "--units", "2", "--kill-engine", "1@20", "--kill-engine", "0@30", "--hang-engine", "1@40",
        "--engine-hang-s", "5", "--no-restart", "--workload", "poisson:n=5"]
