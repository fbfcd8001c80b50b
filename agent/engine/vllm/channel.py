"""Our channel out of (and into) vLLM's engine-core process: step records out, control in.

vLLM drops extra fields of its own stats types on the way to the front end, so the scheduler talks to the
agent over zmq (a vLLM dependency) with msgpack frames:

* out: the scheduler PUSHes one dict per step (``kind="step"``) and one per control reply
  (``kind="control"``) to ``step_addr``, where the agent's unit (:mod:`agent.engine.vllm.unit`) binds an
  asyncio PULL socket;
* in: the scheduler binds a PULL socket on ``control_addr`` and polls it (never blocking) at the top of every
  ``schedule()``; the agent connects a PUSH socket (:class:`ControlSender`).

The sender side never blocks the engine: a full queue (the agent stopped reading) drops the record and
counts it (``dropped``), which the next record carries. Without an address the sink keeps records in memory
(in-process engines and tests).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import msgspec
import zmq

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

HWM = 100_000
"""Records queued per socket before the sender drops (about a minute of steps at 1 kHz)."""


class StepSink(Protocol):
    def emit(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps the last ``maxlen`` records (in-process engines, tests)."""

    def __init__(self, maxlen: int = 1_000_000) -> None:
        self.records: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.records)
        self.records.clear()
        return out

    def close(self) -> None:
        pass


class ZmqSink:
    """PUSHes records to the agent without ever blocking the engine."""

    def __init__(self, addr: str) -> None:
        self._ctx: Any = zmq.Context.instance()
        self._sock: Any = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(addr)
        self.dropped = 0

    def emit(self, record: dict[str, Any]) -> None:
        if self.dropped:
            record["dropped_before"] = self.dropped
        try:
            self._sock.send(_encode(record), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return
        self.dropped = 0

    def close(self) -> None:
        self._sock.close()


def make_sink(addr: str | None) -> StepSink:
    return ZmqSink(addr) if addr else MemorySink()


class ControlInbox:
    """The scheduler's end of the control channel: poll without blocking."""

    def __init__(self, addr: str) -> None:
        self._sock: Any = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                message = _decode(frame)
            except msgspec.DecodeError:
                continue
            if isinstance(message, dict):
                out.append(message)

    def close(self) -> None:
        self._sock.close()


class ControlSender:
    """The agent's end of the control channel."""

    def __init__(self, addr: str) -> None:
        self._sock: Any = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)

    def send(self, message: dict[str, Any]) -> None:
        self._sock.send(_encode(message))

    def close(self) -> None:
        self._sock.close()
