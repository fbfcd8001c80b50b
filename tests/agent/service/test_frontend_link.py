"""The link between the agent's main process and its front-end processes (``agent.service.link``), over a real
Unix socket pair, and the request stream's listener that feeds it (``RequestStream.listen`` and ``drain``)."""

from __future__ import annotations

import asyncio
import pickle
import socket
from typing import Any

import pytest

from agent.engine.vllm.sampling import TokenDelta
from agent.runtime.live.requests import ClusterRequest, RequestRejected, RequestStream
from agent.service.link import HEADER, MAX_FRAME, Outbox, pack, portable, read_frame


async def pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.StreamReader, asyncio.StreamWriter]:
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_unix_connection(sock=a)
    rb, wb = await asyncio.open_unix_connection(sock=b)
    return ra, wa, rb, wb


def test_frames_carry_messages_and_end_with_the_link() -> None:
    async def go() -> None:
        _, wa, rb, _ = await pair()
        delta = TokenDelta((7, 8), " ok ok", None, None, {"kept": [1, 2]})
        wa.write(pack([("out", [("r1", 0, [delta], None)])]) + pack([("serving", 2), ("abort", "r2")]))
        await wa.drain()
        first = await read_frame(rb)
        assert first == [("out", [("r1", 0, [delta], None)])]
        assert await read_frame(rb) == [("serving", 2), ("abort", "r2")]
        wa.close()
        assert await read_frame(rb) is None  # the other side is gone

    asyncio.run(go())


def test_a_frame_cut_short_or_too_long_ends_the_link() -> None:
    async def go() -> None:
        _, wa, rb, _ = await pair()
        frame = pack([("serving", 1)])
        wa.write(frame[:-2])
        wa.close()
        assert await read_frame(rb) is None
        _, wa, rb, _ = await pair()
        wa.write(HEADER.pack(MAX_FRAME + 1))
        with pytest.raises(ConnectionError, match="a frame of"):
            await read_frame(rb)

    asyncio.run(go())


def test_what_one_turn_of_the_loop_says_goes_out_as_one_frame() -> None:
    async def go() -> None:
        _, wa, rb, _ = await pair()
        collected: list[Any] = [("out", ["a", "b"])]
        outbox = Outbox(wa, lambda: collected.pop() if collected else None)
        outbox.put(("serving", 1))
        outbox.put(("reply", 3, True, None))
        outbox.wake()
        assert await read_frame(rb) == [("serving", 1), ("reply", 3, True, None), ("out", ["a", "b"])]
        outbox.wake()  # nothing to say: no frame
        outbox.put(("abort", "x"))
        assert await read_frame(rb) == [("abort", "x")]
        outbox.close()
        outbox.put(("abort", "y"))  # after close: dropped, not raised
        assert await read_frame(rb) is None

    asyncio.run(go())


class Unpicklable(Exception):
    def __init__(self, message: str, handle: Any) -> None:
        super().__init__(message)
        self.handle = handle


def test_errors_cross_as_themselves_or_as_what_they_were() -> None:
    refused = RequestRejected("full", refused_by=1, retry_after_s=0.5)
    back = pickle.loads(pickle.dumps(portable(refused)))
    assert isinstance(back, RequestRejected) and (back.refused_by, back.retry_after_s) == (1, 0.5)
    assert str(back) == "full"
    odd = portable(Unpicklable("no", handle=lambda: None))
    assert isinstance(odd, RuntimeError) and str(odd) == "Unpicklable: no"
    assert portable(None) is None


def test_a_listener_is_told_of_each_delta_and_of_the_end() -> None:
    async def go() -> None:
        stream = RequestStream(ClusterRequest("r", [1, 2, 3], 4), cluster=None, collect=True)  # type: ignore[arg-type]
        stream._push(TokenDelta((5,)))
        told: list[RequestStream] = []
        stream.listen(told.append)
        assert told == [stream]  # a delta was queued already
        stream._push(TokenDelta((6,)))
        assert len(told) == 2
        deltas, ended = stream.drain()
        assert [d.token_ids for d in deltas] == [(5,), (6,)] and not ended
        assert stream.drain() == ([], False)
        stream._push(TokenDelta((7,), finish_reason="length"))
        stream._finish(None, RequestRejected("gone"))
        assert len(told) == 4
        deltas, ended = stream.drain()
        assert [d.token_ids for d in deltas] == [(7,)] and ended
        assert stream.drain() == ([], True)  # the end stays
        with pytest.raises(RequestRejected):
            await stream.__anext__()

    asyncio.run(go())


@pytest.mark.vllm
def test_a_front_ends_loop_verdict_reaches_the_agent_under_its_index() -> None:
    """A front end watches its own event loop and reports each verdict over the link; the agent hears it with the
    front end's index (and nothing from a front end that has not said which it is)."""
    pytest.importorskip("vllm")
    from agent.service.frontends import Frontends, Link

    async def main() -> list[tuple[Any, ...]]:
        reports: list[tuple[Any, ...]] = []
        frontends = Frontends(Any, 2, model_name="m", on_loop=lambda *report: reports.append(report))  # type: ignore[arg-type]
        ra, wa, _, _ = await pair()
        link = Link(frontends, ra, wa)
        link._on(("loop", "busy", 0.95, 10.0, 0.7))  # before its hello
        link.index = 1
        link._on(("loop", "busy", 0.95, 10.0, 0.7))
        link._on(("loop", "clear", 0.4, 10.0, 0.7))
        wa.close()
        return reports

    assert asyncio.run(main()) == [(1, "busy", 0.95, 10.0, 0.7), (1, "clear", 0.4, 10.0, 0.7)]
