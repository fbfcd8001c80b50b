"""A unit's token deltas as plain tuples, for the link to the agent's front-end processes (``--openai-frontends``).

Each delta carries vLLM's ``RequestOutput`` for the OpenAI app. Pickled as it is, that object costs more than it
carries. It has fourteen attributes and a ``CompletionOutput``, and in vLLM's output processor it holds the
request's whole prompt (``prompt_token_ids``) on every delta. A py-spy profile of the agent's main process under
``vllm bench serve`` (256-token prompts, two front ends, 2-core VM, 2026-11-27) put 31% of its samples in sending
the frames: 16% in pickling them, 13% in the socket writes. With this codec the pickling took about 4%. The front
end replaces the prompt, the prompt's token ids and the request id anyway (``agent.engine.vllm.engine_client``,
``_outputs``).

So the common delta (one sequence, no logprobs, nothing for KV transfer) crosses as a tuple of what the app reads:
its tokens, text, finish and stop reasons, and its output's index, tokens, text, cumulative logprob, reasons,
``finished`` and cached-token count. The front end builds a ``RequestOutput`` from it. Any other delta crosses
whole, its prompt left out.
"""

from __future__ import annotations

from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput

from agent.engine.vllm.sampling import TokenDelta

_PLAIN = 0
_WHOLE = 1


def compact(delta: TokenDelta) -> tuple[Any, ...]:
    """``delta`` for the link (see the module)."""
    out: Any = delta.output
    if type(out) is RequestOutput and len(out.outputs) == 1:
        c = out.outputs[0]
        if (c.logprobs is None and out.prompt_logprobs is None and out.kv_transfer_params is None
                and out.metrics is None and c.routed_experts is None and out.ec_transfer_params is None):
            return (_PLAIN, delta.token_ids, delta.text, delta.finish_reason, delta.stop_reason, c.index,
                    c.token_ids, c.text, c.cumulative_logprob, c.finish_reason, c.stop_reason, out.finished,
                    out.num_cached_tokens)
    if isinstance(out, RequestOutput):
        out.prompt = None
        out.prompt_token_ids = None
    return (_WHOLE, delta)


def expand(item: tuple[Any, ...]) -> TokenDelta:
    """The delta :func:`compact` made ``item`` of (its output's request id and prompt left for the front end)."""
    if item[0] == _WHOLE:
        delta: TokenDelta = item[1]
        return delta
    (_, token_ids, text, finish_reason, stop_reason, index, out_ids, out_text, cumulative, out_finish, out_stop,
     finished, cached) = item
    completion = CompletionOutput(index=index, text=out_text, token_ids=out_ids, cumulative_logprob=cumulative,
                                  logprobs=None, finish_reason=out_finish, stop_reason=out_stop)
    output = RequestOutput("", None, None, None, [completion], finished, num_cached_tokens=cached)
    return TokenDelta(token_ids, text, finish_reason, stop_reason, output)
