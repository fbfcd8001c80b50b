"""A unit's deltas packed for the front-end link and unpacked on the other side (``agent.engine.vllm.delta_codec``):
what vLLM's app reads survives, the prompt does not cross."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm")

from vllm.outputs import CompletionOutput, RequestOutput

from agent.engine.vllm.delta_codec import compact, expand
from agent.engine.vllm.sampling import TokenDelta

pytestmark = pytest.mark.vllm


def output(logprobs: object = None, n: int = 1) -> RequestOutput:
    completions = [CompletionOutput(index=i, text=" ok", token_ids=[7], cumulative_logprob=-0.1, logprobs=logprobs,
                                    finish_reason="length", stop_reason=None) for i in range(n)]
    return RequestOutput("cmpl-x-0", "hello", list(range(300)), None, completions, True, num_cached_tokens=16)


def crossed(delta: TokenDelta) -> TokenDelta:
    return expand(pickle.loads(pickle.dumps(compact(delta))))


def test_a_plain_delta_crosses_as_a_tuple_without_its_prompt() -> None:
    delta = TokenDelta((7,), " ok", "length", None, output())
    packed = compact(delta)
    assert isinstance(packed, tuple) and not any(isinstance(x, RequestOutput) for x in packed)
    assert len(pickle.dumps(packed)) < 200  # the 300-token prompt stayed behind
    back = crossed(delta)
    assert (back.token_ids, back.text, back.finish_reason, back.stop_reason) == ((7,), " ok", "length", None)
    out = back.output
    assert isinstance(out, RequestOutput) and out.finished and out.num_cached_tokens == 16
    assert out.prompt_token_ids is None and out.prompt is None
    (c,) = out.outputs
    assert (c.index, c.text, list(c.token_ids), c.cumulative_logprob, c.finish_reason, c.logprobs) == (
        0, " ok", [7], -0.1, "length", None)


@pytest.mark.parametrize("delta", [
    TokenDelta((7,), " ok", None, None, output(logprobs=[{7: -0.1}])),  # logprobs: the object crosses whole
    TokenDelta((7, 7), " ok ok", None, None, output(n=2)),
])
def test_any_other_delta_crosses_whole_without_its_prompt(delta: TokenDelta) -> None:
    back = crossed(delta)
    assert back.token_ids == delta.token_ids and isinstance(back.output, RequestOutput)
    assert back.output.prompt_token_ids is None and back.output.prompt is None
    sent = delta.output
    assert isinstance(sent, RequestOutput)
    assert [(c.index, c.logprobs) for c in back.output.outputs] == [(c.index, c.logprobs) for c in sent.outputs]


def test_a_delta_the_agent_made_crosses_as_it_is() -> None:
    delta = TokenDelta((), "", "abort", None, None)
    assert crossed(delta) == delta
