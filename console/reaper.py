"""``python -m console.reaper SECONDS PID [PID ...]``: kill the processes still running SECONDS from now.

The demo's watchdog (:func:`console.demo.kill_later`): the console leaves an agent that is slow to stop after
SIGTERM to finish in the background, so that quitting gives the shell back at once, and starts this in a session of
its own to kill the agent if it has not exited in time. Each process is held by a pidfd (Linux), so a pid reused
after the process exited is never signalled; where there are no pidfds, nothing is killed (the agent then stops by
itself, or gets the SIGTERM the kernel sends a demo child when the console dies).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Sequence


def kill_after(after_s: float, pids: Sequence[int]) -> int:
    """SIGKILL each of ``pids`` that has not exited ``after_s`` seconds from now; how many were killed."""
    fds = []
    for pid in pids:
        with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfds here
            fds.append(os.pidfd_open(pid))
    end = time.monotonic() + after_s
    while fds and (left := end - time.monotonic()) > 0:
        exited, _, _ = select.select(fds, [], [], left)  # a pidfd reads ready when its process has exited
        for fd in exited:
            fds.remove(fd)
            os.close(fd)
    killed = 0
    for fd in fds:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            killed += 1
        os.close(fd)
    return killed


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m console.reaper SECONDS PID [PID ...]", file=sys.stderr)
        return 2
    kill_after(float(args[0]), [int(pid) for pid in args[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
