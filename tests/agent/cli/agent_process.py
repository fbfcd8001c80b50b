"""``trackside agent --engine vllm --fake-executor ...`` (or simulated units) as a child process, for the tests of this
folder that run the agent as an operator does (``test_vllm_agent.py``, ``test_vllm_frontends.py``,
``test_sim_live_agent.py``, ``test_sim_openai.py``)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
from serve_harness import TOKEN

MODEL = "tiny-llama-fake"
START_TIMEOUT_S = 120.0
WS_LINE = re.compile(r"^trackside agent \S+: (ws://\S+) ")
OPENAI_LINE = re.compile(r"^trackside agent: OpenAI API at (http://\S+)")


class AgentProcess:
    """``trackside agent --engine vllm --fake-executor ...`` as a child process; its URLs read from its stderr."""

    def __init__(self, tmp: Path, *extra: str, token: bool = True, openai_api: bool | str | None = None,
                 simulated: bool = False) -> None:
        """``openai_api``: serve the OpenAI API on a port of the OS's choosing (True), on this address, or not (None:
        vLLM units do, simulated ones not); ``simulated``: simulated units (``extra`` says how)."""
        self.log = tmp / "agent.log"
        engine = ["--node-id", "sim-test"] if simulated else ["--engine", "vllm", "--fake-executor", "--node-id",
                                                              "vllm-test"]
        if openai_api is None:
            openai_api = not simulated
        argv = [sys.executable, "-m", "agent.cli", "agent", *engine, "--units", "2", "--listen", "127.0.0.1:0",
                *extra]
        if openai_api:
            argv += ["--serve-openai", "127.0.0.1:0" if openai_api is True else openai_api]
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN + "\n")
        if token:
            argv += ["--token-file", str(self.token_file)]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        self.ws_url = ""
        self.openai_url = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.ws_url and (self.openai_url or not openai_api)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the agent did not start:\n{self.log.read_text()[-4000:]}")
            for line in self.lines():
                if m := WS_LINE.match(line):
                    self.ws_url = m.group(1)
                elif m := OPENAI_LINE.match(line):
                    self.openai_url = m.group(1)
            time.sleep(0.1)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.openai_url, api_key="unused", max_retries=0, timeout=30.0)

    def ctl(self, *argv: str, token: bool = True) -> tuple[int, str]:
        """``trackside ctl --json`` against this agent (with its token file unless ``token`` is False): (exit status,
        the reply as printed)."""
        from agent.cli.serve import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["ctl", self.ws_url, "--json", *(["--token-file", str(self.token_file)] if token else []),
                         *argv])
        return code, out.getvalue()



def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has: its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
