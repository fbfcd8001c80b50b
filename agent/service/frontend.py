"""A front-end process of the agent's OpenAI intake (``--openai-frontends N``): vLLM's OpenAI app over a link.

Started by the agent's main process (:class:`agent.service.frontends.Frontends`) as ``python -m
agent.service.frontend --link PATH --index I --parent PID``. It connects to the link, is told what to serve
(:class:`~agent.service.link.FrontendHello`), builds the model's renderer and input processor from the units'
``vllm_config`` (:class:`~agent.engine.vllm.openai_app.FrontendModel`), and serves vLLM's OpenAI app with
trackside's middleware on the agent's port, bound with ``SO_REUSEPORT`` beside the other front ends. Its engine
client's ``submit`` sends each rendered request over the link (:class:`LinkClient`), and each request's deltas come
back as a :class:`RemoteStream`, which the engine client and the middleware read as they read a ``RequestStream``.

It ends with the main process: when the link ends, or when the main process is gone (the lifeline of
:mod:`agent.engine.vllm.lifeline`: SIGTERM to itself, SIGKILL after its grace).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from agent.engine.vllm.delta_codec import expand
from agent.engine.vllm.engine_client import RoutedEngineClient
from agent.engine.vllm.lifeline import watch_agent
from agent.engine.vllm.openai_app import FrontendModel, frontend_namespace
from agent.runtime.live.requests import Deltas, RequestRejected
from agent.service.link import FrontendHello, Outbox, pack, read_frame
from agent.service.loop_watch import watch_thread
from agent.service.openai_server import AppServer, checked, refusal_status, routed_app, ticketed

log = logging.getLogger(__name__)


class RemoteStream(Deltas):
    """A request in the main process, as its front end reads it: its deltas, the unit it is on, how it ended (the
    parts of a ``RequestStream`` that the engine client and the middleware read)."""

    def __init__(self, request_id: str, client: LinkClient) -> None:
        super().__init__()
        self.request_id = request_id
        self.unit_id: int | None = None
        self.outcome: Any = None
        self._client = client
        self.done = False

    def abort(self) -> bool:
        if self.done:
            return False
        self._client.abort(self.request_id)
        return True

    def _take(self, unit_id: int | None, deltas: Sequence[tuple[Any, ...]], end: tuple[Any, Any] | None) -> None:
        """What the main process sent of this request: its deltas (``agent.engine.vllm.delta_codec``), the unit it is
        on, and how it ended."""
        if unit_id is not None:
            self.unit_id = unit_id
        for item in deltas:
            self._put(expand(item))
        if end is not None:
            self.outcome, self.error = end
            self.done = True
            self._put_end()


class LinkClient:
    """The front end's side of the link: submits, aborts and calls out; deltas, the serving count and replies in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: FrontendHello) -> None:
        self._reader = reader
        self.outbox = Outbox(writer)
        self.serving = hello.serving
        self.streams: dict[str, RemoteStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any, *, ttft_slo_s: float | None,
               tpot_slo_s: float | None, arrival_s: float) -> RemoteStream:
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = self.streams[request_id] = RemoteStream(request_id, self)
        self.outbox.put(("submit", request_id, prompt_token_ids, params, ttft_slo_s, tpot_slo_s, arrival_s))
        return stream

    def abort(self, request_id: str) -> None:
        self.outbox.put(("abort", request_id))

    async def call(self, method: str, *args: Any) -> Any:
        """Ask the main process (the agent's metrics, a call on every unit's engine)."""
        call_id = next(self._ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self.outbox.put(("call", call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def run(self) -> None:
        """Read the main process's frames until the link ends; then every request still open fails."""
        try:
            while (frame := await read_frame(self._reader)) is not None:
                for message in frame:
                    kind = message[0]
                    if kind == "out":
                        for rid, unit_id, deltas, end in message[1]:
                            stream = self.streams.get(rid)
                            if stream is None:
                                continue
                            if end is not None:
                                del self.streams[rid]
                            stream._take(unit_id, deltas, end)
                    elif kind == "serving":
                        self.serving = int(message[1])
                    elif kind == "reply":
                        _, call_id, ok, value = message
                        future = self._calls.get(call_id)
                        if future is not None and not future.done():
                            if ok:
                                future.set_result(value)
                            else:
                                future.set_exception(value)
        finally:
            self.serving = 0
            gone = RequestRejected("the agent's main process is gone", retry_after_s=1.0)
            for stream in list(self.streams.values()):
                stream._take(None, (), (None, gone))
            self.streams.clear()
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(ConnectionError("the agent's main process is gone"))


class FrontendServer(AppServer):
    """vLLM's OpenAI app over the link, on the agent's port (shared with the other front ends)."""

    def __init__(self, link: LinkClient, hello: FrontendHello) -> None:
        self.link = link
        self.hello = hello
        self._args = frontend_namespace(str(hello.vllm_config.model_config.model), hello.model_name,
                                        hello.frontend_args)
        super().__init__(hello.host, hello.port, reuse_port=True, follow_units=hello.follow_units,
                         log_level=hello.log_level)

    def serving(self) -> int:
        return self.link.serving

    async def build(self) -> Any:
        model = FrontendModel(self.hello.vllm_config, self.link.call)
        submit = ticketed(checked(self.link.submit, self.hello.check))  # a check: 400 here, before the request leaves
        client = RoutedEngineClient(lambda: [model], submit, self.serving, refusal=refusal_status)
        return await routed_app(client, self._args, metrics=lambda: self.link.call("metrics"),
                                retry_after_s=self.hello.retry_after_s, node_id=self.hello.node_id,
                                frontend=self.hello.index)


async def serve(link_path: str, index: int) -> int:
    """Connect, serve until SIGTERM or the link's end; the exit status."""
    reader, writer = await asyncio.open_unix_connection(link_path)
    writer.write(pack([("hello", index)]))
    frame = await read_frame(reader)
    if not frame or frame[0][0] != "hello":
        print(f"trackside front end {index}: the agent sent no hello", file=sys.stderr)
        return 1
    hello: FrontendHello = frame[0][1]
    link = LinkClient(reader, writer, hello)
    for message in frame[1:]:
        if message[0] == "serving":
            link.serving = int(message[1])
    try:
        server = FrontendServer(link, hello)
        await server.start()
    except Exception as exc:
        writer.write(pack([("failed", f"front end {index}: {type(exc).__name__}: {exc}")]))
        with contextlib.suppress(Exception):
            await writer.drain()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    link.outbox.put(("ready", server.port))
    reading = loop.create_task(link.run())
    stopping = loop.create_task(stop.wait())
    watching = loop.create_task(watch_thread(  # the agent alerts when this loop stays busy
        lambda verdict, w: link.outbox.put(("loop", verdict, w.share, w.window_s, w.clear_share))))
    await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
    await server.stop()
    for task in (reading, stopping, watching):
        task.cancel()
    link.outbox.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.service.frontend",
                                     description="A front-end process of a trackside agent's OpenAI intake "
                                                 "(started by the agent with --openai-frontends N).")
    parser.add_argument("--link", required=True, help="the agent's front-end link (a Unix socket)")
    parser.add_argument("--index", type=int, required=True, help="which front end this is")
    parser.add_argument("--parent", type=int, default=os.getppid(), help="the agent's PID (ends with it)")
    parser.add_argument("--no-uvloop", action="store_true", help="asyncio's own event loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"trackside front end {args.index}: %(message)s")
    watch_agent(args.parent, what=f"front end {args.index}")
    if args.no_uvloop:
        return asyncio.run(serve(args.link, args.index))
    import uvloop

    return int(uvloop.run(serve(args.link, args.index)))


if __name__ == "__main__":
    sys.exit(main())
