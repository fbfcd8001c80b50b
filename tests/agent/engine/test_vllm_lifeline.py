"""The lifeline from an engine core to its agent (:mod:`agent.engine.vllm.lifeline`), with real processes: an
"agent" killed with SIGKILL, an "engine core" watching it. (The whole path, a fake-executor engine core of a real
agent, is in ``tests/agent/cli/test_vllm_agent.py``.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from agent.engine.vllm.lifeline import watch_agent

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")

ENGINE = """
import signal, sys, time
from agent.engine.vllm.lifeline import end_engine, watch_agent
if sys.argv[2] == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an engine core stuck where SIGTERM does not end it
watch_agent(int(sys.argv[1]), lambda: end_engine(grace_s=0.5))
print("watching", flush=True)
time.sleep(600)
"""


@pytest.fixture
def agent() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def engine_for(pid: int, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(pid), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "watching\n"
    return proc


@pytest.mark.parametrize(("mode", "signal_"), [("hears", signal.SIGTERM), ("deaf", signal.SIGKILL)])
def test_an_engine_core_ends_when_its_agent_is_killed(agent: subprocess.Popen[bytes], mode: str,
                                                      signal_: signal.Signals) -> None:
    engine = engine_for(agent.pid, mode)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            engine.wait(0.5)  # alive while its agent is
        agent.kill()
        agent.wait()
        assert engine.wait(30) == -signal_  # SIGTERM; SIGKILL after the grace where SIGTERM did not end it
    finally:
        engine.kill()
        engine.wait()


def test_nothing_is_watched_in_the_agents_own_process() -> None:
    assert watch_agent(os.getpid(), lambda: pytest.fail("called")) is None


def test_an_agent_already_gone_ends_the_engine_at_once(caplog: pytest.LogCaptureFixture) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    gone = threading.Event()
    with caplog.at_level(logging.WARNING, logger="agent.engine.vllm.lifeline"):
        thread = watch_agent(proc.pid, gone.set, what="front end 3")  # the log names who stops
        assert thread is not None
        thread.join(10)
    assert gone.is_set()
    assert f"the agent (PID {proc.pid}) is gone: front end 3 stops" in caplog.text
