"""The model vLLM's OpenAI app sees in front of simulated units (``trackside agent --runtime live --serve-openai``).

Simulated units (:class:`~agent.engine.sim_live.SimLiveUnit`) have a calibrated step time and no model. vLLM's app
needs one to render requests (tokenizer, chat template, context length), so it gets the fake executor's tiny model
(:mod:`agent.engine.vllm.cpu`): its tokenizer (:mod:`agent.engine.vllm.tiny_tokenizer`, a byte-level BPE with a chat
template, made here) turns text and chat into the token ids the units are timed on, and every token a unit produces
is that tokenizer's :data:`~agent.engine.vllm.tiny_tokenizer.FAKE_TOKEN_ID`, read `` ok`` (:data:`SIM_TOKEN`), as
the fake executor's are. So a client gets a real OpenAI response, streamed at the pace the calibrated units set.

What a model would decide is not simulated: a unit produces exactly the request's ``max_tokens`` tokens (no end of
sequence, and no stop string or stop token ever matches), and a chat request that does not say ``max_tokens`` gets
:data:`DEFAULT_MAX_TOKENS` (the model's generation config, as vLLM reads a real model's ``max_new_tokens``: without
it a chat would run to the end of the context; a text completion gets OpenAI's 16). Logprobs are refused with 400
(there are no probabilities).
Prompts are counted in the tiny tokenizer's tokens (about one per 2-3 characters of English), not the calibrated
model's: ``vllm bench serve --tokenizer PATH`` with the path the agent prints makes the client count as it does.
"""

from __future__ import annotations

from typing import Any

from agent.engine.vllm.openai_app import FrontendModel
from agent.engine.vllm.tiny_tokenizer import FAKE_TOKEN_ID, FAKE_TOKEN_TEXT

SIM_TOKEN = (FAKE_TOKEN_ID, FAKE_TOKEN_TEXT)
"""What every token of a simulated unit behind the OpenAI intake is (``SimLiveUnit(token=...)``)."""
DEFAULT_MAX_TOKENS = 256
"""The output length of a chat request that does not give ``max_tokens``."""


async def _no_engine(method: str, *args: Any) -> None:
    """What vLLM's app asks of an engine besides requests (profiling, cache resets): a simulated unit has nothing to
    profile or reset."""
    return None


def sim_frontend_model(max_model_len: int, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> FrontendModel:
    """The tiny model as vLLM's app sees it, with ``max_model_len`` (cut to the tiny model's 16,384) and
    ``default_max_tokens`` for requests that give none."""
    from agent.engine.vllm.cpu import TINY_MAX_LEN, cpu_vllm_config

    if max_model_len < 1:
        raise ValueError(f"the simulated model's context must be at least 1 token, not {max_model_len}")
    vllm_config = cpu_vllm_config(max_model_len=min(max_model_len, TINY_MAX_LEN), tokenizer=True,
                                  default_max_tokens=default_max_tokens)
    return FrontendModel(vllm_config, _no_engine)


def tokenizer_path() -> str:
    """Where the tiny model's tokenizer is (``vllm bench serve --tokenizer``)."""
    from agent.engine.vllm.cpu import tiny_model_dir

    return tiny_model_dir()


def check_params(params: Any) -> None:
    """``ValueError`` (vLLM's app answers 400) for what a simulated unit cannot give: logprobs."""
    if getattr(params, "logprobs", None) is not None or getattr(params, "prompt_logprobs", None) is not None:
        raise ValueError("simulated units have no model, so no logprobs: leave out logprobs and prompt_logprobs")
