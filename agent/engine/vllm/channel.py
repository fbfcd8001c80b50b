"""Our channel out of (and into) vLLM's engine-core process: step records out, control in.

vLLM drops extra fields of its own stats types on the way to the front end, so the scheduler talks to the
agent over zmq (a vLLM dependency), one msgpack frame per typed message (:mod:`agent.engine.vllm.messages`):

* out: the scheduler PUSHes a :class:`~agent.engine.vllm.messages.StepMessage` per step (``kind="step"``)
  and a :class:`~agent.engine.vllm.messages.ControlReply` per control request (``kind="control"``) to
  ``step_addr``, where the agent's unit (:mod:`agent.engine.vllm.unit`) binds an asyncio PULL socket and decodes
  them (``decode_engine``);
* in: the agent connects a PUSH socket (:class:`ControlSender`) and sends a
  :data:`~agent.engine.vllm.messages.ControlRequest` (``op``: ``set_policy``, ``set_params``, ``ping``); the
  scheduler binds a PULL socket on ``control_addr`` and polls it (never blocking) at the top of every
  ``schedule()`` (:class:`ControlInbox`), getting each frame as a request or, when it does not decode, as the
  :class:`~agent.engine.vllm.messages.FrameError` that says why.

The sender side never blocks the engine: a full queue (the agent stopped reading) drops the record and
counts it (``dropped``), which the next record carries. Without an address the sink keeps records in memory
(in-process engines and tests).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import msgspec
import zmq

from agent.engine.vllm.messages import ControlRequest, EngineMessage, FrameError, decode_control, encode

HWM = 100_000
"""Records queued per socket before the sender drops (about a minute of steps at 1 kHz)."""


class StepSink(Protocol):
    def emit(self, record: EngineMessage) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps the last ``maxlen`` records (in-process engines, tests)."""

    def __init__(self, maxlen: int = 1_000_000) -> None:
        self.records: deque[EngineMessage] = deque(maxlen=maxlen)

    def emit(self, record: EngineMessage) -> None:
        self.records.append(record)

    def drain(self) -> list[EngineMessage]:
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

    def emit(self, record: EngineMessage) -> None:
        if self.dropped:
            record = msgspec.structs.replace(record, dropped_before=self.dropped)
        try:
            self._sock.send(encode(record), zmq.NOBLOCK)
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

    def poll(self) -> list[ControlRequest | FrameError]:
        """The requests that arrived, in order; a frame that does not decode comes as the error that says why."""
        out: list[ControlRequest | FrameError] = []
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode_control(frame))
            except FrameError as exc:
                out.append(exc)

    def close(self) -> None:
        self._sock.close()


class ControlSender:
    """The agent's end of the control channel."""

    def __init__(self, addr: str) -> None:
        self._sock: Any = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)

    def send(self, message: ControlRequest) -> None:
        self._sock.send(encode(message))

    def close(self) -> None:
        self._sock.close()
