"""An engine core ends with its agent: the lifeline from vLLM's engine-core process to the agent that started it.

vLLM starts each unit's engine core as a child process of the agent, and nothing in vLLM 0.26.0 ends it when that
parent dies without shutting it down (SIGKILL, the OOM killer, a crash in native code): the engine core goes on,
reparented to PID 1, holding its GPU memory, so an agent started again on the same GPUs finds them full. The
scheduler (:mod:`agent.engine.vllm.scheduler`) runs in the engine-core process and, when the agent told it its PID
(``UnitSettings.agent_pid``), starts :func:`watch_agent` there.

The watch is a daemon thread blocked in ``poll`` on a pidfd of the agent (Linux 5.3+: no polling, no PID reuse
race once the pidfd is open). When the agent is gone, the thread sends the engine core SIGTERM, which vLLM's engine
core handles as a shutdown (its busy loop ends, its executor and workers are shut down; in-flight requests are
aborted unless ``shutdown_timeout`` asks for a drain), and SIGKILL after :data:`GRACE_S` if it is still there.
``PR_SET_PDEATHSIG`` would not do: it follows the thread that started the process, and the agent starts engines
from worker threads (a restart is built in ``asyncio.to_thread``).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

GRACE_S = 10.0
"""How long an engine core whose agent is gone has to shut down after SIGTERM before it gets SIGKILL."""


def end_engine(grace_s: float = GRACE_S) -> None:
    """SIGTERM to this process (vLLM's engine core shuts down on it), then SIGKILL if it is still here after
    ``grace_s``. Called from the watch thread."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.warning("trackside: the engine core did not stop %.0f s after SIGTERM: SIGKILL", grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_agent(pid: int, on_gone: Callable[[], None] = end_engine, *,
                what: str = "this engine core") -> threading.Thread | None:
    """Call ``on_gone`` (in a daemon thread) once process ``pid`` has exited. Returns the thread, or None where
    nothing is watched: ``pid`` is this process (an engine run in the agent's own process), or the system has no
    pidfds (not Linux; logged). A ``pid`` already gone calls ``on_gone`` at once, in the thread. ``what``: this
    process, as the log lines name it."""
    if pid == os.getpid():
        return None
    if not hasattr(os, "pidfd_open"):
        log.warning("trackside: no pidfd here: %s will not stop by itself if its agent dies", what)
        return None
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except OSError as e:  # a kernel without pidfd_open (ENOSYS), or not allowed
        log.warning("trackside: cannot watch the agent (PID %d): %s: %s will not stop by itself if its agent dies",
                    pid, e, what)
        return None

    def watch() -> None:
        if fd is not None:
            try:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                while not poller.poll():
                    pass
            finally:
                os.close(fd)
        log.warning("trackside: the agent (PID %d) is gone: %s stops", pid, what)
        on_gone()

    thread = threading.Thread(target=watch, name="trackside-lifeline", daemon=True)
    thread.start()
    return thread
