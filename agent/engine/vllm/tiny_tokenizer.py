"""The fake executor's tokenizer: a byte-level BPE made here (no download), with a chat template.

The tiny model (:mod:`agent.engine.vllm.cpu`) has no weights and the fake executor samples token id 7 at every
step, so this tokenizer only has to be a real one that vLLM's front end can load: any text encodes (every byte
is a token), token id 7 reads `` ok``, and the vocabulary has exactly the model's ``vocab_size`` ids (every
prompt id a workload draws decodes to something; a lone byte id can be part of a UTF-8 character, which the
detokenizer may then show only with the next token). Ids:

* 0-6: ``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS), ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``
  (special: the chat template's role markers);
* 7: `` ok`` (what the fake executor says);
* then the 256 byte symbols of the byte-level alphabet, then merges of letters (pairs, then triples and
  quadruples for a large vocabulary) up to ``vocab_size``.

Files written (what ``transformers.AutoTokenizer`` reads): ``tokenizer.json``, ``tokenizer_config.json``
(with :data:`CHAT_TEMPLATE`) and ``special_tokens_map.json``. The result depends on nothing but
``vocab_size``: the same files on every machine.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
FAKE_TOKEN_ID = 7
"""The token the fake executor samples at every step (and a simulated unit behind the OpenAI intake produces)."""
FAKE_TOKEN_TEXT = " ok"
"""What :data:`FAKE_TOKEN_ID` decodes to."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Each message as ``<|role|>`` newline content ``<|end|>``; the assistant's turn opens with ``<|assistant|>``."""


def _byte_symbols() -> list[str]:
    """The byte-level alphabet: one printable character per byte (GPT-2's mapping)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def _merge_candidates(space: str) -> Iterator[tuple[str, str]]:
    """Merges in the order they enter the vocabulary: `` a``, ``ab``, `` ab``, then three and four letters.

    The first three groups fill the tiny model's vocabulary (about 1,600 ids); the longer ones are there so a
    real model's vocabulary (Llama 3's 128,256 ids) can be filled too, e.g. to serve such a model with dummy
    weights and text prompts on a GPU machine that has no tokenizer files. Each merge's parts are already in
    the vocabulary when it comes.
    """
    letters = string.ascii_lowercase
    yield from ((space, a) for a in letters)
    yield from ((a, b) for a in letters for b in letters)
    yield from ((space + a, b) for a in letters for b in letters)
    yield from ((a + b, c) for a in letters for b in letters for c in letters)
    yield from ((space + a + b, c) for a in letters for b in letters for c in letters)
    yield from ((a + b + c, d) for a in letters for b in letters for c in letters for d in letters)


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
    for left, right in _merge_candidates(space):
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


def main(argv: list[str] | None = None) -> int:
    """``python -m agent.engine.vllm.tiny_tokenizer MODEL_DIR``: write the tokenizer beside a ``config.json``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("model_dir", help="a folder with a model's config.json (its vocab_size is filled)")
    ap.add_argument("--max-length", type=int, default=0, help="model_max_length (default: the config's)")
    args = ap.parse_args(argv)
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    max_length = args.max_length or int(config.get("max_position_embeddings", 16384))
    write_tokenizer(args.model_dir, int(config["vocab_size"]), max_length)
    print(f"tokenizer of {config['vocab_size']} ids written to {args.model_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
