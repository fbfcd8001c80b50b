"""``trackside agent --engine vllm`` end to end on the CPU: the agent as a child process with two fake-executor
engines, driven by the ``openai`` client, watched through the websocket stream, steered with ``trackside ctl``,
recorded with ``trackside record`` into DuckDB.

One agent serves the tests of this module in turn (the engines take seconds to start); each test leaves it as it
found it (every unit active, the ``vllm`` policy, ``least_loaded``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import httpx
import openai
from agent_process import MODEL, WS_LINE, AgentProcess, running
from serve_harness import NotingWriters, run, wait_for

from agent.cli.serve import record
from agent.telemetry import (
    ControlAudit,
    Event,
    NodeHello,
    RequestArrived,
    RequestDispatched,
    RequestFinished,
    RequestFirstToken,
    SlackSample,
    StepEvent,
    UnitLoadEvent,
)
from agent.telemetry.client import stream
from console.model.fleet import fleet_rows
from console.model.queries import summary
from console.model.state import ConsoleState

pytestmark = pytest.mark.vllm

EXAMPLE_CONFIG = Path(__file__).resolve().parents[3] / "examples" / "nodes" / "cpu-fake-executor.toml"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    # The example node config (2 fake-executor units), the command line over it (its own ports, node id, token).
    # On uvloop's event loop, as vllm serve runs its API server: the default (one agent below runs asyncio's).
    proc = AgentProcess(tmp_path_factory.mktemp("vllm-agent"), "--config", str(EXAMPLE_CONFIG))
    assert any(", uvloop event loop" in line for line in proc.lines() if WS_LINE.match(line)), proc.lines()
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, proc.log.read_text()[-4000:]
        assert any(line.startswith("trackside agent: stopped:") for line in proc.lines())


class Watch:
    """Every event of the agent's stream since its start, collected in a task (``async with``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: list[Event] = []

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._run())
        await wait_for(lambda: any(isinstance(e, NodeHello) for e in self.events), what="the hello")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        async for event in stream(self.url, resume_after_seq=0):
            self.events.append(event)

    def of(self, kind: type[Any], since: int = 0) -> list[Any]:
        return [e for e in self.events[since:] if isinstance(e, kind)]

    def finished(self, request_ids: Sequence[str]) -> bool:
        done = {e.request_id for e in self.of(RequestFinished)}
        return all(rid in done for rid in request_ids)


def engine_id(request_id: str) -> str:
    """The id vLLM's app gives the (only) prompt of a completion sent with ``X-Request-Id: request_id``: the
    telemetry's request id."""
    return f"cmpl-{request_id}-0"


async def complete(client: openai.AsyncOpenAI, request_id: str, max_tokens: int = 12,
                   prompt_tokens: int = 40) -> dict[str, Any]:
    """One completion (token ids) with our request id; returns where and how it was served (the response's
    ``x-trackside-*`` headers). Prompts differ from the first token on (the engines cache prefixes)."""
    salt = sum(map(ord, request_id))
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=[100 + (salt + 7 * i) % 900 for i in range(prompt_tokens)], max_tokens=max_tokens,
        extra_headers={"X-Request-Id": request_id}, extra_body={"ignore_eos": True},
    )
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens == max_tokens
    h = raw.headers
    return {"unit_id": int(h["x-trackside-unit"]), "ttft_ms": float(h["x-trackside-ttft-ms"]),
            "met_slo": h["x-trackside-slo-met"] == "true"}


async def ctl(agent: AgentProcess, *argv: str, token: bool = True) -> tuple[int, str]:
    """``trackside ctl --json`` in a thread; (exit status, the reply as printed)."""
    return await asyncio.to_thread(agent.ctl, *argv, token=token)


def test_completions_stream_the_units_steps_requests_and_loads(agent: AgentProcess) -> None:
    async def go() -> None:
        async with Watch(agent.ws_url) as watch:
            t0 = time.time_ns()
            sent = [f"basic-{i}" for i in range(8)]
            ids = [engine_id(rid) for rid in sent]
            client = agent.client()
            served = await asyncio.gather(*(complete(client, rid, max_tokens=10 + i) for i, rid in enumerate(sent)))
            await wait_for(lambda: watch.finished(ids), what="every request_finished")
            t1 = time.time_ns()
        hello = watch.of(NodeHello)[0]
        assert hello.profile == MODEL and hello.dispatch_policy == "least_loaded"
        assert [(u.unit_id, u.batch_policy, u.mode) for u in hello.units] == [(0, "vllm", "active"),
                                                                              (1, "vllm", "active")]
        assert [(u.gpu_ids, u.tensor_parallel_size) for u in hello.units] == [((), 1), ((), 1)]  # on the CPU
        assert hello.boot_ns < t0, "the run started when the agent did"
        steps = [e for e in watch.of(StepEvent) if t0 <= e.time_ns]
        assert {e.unit_id for e in steps} == {0, 1}, "least_loaded spreads 8 requests over both engines"
        for e in steps:
            # vLLM's steps in wall-clock time, as simulated units' (node time 0 is the agent's start)
            assert t0 - 10**9 < e.time_ns < t1 and 0 < e.measured_ns < 10**9 and e.predicted_ns > 0
            assert e.policy == "vllm" and e.num_blocks > 0 and e.kv_used_blocks <= e.num_blocks
        assert sum(e.num_decode_tokens + e.num_prefill_tokens for e in steps) >= 8 * 40
        finished = {e.request_id: e for e in watch.of(RequestFinished) if e.request_id in ids}
        for i, (rid, s) in enumerate(zip(ids, served, strict=True)):
            f = finished[rid]
            assert f.unit_id == s["unit_id"] and f.output_tokens == 10 + i and f.prompt_tokens == 40
            assert f.ttft_ms == pytest.approx(s["ttft_ms"], abs=0.06) and f.met_slo == s["met_slo"]
            assert t0 <= f.arrival_ns <= f.first_token_ns <= f.time_ns <= t1
        lifecycle = {rid: [type(e).__name__ for e in watch.events
                           if isinstance(e, RequestArrived | RequestDispatched | RequestFirstToken | RequestFinished)
                           and e.request_id == rid] for rid in ids}
        assert all(kinds == ["RequestArrived", "RequestDispatched", "RequestFirstToken", "RequestFinished"]
                   for kinds in lifecycle.values()), lifecycle
        dispatched = {e.request_id: e.unit_id for e in watch.of(RequestDispatched)}
        assert all(dispatched[rid] == s["unit_id"] for rid, s in zip(ids, served, strict=True))
        loads = [e for e in watch.of(UnitLoadEvent) if e.time_ns >= t0]
        assert len(loads) >= 2 * len(ids) and {e.unit_id for e in loads} == {0, 1}
        assert all(e.healthy and e.num_blocks == steps[0].num_blocks and e.max_num_seqs == 64 for e in loads)
        slack = [e for e in watch.of(SlackSample) if e.requests]
        assert slack and all(p.request_id in ids or p.request_id.startswith("cmpl-basic") for e in slack
                             for p in e.requests)
        # The console's state model folds the stream as it folds a simulated agent's.
        state = ConsoleState()
        state.apply(watch.events, source=agent.ws_url)
        node = state.nodes["vllm-test"]
        assert node.profile == MODEL and sorted(node.units) == [0, 1]
        assert all(u.num_blocks == steps[0].num_blocks and u.batch_policy == "vllm" for u in node.units.values())
        flow = summary(state, "vllm-test")
        assert flow.num_finished >= len(ids) and flow.slo_attainment == 1.0
        assert len(fleet_rows(state)) == 3
        metrics = httpx.get(agent.ws_url.replace("ws://", "http://") + "/metrics", timeout=10).text
        assert f'vllm:num_requests_running{{model_name="{MODEL}",engine="1"}} 0' in metrics
        assert 'trackside_batch_policy_info{model_name="tiny-llama-fake",engine="0",policy="vllm"} 1' in metrics
        finished_total = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                             if line.startswith("trackside_requests_finished_total{"))
        assert finished_total >= len(ids)

    run(go, timeout_s=60)


def test_batch_policy_hot_swap_reaches_the_engine(agent: AgentProcess) -> None:
    async def go() -> None:
        async with Watch(agent.ws_url) as watch:
            # An idle engine applies it at once: the reply comes after the engine's acknowledgement.
            code, out = await ctl(agent, "set-policy", "--unit", "1", "sarathi", "--param", "token_budget=48")
            assert code == 0, out
            audit = json.loads(out)["payload"]
            assert audit["result"] == "applied" and audit["unit_ids"] == [1] and audit["message"] == ""
            code, out = await ctl(agent, "--dry-run", "set-policy", "eb")
            old = {s["unit_id"]: s["policy"] for s in json.loads(out)["payload"]["old"]}
            assert code == 0 and old == {0: "vllm", 1: "sarathi"}, "the dry run's diff shows what runs now"
            code, _ = await ctl(agent, "set-param", "--unit", "1", "token_budget=-3")
            assert code == 2
            mark = len(watch.events)
            client = agent.client()
            await asyncio.gather(*(complete(client, f"swap-{i}", prompt_tokens=200) for i in range(6)))
            await wait_for(lambda: watch.finished([engine_id(f"swap-{i}") for i in range(6)]), what="the requests")
            steps = watch.of(StepEvent, mark)
            one = [e for e in steps if e.unit_id == 1]
            zero = [e for e in steps if e.unit_id == 0]
            assert one and zero
            assert all(e.policy == "sarathi" and e.budget_tokens == 48 for e in one)
            assert all(e.num_prefill_tokens + e.num_decode_tokens <= 48 for e in one), "the engine keeps to it"
            assert all(e.policy == "vllm" for e in zero)
            # A live parameter change, then back to the start.
            code, out = await ctl(agent, "set-param", "--unit", "1", "token_budget=64")
            assert code == 0 and json.loads(out)["payload"]["old"] == [{"unit_id": 1, "policy": "", "mode": None,
                                                                        "params": {"token_budget": 48}}]
            code, out = await ctl(agent, "status")
            units = json.loads(out)["payload"]["units"]
            assert units[1]["batch_policy"] == "sarathi" and units[1]["batch_params"]["token_budget"] == 64
            assert (await ctl(agent, "set-policy", "vllm"))[0] == 0
            # ctl's reply comes on its own connection: the watch's stream brings the last audit when it does
            await wait_for(lambda: len(watch.of(ControlAudit)) >= 5, what="the last swap's audit")
        audits = watch.of(ControlAudit)
        assert [a.result for a in audits] == ["applied", "dry_run", "rejected", "applied", "applied"]
        last = max(i for i, e in enumerate(watch.events) if isinstance(e, ControlAudit))
        state = ConsoleState()
        state.apply(watch.events[:last], source=agent.ws_url)  # before the last swap back
        units = state.nodes["vllm-test"].units.values()
        # (the audit carries a parameter change as it was typed)
        assert [(u.batch_policy, str(u.batch_params.get("token_budget"))) for u in units] == [
            ("vllm", "None"), ("sarathi", "64")]

    run(go, timeout_s=60)


def test_dispatcher_swap_drain_and_pause(agent: AgentProcess) -> None:
    async def go() -> None:
        client = agent.client()
        async with Watch(agent.ws_url) as watch:
            assert (await ctl(agent, "set-dispatch", "round_robin"))[0] == 0
            _, out = await ctl(agent, "status")
            assert json.loads(out)["payload"]["dispatch_policy"] == "round_robin"
            assert (await ctl(agent, "drain", "--unit", "0"))[0] == 0
            mark = len(watch.events)
            served = await asyncio.gather(*(complete(client, f"drain-{i}") for i in range(6)))
            assert {s["unit_id"] for s in served} == {1}, "a draining unit gets no new request"
            loads = watch.of(UnitLoadEvent, mark)
            assert loads and all(e.healthy == (e.unit_id == 1) for e in loads)
            # Pause unit 1 with a long request on it: it stops stepping, keeps the request, resumes it.
            long = asyncio.create_task(complete(client, "paused-1", max_tokens=300))
            await wait_for(lambda: any(isinstance(e, RequestFirstToken) and e.request_id == engine_id("paused-1")
                                       for e in watch.events), what="the long request's first token")
            mark = len(watch.events)
            assert (await ctl(agent, "pause", "--unit", "1"))[0] == 0
            # from the pause's place in the stream (its audit): when ctl returns, the watch may not have read the
            # steps made before the pause yet (on a loaded machine, more than the one the [1:] below allows)
            def is_pause(e: Event) -> bool:
                return isinstance(e, ControlAudit) and e.action == "set_unit_mode" and e.new[0].mode == "paused"

            await wait_for(lambda: any(map(is_pause, watch.events[mark:])), what="the pause's audit")
            paused_at = next(i for i, e in enumerate(watch.events) if i >= mark and is_pause(e)) + 1
            await asyncio.sleep(0.6)
            assert not watch.of(StepEvent, paused_at)[1:], "a paused engine does not step"
            assert not long.done()
            _, out = await ctl(agent, "status")
            assert [u["mode"] for u in json.loads(out)["payload"]["units"]] == ["draining", "paused"]
            assert (await ctl(agent, "resume", "--unit", "1"))[0] == 0
            assert (await long)["unit_id"] == 1
            assert (await ctl(agent, "resume", "--unit", "0"))[0] == 0
            served = await asyncio.gather(*(complete(client, f"back-{i}") for i in range(4)))
            assert {s["unit_id"] for s in served} == {0, 1}, "round_robin over both again"
            assert (await ctl(agent, "set-dispatch", "least_loaded"))[0] == 0

    run(go, timeout_s=60)


def test_control_needs_the_token(agent: AgentProcess) -> None:
    async def go() -> None:
        code, _ = await ctl(agent, "set-dispatch", "round_robin", token=False)
        assert code == 2
        code, out = await ctl(agent, "status", token=False)
        assert code == 0 and json.loads(out)["payload"]["dispatch_policy"] == "least_loaded"

    run(go)


def test_read_only_agent_replays_a_workload_and_records_to_duckdb(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """No --serve-openai: the agent replays a trace and exits when it is done; no token: control is refused.
    ``trackside record`` stores the stream in DuckDB, and SQL reads it as for simulated units."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"request_id": f"w{i:02d}", "arrival_s": 0.5 + i * 0.08,
                                         "prompt_tokens": 30 + 17 * i % 200, "output_tokens": 4 + 5 * i % 30}) + "\n"
                             for i in range(24)))
    proc = AgentProcess(tmp_path, "--trace", str(trace), "--dispatch", "round_robin", "--batch-policy",
                        "fairbatching", "--no-uvloop", token=False, openai_api=False)
    assert any(", asyncio event loop" in line for line in proc.lines() if WS_LINE.match(line))  # --no-uvloop
    db = tmp_path / "store.duckdb"
    try:
        async def go() -> None:
            code, _ = await ctl(proc, "set-policy", "vllm")
            assert code == 2
            stop = asyncio.Event()
            writers = NotingWriters()
            task = asyncio.create_task(record([proc.ws_url], db, flush_s=0.2, stop=stop, writer_factory=writers.make))
            await wait_for(lambda: proc.proc.poll() is not None, timeout_s=60, what="the workload's end")
            # every finish written (in stream order: the steps before them too), not 0.5 s after the agent's exit
            await wait_for(lambda: bool(writers.made) and sum(isinstance(e, RequestFinished)
                                                              for e in list(writers.made[-1].events)) >= 24,
                           what="the 24 finishes recorded")
            stop.set()
            assert await task == 0

        run(go, timeout_s=90)
    finally:
        assert proc.stop() == 0
    err = capsys.readouterr().err
    assert "control is disabled on this agent (no token file)" in err
    assert any(line.startswith("trackside agent: workload done: 24 finished") for line in proc.lines()), proc.lines()

    from store.queries import sql

    rows = sql(db, "SELECT count(*), count(DISTINCT unit_id), bool_and(NOT refused), sum(output_tokens) "
                   "FROM requests").rows
    assert rows == [(24, 2, True, sum(4 + 5 * i % 30 for i in range(24)))]
    steps = sql(db, "SELECT unit_id, count(*), min(policy), max(policy), sum(num_prefill_tokens) FROM steps "
                    "GROUP BY unit_id ORDER BY unit_id").rows
    assert [r[0] for r in steps] == [0, 1] and all(r[1] > 0 and r[2] == r[3] == "fairbatching" for r in steps)
    assert sum(r[4] for r in steps) >= sum(30 + 17 * i % 200 for i in range(24))
    nodes = sql(db, "SELECT node_id, profile, dispatch_policy FROM nodes").rows
    assert nodes == [("vllm-test", MODEL, "round_robin")]


def test_preemptions_reach_the_stream_under_our_request_ids() -> None:
    """In process: one engine with a KV cache too small for its requests preempts; vLLM's scheduler names them
    with a random suffix, the stream with the agent's ids, and each outcome counts its preemptions."""
    from agent.engine.vllm.config import UnitSettings
    from agent.engine.vllm.cpu import cpu_vllm_config
    from agent.engine.vllm.fake_executor import FakeExecutor
    from agent.engine.vllm.options import EngineOptions
    from agent.engine.vllm.unit import VllmUnit
    from agent.runtime.live.cluster import LiveCluster
    from agent.runtime.live.node import LiveClusterNode
    from agent.runtime.live.requests import ClusterRequest
    from policies.registry import make_batch_policy, make_dispatch_policy

    async def go() -> None:
        config = cpu_vllm_config(num_blocks=24, max_model_len=256, step_model=(0.001, 0.0, 0.0))
        unit = VllmUnit(0, EngineOptions(model="tiny", max_num_batched_tokens=512, max_num_seqs=32),
                        UnitSettings(policy="vllm"), vllm_config=config, executor_class=FakeExecutor)
        unit.start()
        try:
            cluster = LiveCluster([unit], make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1)
            node = LiveClusterNode(cluster, [make_batch_policy("vllm")])
            preempted: list[str] = []
            outcomes: dict[str, Any] = {}
            node.on_preempt = lambda record, ids: preempted.extend(ids)
            node.on_finish = lambda outcome: outcomes.__setitem__(outcome.request_id, outcome)
            cluster.start()
            streams = [cluster.submit(ClusterRequest(f"p{i}", [200 + 37 * i + k for k in range(100)], 100),
                                      collect=False) for i in range(4)]
            await asyncio.gather(*(s.wait() for s in streams))
            await cluster.close()
            engine_ids = [rid for msg in unit.raw for rid in msg.preempted]
        finally:
            await unit.stop()
        assert engine_ids and not set(engine_ids) & {f"p{i}" for i in range(4)}, "vLLM's ids carry a suffix"
        assert preempted and set(preempted) <= {f"p{i}" for i in range(4)}
        assert sum(o.num_preemptions for o in outcomes.values()) == len(preempted)
        assert all(0 <= o.arrival_s <= o.first_token_s <= o.finish_s < 60 for o in outcomes.values()), "node time"
        assert node.num_finished == 4 and not node.states and not node.preemptions

    run(go, timeout_s=60)


def test_two_agents_share_one_openai_port(tmp_path: Path) -> None:
    """``--openai-reuse-port``: two agents of one unit each, as on a node whose GPUs are split between agents, serve
    one OpenAI port. Requests on connections of their own are all answered, the kernel spreads them over both agents
    (``x-trackside-node``), and each agent's stream counts only the requests it served. An agent whose units are all
    failed lets the port go (the other one answers everything) and takes it again once a unit is back. An agent
    killed with SIGKILL takes its engine core with it, and the other one answers everything."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    agents = []
    try:
        for i in range(2):  # one after the other, as their engines would start on one GPU
            (tmp_path / f"agent{i}").mkdir()
            agents.append(AgentProcess(tmp_path / f"agent{i}", "--units", "1", "--node-id", f"shared-{i}",
                                       "--openai-reuse-port", openai_api=address))
        assert agents[0].openai_url == agents[1].openai_url == f"http://{address}/v1"

        async def go() -> dict[str, set[str]]:
            async def one(k: int) -> tuple[str, str]:
                async with httpx.AsyncClient(timeout=60) as http:  # a connection of its own
                    r = await http.post(f"http://{address}/v1/completions", headers={"X-Request-Id": f"s{k}"}, json={
                        "model": MODEL, "prompt": [5 + k, 6, 7], "max_tokens": 4, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 4
                    return str(r.headers["x-trackside-node"]), engine_id(f"s{k}")

            served = await asyncio.gather(*(one(k) for k in range(24)))
            by_node = {node: {rid for n, rid in served if n == node} for node, _ in served}
            for i, agent in enumerate(agents):  # each agent's own stream: the requests it answered, no others
                mine = by_node.get(f"shared-{i}", set())
                async with Watch(agent.ws_url) as watch:
                    await wait_for(lambda w=watch, m=mine: w.finished(sorted(m)), what=f"agent {i}'s finishes")
                    assert {e.request_id for e in watch.of(RequestFinished)} == mine
            # a client that keeps its connection open, to agent 0
            kept = [httpx.AsyncClient(timeout=60) for _ in range(32)]
            try:
                for held in kept:
                    r = await held.post(f"http://{address}/v1/completions", json={
                        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1})
                    if r.headers["x-trackside-node"] == "shared-0":
                        break  # (the kernel chose agent 0 for this client's connection)
                else:
                    raise AssertionError("no connection of 32 went to agent 0")
                # agent 0's only unit fails: it lets the port go and closes its connections, and agent 1 takes every
                # connection, the kept client's next one too
                assert (await ctl(agents[0], "fail-unit", "--unit", "0", "--reason", "test"))[0] == 0
                await wait_for(lambda: any("let go" in line for line in agents[0].lines()), what="the port let go")
                alone = await asyncio.gather(*(one(k) for k in range(100, 112)))
                assert {n for n, _ in alone} == {"shared-1"}
                r = await held.post(f"http://{address}/v1/completions", json={
                    "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
                assert (r.status_code, r.headers["x-trackside-node"]) == (200, "shared-1"), r.text
            finally:
                for http in kept:
                    await http.aclose()
            assert (await ctl(agents[0], "recover-unit", "--unit", "0"))[0] == 0
            await wait_for(lambda: any("taken again" in line for line in agents[0].lines()), what="the port back")
            again = await asyncio.gather(*(one(k) for k in range(200, 224)))
            assert {n for n, _ in again} == {"shared-0", "shared-1"}
            # agent 1 is killed outright (SIGKILL: no shutdown of its own): its engine core stops by itself too
            # (the lifeline), not left holding its GPU, and agent 0 answers every connection
            async with Watch(agents[1].ws_url) as watch:
                engine_pid = watch.of(NodeHello)[0].units[0].engine_pid
            assert engine_pid is not None and running(engine_pid)
            agents[1].proc.kill()
            agents[1].proc.wait()
            await wait_for(lambda: not running(engine_pid), timeout_s=30, what="the killed agent's engine core to stop")
            after = await asyncio.gather(*(one(k) for k in range(300, 312)))
            assert {n for n, _ in after} == {"shared-0"}
            return by_node

        by_node = run(go, timeout_s=150)
        assert set(by_node) == {"shared-0", "shared-1"}, by_node
        assert sum(map(len, by_node.values())) == 24
    finally:
        for i, agent in enumerate(agents):
            assert agent.stop() == (-signal.SIGKILL if i == 1 else 0), agent.log.read_text()[-4000:]
