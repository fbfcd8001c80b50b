"""The fake executor's tokenizer: a byte-level BPE made here (no download), with a chat template.

The tiny model (:mod:`agent.engine.vllm.cpu`) has no weights and the fake executor samples token id 7 at every
step, so this tokenizer only has to be a real one that vLLM's front end can load: any text encodes (every byte
is a token), token id 7 reads `` ok``, and the vocabulary has exactly the model's ``vocab_size`` ids (every
prompt id a workload draws decodes to something; a lone byte id can be part of a UTF-8 character, which the
detokenizer may then show only with the next token). Ids:

* 0-6: ``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS), ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``
  (special: the chat template's role markers);
* 7: `` ok`` (what the fake executor says);
* then the 256 byte symbols of the byte-level alphabet, then merges of letter pairs up to ``vocab_size``.

Files written (what ``transformers.AutoTokenizer`` reads): ``tokenizer.json``, ``tokenizer_config.json``
(with :data:`CHAT_TEMPLATE`) and ``special_tokens_map.json``. The result depends on nothing but
``vocab_size``: the same files on every machine.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
FAKE_TOKEN_TEXT = " ok"
"""What token id 7 (the fake executor's every token) decodes to."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Each message as ``<|role|>`` newline content ``<|end|>``; the assistant's turn opens with ``<|assistant|>``."""


def _byte_symbols() -> list[str]:
    """The byte-level alphabet: one printable character per byte (GPT-2's mapping)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def tokenizer_json(vocab_size: int) -> str:
    """``tokenizer.json`` of the tokenizer (see the module's docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    space = "\u0120"  # the byte-level symbol of " "
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    fake = space + FAKE_TOKEN_TEXT[1:]
    vocab[fake] = len(vocab)
    for symbol in _byte_symbols():
        vocab.setdefault(symbol, len(vocab))
    merges: list[tuple[str, str]] = [(space, "o"), (space + "o", "k")]
    vocab.setdefault(space + "o", len(vocab))
    letters = string.ascii_lowercase
    candidates = [(space, a) for a in letters] + [(a, b) for a in letters for b in letters]
    candidates += [(space + a, b) for a in letters for b in letters]
    for left, right in candidates:
        if len(vocab) >= vocab_size:
            break
        token = left + right
        if token not in vocab:
            vocab[token] = len(vocab)
            merges.append((left, right))
    if len(vocab) < vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is larger than this tokenizer can fill ({len(vocab)})")
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte alphabet and special tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return str(tok.to_str())


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (processes that start together share the folder)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_tokenizer(folder: str | Path, vocab_size: int, max_length: int) -> None:
    """Write the tokenizer's files into ``folder`` (beside the model's ``config.json``)."""
    out = Path(folder)
    _write(out / "tokenizer.json", tokenizer_json(vocab_size))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    _write(out / "special_tokens_map.json", json.dumps(specials))
    _write(out / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE, **specials,
    }))
