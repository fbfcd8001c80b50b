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
Prompts are counted in the tiny tokenizer's tokens (about 1.5 characters of English a token), not the calibrated
model's: ``vllm bench serve --tokenizer PATH`` with the path the agent prints makes the client count as it does. With
the calibrated model's own tokenizer (``--sim-tokenizer DIR``: :func:`sim_tokenizer`), prompts are counted and chats
rendered as that model's server would, so a unit's prefill is timed on the tokens the real model would see; every
token is then that tokenizer's first token of `` ok``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.engine.vllm.openai_app import FrontendModel
from agent.engine.vllm.tiny_tokenizer import FAKE_TOKEN_ID, FAKE_TOKEN_TEXT

SIM_TOKEN = (FAKE_TOKEN_ID, FAKE_TOKEN_TEXT)
"""What every token of a simulated unit behind the OpenAI intake is (``SimLiveUnit(token=...)``)."""
DEFAULT_MAX_TOKENS = 256
"""The output length of a chat request that does not give ``max_tokens``."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A folder with none of these has no tokenizer that ``transformers`` loads."""


async def _no_engine(method: str, *args: Any) -> None:
    """What vLLM's app asks of an engine besides requests (profiling, cache resets): a simulated unit has nothing to
    profile or reset."""
    return None


@dataclass(frozen=True)
class SimTokenizer:
    """A tokenizer that renders requests for simulated units (:func:`sim_tokenizer`)."""

    folder: str
    vocab_size: int
    max_len: int
    """Its ``model_max_length``: the app's context is cut to it."""
    token: tuple[int, str]
    """What every token of a unit is: (id, text)."""
    own: bool = False
    """An operator's tokenizer (``--sim-tokenizer``), not the tiny model's."""


def load_tokenizer(folder: str) -> Any:
    """The Hugging Face tokenizer in ``folder`` (``transformers.AutoTokenizer``, nothing downloaded, no remote code);
    ``ValueError`` saying why where there is none."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{folder}: not a folder (one with a Hugging Face tokenizer: tokenizer.json and "
                         "tokenizer_config.json, as a model's folder has)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{folder}: no tokenizer in it (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        why = " ".join(str(exc).split())  # transformers' messages run over several lines
        raise ValueError(f"{folder}: no tokenizer there that transformers can load ({why})") from None


def sim_tokenizer(folder: str | None = None) -> SimTokenizer:
    """The tokenizer in ``folder`` (None: the tiny model's); its token is the first of `` ok`` as it encodes it;
    ``ValueError`` where ``folder`` has none."""
    from agent.engine.vllm.cpu import TINY_MAX_LEN, TINY_VOCAB, tiny_model_dir

    if folder is None:
        return SimTokenizer(tiny_model_dir(), TINY_VOCAB, TINY_MAX_LEN, SIM_TOKEN)
    tok = load_tokenizer(folder)
    ids = tok.encode(FAKE_TOKEN_TEXT, add_special_tokens=False)
    if not ids:
        raise ValueError(f"{folder}: its tokenizer encodes {FAKE_TOKEN_TEXT!r} to no token")
    max_len = int(min(tok.model_max_length, 1 << 30))  # transformers' "no limit" is 1e30
    return SimTokenizer(str(Path(folder).resolve()), len(tok), max_len, (int(ids[0]), str(tok.decode(ids[:1]))),
                        own=True)


def sim_frontend_model(max_model_len: int, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                       tokenizer: SimTokenizer | None = None) -> FrontendModel:
    """A model as vLLM's app sees it, with ``max_model_len`` and ``default_max_tokens`` for requests that give none:
    the tiny model (its context cut to 16,384), or with an operator's ``tokenizer`` (the context cut to its
    ``model_max_length``) the tiny model grown to that tokenizer's vocabulary."""
    from agent.engine.vllm.cpu import TINY_MAX_LEN, cpu_vllm_config

    if max_model_len < 1:
        raise ValueError(f"the simulated model's context must be at least 1 token, not {max_model_len}")
    if tokenizer is None or not tokenizer.own:
        vllm_config = cpu_vllm_config(max_model_len=min(max_model_len, TINY_MAX_LEN), tokenizer=True,
                                      default_max_tokens=default_max_tokens)
    else:
        vllm_config = cpu_vllm_config(max_model_len=min(max_model_len, tokenizer.max_len), tokenizer=True,
                                      default_max_tokens=default_max_tokens,
                                      tokenizer_dir=(tokenizer.folder, tokenizer.vocab_size))
    return FrontendModel(vllm_config, _no_engine)


def check_params(params: Any) -> None:
    """``ValueError`` (vLLM's app answers 400) for what a simulated unit cannot give: logprobs."""
    if getattr(params, "logprobs", None) is not None or getattr(params, "prompt_logprobs", None) is not None:
        raise ValueError("simulated units have no model, so no logprobs: leave out logprobs and prompt_logprobs")
