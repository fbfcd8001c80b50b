"""The front-end split benchmark (``tests/benchmarks/bench_frontend_split.py``): its classifier of py-spy's
collapsed stacks into engine side (A), HTTP side (B) and the rest (C), on hand-written stacks; the runs themselves
are a benchmark, run by hand."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
from bench_scripts import bench_script

MAIN = ("thread (31068): MainThread;_run_module_as_main (<frozen runpy>:198);<module> (agent/cli/__main__.py:5);"
        "run (uvloop/__init__.py:92);Runner.run (asyncio/runners.py:118)")
HTTP = (f"{MAIN};RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:422);"
        "TracksideMiddleware.__call__ (agent/service/openai_server.py:154);Starlette.__call__ "
        "(starlette/applications.py:96)")


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("bench_frontend_split") as module:
        yield module


def bucket(bench: ModuleType, line: str) -> tuple[str, str] | None:
    """The (bucket, sub-bucket) a one-line profile lands in; None when it is dropped."""
    split = bench.classify_text(line)
    if split.dropped:
        return None
    (label,) = split.sub_buckets
    (b,) = split.buckets
    return b, label


def test_a_line_is_parsed_into_thread_frames_and_count(bench: ModuleType) -> None:
    thread, frames, count = bench.parse_line(f"{MAIN};Hub.flush (agent/service/hub.py:329) 7\n")
    assert (thread, count) == ("MainThread", 7)
    assert frames[-1] == "Hub.flush (agent/service/hub.py:329)" and frames[0].startswith("_run_module_as_main")
    assert bench.parse_frame("_run_code (<frozen runpy>:88)") == ("_run_code", "<frozen runpy>")
    assert bench.parse_line("   \n") is None


def test_the_innermost_anchor_decides(bench: ModuleType) -> None:
    # the output handler's work, reached from a request's task under uvicorn: A, since OutputProcessor is innermost
    engine_under_http = (f"{HTTP};OutputProcessor.process_outputs (vllm/v1/engine/output_processor.py:601);"
                         "IncrementalDetokenizer.update (vllm/v1/engine/detokenizer.py:120);"
                         "Logger.debug (logging/__init__.py:1465) 3")
    assert bucket(bench, engine_under_http) == ("A", "A vLLM OutputProcessor (detokenize, RequestOutput creation)")
    # the socket write: B
    send = (f"{HTTP};StreamingResponse.stream_response (starlette/responses.py:250);"
            "RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:540) 5")
    assert bucket(bench, send) == ("B", "B uvicorn / httptools / h11")
    # generic frames (pydantic) are charged to the first anchor above them
    dump = (f"{HTTP};OpenAIServingCompletion.completion_stream_generator "
            "(vllm/entrypoints/openai/completion/serving.py:300);BaseModel.model_dump_json (pydantic/main.py:477) 2")
    assert bucket(bench, dump) == ("B", "B vLLM OpenAI serving (vllm/entrypoints)")


def test_request_stream_consumer_is_http_side_and_producer_engine_side(bench: ModuleType) -> None:
    pull = f"{HTTP};RequestStream.__anext__ (agent/runtime/live/requests.py:210);Future.result (asyncio/x.py:1) 1"
    ready = f"{HTTP};RequestStream.ready (agent/runtime/live/requests.py:190) 1"
    push = (f"{MAIN};VllmUnit._output (agent/engine/vllm/unit.py:400);"
            "RequestStream._push (agent/runtime/live/requests.py:150) 1")
    assert bucket(bench, pull)[0] == "B" and bucket(bench, ready)[0] == "B"
    assert bucket(bench, push) == ("A", "A RequestStream push (_push/_put/_finish)")
    assert bucket(bench, f"{MAIN};VllmUnit._output (agent/engine/vllm/unit.py:400) 1") == (
        "A", "A VllmUnit._output / LiveRequest")
    # vLLM's own consumer (plain vllm serve), defined in output_processor.py: B too, as the agent's
    collector = (f"{HTTP};AsyncLLM.generate (vllm/v1/engine/async_llm.py:560);"
                 "RequestOutputCollector.get (vllm/v1/engine/output_processor.py:80) 1")
    assert bucket(bench, collector)[0] == "B"


def test_blocked_threads_are_dropped_but_working_ones_and_the_main_thread_kept(bench: ModuleType) -> None:
    monitor = ("thread (31113): MPClientEngineMonitor;Thread._bootstrap (threading.py:1002);"
               "_PollLikeSelector.select (selectors.py:415) 2447")
    idle_pool = ("thread (31252): ThreadPoolExecutor-2_0;Thread._bootstrap (threading.py:1002);"
                 "_worker (concurrent/futures/thread.py:81) 2083")
    tokenizing = ("thread (31252): ThreadPoolExecutor-2_0;Thread._bootstrap (threading.py:1002);"
                  "_worker (concurrent/futures/thread.py:83);"
                  "BaseRenderer._tokenize_prompt (vllm/renderers/base.py:481);"
                  "PreTrainedTokenizerBase.__call__ (transformers/tokenization_utils_base.py:2553) 31")
    main_waiting = f"{MAIN};Event.wait (threading.py:629) 4"  # the main thread's waits are never dropped
    split = bench.classify_text("\n".join((monitor, idle_pool, tokenizing, main_waiting)))
    assert split.dropped == 2447 + 2083
    assert split.kept == 35 and split.threads == {"ThreadPoolExecutor-2_0": 31, "MainThread": 4}
    assert split.buckets == {"B": 31, "C": 4}


def test_no_anchor_is_c_and_the_loop_alone_is_told_apart(bench: ModuleType) -> None:
    assert bucket(bench, f"{MAIN} 9") == ("C", bench.C_LOOP)
    assert bucket(bench, f"{MAIN};Task.__step (asyncio/tasks.py:267);isfuture (asyncio/base_futures.py:21) 1") == (
        "C", bench.C_OTHER)


def test_shares_and_per_token_costs(bench: ModuleType) -> None:
    lines = [f"{MAIN};Hub.flush (agent/service/hub.py:329) 30",
             f"{HTTP};RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:540) 60",
             f"{MAIN} 10"]
    split = bench.classify_lines(lines)
    assert (split.share("A"), split.share("B"), split.share("C")) == (0.3, 0.6, 0.1)
    assert split.engine_of_engine_and_http == pytest.approx(1 / 3)
    run = bench.RunResult("ts-1", "trackside", 128_000, 10.0, 12_800.0, 5.12, split)
    assert run.cpu_us_per_token == pytest.approx(40.0)
    assert run.us_per_token("A") == pytest.approx(12.0) and run.us_per_token("B") == pytest.approx(24.0)
    table = bench.results_table([run])
    assert ("| ts-1 | trackside | 128000 | 10.00 | 12800 | 5.12 | 40.0 | 30 | 60 | 10 | 30.0 | 60.0 | 10.0 | 33.3 "
            "| 12.0 | 24.0 | 4.0 |") in table
    assert "| **A total** | **30.0** |" in bench.breakdown_table([run])
