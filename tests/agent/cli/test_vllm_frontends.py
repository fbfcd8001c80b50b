"""``trackside agent --engine vllm --openai-frontends N`` as an operator runs it: one agent (two fake-executor units)
whose OpenAI port is served by two front-end processes, loaded by real clients on connections of their own; a front
end killed under load and started again; the agent killed outright, its front ends and engine cores ending with it;
a front end that cannot bind the port failing the start with the reason.

The requests through both front ends, every feature of vLLM's app, refusals and disconnects are checked in
``tests/agent/service/test_vllm_openai.py``, whose every test runs with the intake in the agent's process and in two
front-end processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import httpx
import openai
from agent_process import MODEL, AgentProcess, running

from agent.bench.split_frontends import frontend_pids

pytestmark = pytest.mark.vllm

def children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s children."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def frontends_of_agent(agent: AgentProcess) -> list[int]:
    """The front ends' PIDs, from the agent's line that says it serves."""
    pids = frontend_pids("\n".join(agent.lines()))
    assert pids, agent.lines()
    return pids


async def completion(url: str, k: int, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    """A completion on a connection of its own (the kernel picks its front end)."""
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(url + "/completions", json={
            "model": MODEL, "prompt": [5 + k % 500, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream})


async def frontends_of(url: str, n: int) -> set[str]:
    """The front ends (``x-trackside-frontend``) that answered ``n`` completions, each checked."""
    out = set()
    for r in await asyncio.gather(*(completion(url, k) for k in range(n))):
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert r.headers["x-trackside-node"] == "fe-test" and r.headers["x-trackside-unit"] in ("0", "1")
        out.add(r.headers["x-trackside-frontend"])
    return out


async def finished(url: str) -> int:
    """Requests the agent finished, over its units (``trackside_requests_finished_total``)."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
    return sum(int(float(m)) for m in re.findall(r"^trackside_requests_finished_total\{[^}]*\} (\S+)", text, re.M))


def test_two_frontends_serve_one_port_survive_a_killed_one_and_end_with_the_agent(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path, "--openai-frontends", "2", "--node-id", "fe-test")
    try:
        pids = frontends_of_agent(agent)
        assert len(pids) == 2 and all(running(p) for p in pids)
        assert set(pids) <= set(children(agent.proc.pid))
        url = agent.openai_url

        async def go() -> None:
            # both front ends answer, on one port
            assert await frontends_of(url, 40) == {"0", "1"}
            # 200 streams at once, every token of every one
            streams = await asyncio.gather(*(completion(url, k, max_tokens=16, stream=True) for k in range(200)))
            assert [r.status_code for r in streams] == [200] * 200
            assert all(r.text.count('"text":') >= 1 and r.text.rstrip().endswith("data: [DONE]") for r in streams)
            client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
            chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=3, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in chat if c.choices])
            assert text == " ok" * 3
            async with httpx.AsyncClient(timeout=30) as http:
                metrics = (await http.get(url.removesuffix("/v1") + "/metrics")).text
                assert 'vllm:num_requests_running{model_name="tiny-llama-fake",engine="1"}' in metrics
                assert (await http.get(url.removesuffix("/v1") + "/health")).status_code == 200
            # front end 0 killed under load: what it held is aborted in the agent (its requests never finish), the
            # other one answers every new connection meanwhile, and the agent starts front end 0 again
            before = await finished(url)
            load = [asyncio.create_task(completion(url, k, max_tokens=3000, stream=True)) for k in range(16)]
            await asyncio.sleep(1.0)
            os.kill(pids[0], signal.SIGKILL)
            wait_until("the agent to notice", lambda: any("front end 0" in line and "exited" in line
                                                          for line in agent.lines()), 30)
            assert await frontends_of(url, 24) == {"1"}
            outcomes = await asyncio.gather(*load, return_exceptions=True)
            whole = [r for r in outcomes if isinstance(r, httpx.Response) and r.text.rstrip().endswith("[DONE]")]
            assert 0 < len(whole) < 16, outcomes  # (16 connections: both front ends had some)
            async with httpx.AsyncClient(timeout=30) as http:  # nothing left running on the units
                for _ in range(600):
                    metrics = (await http.get(url.removesuffix("/v1") + "/metrics")).text
                    if not re.search(r"^vllm:num_requests_running\{[^}]*\} [1-9]", metrics, re.M):
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("requests still run:\n" + metrics)
            assert await finished(url) - before == 24 + len(whole)
            wait_until("front end 0 back", lambda: any("front end 0 serves again" in line for line in agent.lines()),
                       120)
            assert await frontends_of(url, 40) == {"0", "1"}

        asyncio.run(go())
        # the agent killed outright: its front ends (the new one too) and its engine cores end with it
        mine = [p for p in children(agent.proc.pid) if p not in pids[:1]]
        assert len(mine) >= 4, mine  # two front ends, two engine cores
        agent.proc.kill()
        agent.proc.wait()
        wait_until("the agent's front ends and engine cores to end", lambda: not any(running(p) for p in mine), 30)
    finally:
        agent.stop()


def test_a_front_end_that_cannot_bind_the_port_fails_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:  # a listener that does not share its port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run([
            sys.executable, "-m", "agent.cli", "agent", "--engine", "vllm", "--fake-executor", "--units", "1",
            "--listen", "127.0.0.1:0", "--serve-openai", f"127.0.0.1:{taken.getsockname()[1]}",
            "--openai-frontends", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the OpenAI front ends did not start: front end 0" in done.stderr, done.stderr[-3000:]
    assert "Address already in use" in done.stderr, done.stderr[-3000:]
