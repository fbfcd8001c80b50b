"""The worst per-token TPOT (seed 003, 5.1): its definition, and how the simulated and vLLM units track it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from builders import H100_LIKE
from hypothesis import given
from hypothesis import strategies as st
from node_builders import make_unit, requests

from agent.engine.base import RequestOutcome, StepRecord, SubmittedRequest, worst_tpot_s
from agent.runtime.node import Node
from policies.registry import make_dispatch_policy


def outcome(first_s: float, finish_s: float, tokens: int, worst_s: float | None) -> RequestOutcome:
    return RequestOutcome("r", 0, 0.0, first_s, finish_s, 10, tokens, 0, ttft_slo_s=1.0, tpot_slo_s=0.05,
                          max_tpot_s=worst_s)


def test_the_worst_is_a_running_mean_from_the_first_token_not_the_largest_gap() -> None:
    # Tokens 2 and 3 on time (50 ms), token 4 after a 300 ms stall, token 5 on time again.
    times = [0.0, 0.05, 0.10, 0.40, 0.45]
    assert worst_tpot_s(times) == pytest.approx(0.40 / 3)  # token 4: (0.40 - 0) / (4 - 1)
    mean = (0.45 - 0.0) / 4
    assert worst_tpot_s(times) > mean  # the mean spreads the stall over every token
    assert worst_tpot_s(times) < 0.30  # the largest gap (TBT) is another metric
    # The same stall before the last token counts only as much as the mean does.
    assert worst_tpot_s([0.0, 0.05, 0.10, 0.15, 0.45]) == pytest.approx(0.45 / 4)
    # Tokens delivered together share a time; no tokens after the first: undefined.
    assert worst_tpot_s([0.0, 0.2, 0.2, 0.2]) == pytest.approx(0.2)
    assert worst_tpot_s([1.0]) is None and worst_tpot_s([]) is None


@given(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=2, max_size=40))
def test_the_worst_is_never_below_the_mean(gaps: list[float]) -> None:
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + g)
    mean = (times[-1] - times[0]) / (len(times) - 1)
    assert worst_tpot_s(times) >= mean - 1e-12


def test_an_outcome_meets_its_slo_by_the_metric_asked() -> None:
    # Five tokens in 180 ms (a mean of 45 ms), but token 2 came 120 ms after token 1.
    o = outcome(0.1, 0.28, 5, 0.12)
    assert o.tpot_s == pytest.approx(0.045)
    assert o.tpot_by("mean") == pytest.approx(0.045) and o.tpot_by("worst") == pytest.approx(0.12)
    assert o.meets_slo("mean") and not o.meets_slo("worst")
    assert not o.met_slo  # the default is the worst (agent.telemetry.DEFAULT_TPOT_METRIC)
    one = outcome(0.1, 0.1, 1, None)
    assert one.tpot_by("worst") is None and one.meets_slo("worst") and one.meets_slo("mean")
    untracked = outcome(0.1, 0.28, 5, None)  # built by hand: the worst falls back to the mean
    assert untracked.tpot_by("worst") == pytest.approx(0.045)


def test_a_long_prefill_stalls_a_decoding_request_in_the_simulator() -> None:
    # r000 decodes (about 9 ms a step) when an 8,000-token prompt arrives: vLLM's default schedule puts the whole
    # prompt in one step of about 200 ms next to r000's decode.
    unit = make_unit(cost=H100_LIKE, max_num_batched_tokens=8192)
    token_times: list[float] = []

    def watch(rec: StepRecord) -> None:  # r000's token times, from its output count after each step
        req = unit.requests.get("r000")
        while req is not None and len(token_times) < req.output:
            token_times.append(rec.start_s + rec.duration_s)

    done: list[RequestOutcome] = []
    reqs = requests([(100, 200), (8000, 5)], arrivals=[0.0, 0.03])
    Node([unit], make_dispatch_policy("round_robin"), reqs, ttft_slo_s=10.0, tpot_slo_s=0.05, on_step=watch,
         on_finish=done.append).run()
    r0 = next(o for o in done if o.request_id == "r000")
    token_times.append(r0.finish_s)  # its last token: the request had left the unit when the hook ran
    assert len(token_times) == r0.output_tokens == 200
    assert r0.max_tpot_s == pytest.approx(worst_tpot_s(token_times))  # the running maximum is exact
    assert r0.tpot_s is not None and r0.max_tpot_s > 4 * r0.tpot_s
    assert r0.meets_slo("mean") and not r0.meets_slo("worst")


def test_the_worst_travels_with_a_request_that_moves() -> None:
    source, target = make_unit(0), make_unit(1)  # every step lasts 1 s
    source.submit(SubmittedRequest("r", 0.0, 10, 6, ttft_slo_s=1.0, tpot_slo_s=1.0), 0.0)
    now = 0.0
    for step in range(4):  # the prefill with token 1 (at 1 s), then tokens 2 to 4; token 3 comes 5 s late
        assert source.begin_step(now) is not None
        now += 6.0 if step == 2 else 1.0
        source.end_step(now)
    before = source.requests["r"].max_tpot_s
    assert before == pytest.approx((8.0 - 1.0) / 2)  # token 3, at 8 s
    migrant = source.detach("r")
    assert migrant.max_tpot_s == before
    target.attach(migrant, now)
    finished: tuple[RequestOutcome, ...] = ()
    while target.has_work():
        assert target.begin_step(now) is not None
        now += 1.0
        finished = target.end_step(now).finished
    assert finished[0].output_tokens == 6
    assert finished[0].max_tpot_s == pytest.approx(before)  # the later tokens on time: the stall stays the worst


# -- vLLM units: the front end's timing of output deltas (no engine: a stand-in AsyncLLM, a stand-in clock) --------
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now


class _Collector:
    """What vLLM's ``AsyncLLM.add_request`` returns: the request's output collector, whose ``put`` vLLM's output
    handler calls with each output (the unit replaces it)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.outputs: list[Any] = []

    def put(self, output: Any) -> None:
        self.outputs.append(output)

    def get_nowait(self) -> Any:
        return self.outputs.pop(0) if self.outputs else None

    def close(self) -> None:
        pass


class _LLM:
    """Puts one output per ``(delay_s, num_tokens)`` into the request's collector, as vLLM's output handler does,
    the clock moved on by the delay first."""

    def __init__(self, clock: _Clock, deltas: list[tuple[float, int]]) -> None:
        self.clock = clock
        self.deltas = deltas
        self.tasks: list[asyncio.Task[None]] = []

    async def add_request(self, request_id: str, prompt: Any, params: Any) -> _Collector:
        queue = _Collector(request_id)
        self.tasks.append(asyncio.get_running_loop().create_task(self._outputs(queue)))
        return queue

    async def _outputs(self, queue: _Collector) -> None:
        for i, (delay, n) in enumerate(self.deltas):
            await asyncio.sleep(0)
            self.clock.now += delay
            done = i == len(self.deltas) - 1
            out = SimpleNamespace(token_ids=[7] * n, text="", finish_reason="length" if done else None,
                                  stop_reason=None)
            queue.put(SimpleNamespace(outputs=[out], finished=done))

    async def abort(self, request_id: str, internal: bool = False) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _vllm_outcome(monkeypatch: pytest.MonkeyPatch, deltas: list[tuple[float, int]], **submit: Any) -> RequestOutcome:
    pytest.importorskip("vllm")
    from agent.engine.vllm import unit as unit_module
    from agent.engine.vllm.options import EngineOptions

    clock = _Clock()
    monkeypatch.setattr(unit_module, "time", clock)
    unit = unit_module.VllmUnit(0, EngineOptions(model="tiny"))  # not started: the stand-in answers
    unit.llm = _LLM(clock, deltas)

    async def run() -> RequestOutcome:
        task = unit.submit("q", [1, 2, 3], sum(n for _, n in deltas), arrival_s=clock.now, ttft_slo_s=1.0,
                           tpot_slo_s=0.05, **submit)
        return await task

    try:
        return asyncio.run(run())
    finally:
        asyncio.run(unit.stop())


def test_a_vllm_unit_counts_a_coalesced_delta_at_its_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    # Token 1 at +0.1 s; tokens 2-3 together 0.3 s later; tokens 4-5 each 10 ms after.
    o = _vllm_outcome(monkeypatch, [(0.1, 1), (0.3, 2), (0.01, 1), (0.01, 1)])
    times = [0.0, 0.3, 0.3, 0.31, 0.32]  # from the first token on; a delta's tokens share its time
    assert o.output_tokens == 5
    assert o.max_tpot_s == pytest.approx(worst_tpot_s(times))  # token 2: 0.3 s, not 0.3 / 2 per token
    assert o.max_tpot_s == pytest.approx(0.3)
    assert o.tpot_s == pytest.approx(0.32 / 4)


def test_a_vllm_unit_whose_first_delta_has_several_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    o = _vllm_outcome(monkeypatch, [(0.1, 3), (0.04, 1)])
    assert o.max_tpot_s == pytest.approx(worst_tpot_s([0.0, 0.0, 0.0, 0.04]))  # token 4: 0.04 / 3
    assert o.max_tpot_s == pytest.approx(0.04 / 3)


def test_a_request_migrated_to_a_vllm_unit_keeps_its_worst(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 tokens elsewhere, the first 1 s before it arrives here with a worst of 0.2 s; its next token comes 0.1 s
    # after: (1.1) / 4 = 0.275 s.
    o = _vllm_outcome(monkeypatch, [(0.1, 1), (0.01, 1)], prompt_tokens=3, prior_outputs=4, first_token_s=99.0,
                      max_tpot_s=0.2)
    assert o.output_tokens == 6
    assert o.max_tpot_s == pytest.approx((100.1 - 99.0) / 4)
