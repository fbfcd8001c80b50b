"""A vLLM configuration that builds on a machine without a GPU (tests, the fake executor, smoke runs).

A tiny Llama ``config.json`` (hidden 256, 2 layers, no weights) is the model and ``DeviceConfig("cpu")`` lets
``VllmConfig`` be built at all (``LLM(...)`` cannot be on a CPU-only machine, ``shared/VLLM.md``). The model's
folder also holds a tokenizer made here (:mod:`agent.engine.vllm.tiny_tokenizer`, with a chat template), loaded
with ``tokenizer=True``: text prompts, chat and text back through vLLM's own front end.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from agent.engine.vllm.tiny_tokenizer import write_tokenizer

TINY_VOCAB = 1024
TINY_MAX_LEN = 16384
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": TINY_VOCAB, "max_position_embeddings": TINY_MAX_LEN, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2,
}


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "trackside-vllm-cache"))


@cache
def tiny_model_dir() -> str:
    folder = Path(tempfile.gettempdir()) / "trackside-tiny-llama"
    folder.mkdir(exist_ok=True)
    config = folder / f".config.json.{os.getpid()}.tmp"
    config.write_text(json.dumps(TINY_LLAMA))
    os.replace(config, folder / "config.json")
    write_tokenizer(folder, TINY_VOCAB, TINY_MAX_LEN)
    return str(folder)


@cache
def sized_model_dir(vocab_size: int, max_len: int) -> str:
    """A folder with the tiny Llama's ``config.json`` grown to ``vocab_size`` ids and ``max_len`` positions, and no
    tokenizer: the model beside a tokenizer of another folder (``cpu_vllm_config(tokenizer_dir=...)``)."""
    if vocab_size < 1 or max_len < 1:
        raise ValueError(f"a model needs at least 1 id and 1 position, not {vocab_size} and {max_len}")
    folder = Path(tempfile.gettempdir()) / f"trackside-tiny-llama-{vocab_size}-{max_len}"
    folder.mkdir(exist_ok=True)
    config = folder / f".config.json.{os.getpid()}.tmp"
    config.write_text(json.dumps({**TINY_LLAMA, "vocab_size": vocab_size, "max_position_embeddings": max_len}))
    os.replace(config, folder / "config.json")
    return str(folder)


@cache
def _model_config(max_model_len: int, tokenizer: bool = False, default_max_tokens: int | None = None,
                  tokenizer_dir: tuple[str, int] | None = None) -> Any:
    _env()
    from vllm.config import ModelConfig

    generation = {"max_new_tokens": default_max_tokens} if default_max_tokens is not None else {}
    if tokenizer_dir is None:
        return ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=not tokenizer, max_model_len=max_model_len,
                           dtype="float16", override_generation_config=generation)
    folder, vocab_size = tokenizer_dir
    return ModelConfig(model=sized_model_dir(vocab_size, max_model_len), tokenizer=folder, max_model_len=max_model_len,
                       dtype="float16", override_generation_config=generation)


def cpu_vllm_config(*, max_num_batched_tokens: int = 512, max_num_seqs: int = 32, block_size: int = 16,
                    num_blocks: int = 400, max_model_len: int = 4096, prefix_caching: bool = False,
                    async_scheduling: bool = False, long_prefill_token_threshold: int = 0,
                    step_model: tuple[float, float, float] = (0.003, 2e-6, 1e-8),
                    additional: dict[str, Any] | None = None, tokenizer: bool = False,
                    default_max_tokens: int | None = None, tokenizer_dir: tuple[str, int] | None = None) -> Any:
    """A ``VllmConfig`` for the tiny model on the CPU; ``step_model`` is the fake executor's step time;
    ``tokenizer``: load the model's tokenizer (else token ids only, ``skip_tokenizer_init``); ``default_max_tokens``:
    the output length of a request that gives none (the generation config's ``max_new_tokens``; None: vLLM's, to the
    end of the context); ``tokenizer_dir``: (folder, vocabulary size) of a tokenizer to load instead of the tiny
    model's, the model's vocabulary grown to its size (simulated units behind vLLM's app; no engine runs it)."""
    _env()
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    sched = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cache_cfg = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache_cfg.num_gpu_blocks = num_blocks
    extra = {"trackside_fake": {"num_blocks": num_blocks, "step_model": list(step_model)}, **(additional or {})}
    model = _model_config(max_model_len, tokenizer, default_max_tokens, tokenizer_dir)
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache_cfg,
                      device_config=DeviceConfig(device="cpu"), additional_config=extra)


def engine_versions() -> dict[str, str]:
    """vLLM's and torch's versions, the GPU's name (where there is one) and whether trackside's policies ran compiled,
    for a run's record; an import that fails is reported under ``error``, never raised."""
    from policies._compiled import STATE

    out: dict[str, str] = {"trackside_code": STATE}  # compiled or pure policies (the engine core imports the same tree)
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
        import vllm

        out["vllm"] = vllm.__version__
        out["torch"] = torch.__version__
    except Exception as exc:  # report, never fail the run for it
        out["error"] = repr(exc)
    return out
