"""The OpenAI HTTP intake end to end on the CPU: vLLM's own OpenAI app over two whole vLLM engines (fake executor,
the tiny model's tokenizer) behind a dispatcher, uvicorn on a loopback port, the real ``openai`` client (httpx where
the raw bytes or headers matter) and ``vllm bench serve``.

The server, its cluster and its units live on an event loop in a thread of their own; tests reach into that loop
(:meth:`Served.call`) to swap the dispatcher, switch admission control or read what the units saw. The fake
executor samples token id 7 at every step, which the tiny tokenizer reads `` ok``, and makes up logprobs when
asked (the sampled token at -0.1, then the next ids ever less likely).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import httpx
import openai
from openai_served import (
    MAX_MODEL_LEN,
    METRICS,
    MODEL,
    OK,
    TIMEOUT_S,
    After,
    Hold,
    Pin,
    RejectAll,
    Served,
    data_events,
    ids,
    poll,
    rid,
)

from agent.engine.vllm.cpu import tiny_model_dir
from agent.engine.vllm.fake_executor import TOKEN_ID
from agent.service.openai_server import EmbeddedServer
from policies.base import DispatchPolicy

pytestmark = pytest.mark.vllm


# -- what vLLM's app serves besides generation ----------------------------------------------------------
def test_models_and_health(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra is not None and models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(served.root_url + "/health").status_code == 200


def test_health_and_requests_are_503_while_no_unit_serves(served: Served) -> None:
    unit_ids = [u.unit_id for u in served.units]
    for uid in unit_ids:
        served.call(partial(served.cluster.fail_unit, uid, "test"))
    try:
        if served.frontends:  # told by the main process within its 50 ms poll
            poll(lambda: httpx.get(served.root_url + "/health").status_code == 503)
        assert httpx.get(served.root_url + "/health").status_code == 503
        # a request meanwhile is refused as the dispatcher refuses one (503, Retry-After), streaming or not; the
        # server goes on serving (vLLM's own handler of a dead engine would stop it)
        for stream in (False, True):
            r = httpx.post(served.root_url + "/v1/completions",
                           json={"model": MODEL, "prompt": OK, "max_tokens": 2, "stream": stream})
            assert (r.status_code, r.headers.get("retry-after")) == (503, "1"), r.text
            assert "no trackside unit is serving" in r.json()["error"]["message"]
        r = httpx.post(served.root_url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
    finally:
        for uid in unit_ids:
            served.call(partial(served.cluster.recover_unit, uid))
        if served.frontends:
            poll(lambda: httpx.get(served.root_url + "/health").status_code == 200)
    assert httpx.get(served.root_url + "/health").status_code == 200


def test_tokenize(served: Served) -> None:
    r = httpx.post(served.root_url + "/tokenize", json={"model": MODEL, "prompt": OK * 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [TOKEN_ID] * 3 and body["count"] == 3 and body["max_model_len"] == MAX_MODEL_LEN


def test_metrics_serves_the_agents_text(served: Served) -> None:
    r = httpx.get(served.root_url + "/metrics")
    assert r.status_code == 200 and r.text == METRICS
    assert r.headers["content-type"].startswith("text/plain")
    # read on the server's loop, where the hub it renders lives (not in a worker thread beside it)
    assert served.metrics_threads[-1] is served._thread


# -- completions and chat -------------------------------------------------------------------------------
def test_text_completion(served: Served) -> None:
    prompt = "Once upon a time"
    expected = httpx.post(served.root_url + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()["count"]
    out = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].text == OK * 6 and out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        expected, 6, expected + 6)


def test_logprobs_come_from_vllm_through_the_units(served: Served) -> None:
    out = served.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens == [OK] * 3
    assert lp.token_logprobs == pytest.approx([-0.1] * 3)
    assert lp.top_logprobs is not None and all(len(top) == 3 and top[OK] == pytest.approx(-0.1)
                                               for top in lp.top_logprobs)
    chat = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and [c.token for c in content] == [OK, OK]
    assert all(c.top_logprobs[0].token == OK for c in content)


def test_completion_with_a_token_id_prompt(served: Served) -> None:
    out = served.client().completions.create(model=MODEL, prompt=ids(100), max_tokens=12,
                                             extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == OK * 12 and choice.finish_reason == "length"
    assert (choice.model_extra or {})["token_ids"] == [TOKEN_ID] * 12
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (100, 12, 112)


def test_chat_completion(served: Served) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    tokenized = httpx.post(served.root_url + "/tokenize", json={"model": MODEL, "messages": messages})
    assert tokenized.status_code == 200, tokenized.text
    prompt_tokens = tokenized.json()["count"]
    out = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert out.object == "chat.completion" and out.model == MODEL
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == OK * 5
    assert choice.finish_reason == "length"
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 5)


def test_chat_completion_streaming(served: Served) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    chunks = list(served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, stream=True,
        stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    contents = [c.choices[0].delta.content or "" for c in with_choices]
    assert "".join(contents) == OK * 20
    assert sum(1 for text in contents if text) >= 2, "tokens arrive in several chunks"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert not last.choices and last.usage is not None
    assert last.usage.completion_tokens == 20 and last.usage.prompt_tokens > 0


def test_parallel_sampling_gives_n_choices_each_routed_on_its_own(served: Served) -> None:
    request_id = rid("parallel")
    out = served.client().completions.create(model=MODEL, prompt=ids(20), max_tokens=4, n=3, seed=7,
                                             extra_headers={"x-request-id": request_id})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.text == OK * 4 and c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (20, 12)
    # three requests at the dispatcher, with vLLM's child ids, each with its own outcome
    found = served.call(lambda: [o for u in served.units for o in u.outcomes if request_id in o.request_id])
    assert sorted(o.request_id.split("_")[0] for o in found) == ["0", "1", "2"]
    assert all(o.output_tokens == 4 for o in found)


def test_parallel_sampling_streams_every_choice(served: Served) -> None:
    chunks = list(served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Two stories"}], max_tokens=5, n=2, stream=True,
        stream_options={"include_usage": True}))
    text: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert text == {0: OK * 5, 1: OK * 5} and finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_a_stop_string_ends_a_text_completion(served: Served) -> None:
    out = served.client().completions.create(model=MODEL, prompt="Say ok", max_tokens=10, stop=[OK * 2])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and (choice.model_extra or {})["stop_reason"] == OK * 2
    assert choice.text == ""  # every output so far is the stop string, which is left out
    assert out.usage is not None and out.usage.completion_tokens == 2
    out = served.client().completions.create(model=MODEL, prompt="Say ok", max_tokens=10, stop=[OK * 2],
                                             extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == OK * 2 and out.choices[0].finish_reason == "stop"


def test_a_stop_string_ends_a_streamed_text_completion(served: Served) -> None:
    chunks = list(served.client().completions.create(
        model=MODEL, prompt="Say ok", max_tokens=10, stop=[OK * 3], stream=True,
        stream_options={"include_usage": True}, extra_body={"include_stop_str_in_output": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == OK * 3
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert (with_choices[-1].choices[0].model_extra or {})["stop_reason"] == OK * 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_stop_token_ids_end_a_request(served: Served) -> None:
    out = served.client().completions.create(model=MODEL, prompt=ids(10), max_tokens=10,
                                             extra_body={"stop_token_ids": [TOKEN_ID]})
    c = out.choices[0]
    assert c.finish_reason == "stop" and (c.model_extra or {})["stop_reason"] == TOKEN_ID
    assert out.usage is not None and out.usage.completion_tokens == 1


# -- SLOs and the x-trackside-* headers -----------------------------------------------------------------
def test_per_request_slos_reach_the_units(served: Served) -> None:
    request_id = rid("slo")
    served.client().completions.create(model=MODEL, prompt=ids(5), max_tokens=3,
                                       extra_headers={"x-request-id": request_id},
                                       extra_body={"vllm_xargs": {"ttft_slo_ms": 1234, "tpot_slo_ms": 20}})
    o = served.outcome(request_id)
    assert (o.ttft_slo_s, o.tpot_slo_s) == pytest.approx((1.234, 0.020))
    request_id = rid("default-slo")
    served.client().completions.create(model=MODEL, prompt=ids(5), max_tokens=3,
                                       extra_headers={"x-request-id": request_id})
    o = served.outcome(request_id)
    assert (o.ttft_slo_s, o.tpot_slo_s) == pytest.approx((0.5, 0.05))  # the cluster's defaults


def test_a_bad_slo_is_a_bad_request(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="ttft_slo_ms"):
        served.client().completions.create(model=MODEL, prompt=ids(5), max_tokens=3,
                                           extra_body={"vllm_xargs": {"ttft_slo_ms": -1}})


def test_whole_responses_say_where_and_how_they_were_served(served: Served) -> None:
    request_id = rid("headers")
    raw = served.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        extra_headers={"x-request-id": request_id}, extra_body={"vllm_xargs": {"ttft_slo_ms": 60_000}})
    o = served.outcome(request_id)
    assert raw.headers["x-trackside-unit"] == str(o.unit_id)
    assert float(raw.headers["x-trackside-ttft-ms"]) == pytest.approx(o.ttft_s * 1e3, abs=0.1)
    assert o.tpot_s is not None
    assert float(raw.headers["x-trackside-tpot-ms"]) == pytest.approx(o.tpot_s * 1e3, abs=0.01)
    assert o.max_tpot_s is not None and o.max_tpot_s >= o.tpot_s  # the mean is the worst's value at the last token
    assert float(raw.headers["x-trackside-max-tpot-ms"]) == pytest.approx(o.max_tpot_s * 1e3, abs=0.01)
    met = o.ttft_s <= o.ttft_slo_s and o.max_tpot_s <= o.tpot_slo_s
    assert raw.headers["x-trackside-slo-met"] == ("true" if met else "false")
    assert raw.parse().choices[0].message.content == OK * 8
    # an SLO nobody can meet
    raw = served.client().completions.with_raw_response.create(
        model=MODEL, prompt=ids(5), max_tokens=2, extra_body={"vllm_xargs": {"ttft_slo_ms": 1e-6}})
    assert raw.headers["x-trackside-slo-met"] == "false"


def test_streamed_responses_say_their_unit(served: Served, dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(Pin(1))
    with httpx.stream("POST", served.base_url + "/completions", timeout=TIMEOUT_S,
                      json={"model": MODEL, "prompt": ids(8), "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-trackside-unit"] == "1"
        assert "x-trackside-ttft-ms" not in r.headers  # not known when the stream starts
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_the_dispatcher_is_asked_again_at_its_next_check(served: Served,
                                                         dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(After(0.3))
    raw = served.client().completions.with_raw_response.create(model=MODEL, prompt=ids(10), max_tokens=2)
    assert raw.headers["x-trackside-unit"] == "0"
    assert float(raw.headers["x-trackside-ttft-ms"]) >= 300  # the wait at the dispatcher counts


def test_two_units_both_serve_under_least_loaded(served: Served) -> None:
    client = served.client()

    def one(i: int) -> str:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=ids(200, start=300 + i), max_tokens=40)
        return str(raw.headers["x-trackside-unit"])

    with ThreadPoolExecutor(6) as pool:
        units = list(pool.map(one, range(6)))
    assert set(units) == {"0", "1"}, units


# -- refused requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_rejected_requests_get_503(served: Served, dispatcher: Callable[[DispatchPolicy], None],
                                   stream: bool) -> None:
    dispatcher(RejectAll())
    rejected = served.call(lambda: served.cluster.num_rejected)
    r = httpx.post(served.base_url + "/completions", timeout=TIMEOUT_S,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": stream})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert "reject_all dispatcher rejected" in error["message"]
    assert served.call(lambda: served.cluster.num_rejected) == rejected + 1
    with pytest.raises(openai.InternalServerError) as info:
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, stream=stream)
    assert info.value.status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_no_unit_taking_a_request_in_time_gets_503(served: Served, dispatcher: Callable[[DispatchPolicy], None],
                                                   stream: bool) -> None:
    dispatcher(Hold())
    old = served.set_attr(served.cluster, "pending_timeout_s", 0.2)
    try:
        r = httpx.post(served.base_url + "/completions", timeout=TIMEOUT_S,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": stream})
    finally:
        served.set_attr(served.cluster, "pending_timeout_s", old)
    assert r.status_code == 503 and "retry-after" in r.headers
    assert "no unit took the request within 0.2 s" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_refused_by_admission_control_gets_429(served: Served, refusing: list[tuple[int, int]],
                                               stream: bool) -> None:
    refused = served.call(lambda: served.cluster.num_refused)
    r = httpx.post(served.base_url + "/completions", timeout=TIMEOUT_S,
                   json={"model": MODEL, "prompt": ids(12), "max_tokens": 2, "stream": stream})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"  # the cluster's TTFT SLO, 0.5 s, rounded up
    error = r.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429 and "admission control" in error["message"]
    assert served.call(lambda: served.cluster.num_refused) == refused + 1
    assert refusing and refusing[-1][1] == 12
    with pytest.raises(openai.RateLimitError):
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, stream=stream)


def test_the_responses_api_is_routed_and_refused_like_the_others(served: Served,
                                                                 refusing: list[tuple[int, int]]) -> None:
    r = httpx.post(served.base_url + "/responses", timeout=TIMEOUT_S,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "RateLimitError" and refusing


def test_the_responses_api_says_where_it_was_served(served: Served) -> None:
    raw = served.client().responses.with_raw_response.create(model=MODEL, input="Hello", max_output_tokens=4)
    out = raw.parse()
    assert out.output_text == OK * 4 and out.usage is not None and out.usage.output_tokens == 4
    o = served.outcome(out.id)  # the engine request's id is the response's
    assert raw.headers["x-trackside-unit"] == str(o.unit_id)
    assert float(raw.headers["x-trackside-ttft-ms"]) == pytest.approx(o.ttft_s * 1e3, abs=0.1)


def test_the_embedded_http_server_leaves_sigint_and_sigterm_to_the_agent() -> None:
    # uvicorn's own serve() swaps both handlers while it runs (in the main thread, as here) and raises a signal it
    # took once more on its way out; in the agent the signal is the agent's shutdown, which stops this server too.
    import uvicorn

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = EmbeddedServer(uvicorn.Config(app=lambda scope, receive, send: None))
    with server.capture_signals():
        assert {sig: signal.getsignal(sig) for sig in before} == before
    assert {sig: signal.getsignal(sig) for sig in before} == before


# -- clients that leave -----------------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_kv(served: Served,
                                                   dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(Pin(1))
    unit = served.units[1]
    request_id = rid("abort")
    prompt_blocks = 1000 // 16
    mark = served.call(lambda: len(unit.records))

    def live_ids() -> list[str]:
        return list(served.call(lambda: [k for k in unit.live if request_id in k]))

    with httpx.Client(timeout=TIMEOUT_S) as http, http.stream(
        "POST", served.base_url + "/completions", headers={"x-request-id": request_id},
        json={"model": MODEL, "prompt": ids(1000), "max_tokens": 3000, "stream": True},
    ) as r:
        assert r.status_code == 200
        # Keep the iterator: leaving it (a break in a for loop) closes the connection at once.
        events = data_events(r.iter_lines())
        text = ""
        while len(text) < 5 * len(OK):  # a chunk may carry several tokens
            text += next(events)["choices"][0]["text"]
        assert text == OK * (len(text) // len(OK))
        # decoding on unit 1, holding the prompt's KV
        poll(lambda: served.call(lambda: any(rec.kv_used_blocks >= prompt_blocks for rec in unit.records[mark:])))
        assert len(live_ids()) == 1
    # the connection is closed: the request must leave the cluster, the unit and the engine
    poll(lambda: not live_ids() and not served.call(lambda: [k for k in served.cluster.streams if request_id in k]))
    poll(lambda: served.call(lambda: unit.llm.output_processor.get_num_unfinished_requests() == 0))
    assert not [o for o in served.call(lambda: list(unit.outcomes)) if request_id in o.request_id]
    # vLLM freed its blocks: a small request on the same unit runs alone and holds only its own KV
    after = served.call(lambda: len(unit.records))
    raw = served.client().completions.with_raw_response.create(model=MODEL, prompt=ids(20), max_tokens=2)
    assert raw.headers["x-trackside-unit"] == "1"
    prefill = poll(lambda: served.call(lambda: next((rec for rec in unit.records[after:] if rec.num_prefill_tokens),
                                                    None)))
    assert prefill.num_prefill_tokens == 20 and prefill.num_running == 1
    assert prefill.kv_used_blocks <= 2


def test_non_streaming_disconnect_aborts(served: Served, dispatcher: Callable[[DispatchPolicy], None]) -> None:
    dispatcher(Pin(0))
    unit = served.units[0]
    request_id = rid("gone")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/completions", headers={"x-request-id": request_id}, timeout=0.5,
                   json={"model": MODEL, "prompt": ids(50), "max_tokens": 3000})
    poll(lambda: served.call(lambda: not [k for k in [*served.cluster.streams, *unit.live] if request_id in k]))
    poll(lambda: served.call(lambda: unit.llm.output_processor.get_num_unfinished_requests() == 0))
    assert not [o for o in served.call(lambda: list(unit.outcomes)) if request_id in o.request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_pending_leaves_the_queue(served: Served, dispatcher: Callable[[DispatchPolicy], None],
                                                   stream: bool) -> None:
    dispatcher(Hold())
    request_id = rid("held")
    aborted = served.call(lambda: served.cluster.num_aborted)

    def pending() -> list[str]:
        return list(served.call(lambda: [k for k in served.cluster.pending if request_id in k]))

    # The client leaves once the request is seen waiting, not after a 0.5 s read timeout: on a loaded machine the
    # timeout could end the request before the test had seen it pending (held by Hold, nothing comes back meanwhile).
    url = httpx.URL(served.base_url + "/completions")
    body = json.dumps({"model": MODEL, "prompt": ids(10), "max_tokens": 5, "stream": stream}).encode()
    with socket.create_connection((url.host, url.port), timeout=TIMEOUT_S) as client:
        client.sendall(f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
                       f"Content-Type: application/json\r\nX-Request-Id: {request_id}\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        poll(pending)
        client.setblocking(False)
        with pytest.raises(BlockingIOError):
            client.recv(1)  # no reply (not even its headers) while it waits
    poll(lambda: not pending() and not served.call(lambda: [k for k in served.cluster.streams if request_id in k]))
    assert served.call(lambda: served.cluster.num_aborted) == aborted + 1
    assert all(request_id not in k for u in served.units for k in u.live)


# -- a benchmark client ------------------------------------------------------------------------------------
def test_vllm_bench_serve_completes_every_request(served: Served, tmp_path: Path) -> None:
    vllm = Path(sys.executable).with_name("vllm")
    command = [str(vllm)] if vllm.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    done = subprocess.run(
        [*command, "bench", "serve", "--backend", "openai-chat", "--base-url", served.root_url,
         "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer", tiny_model_dir(),
         "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16", "--num-prompts", "50",
         "--request-rate", "20", "--seed", "0", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "r.json"],
        capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (50, 0), result
