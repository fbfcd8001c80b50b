"""The harness of the OpenAI intake's tests (``test_vllm_openai.py``): two whole vLLM engines (fake executor, the
tiny model's tokenizer) behind a dispatcher and the HTTP intake, on an event loop in a thread of their own, served
from that loop or from front-end processes linked to it; helpers and test dispatchers. The fixtures are in this
folder's ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import openai

from agent.engine.base import RequestOutcome
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import cpu_vllm_config
from agent.engine.vllm.fake_executor import FakeExecutor
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.tiny_tokenizer import FAKE_TOKEN_TEXT
from agent.engine.vllm.unit import VllmUnit
from agent.runtime.live.cluster import LiveCluster
from agent.service.frontends import Frontends
from agent.service.openai_server import OpenAIServer
from policies.base import DispatchPolicy
from policies.registry import DISPATCH_POLICIES
from policies.types import DispatchDecision, PendingRequest, UnitLoad

T = TypeVar("T")
MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
TIMEOUT_S = 20.0
METRICS = "# trackside test\ntrackside_test_total 1\n"
OK = FAKE_TOKEN_TEXT


class Served:
    """Two fake-executor units, a least_loaded cluster and the HTTP server, on a loop in a background thread: served
    from that loop, or (``frontends`` > 0) from that many front-end processes linked to it."""

    def __init__(self, frontends: int = 0) -> None:
        self.frontends = frontends
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="openai-server", daemon=True)
        self._thread.start()
        self.units: list[VllmUnit] = []
        self.metrics_threads: list[threading.Thread] = []
        self.call(self._start)

    async def _start(self) -> None:
        for i in range(2):
            config = cpu_vllm_config(num_blocks=400, max_model_len=MAX_MODEL_LEN, step_model=(0.002, 2e-6, 1e-8),
                                     tokenizer=True)
            unit = VllmUnit(i, EngineOptions(model=MODEL, max_num_batched_tokens=512, max_num_seqs=32),
                            UnitSettings(policy="vllm"), vllm_config=config, executor_class=FakeExecutor)
            unit.start()
            self.units.append(unit)
        self.cluster = LiveCluster(self.units, DISPATCH_POLICIES["least_loaded"](), ttft_slo_s=0.5, tpot_slo_s=0.05)
        self.server: OpenAIServer | Frontends
        if self.frontends:
            self.server = Frontends(self.cluster, self.frontends, "127.0.0.1", 0, model_name=MODEL,
                                    metrics=self._metrics)
        else:
            self.server = OpenAIServer(self.cluster, "127.0.0.1", 0, model_name=MODEL, metrics=self._metrics)
        await self.server.start()

    def _metrics(self) -> str:
        self.metrics_threads.append(threading.current_thread())
        return METRICS

    async def _stop(self) -> None:
        await self.server.stop()
        for u in self.units:
            await u.stop()

    def close(self) -> None:
        try:
            self.call(self._stop)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a plain function or a coroutine function) on the server's loop; returns its result."""
        async def run() -> Any:
            out = fn()
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=60)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=TIMEOUT_S, **kwargs)

    def outcome(self, request_id_part: str) -> RequestOutcome:
        """The outcome (on either unit) of the request whose id contains ``request_id_part`` (vLLM's app prefixes
        the ``x-request-id`` header's value)."""
        found: list[RequestOutcome] = self.call(
            lambda: [o for u in self.units for o in u.outcomes if request_id_part in o.request_id])
        assert len(found) == 1, found
        return found[0]

    def set_attr(self, obj: object, name: str, value: Any) -> Any:
        """Set ``obj.name`` on the server's loop; returns the old value."""
        def swap() -> Any:
            old = getattr(obj, name)
            setattr(obj, name, value)
            return old

        return self.call(swap)


def poll(what: Callable[[], T], timeout_s: float = TIMEOUT_S, interval_s: float = 0.01) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def ids(n: int, start: int = 300) -> list[int]:
    """A token-id prompt of letter pairs (ids 300-999). Not byte tokens: vLLM's incremental detokenizer (the
    ``tokenizers`` ``DecodeStream`` it primes with the prompt) puts a prompt that ends in an incomplete UTF-8
    sequence in front of the first output's text."""
    return [start + i % 700 for i in range(n)]


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def data_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream's ``data:`` lines, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            return
        yield json.loads(payload)


# -- test dispatchers -------------------------------------------------------------------------------
class Pin(DispatchPolicy):
    """Everything to one unit."""

    name = "pin"

    def __init__(self, unit_id: int) -> None:
        super().__init__()
        self.unit_id = unit_id

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        return DispatchDecision(assignments=tuple((p.request_id, self.unit_id) for p in pending))


class Hold(DispatchPolicy):
    """Keeps every request pending."""

    name = "hold"

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        return DispatchDecision()


class After(DispatchPolicy):
    """Holds each request ``delay_s`` after its arrival, then places it on unit 0: wakes only by ``next_check_s``."""

    name = "after"

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        due = tuple((p.request_id, 0) for p in pending if p.arrival_s + self.delay_s <= now_s)
        later = [p.arrival_s + self.delay_s for p in pending if p.arrival_s + self.delay_s > now_s]
        return DispatchDecision(assignments=due, next_check_s=min(later) if later else None)


class RejectAll(DispatchPolicy):
    name = "reject_all"

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        return DispatchDecision(rejected=tuple(p.request_id for p in pending))
