"""``trackside agent --runtime live --serve-openai``: vLLM's own OpenAI app over simulated units, as an operator runs it
(a child process, the ``openai`` client, ``trackside ctl``), and what it refuses."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import httpx
from agent_errors import error_of
from agent_process import AgentProcess
from serve_harness import run

from agent.engine.vllm.cpu import tiny_model_dir
from agent.engine.vllm.sim_model import DEFAULT_MAX_TOKENS, SIM_TOKEN, sim_tokenizer

pytestmark = pytest.mark.vllm

PROFILE = "h100-llama31-8b"
STREAMS = 24
MAX_TOKENS = 150


WORDS = ("[UNK]", "<bos>", "<eos>", "hello", "world", "say", "ok", "please", "user", "assistant", ":")
WORD_MAX_LEN = 8192


def word_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer unlike the tiny one, as an operator's folder has it: a token per word (split at spaces
    and punctuation, an unknown word ``[UNK]``), ``ok`` a word of its own (id 6), a chat template of its own, and a
    context of 8,192."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="<bos>", eos_token="<eos>",
                                  model_max_length=WORD_MAX_LEN)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(str(folder))
    return folder


def test_openai_clients_are_served_by_simulated_units_and_keep_their_streams_when_a_unit_fails(
        tmp_path: Path) -> None:
    """Chat and text completions, streamed and whole, rendered by vLLM's app and timed by the calibrated units; 24
    streams in flight when an operator fails unit 1 all end whole, those on unit 1 moved to unit 0 by recompute."""
    proc = AgentProcess(tmp_path, "--runtime", "live", "--dispatch", "round_robin", simulated=True, openai_api=True)
    assert any(f"model {PROFILE}: simulated units" in line for line in proc.lines()), proc.lines()
    try:
        async def go() -> None:
            client = proc.client()
            models = await client.models.list()
            assert [m.id for m in models.data] == [PROFILE]

            chat = await client.chat.completions.create(
                model=PROFILE, messages=[{"role": "user", "content": "Say ok."}], max_tokens=7)
            assert chat.choices[0].message.content == " ok" * 7 and chat.choices[0].finish_reason == "length"
            assert chat.usage is not None and chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 3

            # no max_tokens: a chat gets the simulated model's default (it never ends a sequence by itself), a text
            # completion OpenAI's 16
            long = await client.chat.completions.create(model=PROFILE, messages=[{"role": "user", "content": "hi"}])
            assert long.usage is not None and long.usage.completion_tokens == DEFAULT_MAX_TOKENS
            whole = await client.completions.create(model=PROFILE, prompt="hello")
            assert whole.usage is not None and whole.usage.completion_tokens == 16

            # a stop string never matches (no model decides the text), and the stream still ends properly
            text = ""
            stream = await client.completions.create(model=PROFILE, prompt="count", max_tokens=5, stop=["zzz"],
                                                     stream=True)
            finish = None
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert (text, finish) == (" ok" * 5, "length")

            async with httpx.AsyncClient(base_url=proc.openai_url.removesuffix("/v1"), timeout=30) as http:
                refused = await http.post("/v1/completions", json={"model": PROFILE, "prompt": "x", "max_tokens": 2,
                                                                  "logprobs": 1})
                assert refused.status_code == 400 and "no logprobs" in refused.json()["error"]["message"]
                assert (await http.get("/health")).status_code == 200
                metrics = (await http.get("/metrics")).text
                assert f'vllm:num_requests_running{{model_name="{PROFILE}",engine="1"}} 0' in metrics

            # 24 streams at once, then unit 1 taken out under them: every stream ends whole
            first_chunk = asyncio.Event()
            started = 0

            async def one(k: int) -> tuple[str, str | None]:
                nonlocal started
                out, finish = "", None
                s = await client.chat.completions.create(
                    model=PROFILE, messages=[{"role": "user", "content": f"stream {k}"}], max_tokens=MAX_TOKENS,
                    stream=True)
                async for chunk in s:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if not out:
                            started += 1
                            if started == STREAMS:
                                first_chunk.set()
                        out += chunk.choices[0].delta.content
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                return out, finish

            tasks = [asyncio.create_task(one(k)) for k in range(STREAMS)]
            await asyncio.wait_for(first_chunk.wait(), 30)
            code, reply = await asyncio.to_thread(proc.ctl, "fail-unit", "--unit", "1")
            assert code == 0, reply
            results = await asyncio.gather(*tasks)
            assert results == [(" ok" * MAX_TOKENS, "length")] * STREAMS
            code, reply = await asyncio.to_thread(proc.ctl, "status")
            units = {u["unit_id"]: u for u in json.loads(reply)["payload"]["units"]}
            assert units[1]["mode"] == "failed" and units[0]["mode"] == "active"
            code, reply = await asyncio.to_thread(proc.ctl, "recover-unit", "--unit", "1")
            assert code == 0, reply
            after = await client.completions.create(model=PROFILE, prompt="back", max_tokens=3)
            assert after.choices[0].text == " ok" * 3

        run(go, timeout_s=120)
    finally:
        assert proc.stop() == 0
    lines = proc.lines()
    moved = [int(m.group(1)) for line in lines
             if line.startswith("unit 1 failed") and (m := re.search(r"\((\d+) request\(s\) go on elsewhere\)", line))]
    assert len(moved) == 1 and moved[0] >= 1, lines  # streams were on unit 1, and went on on unit 0
    assert any(line.startswith("trackside agent: stopped: ") and ", 0 refused, 0 aborted or failed" in line
               for line in lines), lines


def test_an_operators_tokenizer_counts_the_prompts_and_renders_the_chats_in_every_front_end(tmp_path: Path) -> None:
    """With ``--sim-tokenizer DIR`` the app renders requests with that tokenizer (its words, its chat template, its
    context) and every token a unit produces is its ``ok``; with ``--openai-frontends 2`` two front-end processes
    serve the app, each rendering with it and refusing logprobs itself. ``--kill-engine 1@0`` counts from when the
    port is up (the front ends take seconds to start)."""
    from transformers import AutoTokenizer

    folder = word_tokenizer(tmp_path / "tokenizer")
    words, tiny = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(tiny_model_dir())
    prompt = "hello world, please say hello"
    assert len(tiny.encode(prompt)) > len(words.encode(prompt)) == 6  # the counts tell the tokenizers apart
    proc = AgentProcess(tmp_path, "--runtime", "live", "--sim-tokenizer", str(folder), "--openai-frontends", "2",
                        "--kill-engine", "1@0", "--no-restart", simulated=True, openai_api=True)
    assert any("(2 front-end processes, PIDs " in line and
               f"every token 'ok'; prompts counted by the tokenizer in {folder.resolve()}" in line
               for line in proc.lines()), proc.lines()
    try:
        async def go() -> None:
            client = proc.client()
            text = await client.completions.create(model=PROFILE, prompt=prompt, max_tokens=4)
            assert text.choices[0].text == "ok" * 4
            assert text.usage is not None and text.usage.prompt_tokens == 6
            messages = [{"role": "user", "content": "say hello"}]
            chat = await client.chat.completions.create(model=PROFILE, messages=messages,  # type: ignore[arg-type]
                                                        max_tokens=3)
            assert chat.choices[0].message.content == "ok" * 3
            rendered = words.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert rendered == "user: say hello assistant: "
            assert chat.usage is not None and chat.usage.prompt_tokens == len(words.encode(rendered)) == 6
            frontends = set()
            for _ in range(12):  # new connections, spread by the kernel (SO_REUSEPORT)
                async with httpx.AsyncClient(base_url=proc.openai_url.removesuffix("/v1"), timeout=30) as http:
                    tokens = await http.post("/tokenize", json={"model": PROFILE, "prompt": "hello nowhere"})
                    assert (tokens.json()["tokens"], tokens.json()["max_model_len"]) == ([3, 0], WORD_MAX_LEN)
                    refused = await http.post("/v1/completions", json={"model": PROFILE, "prompt": "hello",
                                                                      "max_tokens": 2, "logprobs": 1})
                    assert refused.status_code == 400 and "no logprobs" in refused.json()["error"]["message"]
                    answered = await http.post("/v1/completions", json={"model": PROFILE, "prompt": "hello world",
                                                                       "max_tokens": 2})
                    assert answered.json()["usage"]["prompt_tokens"] == 2
                    frontends.add(answered.headers["x-trackside-frontend"])
            assert frontends <= {"0", "1"} and frontends

        run(go, timeout_s=60)
    finally:
        assert proc.stop() == 0
    lines = proc.lines()
    up = next(i for i, line in enumerate(lines) if "OpenAI API at " in line)
    killed = [i for i, line in enumerate(lines) if line.startswith("unit 1 failed: engine killed by --kill-engine 1@0")]
    assert len(killed) == 1 and killed[0] > up, lines


def test_the_units_token_is_the_first_of_ok_as_the_tokenizer_encodes_it(tmp_path: Path) -> None:
    assert sim_tokenizer().token == SIM_TOKEN == (7, " ok")
    word = sim_tokenizer(str(word_tokenizer(tmp_path / "words")))
    assert (word.token, word.vocab_size, word.max_len, word.own) == ((6, "ok"), len(WORDS), WORD_MAX_LEN, True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no tokenizer in it"):
        sim_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="broken: no tokenizer there that transformers can load"):
        sim_tokenizer(str(tmp_path / "broken"))


def test_vllm_checks_the_front_end_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--openai-arg`` goes through vLLM's own parser and ``--sim-tokenizer`` is loaded before anything starts (the
    other refusals around the port: ``test_sim_live_agent.py``)."""
    live = ("--runtime", "live", "--serve-openai", "127.0.0.1:0")
    assert error_of(capsys, *live, "--openai-arg", "no_such_flag=1").startswith(
        "--openai-arg: unrecognized arguments: --no-such-flag")
    with socket.socket() as taken:  # a port held by a process that does not share it: the error names both ports
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = f"127.0.0.1:{taken.getsockname()[1]}"
        assert error_of(capsys, "--runtime", "live", "--serve-openai", port, "--listen", "127.0.0.1:0") == (
            f"cannot listen on 127.0.0.1:0 or {port}: Address already in use")
    assert error_of(capsys, *live, "--sim-tokenizer", str(tmp_path / "none")) == (
        f"--sim-tokenizer {tmp_path / 'none'}: not a folder (one with a Hugging Face tokenizer: tokenizer.json and "
        "tokenizer_config.json, as a model's folder has)")
