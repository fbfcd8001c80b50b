"""An alert when the agent's event loop is what limits the node (``AlertCode.EVENT_LOOP_BUSY``).

On a vLLM node one event loop runs the OpenAI front end for every unit, the dispatcher and the telemetry; under a
saturating load it can be busy all the time while the GPUs wait (docs/vllm.md, "One front-end process for the whole
node"). ``trackside_event_loop_cpu_seconds_total`` shows that on a dashboard; this puts it on the agent's stream,
where the console shows alerts: a ``warning`` once the loop's thread has been busy at least
:data:`BUSY_SHARE` of :data:`WINDOW_S` seconds, an ``info`` once it has been busy at most :data:`CLEAR_SHARE` of
such a window again (the gap between the two keeps a load near the threshold from alerting over and over).

:class:`LoopWatch` decides from readings it is given (pure; tests pass made-up ones); :func:`watch_thread` takes them
on the loop's own thread (``time.thread_time``: that thread's CPU time) every :data:`INTERVAL_S`, and
:func:`watch_loop` publishes the agent's. Each front-end process of ``--openai-frontends N`` watches its own loop
the same way and reports its verdicts over its link; the agent publishes them naming the front end
(``agent.service.frontends``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Final, Literal

from agent.service.hub import Hub
from agent.telemetry.events import Alert, AlertCode

BUSY_SHARE: Final = 0.9
CLEAR_SHARE: Final = 0.7
WINDOW_S: Final = 10.0
INTERVAL_S: Final = 1.0

Verdict = Literal["busy", "clear"]


class LoopWatch:
    """Whether the loop's thread has been busy (or no longer is) over the last ``window_s``, from
    ``(wall seconds, thread CPU seconds)`` readings taken on that thread."""

    def __init__(self, busy_share: float = BUSY_SHARE, clear_share: float = CLEAR_SHARE,
                 window_s: float = WINDOW_S) -> None:
        if not 0 < clear_share < busy_share <= 1:
            raise ValueError("need 0 < clear_share < busy_share <= 1")
        self.busy_share = busy_share
        self.clear_share = clear_share
        self.window_s = window_s
        self.alerted = False
        """A ``busy`` verdict was given and no ``clear`` since."""
        self.share: float | None = None
        """The busy share over the last full window, once there is one."""
        self._readings: deque[tuple[float, float]] = deque()

    def observe(self, now_s: float, cpu_s: float) -> Verdict | None:
        """Take a reading; ``busy`` or ``clear`` when the state changes, else None."""
        readings = self._readings
        readings.append((now_s, cpu_s))
        while len(readings) > 2 and now_s - readings[1][0] >= self.window_s:
            readings.popleft()  # keep one reading at least a window old
        then_s, then_cpu = readings[0]
        if now_s - then_s < self.window_s:
            return None
        self.share = share = (cpu_s - then_cpu) / (now_s - then_s)
        if not self.alerted and share >= self.busy_share:
            self.alerted = True
            return "busy"
        if self.alerted and share <= self.clear_share:
            self.alerted = False
            return "clear"
        return None


AGENT_ADVICE: Final = ("the front end, dispatch and telemetry may limit this node before its GPUs do: run its units as "
                       "several agents (--agents N; docs/deploy.md, \"Several agents on one node\")")
FRONTEND_ADVICE: Final = ("the OpenAI front ends may limit this agent before its units do: run more of them "
                          "(--openai-frontends N; docs/openai-intake.md, \"Several front-end processes\")")


def alert(hub: Hub, verdict: Verdict, share: float | None, window_s: float, clear_share: float, *,
          loop: str = "the agent's event loop", advice: str = AGENT_ADVICE) -> Alert:
    """The alert for ``verdict`` on ``loop`` (``share``: its busy share over the last ``window_s``), stamped with the
    node's time; a busy one says what to do about it (``advice``)."""
    busy = f"{share or 0.0:.0%}"
    window = f"{window_s:.0f} s"
    if verdict == "busy":
        message = f"{loop} was {busy} busy over the last {window}: {advice}"
    else:
        message = f"{loop} is {busy} busy over the last {window}, below {clear_share:.0%}"
    return Alert(node_id=hub.node_id, time_ns=hub.origin.ns(hub.node.now_s), code=AlertCode.EVENT_LOOP_BUSY,
                 severity="warning" if verdict == "busy" else "info", message=message)


async def watch_thread(on_verdict: Callable[[Verdict, LoopWatch], None], watch: LoopWatch | None = None, *,
                       interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                       cpu: Callable[[], float] = time.thread_time) -> None:
    """Read the loop thread's CPU time every ``interval_s`` until cancelled, calling ``on_verdict`` with what
    ``watch`` says when it changes (run it as a task on the loop it watches)."""
    watch = watch or LoopWatch()
    while True:
        await asyncio.sleep(interval_s)
        verdict = watch.observe(clock(), cpu())
        if verdict is not None:
            on_verdict(verdict, watch)


async def watch_loop(hub: Hub, watch: LoopWatch | None = None, *, interval_s: float = INTERVAL_S,
                     clock: Callable[[], float] = time.monotonic,
                     cpu: Callable[[], float] = time.thread_time) -> None:
    """:func:`watch_thread` on the agent's own loop, its verdicts published on the hub."""
    def publish(verdict: Verdict, w: LoopWatch) -> None:
        hub.publish(alert(hub, verdict, w.share, w.window_s, w.clear_share))

    await watch_thread(publish, watch, interval_s=interval_s, clock=clock, cpu=cpu)
