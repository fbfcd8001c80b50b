"""The OpenAI intake in several processes (``--openai-frontends N``): the main process's side.

The agent's main process keeps everything that acts on a request after it started: the units (their ``AsyncLLM`` s,
so vLLM's output processing and detokenization), the cluster with each request's ``RequestStream``, the dispatcher,
the telemetry and control. N front-end processes (:mod:`agent.service.frontend`) each run vLLM's OpenAI app and its
HTTP server on the same port (``SO_REUSEPORT``: the kernel spreads connections between them), rendering and
tokenizing requests, and writing the responses; what they submit crosses a link (:mod:`agent.service.link`) into
the cluster here, and each request's deltas cross back. Migrations, failed units, restarts and the pending timeout
work as with one process, since the streams never leave this one. Measured split of the per-token CPU, and why
this split and not vLLM's own (API servers that each talk to every engine core): ``docs/vllm.md``, "Several
front-end processes for one agent".

:class:`Frontends` starts the processes, serves their links, tells them how many units serve, and starts again a
front end that died (its connections died with it; its requests are aborted here), with backoff. Each front end
ends with the main process (the lifeline of ``agent.engine.vllm.lifeline``, and the end of its link).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from agent.engine.vllm.delta_codec import compact
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.requests import ClusterRequest, RequestStream
from agent.runtime.live.restarts import backoff
from agent.service.link import FrontendHello, Outbox, portable, read_frame
from agent.service.loop_watch import FRONTEND_ADVICE, Verdict, alert
from agent.service.openai_server import ServedModel, cluster_max_tokens
from agent.telemetry.client import host_port

log = logging.getLogger(__name__)

UNIT_CALLS = ("start_profile", "stop_profile", "reset_mm_cache", "reset_encoder_cache", "reset_prefix_cache")
"""What a front end may ask of every unit's engine (vLLM's app routes: profiling, cache resets)."""

START_TIMEOUT_S = 300.0
"""How long a front end has to import vLLM, build its renderer and bind the port."""


class FrontendStartError(Exception):
    """A front-end process did not start (the message says why: its own words, or how it exited)."""


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Link:
    """One front end's connection, on the main process's side: its submits go to the cluster, each of its requests'
    deltas go back in the next frame (a listener on the stream, no task per request)."""

    def __init__(self, frontends: Frontends, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._frontends = frontends
        self._cluster = frontends.cluster
        self._reader = reader
        self.outbox = Outbox(writer, self._collect)
        self.streams: dict[str, RequestStream] = {}
        self._dirty: list[RequestStream] = []
        self._noted: set[str] = set()
        self.index: int | None = None
        self.ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        """The port, once the front end serves; the reason as a ``FrontendStartError`` if it cannot."""
        self.ready.add_done_callback(_retrieved)  # a start nobody waits for any more is not an error to log
        self._calls: set[asyncio.Task[None]] = set()

    def _note(self, stream: RequestStream) -> None:
        if stream.request_id not in self._noted:
            self._noted.add(stream.request_id)
            self._dirty.append(stream)
            self.outbox.wake()

    def _collect(self) -> tuple[Any, ...] | None:
        if not self._dirty:
            return None
        out = []
        for stream in self._dirty:
            deltas, ended = stream.drain()
            end = None
            if ended:
                end = (stream.outcome, portable(stream.error))
                self.streams.pop(stream.request_id, None)
            out.append((stream.request_id, stream.unit_id, [compact(d) for d in deltas], end))
        self._dirty.clear()
        self._noted.clear()
        return ("out", out)

    async def serve(self) -> None:
        """Read the front end's frames until its link ends; then abort what it left in flight."""
        try:
            while (frame := await read_frame(self._reader)) is not None:
                for message in frame:
                    self._on(message)
        finally:
            self.outbox.close()
            for stream in list(self.streams.values()):
                stream.abort()  # its clients' connections ended with it
            self.streams.clear()
            if not self.ready.done():
                self.ready.set_exception(FrontendStartError("its link ended before it served"))

    def _on(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            _, rid, ids, params, ttft_slo_s, tpot_slo_s, arrival_s = message
            try:
                stream = self._cluster.submit(ClusterRequest(rid, ids, cluster_max_tokens(params),
                                                             ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                                                             arrival_s=arrival_s, params=params))
            except Exception as exc:  # a request id already in flight (from another front end)
                self.outbox.put(("out", [(rid, None, [], (None, portable(exc)))]))
                return
            self.streams[rid] = stream
            stream.listen(self._note)
        elif kind == "abort":
            held = self.streams.get(message[1])
            if held is not None:
                held.abort()
        elif kind == "call":
            task = asyncio.get_running_loop().create_task(self._call(*message[1:]))
            self._calls.add(task)  # (the loop keeps only a weak reference to a task)
            task.add_done_callback(self._calls.discard)
        elif kind == "hello":
            self.index = int(message[1])
            self.outbox.put(("hello", self._frontends.hello(self.index)))
        elif kind == "ready":
            if not self.ready.done():
                self.ready.set_result(int(message[1]))
        elif kind == "failed":
            if not self.ready.done():
                self.ready.set_exception(FrontendStartError(str(message[1])))
        elif kind == "loop":
            if self.index is not None and self._frontends.on_loop is not None:
                self._frontends.on_loop(self.index, *message[1:])
        else:
            log.warning("front-end link: unknown message %r", kind)

    async def _call(self, call_id: int, method: str, args: Sequence[Any]) -> None:
        try:
            value = await self._frontends.call(method, args)
        except Exception as exc:
            self.outbox.put(("reply", call_id, False, portable(exc)))
        else:
            self.outbox.put(("reply", call_id, True, value))


LoopReport = Callable[[int, Verdict, "float | None", float, float], None]
"""What a front end's loop verdict is given to: its index, ``busy`` or ``clear``, the busy share, the window, the share
that clears."""


class Frontends:
    """N front-end processes serving the OpenAI port for ``cluster`` (see the module). ``metrics``: the text their
    ``GET /metrics`` serves (the agent's); ``follow_units``: they let the port go while no unit serves (the port
    is shared with other agents); ``say``: where their starts, deaths and restarts are told."""

    def __init__(self, cluster: LiveCluster[Any], count: int, host: str = "127.0.0.1", port: int = 8000, *,
                 model_name: str, frontend_args: Sequence[str] = (), metrics: Callable[[], str] | None = None,
                 follow_units: bool = False, node_id: str | None = None, log_level: str = "warning",
                 uvloop: bool = True, say: Callable[[str], None] | None = None,
                 restart_delays: Callable[[], Iterator[float]] | None = backoff,
                 on_loop: LoopReport | None = None, model: ServedModel | None = None) -> None:
        if count < 1:
            raise ValueError("--openai-frontends: at least 1")
        self.cluster = cluster
        self.model = model
        """The model the front ends render for where the units are not vLLM engines (simulated units): its
        ``vllm_config`` goes in the hello, its ``check`` runs in each front end, and its engine answers the calls."""
        self.count = count
        self.host = host
        self.port = port
        self.model_name = model_name
        self.frontend_args = tuple(frontend_args)
        self._metrics = metrics
        self._follow_units = follow_units
        self._node_id = node_id
        self._log_level = log_level
        self._uvloop = uvloop
        self._say = say or log.warning
        self._restart_delays = restart_delays
        self.on_loop = on_loop
        """Called with a front end's index and its event loop's verdict when it changes (``busy``/``clear``, the
        busy share, the window and the share that clears: :class:`~agent.service.loop_watch.LoopWatch`)."""
        self._dir = ""
        self._server: asyncio.Server | None = None
        self._links: list[Link] = []
        self._waiting: dict[int, asyncio.Future[Link]] = {}
        self.processes: list[asyncio.subprocess.Process | None] = [None] * count
        self.restarts = [0] * count
        """How many times each front end was started again."""
        self._tasks: list[asyncio.Task[None]] = []
        self._serving = -1
        self._stopping = False

    @property
    def base_url(self) -> str:
        return f"http://{host_port(self.host, self.port)}/v1"

    @property
    def pids(self) -> list[int | None]:
        return [p.pid if p is not None else None for p in self.processes]

    def hello(self, index: int) -> FrontendHello:
        engine = self.model.engine if self.model is not None else self.cluster.units[0].llm
        return FrontendHello(index=index, vllm_config=engine.vllm_config, host=self.host,
                             port=self.port, model_name=self.model_name, frontend_args=self.frontend_args,
                             node_id=self._node_id, retry_after_s=max(1.0, self.cluster.ttft_slo_s),
                             serving=self.cluster.num_serving, follow_units=self._follow_units,
                             log_level=self._log_level, check=self.model.check if self.model is not None else None)

    async def call(self, method: str, args: Sequence[Any]) -> Any:
        """A front end's call: the metrics text, or ``method`` on every serving unit's engine."""
        if method == "metrics":
            return self._metrics() if self._metrics is not None else ""
        if method not in UNIT_CALLS:
            raise ValueError(f"not a call a front end may make: {method!r}")
        engines = ([self.model.engine] if self.model is not None else
                   [u.llm for u in self.cluster.units if u.llm is not None and not u.llm.errored])
        results = await asyncio.gather(*(getattr(e, method)(*args) for e in engines))
        return all(results) if method == "reset_prefix_cache" else None

    async def start(self) -> None:
        """Start the first process, which binds the port (its error, a port in use, ends the start), then the others
        together; return once every one serves."""
        self.cluster.start()
        self._dir = tempfile.mkdtemp(prefix="trackside-frontends-")  # mode 0700: only this user reaches the link
        path = os.path.join(self._dir, "link")
        self._server = await asyncio.start_unix_server(self._accept, path=path)
        self._serving = self.cluster.num_serving  # what each hello says
        self.cluster.serving_listeners.append(self._push_serving)  # a unit failed or back: at once
        try:
            port = await self._start_one(0)
            if self.port == 0:
                self.port = port  # the OS chose it for the first one: the others share it
            # the others at once: each spends seconds importing vLLM and building its renderer
            await asyncio.gather(*(self._start_one(i) for i in range(1, self.count)))
        except BaseException:
            await self.stop()
            raise
        for i in range(self.count):
            self._tasks.append(asyncio.get_running_loop().create_task(self._supervise(i)))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(self, reader, writer)
        first = await read_frame(reader)
        if not first or first[0][0] != "hello":
            writer.close()
            return
        for message in first:
            link._on(message)
        index = link.index
        waiting = self._waiting.get(index) if index is not None else None
        if waiting is None or waiting.done():
            link.outbox.close()
            return
        waiting.set_result(link)
        self._links.append(link)
        link.outbox.put(("serving", self.cluster.num_serving))  # in case it changed since the hello
        try:
            await link.serve()
        finally:
            self._links.remove(link)

    async def _start_one(self, index: int) -> int:
        """Start front end ``index`` and wait until it serves; its port."""
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[Link] = loop.create_future()
        self._waiting[index] = waiting
        argv = [sys.executable, "-m", "agent.service.frontend", "--link", os.path.join(self._dir, "link"),
                "--index", str(index), "--parent", str(os.getpid())]
        if not self._uvloop:
            argv.append("--no-uvloop")
        process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
        self.processes[index] = process
        exited: asyncio.Future[Any] = loop.create_task(process.wait())
        try:
            done, _ = await asyncio.wait([waiting, exited], timeout=START_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiting not in done:
                raise FrontendStartError(f"front end {index} exited with status {process.returncode} before it "
                                         "served" if exited in done else f"front end {index} did not connect in "
                                         f"{START_TIMEOUT_S:.0f} s")
            link = waiting.result()
            ready = await asyncio.wait_for(asyncio.shield(link.ready), START_TIMEOUT_S)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        finally:
            exited.cancel()
            self._waiting.pop(index, None)
        return ready

    async def _supervise(self, index: int) -> None:
        """Start front end ``index`` again whenever it dies (after the backoff's delays: 1 s, doubling to 60 s, from
        the first again once it serves), until the agent stops."""
        delays = self._restart_delays() if self._restart_delays is not None else None
        while not self._stopping:
            process = self.processes[index]
            assert process is not None
            status = await process.wait()
            if self._stopping:
                return
            if delays is None:
                self._say(f"front end {index} (PID {process.pid}) exited with status {status}: not started again")
                return
            delay = next(delays)
            self._say(f"front end {index} (PID {process.pid}) exited with status {status}: starting it again in "
                      f"{delay:.1f} s")
            await asyncio.sleep(delay)
            try:
                await self._start_one(index)
            except FrontendStartError as exc:
                self._say(f"front end {index} did not start again: {exc}")
                continue
            self.restarts[index] += 1
            assert self._restart_delays is not None
            delays = self._restart_delays()
            self._say(f"front end {index} serves again (PID {self.pids[index]})")

    def _push_serving(self, n: int) -> None:
        """Tell every front end how many units serve, when it changed (their ``/health`` and 503s)."""
        if n != self._serving:
            self._serving = n
            for link in self._links:
                link.outbox.put(("serving", n))

    async def stop(self) -> None:
        """Stop the front ends (SIGTERM: they stop taking connections and close theirs), abort what is in flight (no
        unit is restarted from here on: a Ctrl-C in a terminal reaches the engine cores too), close."""
        self._stopping = True
        with contextlib.suppress(ValueError):
            self.cluster.serving_listeners.remove(self._push_serving)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for process in self.processes:
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        await self.cluster.close()
        for process in self.processes:
            if process is not None:
                try:
                    await asyncio.wait_for(process.wait(), 10.0)
                except TimeoutError:
                    process.kill()
                    await process.wait()
        if self._server is not None:
            self._server.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


async def start_frontends(cluster: LiveCluster[Any], count: int, host: str, port: int, *, hub: Any,
                          say: Callable[[str], None], about: str = "", **options: Any) -> Frontends:
    """Start ``count`` front ends for ``cluster`` on ``host:port`` (``options``: :class:`Frontends`'), a front end's
    busy event loop alerted on ``hub``'s stream, and ``say`` where they serve (``about``: what else to say of them);
    :class:`FrontendStartError` where one did not start."""

    def loop_alert(index: int, verdict: Verdict, share: float | None, window_s: float, clear_share: float) -> None:
        hub.publish(alert(hub, verdict, share, window_s, clear_share, loop=f"front end {index}'s event loop",
                          advice=FRONTEND_ADVICE))

    frontends = Frontends(cluster, count, host, port, metrics=hub.metrics_text, say=say, on_loop=loop_alert,
                          **options)
    await frontends.start()
    say(f"OpenAI API at {frontends.base_url} ({count} front-end processes, PIDs "
        f"{', '.join(str(p) for p in frontends.pids)}{'; ' + about if about else ''})")
    return frontends
