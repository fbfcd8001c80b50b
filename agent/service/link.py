"""The link between the agent's main process and its front-end processes (``--openai-frontends N``): framing.

One Unix-domain stream connection per front end, in a directory only the agent's user can open. Each frame is a
4-byte big-endian length and a pickled list of messages; each message a tuple whose first item names it. Pickle,
because what crosses is vLLM's own objects (``SamplingParams`` in, the units' ``RequestOutput`` s out, the
``VllmConfig`` a front end builds its renderer from) and both ends are the same agent's processes, started by it,
on a socket no other user can reach: nothing here decodes a frame from anyone else. Messages are batched: what
one side has to say in one turn of its event loop goes out as one frame (one pickle and one write for every
request's deltas of a unit's step, rather than one per request).

Front end to main process:

* ``("submit", request_id, prompt_token_ids, sampling_params, ttft_slo_s, tpot_slo_s, arrival_s)``
* ``("abort", request_id)``
* ``("call", call_id, method, args)``: the agent's metrics text, or a call on every unit's engine
  (``reset_prefix_cache``...), answered by a ``reply``
* ``("ready", port)`` once it serves, ``("failed", message)`` if it cannot

Main process to front end:

* ``("hello", FrontendHello)``: what the front end serves and how
* ``("serving", n)``: how many units serve, whenever it changes
* ``("out", [(request_id, unit_id, deltas, end), ...])``: each request's ``TokenDelta`` s since the last frame (as
  ``agent.engine.vllm.delta_codec`` packs them) and the unit it is on; ``end`` is None, or ``(outcome, error)``
  once the request ended
* ``("reply", call_id, ok, value)``
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30
"""The largest frame either side accepts (1 GiB): anything longer is a broken link, not a message."""


@dataclass(frozen=True, slots=True)
class FrontendHello:
    """What the main process tells a front end when it connects."""

    index: int
    """Which front end this is (0..N-1): the ``x-trackside-frontend`` header."""
    vllm_config: Any
    """The units' ``VllmConfig`` (every unit serves the same model): the renderer and input processor are built
    from it."""
    host: str
    port: int
    model_name: str
    frontend_args: tuple[str, ...]
    """``vllm serve`` front-end flags, already checked in the main process."""
    node_id: str | None
    retry_after_s: float
    serving: int
    follow_units: bool
    """Let the port go while no unit serves (the agent's port is shared with other agents)."""
    log_level: str = "warning"
    check: Callable[[Any], None] | None = None
    """Raises ``ValueError`` (400) for sampling parameters the units cannot serve (simulated units: a module's
    function, pickled by name)."""


def pack(messages: list[tuple[Any, ...]]) -> bytes:
    """One frame of ``messages``."""
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> list[tuple[Any, ...]] | None:
    """The next frame's messages; None at the end of the link (the other side closed it or is gone)."""
    try:
        size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
        if size > MAX_FRAME:
            raise ConnectionError(f"a frame of {size} bytes on the front-end link")
        messages: list[tuple[Any, ...]] = pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
        return None
    return messages


def portable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it survives pickling, else a ``RuntimeError`` that says what it was (an engine's exception may
    carry what does not pickle)."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class Outbox:
    """Messages for one link, sent as one frame at the end of the event loop's turn (``call_soon``); ``collect``,
    called then, adds what was only noted meanwhile (:meth:`wake`: the requests with new deltas)."""

    def __init__(self, writer: asyncio.StreamWriter,
                 collect: Callable[[], tuple[Any, ...] | None] | None = None) -> None:
        self._writer = writer
        self._collect = collect
        self._messages: list[tuple[Any, ...]] = []
        self._scheduled = False
        self.closed = False

    def put(self, message: tuple[Any, ...]) -> None:
        self._messages.append(message)
        self.wake()

    def wake(self) -> None:
        """Have the frame sent at the end of this turn of the loop."""
        if not self._scheduled and not self.closed:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._collect is not None and (more := self._collect()) is not None:
            self._messages.append(more)
        if not self._messages or self.closed:
            return
        messages, self._messages = self._messages, []
        if self._writer.is_closing():
            self.closed = True
            return
        self._writer.write(pack(messages))

    def close(self) -> None:
        self.flush()
        self.closed = True
        self._writer.close()
