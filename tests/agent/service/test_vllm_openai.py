"""The OpenAI-compatible HTTP intake end to end on the CPU: two whole vLLM engines (fake executor) behind a
dispatcher, uvicorn on a loopback port, and the real ``openai`` client (or httpx where the raw bytes matter).

The server, its cluster and its units live on an event loop in a thread of their own; tests reach into that
loop (:meth:`Served.call`) to swap the dispatcher or read what the units saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("vllm")

import httpx
import openai

from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import TINY_LLAMA, cpu_vllm_config
from agent.engine.vllm.fake_executor import TOKEN_ID, FakeExecutor
from agent.engine.vllm.unit import EngineOptions, VllmUnit
from agent.runtime.vllm.cluster import VllmCluster
from agent.service.openai_server import OpenAIServer
from policies.base import DispatchPolicy
from policies.registry import DISPATCH_POLICIES
from policies.types import DispatchDecision, PendingRequest, UnitLoad

pytestmark = pytest.mark.vllm

T = TypeVar("T")
MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
TIMEOUT_S = 20.0


class Served:
    """Two fake-executor units, a least_loaded cluster and the HTTP server, on a loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="openai-server", daemon=True)
        self._thread.start()
        self.units: list[VllmUnit] = []
        self.call(self._start)

    async def _start(self) -> None:
        for i in range(2):
            config = cpu_vllm_config(num_blocks=400, max_model_len=MAX_MODEL_LEN, step_model=(0.002, 2e-6, 1e-8))
            unit = VllmUnit(i, EngineOptions(model=MODEL, max_num_batched_tokens=512, max_num_seqs=32),
                            UnitSettings(policy="vllm"), vllm_config=config, executor_class=FakeExecutor)
            unit.start()
            self.units.append(unit)
        self.cluster = VllmCluster(self.units, DISPATCH_POLICIES["least_loaded"](), ttft_slo_s=0.5, tpot_slo_s=0.05)
        self.server = OpenAIServer(self.cluster, "127.0.0.1", 0, model_name=MODEL)
        await self.server.start()

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

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kwargs)

    def use_dispatcher(self, dispatcher: DispatchPolicy) -> DispatchPolicy:
        old: DispatchPolicy = self.call(lambda: self.cluster.dispatcher)

        def swap() -> None:
            self.cluster.dispatcher = dispatcher

        self.call(swap)
        return old


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def dispatcher(served: Served) -> Iterator[Callable[[DispatchPolicy], None]]:
    """Swap the cluster's dispatcher for one test."""
    old: list[DispatchPolicy] = []

    def use(d: DispatchPolicy) -> None:
        old.append(served.use_dispatcher(d))

    yield use
    if old:
        served.use_dispatcher(old[0])


def poll(what: Callable[[], T], timeout_s: float = TIMEOUT_S, interval_s: float = 0.01) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def ids(n: int, start: int = 10) -> list[int]:
    return [start + i % 900 for i in range(n)]


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


# -- the tests --------------------------------------------------------------------------------------
def test_models_and_health(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra is not None and models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(served.base_url.removesuffix("/v1") + "/health").status_code == 200


def test_completion_with_a_token_id_prompt(served: Served) -> None:
    prompt = ids(100)
    out = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text == "" and choice.finish_reason == "length"
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == [TOKEN_ID] * 12
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (100, 12, 112)
    served_by = (out.model_extra or {})["trackside"]
    assert served_by["unit_id"] in (0, 1)
    assert served_by["ttft_slo_ms"] == 500.0 and served_by["tpot_slo_ms"] == 50.0  # the server's defaults
    assert served_by["ttft_ms"] > 0


def test_default_max_tokens_and_per_request_slos(served: Served) -> None:
    out = served.client().completions.create(
        model=MODEL, prompt=[ids(5)], extra_body={"trackside": {"ttft_slo_ms": 1234, "tpot_slo_ms": 20},
                                                   "ignore_eos": True, "return_token_ids": True,
                                                   "temperature": 0.0, "seed": 3, "top_p": 0.9},
    )
    extra = out.choices[0].model_extra or {}
    assert extra["token_ids"] == [TOKEN_ID] * 16  # OpenAI's default max_tokens
    assert extra["prompt_token_ids"] == ids(5)
    served_by = (out.model_extra or {})["trackside"]
    assert (served_by["ttft_slo_ms"], served_by["tpot_slo_ms"]) == (1234.0, 20.0)


def test_streaming(served: Served) -> None:
    chunks = list(served.client().completions.create(
        model=MODEL, prompt=ids(64), max_tokens=20, stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) >= 2, "tokens arrive in several chunks"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert with_choices[-1].choices[0].finish_reason == "length"
    tokens = [t for c in with_choices for t in (c.choices[0].model_extra or {})["token_ids"]]
    assert tokens == [TOKEN_ID] * 20
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert not last.choices and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (64, 20)
    assert (last.model_extra or {})["trackside"]["unit_id"] in (0, 1)


def test_stream_is_server_sent_events_ending_with_done(served: Served) -> None:
    with httpx.stream("POST", served.base_url + "/completions",
                      json={"model": MODEL, "prompt": ids(8), "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


TOO_LONG = ids(MAX_MODEL_LEN)


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"model": MODEL}, 400, "prompt", "required"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": [1, 2], "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ({"prompt": TOO_LONG, "max_tokens": 1}, 400, "prompt", "maximum context length is 4096"),
    ({"prompt": ids(4000), "max_tokens": 200}, 400, "max_tokens", "maximum context length is 4096"),
    ({"prompt": "Once upon a time"}, 400, "prompt", "without a tokenizer"),
    ({"prompt": [1, 2.5]}, 400, "prompt", "token ids"),
    ({"prompt": [1, 5000]}, 400, "prompt", "vocabulary"),
    ({"prompt": [[1, 2], [3, 4]]}, 400, "prompt", "one prompt per request"),
    ({"prompt": [1, 2], "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": [1, 2], "temperature": 7}, 400, "temperature", "temperature"),
    ({"prompt": [1, 2], "n": 2}, 400, "n", "not supported"),
    ({"prompt": [1, 2], "logprobs": 3}, 400, "logprobs", "not supported"),
    ({"prompt": [1, 2], "max_token": 3}, 400, "max_token", "unrecognized"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"prompt": [1, 2], "trackside": {"ttft_slo_ms": -1}}, 400, "trackside.ttft_slo_ms", "positive"),
    ({"prompt": [1, 2], "trackside": {"ttft": 1}}, 400, "trackside", "unknown"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model", "does not exist"),
])
def test_bad_requests_get_an_openai_error(served: Served, body: dict[str, Any], status: int, param: str,
                                          words: str) -> None:
    r = httpx.post(served.base_url + "/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert words in error["message"]


def test_bad_json_and_unknown_paths(served: Served) -> None:
    r = httpx.post(served.base_url + "/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.base_url + "/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.get(served.base_url + "/chat/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_the_openai_client_raises_with_the_message(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
        served.client().completions.create(model=MODEL, prompt="hello", max_tokens=2)


def test_rejected_requests_get_503(served: Served, dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(RejectAll())
    with pytest.raises(openai.InternalServerError) as info:
        served.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert info.value.status_code == 503
    r = httpx.post(served.base_url + "/completions", json={"prompt": [1, 2], "stream": True})
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "reject_all dispatcher rejected" in error["message"]


def test_the_dispatcher_is_asked_again_at_its_next_check(served: Served,
                                                         dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(After(0.3))
    out = served.client().completions.create(model=MODEL, prompt=ids(10), max_tokens=2)
    served_by = (out.model_extra or {})["trackside"]
    assert served_by["unit_id"] == 0 and served_by["ttft_ms"] >= 300  # the wait at the dispatcher counts


def test_two_units_both_serve_under_least_loaded(served: Served) -> None:
    client = served.client()

    def one(i: int) -> int:
        out = client.completions.create(model=MODEL, prompt=ids(200, start=10 + i), max_tokens=40)
        return int((out.model_extra or {})["trackside"]["unit_id"])

    with ThreadPoolExecutor(6) as pool:
        units = list(pool.map(one, range(6)))
    assert set(units) == {0, 1}, units


def test_disconnect_mid_stream_aborts_and_frees_kv(served: Served,
                                                   dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(Pin(1))
    unit = served.units[1]
    rid = f"abort-{uuid.uuid4().hex[:8]}"
    prompt_blocks = 1000 // 16
    mark = served.call(lambda: len(unit.records))
    with httpx.Client(timeout=TIMEOUT_S) as http, http.stream(
        "POST", served.base_url + "/completions", headers={"x-request-id": rid},
        json={"model": MODEL, "prompt": ids(1000), "max_tokens": 3000, "stream": True},
    ) as r:
        assert r.status_code == 200
        # Keep the iterator: leaving it (a break in a for loop) closes the connection at once.
        lines = r.iter_lines()
        assert sum(next(lines).startswith("data: ") for _ in range(9)) == 5
        # decoding on unit 1, holding the prompt's KV
        poll(lambda: served.call(lambda: any(r.kv_used_blocks >= prompt_blocks for r in unit.records[mark:])))
        assert rid in served.call(lambda: dict(unit.live))
    # the connection is closed: the request must leave the cluster, the unit and the engine
    poll(lambda: served.call(lambda: rid not in served.cluster.streams and rid not in unit.live))
    poll(lambda: served.call(lambda: unit.llm.output_processor.get_num_unfinished_requests() == 0))
    assert rid not in {o.request_id for o in served.call(lambda: list(unit.outcomes))}
    # vLLM freed its blocks: a small request on the same unit runs alone and holds only its own KV
    after = served.call(lambda: len(unit.records))
    out = served.client().completions.create(model=MODEL, prompt=ids(20), max_tokens=2)
    assert (out.model_extra or {})["trackside"]["unit_id"] == 1
    prefill = poll(lambda: served.call(lambda: next((r for r in unit.records[after:] if r.num_prefill_tokens), None)))
    assert prefill.num_prefill_tokens == 20 and prefill.num_running == 1
    assert prefill.kv_used_blocks <= 2


def test_non_streaming_disconnect_aborts(served: Served, dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(Pin(0))
    unit = served.units[0]
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/completions", headers={"x-request-id": rid}, timeout=0.5,
                   json={"model": MODEL, "prompt": ids(50), "max_tokens": 3000})
    poll(lambda: served.call(lambda: rid not in served.cluster.streams and rid not in unit.live))
    poll(lambda: served.call(lambda: unit.llm.output_processor.get_num_unfinished_requests() == 0))
    assert rid not in {o.request_id for o in served.call(lambda: list(unit.outcomes))}


def test_disconnect_while_pending_leaves_the_queue(served: Served,
                                                   dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(Hold())
    rid = f"held-{uuid.uuid4().hex[:8]}"
    aborted = served.call(lambda: served.cluster.num_aborted)
    with ThreadPoolExecutor(1) as pool:
        post = pool.submit(httpx.post, served.base_url + "/completions", headers={"x-request-id": rid}, timeout=0.5,
                           json={"model": MODEL, "prompt": ids(10), "max_tokens": 5, "stream": True})
        poll(lambda: served.call(lambda: rid in served.cluster.pending))
        with pytest.raises(httpx.ReadTimeout):
            post.result()
    poll(lambda: served.call(lambda: rid not in served.cluster.pending and rid not in served.cluster.streams))
    assert served.call(lambda: served.cluster.num_aborted) == aborted + 1
    assert all(rid not in u.live for u in served.units)


def test_stop_token_ids_end_a_request(served: Served) -> None:
    out = served.client().completions.create(model=MODEL, prompt=ids(10), max_tokens=10,
                                             extra_body={"stop_token_ids": [TOKEN_ID]})
    c = out.choices[0]
    assert c.finish_reason == "stop" and (c.model_extra or {})["stop_reason"] == TOKEN_ID
    assert out.usage is not None and out.usage.completion_tokens == 1


# -- a model with a tokenizer: text prompts, text back --------------------------------------------------
def _tokenizer_model(folder: Path) -> str:
    """The tiny Llama plus a word-level tokenizer over its 1,024 ids (``w3`` ... ``w1023``; id 7 is ``seven``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1024)}}
    vocab["seven"] = vocab.pop("w7")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from vllm.config import ModelConfig

    model_dir = _tokenizer_model(tmp_path_factory.mktemp("tokenizer-model"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    state: dict[str, Any] = {}

    async def start() -> str:
        config = cpu_vllm_config(max_model_len=MAX_MODEL_LEN)
        config = dataclasses.replace(config, model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=False, max_model_len=MAX_MODEL_LEN, dtype="float16"))
        unit = state["unit"] = VllmUnit(0, EngineOptions(model=MODEL), UnitSettings(policy="vllm"),
                                        vllm_config=config, executor_class=FakeExecutor)
        unit.start()
        cluster = VllmCluster([unit], DISPATCH_POLICIES["round_robin"](), ttft_slo_s=0.5, tpot_slo_s=0.05)
        server = state["server"] = OpenAIServer(cluster, "127.0.0.1", 0, model_name=MODEL)
        await server.start()
        return server.base_url

    async def stop() -> None:
        await state["server"].stop()
        await state["unit"].stop()

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    finally:
        if state:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_text_prompts_and_text_back_with_a_tokenizer(with_tokenizer: str) -> None:
    client = openai.OpenAI(base_url=with_tokenizer, api_key="none", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="w10 w11 w12", max_tokens=4)
    assert out.choices[0].text.split() == ["seven"] * 4
    assert "token_ids" not in (out.choices[0].model_extra or {})  # only on request when there is text
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 4)
    chunks = list(client.completions.create(model=MODEL, prompt="w10", max_tokens=3, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks).split() == ["seven"] * 3
    assert [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]] == [TOKEN_ID] * 3
    assert (chunks[0].choices[0].model_extra or {})["prompt_token_ids"] == [10]
    # token-id prompts still work
    out = client.completions.create(model=MODEL, prompt=[10, 11], max_tokens=2)
    assert out.choices[0].text.split() == ["seven"] * 2
