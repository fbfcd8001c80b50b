"""OpenAI-compatible HTTP intake for a :class:`~agent.runtime.vllm.cluster.VllmCluster` (FastAPI + uvicorn).

``POST /v1/completions`` (whole responses or ``stream: true`` server-sent events), ``GET /v1/models``,
``GET /health``. Each request waits at the cluster's dispatcher, which picks its unit; the response (or, when
streaming, the response headers) is held until the request has its first token, so that a rejection (503), a
request vLLM refuses (400) or a failure before the first token gets a proper status. A client that goes away
aborts its request: off the dispatcher's queue while pending, ``AsyncLLM.abort`` (KV freed) on a unit.
Request and response fields: :mod:`agent.service.openai_protocol`; usage: ``docs/openai-intake.md``.

Try it on a CPU (fake executor, no model)::

    python -m agent.service.openai_server --fake --units 2 --dispatch least_loaded \\
        --batch-policy fairbatching --listen 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from agent.engine.base import RequestOutcome
from agent.engine.vllm.sampling import TokenDelta
from agent.engine.vllm.unit import VllmUnit, sampling_params
from agent.runtime.vllm.cluster import VllmCluster
from agent.runtime.vllm.requests import ClusterRequest, RequestAborted, RequestRejected, RequestStream
from agent.service import openai_protocol as proto
from agent.service.openai_protocol import ApiError, CompletionParams, ModelInfo

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


def model_info(cluster: VllmCluster, name: str | None = None, aliases: tuple[str, ...] = ()) -> ModelInfo:
    """The model as the first unit's engine has it (all units of a cluster serve the same model)."""
    llm = cluster.units[0].llm
    if llm is None:
        raise RuntimeError("start the units before serving them")
    cfg = llm.model_config
    vocab = int(cfg.get_vocab_size())
    tokenizer = llm.tokenizer
    if tokenizer is not None:
        vocab = max(vocab, int(tokenizer.max_token_id) + 1)
    served = getattr(cfg, "served_model_name", None)
    name = name or (served if isinstance(served, str) else None) or cluster.units[0].options.model
    return ModelInfo(name=name, max_model_len=int(cfg.max_model_len), vocab_size=vocab,
                     has_tokenizer=tokenizer is not None, created=int(time.time()),
                     aliases=tuple(a for a in (*aliases, str(cfg.model)) if a != name))


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the ASGI server sends ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``await work``, or raise :class:`ClientGone` (cancelling it) if the client goes first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone


class _EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends (a disconnect cancels the sender)."""

    def __init__(self, events: AsyncIterator[bytes], request_stream: RequestStream) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._request_stream = request_stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._request_stream.abort():
                log.info("client gone: aborted %s", self._request_stream.request_id)


class CompletionsHandler:
    """``/v1/completions`` over a cluster: checks, tokenizes, submits, answers."""

    def __init__(self, cluster: VllmCluster, model: ModelInfo, tokenizer: Any = None) -> None:
        self.cluster = cluster
        self.model = model
        self.tokenizer = tokenizer

    async def handle(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(ApiError(f"the request body is not valid JSON: {exc}"))
        try:
            params = proto.parse_completion(body, self.model)
            ids = params.prompt_token_ids
            if ids is None:
                assert params.prompt_text is not None and self.tokenizer is not None
                ids = list(self.tokenizer.encode(params.prompt_text))
            max_tokens = proto.check_prompt_tokens(ids, params.max_tokens, self.model)
            try:
                sampling_params(max_tokens, params.sampling)  # vLLM's own range checks, before dispatching
            except (ValueError, TypeError) as exc:
                raise ApiError(str(exc), param=getattr(exc, "parameter", None)) from None
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            if rid in self.cluster.streams:
                raise ApiError(f"request id {rid!r} (x-request-id) is already in flight", param="x-request-id")
        except ApiError as err:
            return _error(err)
        stream = self.cluster.submit(ClusterRequest(
            rid, ids, max_tokens, ttft_slo_s=params.ttft_slo_s, tpot_slo_s=params.tpot_slo_s,
            sampling=params.sampling,
        ))
        response_id = f"cmpl-{rid}"
        created = int(time.time())
        try:
            first = await _unless_gone(request, _first(stream))
        except ClientGone:
            if stream.abort():
                log.info("client gone: aborted %s", rid)
            return Response(status_code=499)
        except Exception as exc:
            return _error(_api_error(exc))
        if params.stream:
            return _EventStream(self._events(stream, first, params, ids, response_id, created), stream)
        try:
            deltas = await _unless_gone(request, _rest(stream, first))
            outcome = await stream.wait()
        except ClientGone:
            if stream.abort():
                log.info("client gone: aborted %s", rid)
            return Response(status_code=499)
        except Exception as exc:
            return _error(_api_error(exc))
        token_ids = [t for d in deltas for t in d.token_ids]
        last = deltas[-1] if deltas else TokenDelta(())
        with_ids = params.return_token_ids or not self.model.has_tokenizer
        choice = proto.choice(
            "".join(d.text for d in deltas), token_ids=token_ids if with_ids else None,
            finish_reason=last.finish_reason, stop_reason=last.stop_reason,
            prompt_token_ids=ids if params.return_token_ids else None,
        )
        return JSONResponse(proto.completion(
            response_id, created, self.model.name, [choice], proto.usage(len(ids), len(token_ids)),
            _served(stream, outcome),
        ))

    async def _events(self, stream: RequestStream, first: TokenDelta | None, params: CompletionParams,
                      ids: list[int], response_id: str, created: int) -> AsyncIterator[bytes]:
        with_ids = params.return_token_ids or not self.model.has_tokenizer
        name = self.model.name
        generated = 0
        prompt_ids: list[int] | None = ids if params.return_token_ids else None
        try:
            delta = first
            while delta is not None:
                generated += len(delta.token_ids)
                chunk = proto.choice(delta.text, token_ids=delta.token_ids if with_ids else None,
                                     finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                     prompt_token_ids=prompt_ids)
                prompt_ids = None  # the first chunk only, as vLLM does
                use = proto.usage(len(ids), generated) if params.continuous_usage else None
                yield proto.sse(proto.completion(response_id, created, name, [chunk], use))
                delta = await anext(stream, None)
            outcome = await stream.wait()
            if params.include_usage:
                yield proto.sse(proto.completion(response_id, created, name, [], proto.usage(len(ids), generated),
                                                 _served(stream, outcome)))
        except Exception as exc:  # a disconnect cancels (CancelledError passes)
            yield proto.sse(_api_error(exc).body())
        yield proto.sse("[DONE]")


async def _first(stream: RequestStream) -> TokenDelta | None:
    return await anext(stream, None)


async def _rest(stream: RequestStream, first: TokenDelta | None) -> list[TokenDelta]:
    out = [] if first is None else [first]
    async for delta in stream:
        out.append(delta)
    return out


def _api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRejected):
        return ApiError(f"{exc}: the server is at capacity, retry later", status=503)
    if isinstance(exc, RequestAborted):
        return ApiError(f"{exc} (the server is shutting down)", status=503)
    if isinstance(exc, ValueError):
        return ApiError(f"the engine refused the request: {exc}")
    log.exception("request failed", exc_info=exc)
    return ApiError(f"the engine failed the request: {type(exc).__name__}: {exc}", status=500)


def _served(stream: RequestStream, outcome: RequestOutcome) -> dict[str, Any]:
    """Our ``trackside`` response field: the unit, the measured TTFT/TPOT and the request's SLOs."""
    tpot = outcome.tpot_s
    return {"unit_id": stream.unit_id, "ttft_ms": round(outcome.ttft_s * 1e3, 3),
            "tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
            "ttft_slo_ms": round(outcome.ttft_slo_s * 1e3, 3), "tpot_slo_ms": round(outcome.tpot_slo_s * 1e3, 3),
            "met_slo": bool(outcome.met_slo)}


def build_app(cluster: VllmCluster, model: ModelInfo, tokenizer: Any = None) -> FastAPI:
    """The ASGI app (no server): ``/v1/completions``, ``/v1/models``, ``/health``."""
    app = FastAPI(title="trackside", docs_url=None, redoc_url=None, openapi_url=None)
    handler = CompletionsHandler(cluster, model, tokenizer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handler.handle(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(proto.models(model))

    @app.get("/health")
    async def health() -> Response:
        if not cluster.num_serving:  # a failed unit is out of the dispatcher's choice: the others serve on
            return _error(ApiError(f"no unit serves ({len(cluster.failed)} failed)", status=503))
        return Response(status_code=200)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(ApiError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(ApiError(str(exc)))

    return app


class OpenAIServer:
    """uvicorn serving :func:`build_app` on a loopback (or given) address, inside the running event loop."""

    def __init__(self, cluster: VllmCluster, host: str = "127.0.0.1", port: int = 8000, *,
                 model_name: str | None = None, log_level: str = "warning") -> None:
        self.cluster = cluster
        self.model = model_info(cluster, model_name)
        tokenizer = cluster.units[0].llm.tokenizer
        self.app = build_app(cluster, self.model, tokenizer)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        """The bound port (the one the OS chose for ``port=0``)."""
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, lifespan="off",
                                                     timeout_graceful_shutdown=2))
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        """Serve in the background; returns once the server accepts connections."""
        self.cluster.start()
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, abort what is in flight, close."""
        self._server.should_exit = True
        await self.cluster.close()
        if self._task is not None:
            await self._task
        self._sock.close()

    async def serve(self) -> None:
        """Serve until cancelled."""
        await self.start()
        try:
            assert self._task is not None
            await asyncio.shield(self._task)
        finally:
            await self.stop()


async def serve_openai(cluster: VllmCluster, host: str = "127.0.0.1", port: int = 8000, *,
                       model_name: str | None = None) -> None:
    """Serve the cluster's units over the OpenAI API until cancelled (the units must be started)."""
    server = OpenAIServer(cluster, host, port, model_name=model_name)
    log.info("serving %s on %s (%d unit(s), dispatch %s)", server.model.name, server.base_url, len(cluster.units),
             cluster.dispatcher.name)
    await server.serve()


# -- trying it out --------------------------------------------------------------------------------
def _parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return (host.strip("[]") or "127.0.0.1"), int(port)


async def _main(args: argparse.Namespace) -> None:
    from agent.engine.vllm.config import UnitSettings
    from agent.engine.vllm.unit import EngineOptions
    from policies.registry import batch_policy_class, dispatch_policy_class

    dispatcher = dispatch_policy_class(args.dispatch)()  # unknown names fail before any engine starts
    if args.batch_policy != "plain":
        batch_policy_class(args.batch_policy)
    units: list[VllmUnit] = []
    try:
        for i in range(args.units):
            kwargs: dict[str, Any] = {}
            if args.fake:
                from agent.engine.vllm.cpu import cpu_vllm_config
                from agent.engine.vllm.fake_executor import FakeExecutor

                kwargs = {"vllm_config": cpu_vllm_config(), "executor_class": FakeExecutor}
            options = EngineOptions(model=args.model or "tiny-llama-fake", load_format=args.load_format,
                                    gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager,
                                    max_model_len=args.max_model_len, plain=args.batch_policy == "plain",
                                    extra={"skip_tokenizer_init": False} if args.tokenizer else {})
            settings = UnitSettings(policy="vllm" if options.plain else args.batch_policy,
                                    ttft_slo_s=args.ttft_slo_ms / 1e3, tpot_slo_s=args.tpot_slo_ms / 1e3)
            unit = VllmUnit(i, options, settings, **kwargs)
            units.append(unit)
            unit.start()
        cluster = VllmCluster(units, dispatcher, ttft_slo_s=args.ttft_slo_ms / 1e3,
                              tpot_slo_s=args.tpot_slo_ms / 1e3)
        host, port = _parse_listen(args.listen)
        await serve_openai(cluster, host, port,
                           model_name=args.served_model_name or ("tiny-llama-fake" if args.fake else None))
    finally:
        for u in units:
            await u.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.service.openai_server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (default %(default)s)")
    ap.add_argument("--units", type=int, default=1, help="engines (each its own engine-core process)")
    ap.add_argument("--dispatch", default="least_loaded", help="dispatch policy (default %(default)s)")
    ap.add_argument("--batch-policy", default="vllm", help="batch policy of every unit, or 'plain' (vLLM's own)")
    ap.add_argument("--ttft-slo-ms", type=float, default=500.0, help="SLO of a request that names none")
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--fake", action="store_true", help="CPU: tiny model config, fake executor (no GPU, no model)")
    ap.add_argument("--model", help="model folder or name (GPU)")
    ap.add_argument("--served-model-name", help="the id clients name (default: --model)")
    ap.add_argument("--load-format", default="auto", help="'dummy': random weights")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="per unit: share the GPU")
    ap.add_argument("--max-model-len", type=int, default=16384, help="GPU (the fake model has 4096)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    ap.add_argument("--tokenizer", action="store_true",
                    help="load the model's tokenizer: text prompts, text back (default: token ids only)")
    args = ap.parse_args(argv)
    if args.fake and args.tokenizer:
        ap.error("--fake serves a model without a tokenizer")
    if not args.fake and not args.model:
        ap.error("give --model DIR (GPU) or --fake (CPU)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
