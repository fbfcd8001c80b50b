"""The pieces under the OpenAI front end that need no engine: the tiny model's tokenizer, per-request SLOs from
``vllm_xargs``, rendered prompts, ``--openai-arg`` items, and :class:`RoutedEngineClient` turning a unit's deltas
into the ``RequestOutput`` s vLLM's app expects (with a stand-in for the cluster)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from agent.engine.vllm.engine_client import RoutedEngineClient, prompt_token_ids, request_slos
from agent.engine.vllm.openai_app import FrontendArgError, frontend_tokens
from agent.engine.vllm.sampling import TokenDelta
from agent.engine.vllm.tiny_tokenizer import SPECIAL_TOKENS, tokenizer_json, write_tokenizer

pytestmark = pytest.mark.vllm


def test_the_tiny_tokenizer_fills_the_vocabulary_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, 1024, 4096)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 1024 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)
    for text in ("Hello, world!", "naïve café ✓ 42", " ok ok"):
        assert tok.decode(tok.encode(text)) == text  # every byte has a token
    assert tok.encode(" ok") == [7]
    assert json.loads(tokenizer_json(1024)) == json.loads(tokenizer_json(1024))  # the same files everywhere
    with pytest.raises(ValueError, match="smaller"):
        tokenizer_json(100)


def test_the_tokenizer_fills_a_real_models_vocabulary_from_its_config(tmp_path: Path) -> None:
    # What a GPU machine without tokenizer files uses to serve Llama 3 with dummy weights and text prompts.
    from transformers import AutoTokenizer

    from agent.engine.vllm.tiny_tokenizer import main

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128_256, "max_position_embeddings": 8192}))
    assert main([str(tmp_path)]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 128_256 and tok.model_max_length == 8192
    assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
    assert tok.encode(" ok") == [7]  # the small vocabulary's ids are unchanged
    assert json.loads(tokenizer_json(1024))["model"]["merges"] == \
        json.loads(tokenizer_json(128_256))["model"]["merges"][:len(json.loads(tokenizer_json(1024))["model"]["merges"])]


def test_slos_come_from_vllm_xargs_in_milliseconds() -> None:
    params = SamplingParams(max_tokens=4, extra_args={"ttft_slo_ms": 250, "tpot_slo_ms": "40"})
    assert request_slos(params) == {"ttft_slo_s": 0.25, "tpot_slo_s": 0.04}
    assert request_slos(SamplingParams(max_tokens=4)) == {"ttft_slo_s": None, "tpot_slo_s": None}
    for bad in (0, -5, "soon", float("inf")):
        with pytest.raises(ValueError, match="ttft_slo_ms"):
            request_slos(SamplingParams(max_tokens=4, extra_args={"ttft_slo_ms": bad}))


def test_rendered_prompts_give_their_token_ids() -> None:
    assert prompt_token_ids({"type": "token", "prompt_token_ids": [1, 2], "prompt": "hi"}) == ([1, 2], "hi")
    assert prompt_token_ids({"prompt_token_ids": [3]}) == ([3], None)
    with pytest.raises(ValueError, match="'embeds'"):
        prompt_token_ids({"type": "embeds", "prompt_embeds": None})
    with pytest.raises(ValueError, match="rendered"):
        prompt_token_ids("raw text")


def test_openai_args_become_vllm_serve_flags() -> None:
    assert frontend_tokens(["chat_template=/t.jinja", "enable_auto_tool_choice=true", "x=false"]) == [
        "--chat-template", "/t.jinja", "--enable-auto-tool-choice"]
    with pytest.raises(FrontendArgError, match="KEY=VALUE"):
        frontend_tokens(["chat_template"])


class _Routed:
    """A stand-in for the cluster's request stream: yields given deltas, records an abort; ``burst``: how many
    more deltas :meth:`ready` finds queued after each one iterated (a consumer that fell behind)."""

    def __init__(self, request_id: str, deltas: list[TokenDelta], burst: int = 0) -> None:
        self.request_id = request_id
        self.deltas = deltas
        self.burst = burst
        self.next = 0
        self.aborted = False

    async def _gen(self) -> AsyncIterator[TokenDelta]:
        while self.next < len(self.deltas):
            self.next += 1
            yield self.deltas[self.next - 1]

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self._gen()

    def ready(self) -> list[TokenDelta]:
        out = self.deltas[self.next:self.next + self.burst]
        self.next += len(out)
        return out

    def abort(self) -> bool:
        self.aborted = True
        return True


class _Engine:
    vllm_config = model_config = renderer = input_processor = None
    errored = False


def _delta(ids: list[int], text: str, finish: str | None = None, *, prompt: list[int]) -> TokenDelta:
    out = RequestOutput("unit-side", None, prompt, None,
                        [CompletionOutput(0, text, ids, None, None, finish_reason=finish)], finish is not None,
                        num_cached_tokens=0)
    return TokenDelta(tuple(ids), text, finish, None, out)


def _client(deltas: list[TokenDelta], serving: int = 1, burst: int = 0) -> tuple[RoutedEngineClient, list[Any]]:
    calls: list[Any] = []

    def submit(request_id: str, ids: list[int], params: SamplingParams, **kw: Any) -> _Routed:
        routed = _Routed(request_id, deltas, burst)
        calls.append((request_id, ids, params, kw, routed))
        return routed

    return RoutedEngineClient(lambda: [_Engine()], submit, lambda: serving), calls


async def _collect(client: RoutedEngineClient, params: SamplingParams) -> list[RequestOutput]:
    return await _collect_with(client, params)


async def _collect_with(client: RoutedEngineClient, params: SamplingParams, **kw: Any) -> list[RequestOutput]:
    prompt = {"type": "token", "prompt_token_ids": [5, 6, 7], "prompt": "abc"}
    return [out async for out in client.generate(prompt, params, "req-1", **kw)]


def _fanned(per_child: dict[int, list[TokenDelta]], fail: int | None = None) -> tuple[RoutedEngineClient, list[Any]]:
    """A client whose child ``i`` (vLLM's id ``i_req-1``) yields ``per_child[i]``, yielding to the loop between
    deltas so the children interleave; child ``fail`` raises after its deltas."""
    calls: list[Any] = []

    class Child(_Routed):
        async def _gen(self) -> AsyncIterator[TokenDelta]:
            async for d in super()._gen():
                await asyncio.sleep(0)
                yield d
            if self.request_id.startswith(f"{fail}_"):
                raise RuntimeError("engine failed")

    def submit(request_id: str, ids: list[int], params: SamplingParams, **kw: Any) -> _Routed:
        routed = Child(request_id, per_child[int(request_id.split("_")[0])])
        calls.append((request_id, ids, params, kw, routed))
        return routed

    return RoutedEngineClient(lambda: [_Engine()], submit, lambda: 1), calls


def _seq(i: int, n: int) -> list[TokenDelta]:
    """Child ``i``'s deltas: ``n`` tokens ``10 * i + k``, the last one finishing."""
    return [_delta([10 * i + k], f" t{i}{k}", "length" if k == n - 1 else None, prompt=[5, 6, 7]) for k in range(n)]


def test_deltas_are_forwarded_with_the_original_request_and_prompt() -> None:
    # The second delta comes from a unit the request moved to: its prompt there was longer.
    deltas = [_delta([7], " ok", prompt=[5, 6, 7]), _delta([7, 7], " ok ok", "length", prompt=[5, 6, 7, 7])]
    client, calls = _client(deltas)
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA, extra_args={"ttft_slo_ms": 100})
    outs = asyncio.run(_collect(client, params))
    assert [(o.request_id, o.prompt, o.prompt_token_ids) for o in outs] == [("req-1", "abc", [5, 6, 7])] * 2
    assert [o.outputs[0].text for o in outs] == [" ok", " ok ok"] and [o.finished for o in outs] == [False, True]
    (rid, ids, _, kw, routed) = calls[0]
    assert rid == "req-1" and ids == [5, 6, 7] and kw["ttft_slo_s"] == 0.1 and kw["tpot_slo_s"] is None
    assert not routed.aborted  # it finished


def test_deltas_that_queued_up_go_out_as_one_output() -> None:
    # The app fell behind: after the first delta, two more (the last one finishing) are already queued.
    def deltas() -> list[TokenDelta]:  # fresh each time: a unit's outputs are consumed (merged into) once
        return [_delta([7], " ok", prompt=[5, 6, 7]), _delta([8], " a", prompt=[5, 6, 7]),
                _delta([9], " b", "length", prompt=[5, 6, 7]), _delta([7], " ok", prompt=[5, 6, 7])]

    client, _ = _client(deltas()[:3], burst=2)
    outs = asyncio.run(_collect(client, SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA)))
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    assert list(outs[0].outputs[0].token_ids) == [7, 8, 9] and outs[0].outputs[0].text == " ok a b"
    d = deltas()
    client, _ = _client(d[:2] + d[3:] + d[2:3], burst=1)  # two outputs of two deltas each
    outs = asyncio.run(_collect(client, SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)))
    assert [list(o.outputs[0].token_ids) for o in outs] == [[7, 8], [7, 9]] and [o.finished for o in outs] == [
        False, True]


def test_parallel_sampling_routes_n_requests_and_merges_them_as_vllm_does() -> None:
    # n=3: three requests at the dispatcher with vLLM's child ids and seeds; one final output with the three
    # sequences in index order, though the shortest finishes first.
    client, calls = _fanned({0: _seq(0, 3), 1: _seq(1, 1), 2: _seq(2, 2)})
    params = SamplingParams(max_tokens=3, n=3, seed=40, output_kind=RequestOutputKind.FINAL_ONLY)
    outs = asyncio.run(_collect(client, params))
    assert [c[0] for c in calls] == ["0_req-1", "1_req-1", "2_req-1"]
    assert [(c[2].n, c[2].seed) for c in calls] == [(1, 40), (1, 41), (1, 42)] and params.n == 3
    assert len({c[3]["arrival_s"] for c in calls}) == 1  # one arrival for all
    assert len(outs) == 1 and outs[0].finished and outs[0].request_id == "req-1"
    assert [(c.index, list(c.token_ids), c.finish_reason) for c in outs[0].outputs] == [
        (0, [0, 1, 2], "length"), (1, [10], "length"), (2, [20, 21], "length")]
    assert not any(c[4].aborted for c in calls)


def test_parallel_sampling_streams_each_sequence_with_its_index_and_finishes_with_the_last() -> None:
    client, _ = _fanned({0: _seq(0, 2), 1: _seq(1, 3)})
    outs = asyncio.run(_collect(client, SamplingParams(max_tokens=3, n=2, output_kind=RequestOutputKind.DELTA)))
    got = [(o.outputs[0].index, list(o.outputs[0].token_ids), o.finished) for o in outs]
    assert sorted(got) == sorted([(0, [0], False), (0, [1], False), (1, [10], False), (1, [11], False),
                                  (1, [12], True)])
    assert got[-1] == (1, [12], True) and [o.finished for o in outs].count(True) == 1
    assert [o.prompt_logprobs is None for o in outs][1:] == [True] * 4  # the prompt's logprobs once
    assert {o.request_id for o in outs} == {"req-1"}


def test_a_failed_sequence_fails_the_parallel_request_and_aborts_the_others() -> None:
    client, calls = _fanned({0: _seq(0, 1), 1: _seq(1, 5)}, fail=0)
    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(_collect(client, SamplingParams(max_tokens=5, n=2, output_kind=RequestOutputKind.DELTA)))
    assert calls[1][4].aborted  # the other sequence does not stay behind
    # a client that leaves early aborts every sequence
    client, calls = _fanned({0: _seq(0, 3), 1: _seq(1, 3)})

    async def first_only() -> None:
        gen = client.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=3, n=2), "r")
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(first_only())
    assert all(c[4].aborted for c in calls)
    client, calls = _fanned({0: _seq(0, 3), 1: _seq(1, 3)})
    asyncio.run(client.abort("req-1"))  # nothing routed under that id yet: nothing to do
    assert calls == []


def test_the_cluster_stream_hands_over_queued_deltas_and_keeps_its_end() -> None:
    from agent.runtime.live.requests import ClusterRequest, RequestStream

    async def main() -> None:
        stream = RequestStream(ClusterRequest("r", [1, 2], 3), None, collect=True)  # type: ignore[arg-type]
        assert stream.ready() == []
        deltas = [TokenDelta((7,), " ok", None, None), TokenDelta((8,), " a", None, None),
                  TokenDelta((9,), " b", "length", None)]
        for d in deltas:
            stream._push(d)
        assert await stream.__anext__() == deltas[0]
        assert stream.ready() == deltas[1:] and stream.ready() == []
        stream._finish(None, None)
        assert stream.ready() == []  # the end stays queued: iteration ends after it
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert stream.output_token_ids == [7, 8, 9]

    asyncio.run(main())


def test_final_only_output_is_merged_by_vllm_and_a_lost_finish_is_made_up() -> None:
    # The last delta has no engine output: its unit died after the last token (the cluster made the finish).
    deltas = [_delta([7], " ok", prompt=[5, 6, 7]), _delta([7], " ok", prompt=[5, 6, 7]),
              TokenDelta((), "", "length", None)]
    client, _ = _client(deltas)
    outs = asyncio.run(_collect(client, SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)))
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == " ok ok" and list(outs[0].outputs[0].token_ids) == [7, 7]
    assert outs[0].outputs[0].finish_reason == "length"


def test_a_request_left_early_is_aborted_and_a_dead_node_is_unhealthy() -> None:
    client, calls = _client([_delta([7], " ok", prompt=[1]), _delta([7], " ok", "length", prompt=[1])])

    async def first_only() -> None:
        gen = client.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2), "r")
        await gen.__anext__()
        await gen.aclose()  # what the app does when its client goes away

    asyncio.run(first_only())
    assert calls[0][4].aborted
    with pytest.raises(ValueError, match="LoRA"):
        asyncio.run(_collect_with(client, SamplingParams(max_tokens=2), lora_request=object()))
    assert client.errored is False and client.is_running
    dead, _ = _client([], serving=0)
    assert dead.errored
    with pytest.raises(Exception, match="no trackside unit is serving"):
        asyncio.run(dead.check_health())
