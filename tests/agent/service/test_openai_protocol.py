"""The OpenAI completions protocol as plain data (no server, no vLLM): request checks and response shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.engine.vllm.sampling import Sampling
from agent.service.openai_protocol import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ModelInfo,
    check_prompt_tokens,
    choice,
    completion,
    models,
    parse_completion,
    sse,
    usage,
)

NO_TOKENIZER = ModelInfo(name="m", max_model_len=100, vocab_size=50, has_tokenizer=False, aliases=("/models/m",))
TOKENIZER = ModelInfo(name="m", max_model_len=100, vocab_size=50, has_tokenizer=True)


def error(body: Any, model: ModelInfo = NO_TOKENIZER) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_completion(body, model)
    return info.value


def test_a_token_prompt_with_defaults() -> None:
    p = parse_completion({"prompt": [1, 2, 3]}, NO_TOKENIZER)
    assert p.prompt_token_ids == [1, 2, 3] and p.prompt_text is None
    assert p.max_tokens == DEFAULT_MAX_TOKENS and not p.stream and not p.include_usage
    assert p.sampling == Sampling(ignore_eos=False)  # OpenAI semantics: stop at EOS unless asked
    assert (p.ttft_slo_s, p.tpot_slo_s) == (None, None)


def test_everything_passed_through() -> None:
    p = parse_completion({
        "model": "/models/m", "prompt": [[4, 5]], "max_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True,
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 11, "min_tokens": 2, "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "repetition_penalty": 1.1, "stop_token_ids": [9], "return_token_ids": True,
        "user": "u", "n": 1, "best_of": None, "logprobs": None, "echo": False, "stop": None, "logit_bias": {},
        "trackside": {"ttft_slo_ms": 250, "tpot_slo_ms": 40},
    }, NO_TOKENIZER)
    assert p.prompt_token_ids == [4, 5] and p.max_tokens == 7 and p.stream
    assert p.include_usage and p.continuous_usage and p.return_token_ids
    assert p.sampling == Sampling(ignore_eos=True, temperature=0.5, top_p=0.9, top_k=5, seed=11, min_tokens=2,
                                  presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1,
                                  stop_token_ids=(9,))
    assert (p.ttft_slo_s, p.tpot_slo_s) == (0.25, 0.04)


def test_text_prompts_need_a_tokenizer() -> None:
    assert "without a tokenizer" in error({"prompt": "hi"}).message
    p = parse_completion({"prompt": "hi"}, TOKENIZER)
    assert p.prompt_text == "hi" and p.prompt_token_ids is None and p.sampling.detokenize


def test_explicit_null_max_tokens_takes_the_rest_of_the_context() -> None:
    p = parse_completion({"prompt": [1] * 30, "max_tokens": None}, NO_TOKENIZER)
    assert p.max_tokens is None
    assert check_prompt_tokens([1] * 30, None, NO_TOKENIZER) == 70
    with pytest.raises(ApiError, match="no room"):
        check_prompt_tokens([1] * 100, None, NO_TOKENIZER)
    with pytest.raises(ApiError, match="empty"):  # a text prompt that tokenized to nothing
        check_prompt_tokens([], 5, TOKENIZER)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [True, 2]}, "prompt"),  # booleans are not token ids
    ({"prompt": [1], "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": [1], "max_tokens": True}, "max_tokens"),
    ({"prompt": [1], "seed": "1"}, "seed"),
    ({"prompt": [1], "top_p": float("nan")}, "top_p"),
    ({"prompt": [1], "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": [1], "stop_token_ids": [1, "x"]}, "stop_token_ids"),
    ({"prompt": [1], "stop": ["\n"]}, "stop"),
    ({"prompt": [1], "echo": True}, "echo"),
    ({"prompt": [1], "n": 1.0}, "n"),
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ({"prompt": [1], "trackside": 5}, "trackside"),
    ({"prompt": [1], "trackside": {"tpot_slo_ms": "fast"}}, "tpot_slo_ms"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [50]}, "prompt"),
    ({"prompt": [1] * 95, "max_tokens": 6}, "max_tokens"),
    ({"prompt": [1] * 101}, "prompt"),
    ({"prompt": None}, "prompt"),
])
def test_bad_fields_name_their_parameter(body: dict[str, Any], param: str) -> None:
    err = error(body)
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["param"] == param


def test_unknown_model_is_404() -> None:
    err = error({"model": "other", "prompt": [1]})
    assert err.status == 404 and err.body()["error"]["type"] == "NotFoundError"


def test_response_shapes() -> None:
    c = choice("", token_ids=[7, 7], finish_reason="length", prompt_token_ids=[1])
    assert c == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "token_ids": [7, 7], "prompt_token_ids": [1]}
    assert "token_ids" not in choice("ab", token_ids=None, finish_reason=None)
    body = completion("cmpl-1", 5, "m", [c], usage(3, 2), {"unit_id": 1})
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                             "prompt_tokens_details": None}
    assert body["object"] == "text_completion" and body["trackside"] == {"unit_id": 1}
    assert models(NO_TOKENIZER)["data"][0]["id"] == "m"
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse(body)[len(b"data: "):]) == body
    assert ApiError("x", 503).body() == {"error": {"message": "x", "type": "ServiceUnavailableError",
                                                   "param": None, "code": 503}}
