"""The OpenAI completions API as plain data: parse and check a request body, build responses and stream chunks.

No I/O and no vLLM here (:mod:`agent.service.openai_server` is the HTTP side). Field names follow OpenAI's
API and, for what OpenAI lacks, vLLM 0.26.0's own server (``vllm/entrypoints/openai/completion/protocol.py``):
``ignore_eos``, ``top_k``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids`` and ``return_token_ids`` in
requests; ``token_ids``, ``prompt_token_ids`` and ``stop_reason`` in choices; errors as
``{"error": {"message", "type", "param", "code"}}`` with vLLM's type names and the HTTP status as ``code``.
Our own extension is one object, ``trackside``: per-request SLOs in a request, where and how fast it was served
in a response.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.engine.vllm.sampling import Sampling

DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default when a request names no ``max_tokens``."""

ERROR_TYPES = {
    400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
    422: "UnprocessableEntityError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request the server answers with an error status and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError" if status < 500
                                                                  else "InternalServerError"),
                      "param": param, "code": status}}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server tells clients about the model and checks requests against."""

    name: str
    """The id ``/v1/models`` lists; requests may name it (or an alias) as ``model``."""
    max_model_len: int
    vocab_size: int
    """Token ids must lie in ``[0, vocab_size)``."""
    has_tokenizer: bool
    """Text prompts are accepted (and text returned) only with a tokenizer."""
    created: int = 0
    aliases: tuple[str, ...] = ()
    owned_by: str = "trackside"


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """A checked ``/v1/completions`` request."""

    prompt_token_ids: list[int] | None
    """None for a text prompt (tokenize :attr:`prompt_text`, then :func:`check_prompt_tokens`)."""
    prompt_text: str | None
    max_tokens: int | None
    """None: the rest of the context (``max_model_len`` minus the prompt), as vLLM does for an explicit null."""
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: a last chunk with ``usage`` (and ``trackside``) and no choices."""
    continuous_usage: bool
    """``stream_options.continuous_usage_stats``: ``usage`` in every chunk."""
    return_token_ids: bool
    sampling: Sampling
    ttft_slo_s: float | None
    tpot_slo_s: float | None


# Fields accepted with any value of their type (passed through or harmless) and fields accepted only with
# their "off" value (the feature is not supported).
_ACCEPTED = {"model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos", "temperature", "top_p",
             "top_k", "seed", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "stop_token_ids", "return_token_ids", "user", "trackside"}
_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None,), "echo": (None, False), "suffix": (None, ""),
    "stop": (None, "", []), "logit_bias": (None, {}),
}


def parse_completion(body: Any, model: ModelInfo) -> CompletionParams:
    """Check a ``/v1/completions`` body; raises :class:`ApiError` (400 or 404) naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _ACCEPTED and k not in _OFF_ONLY)
    if unknown:
        raise ApiError(f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    for key, allowed in _OFF_ONLY.items():
        if key in body and not any(_same(body[key], a) for a in allowed):
            raise ApiError(f"'{key}' is not supported by this server (allowed: "
                           f"{', '.join(json.dumps(a) for a in allowed)})", param=key)
    name = body.get("model")
    if name is not None and name != model.name and name not in model.aliases:
        raise ApiError(f"The model `{name}` does not exist.", status=404, param="model")
    ids, text = _prompt(body.get("prompt", _MISSING), model)
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    if "max_tokens" in body:
        max_tokens = _int(body, "max_tokens", minimum=1, nullable=True)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError("'stream_options' needs 'stream': true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise ApiError("'stream_options' takes 'include_usage' and 'continuous_usage_stats' (booleans)",
                           param="stream_options")
    options = options or {}
    slo = _slo(body.get("trackside"))
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids)):
        raise ApiError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    sampling = Sampling(
        ignore_eos=_bool(body, "ignore_eos", False),
        temperature=_num(body, "temperature"), top_p=_num(body, "top_p"),
        top_k=_int(body, "top_k", nullable=True, default=None),
        seed=_int(body, "seed", nullable=True, default=None),
        min_tokens=_int(body, "min_tokens", minimum=0, nullable=True, default=None),
        presence_penalty=_num(body, "presence_penalty"), frequency_penalty=_num(body, "frequency_penalty"),
        repetition_penalty=_num(body, "repetition_penalty"),
        stop_token_ids=tuple(stop_ids or ()),
        detokenize=model.has_tokenizer,
    )
    params = CompletionParams(
        prompt_token_ids=ids, prompt_text=text, max_tokens=max_tokens, stream=stream,
        include_usage=_bool(options, "include_usage", False),
        continuous_usage=_bool(options, "continuous_usage_stats", False),
        return_token_ids=_bool(body, "return_token_ids", False), sampling=sampling,
        ttft_slo_s=slo[0], tpot_slo_s=slo[1],
    )
    if ids is not None:
        check_prompt_tokens(ids, max_tokens, model)
    return params


def check_prompt_tokens(ids: Sequence[int], max_tokens: int | None, model: ModelInfo) -> int:
    """Check a token-id prompt against the model; returns the ``max_tokens`` to generate."""
    if not ids:
        raise ApiError("the prompt is empty (no tokens)", param="prompt")
    vocab = model.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is out of the model's vocabulary (0 to {vocab - 1})", param="prompt")
    n = len(ids)
    limit = model.max_model_len
    if max_tokens is None:
        if n >= limit:
            raise ApiError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                           f"contains {n} tokens, which leaves no room for output tokens.", param="prompt")
        return limit - n
    if n + max_tokens > limit:
        raise ApiError(f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{max_tokens} output tokens and your prompt contains {n} input tokens, for a total of "
                       f"{n + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
                       f"requested output tokens.", param="max_tokens" if n < limit else "prompt")
    return max_tokens


# -- responses ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def choice(text: str, *, token_ids: Sequence[int] | None, finish_reason: str | None,
           stop_reason: int | str | None = None, prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """One choice (index 0) of a response or a stream chunk; token id lists are left out when None."""
    out: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                           "stop_reason": stop_reason}
    if token_ids is not None:
        out["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt_token_ids)
    return out


def completion(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None, trackside: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``text_completion`` object: the whole response, or one stream chunk (``usage_`` None)."""
    out: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": created, "model": model,
                           "choices": choices, "usage": usage_}
    if trackside is not None:
        out["trackside"] = dict(trackside)
    return out


def models(model: ModelInfo) -> dict[str, Any]:
    """The ``/v1/models`` list (vLLM's ``ModelCard`` fields)."""
    return {"object": "list", "data": [{
        "id": model.name, "object": "model", "created": model.created, "owned_by": model.owned_by,
        "root": model.name, "parent": None, "max_model_len": model.max_model_len, "permission": [],
    }]}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


# -- field checks ---------------------------------------------------------------------------------
_MISSING = object()


def _same(value: Any, allowed: Any) -> bool:
    return type(value) is type(allowed) and bool(value == allowed)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompt(prompt: Any, model: ModelInfo) -> tuple[list[int] | None, str | None]:
    if prompt is _MISSING or prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not model.has_tokenizer:
            raise ApiError("this model is served without a tokenizer (skip_tokenizer_init): send the prompt as "
                           "a list of token ids", param="prompt")
        if not prompt:
            raise ApiError("'prompt' must not be empty", param="prompt")
        return None, prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError("'prompt' must not be empty", param="prompt")
        if all(_is_int(t) for t in prompt):
            return list(prompt), None
        if all(isinstance(p, str | list) for p in prompt):
            raise ApiError("one prompt per request: batches of prompts are not supported", param="prompt")
    raise ApiError("'prompt' must be a string or a list of integer token ids", param="prompt")


def _int(body: Mapping[str, Any], key: str, *, minimum: int | None = None, nullable: bool = False,
         default: int | None = None) -> int | None:
    if key not in body:
        return default
    v = body[key]
    if v is None and nullable:
        return None
    if not _is_int(v):
        raise ApiError(f"'{key}' must be an integer, got {json.dumps(v)}", param=key)
    if minimum is not None and v < minimum:
        raise ApiError(f"'{key}' must be at least {minimum}, got {v}", param=key)
    return int(v)


def _num(body: Mapping[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise ApiError(f"'{key}' must be a number, got {json.dumps(v)}", param=key)
    return float(v)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be true or false, got {json.dumps(v)}", param=key)
    return v


def _slo(ext: Any) -> tuple[float | None, float | None]:
    if ext is None:
        return None, None
    if not isinstance(ext, dict):
        raise ApiError("'trackside' must be an object ({\"ttft_slo_ms\": ..., \"tpot_slo_ms\": ...})",
                       param="trackside")
    unknown = sorted(set(ext) - {"ttft_slo_ms", "tpot_slo_ms"})
    if unknown:
        raise ApiError(f"unknown 'trackside' field(s): {', '.join(unknown)} (known: ttft_slo_ms, tpot_slo_ms)",
                       param="trackside")
    out: list[float | None] = []
    for key in ("ttft_slo_ms", "tpot_slo_ms"):
        v = _num(ext, key)
        if v is not None and v <= 0:
            raise ApiError(f"'trackside.{key}' must be positive, got {v}", param=f"trackside.{key}")
        out.append(None if v is None else v / 1e3)
    return out[0], out[1]
