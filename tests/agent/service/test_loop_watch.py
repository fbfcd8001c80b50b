"""The event loop's alert (``agent.service.loop_watch``): when the agent's loop has been busy a whole window it says
so on the stream, once, and says again when it no longer is."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.service.hub import Hub
from agent.service.loop_watch import FRONTEND_ADVICE, LoopWatch, alert, watch_loop
from agent.telemetry import Alert, Subscribe
from agent.telemetry.events import AlertCode
from agent.workload.spec import parse_workload


def run(watch: LoopWatch, shares: list[float]) -> list[tuple[int, str]]:
    """Readings one second apart, the loop busy ``shares[i]`` of second ``i``; the verdicts and when."""
    cpu = 0.0
    out = []
    for t, share in enumerate([0.0, *shares]):
        cpu += share
        verdict = watch.observe(float(t), cpu)
        if verdict is not None:
            out.append((t, verdict))
    return out


def test_a_busy_window_alerts_once_and_a_quiet_one_clears() -> None:
    watch = LoopWatch(busy_share=0.9, clear_share=0.7, window_s=10)
    verdicts = run(watch, [0.95] * 15 + [0.8] * 15 + [0.5] * 12)
    # 0.8 is neither: no alert comes and goes around one threshold; at 34 s the last 10 s were 6 x 0.8 + 4 x 0.5: 0.68
    assert verdicts == [(10, "busy"), (34, "clear")]
    assert watch.share == pytest.approx(0.5) and not watch.alerted


def test_no_verdict_before_a_whole_window_nor_for_a_short_burst() -> None:
    assert run(LoopWatch(window_s=10), [1.0] * 9) == []
    assert run(LoopWatch(window_s=10), [0.5] * 10 + [1.0] * 4 + [0.5] * 10) == []  # at most 0.7 of any 10 s
    with pytest.raises(ValueError):
        LoopWatch(busy_share=0.7, clear_share=0.7)


def test_the_alert_reaches_the_stream() -> None:
    config = BenchConfig(units=2)
    hub = Hub(make_node(config, parse_workload("poisson:n=5,rate=1", seed=1)), node_id="n", profile=config.profile)
    hub.attach()
    sub, _, _ = hub.subscribe(Subscribe(kinds=("alert",)), lambda: None)
    assert sub is not None
    clock, cpu = itertools.count(), itertools.count(step=0.95)

    async def main() -> None:
        task = asyncio.create_task(watch_loop(hub, LoopWatch(window_s=3), interval_s=0.001,
                                              clock=lambda: float(next(clock)), cpu=lambda: float(next(cpu))))
        for _ in range(5000):  # the 4th reading (3 s of made-up time) decides; each takes a real millisecond or so
            if sub.pop_many(1):
                break
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(main())
    (alert,) = [e for e in hub.replay.since(0).events if isinstance(e, Alert)]
    assert alert.code == AlertCode.EVENT_LOOP_BUSY and alert.severity == "warning" and "95% busy" in alert.message
    assert "--agents N" in alert.message  # what to do about it


def test_a_front_ends_alert_names_it_and_says_to_run_more() -> None:
    config = BenchConfig(units=1)
    hub = Hub(make_node(config, parse_workload("poisson:n=5,rate=1", seed=1)), node_id="n", profile=config.profile)
    busy = alert(hub, "busy", 0.93, 10.0, 0.7, loop="front end 2's event loop", advice=FRONTEND_ADVICE)
    assert busy.severity == "warning" and busy.message.startswith("front end 2's event loop was 93% busy over the last "
                                                                  "10 s: ")
    assert "--openai-frontends N" in busy.message
    clear = alert(hub, "clear", 0.5, 10.0, 0.7, loop="front end 2's event loop", advice=FRONTEND_ADVICE)
    assert clear.severity == "info" and clear.message == (
        "front end 2's event loop is 50% busy over the last 10 s, below 70%")
