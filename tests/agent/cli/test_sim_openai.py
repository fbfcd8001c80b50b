"""``trackside agent --runtime live --serve-openai``: vLLM's own OpenAI app over simulated units, as an operator runs it
(a child process, the ``openai`` client, ``trackside ctl``), and what it refuses."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import httpx
from agent_errors import error_of
from agent_process import AgentProcess
from serve_harness import run

from agent.cli.serve import main
from agent.engine.vllm.sim_model import DEFAULT_MAX_TOKENS

pytestmark = pytest.mark.vllm

PROFILE = "h100-llama31-8b"
STREAMS = 24
MAX_TOKENS = 150


def ctl(agent: AgentProcess, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["ctl", agent.ws_url, "--json", "--token-file", str(agent.token_file), *argv])
    return code, out.getvalue()


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
            code, reply = await asyncio.to_thread(ctl, proc, "fail-unit", "--unit", "1")
            assert code == 0, reply
            results = await asyncio.gather(*tasks)
            assert results == [(" ok" * MAX_TOKENS, "length")] * STREAMS
            code, reply = await asyncio.to_thread(ctl, proc, "status")
            units = {u["unit_id"]: u for u in json.loads(reply)["payload"]["units"]}
            assert units[1]["mode"] == "failed" and units[0]["mode"] == "active"
            code, reply = await asyncio.to_thread(ctl, proc, "recover-unit", "--unit", "1")
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


def test_vllm_checks_the_front_end_options(capsys: pytest.CaptureFixture[str]) -> None:
    """``--openai-arg`` goes through vLLM's own parser before anything starts (the other refusals around the port:
    ``test_sim_live_agent.py``)."""
    assert error_of(capsys, "--runtime", "live", "--serve-openai", "127.0.0.1:0", "--openai-arg",
                    "no_such_flag=1").startswith("--openai-arg: unrecognized arguments: --no-such-flag")
