"""The agent's OpenAI-compatible HTTP intake: vLLM's own OpenAI app in front of trackside's dispatcher.

vLLM 0.26.0's app (``vllm serve``'s, built by :mod:`agent.engine.vllm.openai_app`) renders every request: chat
with the model's chat template, text and token prompts, stop strings, logprobs, ``/tokenize``, ``/v1/models``,
``/health``, ``/version``. Its engine client is :class:`~agent.engine.vllm.engine_client.RoutedEngineClient`, whose
``generate`` queues each request at the :class:`~agent.runtime.live.cluster.LiveCluster`'s dispatcher: the
dispatch policy picks the unit, a migration or a failed unit moves it on by recompute, and the telemetry sees it
like any other request.

What trackside adds around vLLM's app (:class:`TracksideMiddleware`, plain ASGI):

* a request that was refused before reaching a unit gets a proper status instead of vLLM's generic error: 429
  with ``Retry-After`` when the admission control of the unit it was placed on refused it (FairBatching+PAB's
  admission budget), 503 with ``Retry-After`` when the dispatcher rejected it, no unit took it in time or no unit
  serves at all (every unit failed: vLLM's app is kept from stopping the server, as it does for a dead engine). For a
  streaming request the response's start is held until its first event, so the status can still change;
* response headers with where and how the request was served: ``x-trackside-node`` (the agent's node id, where
  several agents share one port), ``x-trackside-unit`` (the unit it is on when the
  response starts: for a stream, at its first event; a later migration does not change it),
  and on whole responses ``x-trackside-ttft-ms``, ``x-trackside-tpot-ms``, ``x-trackside-slo-met``;
* ``GET /metrics`` serves the agent's metrics (vLLM's ``vllm:`` names, one ``engine`` label per unit) instead of
  vLLM's route: vLLM's Prometheus logger unregisters every ``vllm:`` collector when an engine starts, so
  independent engines in one process would show only the last one's numbers.

Per-request SLOs: ``vllm_xargs: {"ttft_slo_ms": ..., "tpot_slo_ms": ...}`` in the request body (vLLM's field for
extensions). Usage: ``docs/openai-intake.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Generator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.engine.vllm.engine_client import Routed, RoutedEngineClient
from agent.engine.vllm.openai_app import build_openai_app, frontend_namespace
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.requests import ClusterRequest, RequestRejected, RequestStream
from agent.telemetry.client import host_port

log = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
"""Where requests go through the dispatcher (the paths :class:`TracksideMiddleware` looks after). A streamed
response of ``/v1/responses`` starts (``response.created``) before its request reaches the dispatcher, so it gets
neither the unit's header nor a refusal's status: a refusal ends that stream with vLLM's error event."""


@dataclass(slots=True)
class _Ticket:
    """The requests one HTTP request submitted (a completion with several prompts submits several)."""

    streams: list[Any] = field(default_factory=list)
    """``RequestStream`` s, or a front end's ``RemoteStream`` s: what :func:`refusal` and :func:`served_headers`
    read (``error``, ``unit_id``, ``outcome``)."""


_ticket: ContextVar[_Ticket | None] = ContextVar("trackside_http_ticket", default=None)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model vLLM's app renders requests for, where the units are not vLLM engines (simulated units:
    :mod:`agent.engine.vllm.sim_model`); vLLM units give their own (each unit's ``AsyncLLM``)."""

    engine: Any
    """What the engine client takes the model from (``vllm_config``, ``renderer``...; ``FrontendModel``)."""
    name: str
    """The model id clients name."""
    check: Callable[[Any], None] | None = None
    """Raises ``ValueError`` (400) for sampling parameters the units cannot serve."""


def refusal(streams: Sequence[RequestStream], default_retry_s: float) -> tuple[int, dict[str, Any], float] | None:
    """The HTTP status, OpenAI-style error body and ``Retry-After`` seconds for requests refused before reaching a
    unit; None when none was."""
    for stream in streams:
        err = stream.error
        if isinstance(err, RequestRejected):
            status = refusal_status(err) or 503
            kind = "RateLimitError" if status == 429 else "ServiceUnavailableError"
            body = {"error": {"message": str(err), "type": kind, "param": None, "code": status}}
            return status, body, err.retry_after_s or default_retry_s
    return None


def refusal_status(exc: BaseException) -> int | None:
    """The HTTP status of a request that ended with ``exc`` before reaching a unit: 429 for a unit's admission
    control, 503 for the dispatcher or the pending timeout; None for any other error."""
    if isinstance(exc, RequestRejected):
        return 429 if exc.refused_by is not None else 503
    return None


def served_headers(streams: Sequence[RequestStream]) -> list[tuple[bytes, bytes]]:
    """``x-trackside-*`` headers for a response to one request (none for several: see the telemetry)."""
    if len(streams) != 1:
        return []
    stream = streams[0]
    out: list[tuple[bytes, bytes]] = []
    if stream.unit_id is not None:
        out.append((b"x-trackside-unit", str(stream.unit_id).encode()))
    o = stream.outcome
    if o is not None:
        tpot, worst = o.tpot_s, o.tpot_by("worst")
        out += [(b"x-trackside-ttft-ms", f"{o.ttft_s * 1e3:.1f}".encode()),
                (b"x-trackside-tpot-ms", f"{(tpot or 0.0) * 1e3:.2f}".encode()),
                (b"x-trackside-max-tpot-ms", f"{(worst or 0.0) * 1e3:.2f}".encode()),
                (b"x-trackside-slo-met", b"true" if o.met_slo else b"false")]
    return out


class TracksideMiddleware:
    """Statuses for refused requests and ``x-trackside-*`` headers around vLLM's app (see the module)."""

    def __init__(self, app: ASGIApp, *, retry_after_s: float = 1.0, node_id: str | None = None,
                 frontend: int | None = None) -> None:
        self.app = app
        self.retry_after_s = retry_after_s
        self._node = [(b"x-trackside-node", node_id.encode())] if node_id else []
        if frontend is not None:
            self._node.append((b"x-trackside-frontend", str(frontend).encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in ROUTED_PATHS:
            await self.app(scope, receive, send)
            return
        ticket = _Ticket()
        token = _ticket.set(ticket)
        held: Message | None = None
        replaced = False

        async def send_(message: Message) -> None:
            nonlocal held, replaced
            if replaced:
                return
            if message["type"] == "http.response.start":
                held = message
                return
            if held is not None and message["type"] == "http.response.body":
                start, held = held, None
                refused = refusal(ticket.streams, self.retry_after_s)
                if refused is not None:
                    replaced = True
                    status, body, retry_s = refused
                    await send({"type": "http.response.start", "status": status, "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", str(max(1, math.ceil(retry_s))).encode()), *self._node,
                    ]})
                    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
                    return
                headers = [*start.get("headers", []), *self._node, *served_headers(ticket.streams)]
                if start["status"] == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    # (no unit serves: vLLM's app answered from the engine client's dead_error)
                    headers.append((b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode()))
                await send({**start, "headers": headers})
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception:
            if not replaced:
                raise
            log.debug("request refused before reaching a unit", exc_info=True)  # answered already
        finally:
            _ticket.reset(token)


def ticketed(submit: Callable[..., Routed]) -> Callable[..., Routed]:
    """``submit``, each routed request remembered for the HTTP request that made it (its status and headers,
    :class:`TracksideMiddleware`)."""

    def submit_(*args: Any, **kwargs: Any) -> Routed:
        routed = submit(*args, **kwargs)
        ticket = _ticket.get()
        if ticket is not None:
            ticket.streams.append(routed)
        return routed

    return submit_


def routed_submit(cluster: LiveCluster[Any], check: Callable[[Any], None] | None = None) -> Callable[..., Routed]:
    """The engine client's way into the cluster: each tokenized request is queued at the dispatcher with vLLM's
    sampling parameters, and remembered for the HTTP request that made it (its status and headers); ``check``
    raises ``ValueError`` (400) for parameters the units cannot serve."""

    def submit(request_id: str, prompt_token_ids: list[int], params: Any, *, ttft_slo_s: float | None,
               tpot_slo_s: float | None, arrival_s: float) -> Routed:
        return cluster.submit(ClusterRequest(request_id, prompt_token_ids, cluster_max_tokens(params),
                                             ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, arrival_s=arrival_s,
                                             params=params))

    return ticketed(checked(submit, check))


def checked(submit: Callable[..., Routed], check: Callable[[Any], None] | None) -> Callable[..., Routed]:
    """``submit`` that first runs ``check`` on the sampling parameters (its ``ValueError``: 400, before the request
    goes anywhere); ``submit`` itself without one (vLLM units: no call per request)."""
    if check is None:
        return submit

    def submit_(request_id: str, prompt_token_ids: list[int], params: Any, **slos: Any) -> Routed:
        check(params)
        return submit(request_id, prompt_token_ids, params, **slos)

    return submit_


def cluster_max_tokens(params: Any) -> int:
    """The output length a request of vLLM's ``SamplingParams`` may reach (vLLM's default, 16, when unset)."""
    return int(params.max_tokens) if params.max_tokens is not None else 16


async def build_app(cluster: LiveCluster[Any], *, model_name: str | None = None, frontend_args: Sequence[str] = (),
                    metrics: Callable[[], str] | None = None, args: argparse.Namespace | None = None,
                    node_id: str | None = None, model: ServedModel | None = None) -> ASGIApp:
    """vLLM's OpenAI app over ``cluster`` (started units), wrapped in :class:`TracksideMiddleware`: what
    :class:`OpenAIServer` serves (see it for the arguments); ``args``: ``frontend_args`` parsed already."""
    engines: Callable[[], Sequence[Any]] = ((lambda: [model.engine]) if model is not None
                                            else (lambda: [u.llm for u in cluster.units]))
    client = RoutedEngineClient(engines, routed_submit(cluster, model.check if model is not None else None),
                                lambda: cluster.num_serving, refusal=refusal_status)
    name = model_name or (model.name if model is not None else cluster.units[0].options.model)
    if args is None:
        args = frontend_namespace(str(client.model_config.model), name, frontend_args)
    return await routed_app(client, args, metrics=metrics, retry_after_s=max(1.0, cluster.ttft_slo_s),
                            node_id=node_id)


async def routed_app(client: RoutedEngineClient, args: argparse.Namespace, *,
                     metrics: Callable[[], str | Awaitable[str]] | None, retry_after_s: float,
                     node_id: str | None, frontend: int | None = None) -> ASGIApp:
    """vLLM's OpenAI app over ``client``, ``/metrics`` serving ``metrics()`` (None: vLLM's route), wrapped in
    :class:`TracksideMiddleware`; ``frontend``: the front-end process's index, for its header."""
    app = await build_openai_app(client, args)
    if metrics is not None:
        from starlette.responses import PlainTextResponse

        render = metrics

        async def metrics_route() -> PlainTextResponse:
            # A coroutine, so that it runs on the loop's thread with the hub it reads (FastAPI runs a plain
            # function endpoint in a worker thread: the hub's flush there raced the loop's own telemetry).
            text = render()
            if not isinstance(text, str):
                text = await text
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/metrics"]
        app.add_api_route("/metrics", metrics_route, methods=["GET"], include_in_schema=False)
    app.state.trackside_client = client
    return TracksideMiddleware(app, retry_after_s=retry_after_s, node_id=node_id, frontend=frontend)


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to serve on. Made with ``IPPROTO_TCP`` as its protocol, as
    asyncio's own ``create_server`` makes them: asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on
    connections whose socket says so. A socket made with protocol 0 left Nagle on for every connection, so a small
    write that followed another (the first SSE chunk after the response's headers) could wait for the client's
    delayed ACK, up to 40 ms on Linux: the TTFT tail of docs/vllm.md (found 2026-11-26).

    ``reuse_port``: ``SO_REUSEPORT``, so that other processes of the same user can bind the same address; Linux then
    spreads incoming connections between the sockets (``--openai-reuse-port``: several agents of one node behind one
    port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class EmbeddedServer(uvicorn.Server):
    """uvicorn's server, embedded in the agent's event loop: it leaves SIGINT and SIGTERM to the agent.

    uvicorn's own ``serve`` replaces both handlers while it runs (``Server.capture_signals``, main thread only), stops
    on its own when one comes, and on its way out puts back the handlers it found and raises the signal again. In the
    agent the signal belongs to the agent's shutdown (``agent.service.launch``: the units, the telemetry's drain, then
    :meth:`OpenAIServer.stop`), which stops this server too; a signal taken and raised again by the server is a second
    path into it, and one that ends the process with the default action (exit status 143) should the handler it puts
    back be the default one by then."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class AppServer:
    """uvicorn serving an ASGI app on a loopback (or given) address, in the running loop: the part of the OpenAI
    intake that does not depend on where the units are (in this process: :class:`OpenAIServer`; in the main process,
    for a front-end process: ``agent.service.frontend``).

    ``reuse_port``: the port may be shared with other processes (``listening_socket``); ``follow_units``: let it go
    while no unit serves (:meth:`_follow_units`); ``say``: where a shared port's changes are told (default: this
    module's log, at warning).
    """

    def __init__(self, host: str, port: int, *, reuse_port: bool = False, follow_units: bool = False,
                 log_level: str = "warning", say: Callable[[str], None] | None = None) -> None:
        self.app: Any = None
        """The ASGI app served (set by :meth:`start`)."""
        self._sock = listening_socket(host, port, reuse_port)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        """The bound port (the one the OS chose for ``port=0``)."""
        self._log_level = log_level
        self._follow_units_on = follow_units
        self._say = say or log.warning
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self.accepting = False
        """Whether the port takes new connections (a shared port is let go while no unit serves)."""

    @property
    def base_url(self) -> str:
        return f"http://{host_port(self.host, self.port)}/v1"

    def serving(self) -> int:
        """How many units serve now."""
        raise NotImplementedError

    async def build(self) -> ASGIApp:
        """The app to serve (called once, by :meth:`start`)."""
        raise NotImplementedError

    async def close_units(self) -> None:
        """What :meth:`stop` does between stopping the server's intake and awaiting it (abort what is in flight)."""

    async def start(self) -> None:
        """Serve in the background; returns once the server accepts connections."""
        self.app = await self.build()
        self._server = EmbeddedServer(uvicorn.Config(self.app, log_level=self._log_level, lifespan="off",
                                                     timeout_graceful_shutdown=2))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.accepting = True
        if self._follow_units_on:
            self._follow = asyncio.get_running_loop().create_task(self._follow_units())

    async def _follow_units(self, interval_s: float = 0.25) -> None:
        """On a port shared with other agents: stop taking connections while none of the units serves, so that the
        kernel gives them to the other agents on the port, and take them again once one serves (an agent on a port
        of its own keeps it and answers 503). The connections it holds are closed when it lets the port go, as
        uvicorn's graceful shutdown closes them (an idle one at once, a busy one after its response), so that a
        client that keeps its connection open comes back on a new one, which another agent takes."""
        assert self._server is not None
        while True:
            await asyncio.sleep(interval_s)
            serving = self.serving() > 0
            if self.accepting and not serving:
                for server in self._server.servers:
                    server.close()  # its listening socket only: connections stay open
                for connection in list(self._server.server_state.connections):
                    connection.shutdown()
                self.accepting = False
                self._say(f"no unit serves: OpenAI port {self.port} let go, the other agents on it take its "
                          "connections")
            elif serving and not self.accepting:
                try:
                    sock = listening_socket(self.host, self.port, reuse_port=True)
                except OSError as exc:  # taken meanwhile by a process that does not share it: try again
                    self._say(f"cannot take OpenAI port {self.port} again: {exc.strerror or exc}")
                    await asyncio.sleep(5.0)
                    continue
                self._sock = sock
                await self._server.startup(sockets=[self._sock])
                self.accepting = True
                self._say(f"a unit serves again: OpenAI port {self.port} taken again")

    async def stop(self) -> None:
        """Stop accepting, abort what is in flight, close."""
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        if self._server is not None:
            self._server.should_exit = True
        await self.close_units()
        if self._task is not None:
            await self._task
        self._sock.close()


class OpenAIServer(AppServer):
    """vLLM's OpenAI app over the cluster, served in the agent's own process (see :class:`AppServer`).

    ``frontend_args``: ``vllm serve`` front-end flags (``--chat-template``, ``--api-key``...), checked by vLLM;
    ``metrics``: the text ``GET /metrics`` serves (the agent's; None keeps vLLM's route).
    ``reuse_port``: the port may be shared with other agents, and is let go while no unit serves; ``node_id``: the
    agent's, in each routed response's ``x-trackside-node`` header; ``model``: what the app renders requests for when
    the units are not vLLM engines (None: the units' own).
    """

    def __init__(self, cluster: LiveCluster[Any], host: str = "127.0.0.1", port: int = 8000, *,
                 model_name: str | None = None, frontend_args: Sequence[str] = (),
                 metrics: Callable[[], str] | None = None, log_level: str = "warning",
                 reuse_port: bool = False, node_id: str | None = None,
                 say: Callable[[str], None] | None = None, model: ServedModel | None = None) -> None:
        self.cluster = cluster
        self.model = model
        self.model_name = model_name or (model.name if model is not None else cluster.units[0].options.model)
        engine = model.engine if model is not None else cluster.units[0].llm
        # Parsed once, here: bad flags fail before the port is bound.
        self._args = frontend_namespace(str(engine.model_config.model), self.model_name, frontend_args)
        self._metrics = metrics
        self._node_id = node_id
        super().__init__(host, port, reuse_port=reuse_port, follow_units=reuse_port, log_level=log_level, say=say)

    def serving(self) -> int:
        return self.cluster.num_serving

    async def build(self) -> ASGIApp:
        self.cluster.start()
        return await build_app(self.cluster, model_name=self.model_name, args=self._args, metrics=self._metrics,
                               node_id=self._node_id, model=self.model)

    async def close_units(self) -> None:
        await self.cluster.close()
