"""``docs/deploy.md`` and ``examples/deploy/*.service``: the commands of the deployment guide, run.

The guide's ``sh``/``bash`` blocks are read as written; every ``trackside`` command that needs no GPU runs with its
paths moved to a temporary folder (``/etc/trackside/...``, ``/var/lib/trackside/...``, ``~/.config/trackside/...``,
the venv's ``trackside`` as this interpreter's ``python -m agent.cli``, port 7700 as a free one, the node's name as
``localhost``): ``--help``, ``--dry-run`` (vLLM), the recorder unit's ``ExecStart`` against a simulated agent,
``sql``, ``prune``, ``ctl``, the console (headless) over a plain socket and over TLS with the guide's ``openssl``
certificates. Every flag of every ``trackside`` command in the guide and in the units must exist in that command's
``--help``. The GPU commands (starting engines, ``systemctl``, ``journalctl``, ``ssh``) are not run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "deploy.md"
UNITS = sorted((ROOT / "examples" / "deploy").glob("*.service"))
VENV_TRACKSIDE = "/opt/trackside/venv/bin/trackside"
TRACKSIDE = [sys.executable, "-m", "agent.cli"]


# -- reading the guide ----------------------------------------------------------------------------------------
def blocks(lang: tuple[str, ...]) -> list[str]:
    found = re.finditer(r"^```(\w*)\n(.*?)^```", DOC.read_text(), re.S | re.M)
    return [m.group(2) for m in found if m.group(1) in lang]


def shell_lines() -> list[str]:
    """Every command line of the shell blocks, continuations joined, split at ``&&``."""
    lines: list[str] = []
    for block in blocks(("sh", "bash")):
        for line in block.replace("\\\n", " ").splitlines():
            lines.extend(part.strip() for part in line.split("&&") if part.strip())
    return lines


def is_trackside(line: str) -> bool:
    words = line.removeprefix("sudo -u trackside ").split()
    words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    return bool(words) and words[0] in ("trackside", VENV_TRACKSIDE)


def doc_commands() -> list[str]:
    return [line for line in shell_lines() if is_trackside(line)]


def unit_exec_starts() -> list[str]:
    starts = [line.removeprefix("ExecStart=") for unit in UNITS for line in unit.read_text().splitlines()
              if line.startswith("ExecStart=")]
    assert len(starts) == len(UNITS) >= 2
    return starts


def moved(text: str, paths: dict[str, str]) -> str:
    """``text`` with each of ``paths``'s keys replaced, in one pass (a new path is not replaced again)."""
    if not paths:
        return text
    pattern = "|".join(re.escape(old) for old in sorted(paths, key=len, reverse=True))
    return re.sub(pattern, lambda m: paths[m.group(0)], text)


def split(line: str, paths: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """``line`` as (environment, argv): ``sudo -u trackside`` dropped, the paths in ``paths`` replaced, ``trackside``
    this interpreter's."""
    line = moved(line, paths or {})
    words = shlex.split(line.removeprefix("sudo -u trackside "), comments=True)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] in ("trackside", VENV_TRACKSIDE), line
    return env, words[1:]


def subcommand(argv: list[str]) -> list[str]:
    """The subcommand path whose ``--help`` lists ``argv``'s flags (``ctl`` takes an action after its URI)."""
    if not argv or argv[0].startswith("-"):
        return []
    if argv[0] == "ctl":
        actions = [w for w in argv[1:] if w in ("status", "policies", "set-policy", "set-dispatch", "set-param",
                                                "pause", "drain", "resume")]
        return ["ctl", *actions[:1]]
    return argv[:1]


@cache
def help_text(path: tuple[str, ...]) -> str:
    argv = [path[0], "ws://127.0.0.1:1", *path[1:]] if len(path) > 1 else list(path)  # ctl URI ACTION --help
    done = subprocess.run([*TRACKSIDE, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- every flag exists ----------------------------------------------------------------------------------------
def test_the_guide_names_the_commands_it_is_about() -> None:
    commands = doc_commands()
    text = " ".join(commands)
    for needed in ("agent --config /etc/trackside/node.toml", "--dry-run", "record ws://", "--retention",
                   "console ws://127.0.0.1:7700", "console wss://", "ctl wss://"):
        assert needed in text, needed
    assert any(line.startswith("ssh -N -L 7700:127.0.0.1:7700") for line in shell_lines())
    assert [unit.name for unit in UNITS] == ["trackside-agent.service", "trackside-recorder.service"]


@pytest.mark.parametrize("line", [*doc_commands(), *unit_exec_starts()])
def test_every_flag_is_in_the_commands_help(line: str) -> None:
    _, argv = split(line)
    path = subcommand(argv)
    helps = help_text(tuple(path)) + (help_text(tuple(path[:1])) if len(path) > 1 else "")
    for word in argv:
        if word.startswith("--"):
            flag = word.partition("=")[0]
            found = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps)
            assert found, f"{flag} not in `{' '.join(path)} --help`"


def test_the_units() -> None:
    agent, recorder = (unit.read_text() for unit in UNITS)
    start = next(line for line in agent.splitlines() if line.startswith("ExecStart="))
    assert start.split() == ["ExecStart=" + VENV_TRACKSIDE, "agent", "--config", "/etc/trackside/node.toml",
                             "--token-file", "/etc/trackside/token"]
    for text in (agent, recorder):
        assert "User=trackside" in text and "Restart=on-failure" in text
    assert "Environment=VLLM_USE_FLASHINFER_SAMPLER=0" in agent
    settings = [line.split("=")[0] for line in agent.splitlines() if line and not line.startswith("#")]
    for breaks_gpus in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "MemoryDenyWriteExecute"):
        assert breaks_gpus not in settings, breaks_gpus


def test_the_help_commands_run() -> None:
    helps = [line for line in doc_commands() if line.split()[-1] == "--help"]
    assert helps
    for line in helps:
        _, argv = split(line)
        done = subprocess.run([*TRACKSIDE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage: trackside" in done.stdout, line


# -- the dry runs (vLLM's parser types the engine arguments) ------------------------------------------------
def node_paths(tmp_path: Path) -> dict[str, str]:
    """The guide's node config (the example it copies to /etc/trackside/node.toml) and token in ``tmp_path``."""
    copy = next(line for line in shell_lines() if line.startswith("sudo cp ") and "/etc/trackside/node.toml" in line)
    example = ROOT / copy.split()[2].removeprefix("/opt/trackside/src/")
    shutil.copy(example, tmp_path / "node.toml")
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "token").chmod(0o600)
    return {"/etc/trackside/node.toml": str(tmp_path / "node.toml"), "/etc/trackside/token": str(tmp_path / "token"),
            "/opt/trackside/src/": f"{ROOT}/", "~/.config/trackside/": f"{tmp_path}/",
            "/var/lib/trackside/": f"{tmp_path}/", "/tmp/": f"{tmp_path}/", "/etc/trackside/tls/": f"{tmp_path}/"}


def run_dry(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    from agent.cli.serve import main

    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    plan, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
    assert isinstance(plan, dict) and all(one["units"] for one in plan.get("agents", [plan]))
    return plan


@pytest.mark.vllm
def test_the_dry_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    monkeypatch.chdir(ROOT)
    paths = node_paths(tmp_path)
    dry = [line for line in doc_commands() if line.split()[-1] == "--dry-run"]
    assert len(dry) >= 3 and any("--agents" in line for line in dry)
    for line in dry:
        _, argv = split(line, paths)
        plan = run_dry(capsys, argv)
        for one in plan.get("agents", [plan]):  # --agents N: each agent's plan
            assert one["control"] is ("--token-file" in argv)
        if "--agents" in argv:  # the 8-GPU example as four agents of two GPUs on one OpenAI port
            assert [([u["gpus"] for u in a["units"]], a["listen"], a["serve_openai"]) for a in plan["agents"]] == [
                ([[2 * i], [2 * i + 1]], f"127.0.0.1:{7700 + i}", "127.0.0.1:8000") for i in range(4)]
    # The unit's own command line, as the guide checks it, and with the guide's TLS lines in the config.
    _, argv = split(unit_exec_starts()[0], paths)
    plan = run_dry(capsys, [*argv, "--dry-run"])
    assert plan["control"] is True and len(plan["units"]) == 8 and plan["listen"] == "127.0.0.1:7700"
    (toml,) = blocks(("toml",))
    toml = moved(toml, paths)
    keys = {line.split("=")[0].strip() for line in toml.splitlines() if "=" in line}
    node = (tmp_path / "node.toml").read_text().splitlines()
    kept = [line for line in node if line.split("=")[0].strip() not in keys]  # the examples' keys come first
    (tmp_path / "node.toml").write_text(toml + "\n".join(kept) + "\n")
    assert run_dry(capsys, [*argv, "--dry-run"])["listen"] == "0.0.0.0:7700"


@pytest.mark.vllm
def test_several_agents_on_one_node(tmp_path: Path) -> None:
    """The guide's "Several agents on one node" block, run with bash: its configs, made from the example, resolve to
    four agents on GPU pairs with their own node ids and ports (``--dry-run``); the systemd template's command names
    each instance's config."""
    pytest.importorskip("vllm")
    (block,) = [b for b in blocks(("sh",)) if "node-$i.toml" in b and "for i in 1 2 3" in b]
    script = moved(block.replace("sudo install -m 640 -g trackside", "install -m 640"), {
        "/etc/trackside/": f"{tmp_path}/", "/opt/trackside/src/": f"{ROOT}/",
        VENV_TRACKSIDE: " ".join(shlex.quote(w) for w in TRACKSIDE)})
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    decoder = json.JSONDecoder()
    plans, text = [], done.stdout
    while "{\n" in text:
        plan, end = decoder.raw_decode(text[text.index("{\n"):])
        plans.append(plan)
        text = text[text.index("{\n") + end:]
    assert [[u["gpus"] for u in p["units"]] for p in plans] == [[[2 * i], [2 * i + 1]] for i in range(4)]
    assert [(p["node_id"], p["serve_openai"], p["openai_reuse_port"], p["listen"]) for p in plans] == [
        (f"gpu-node-7-{i}", "127.0.0.1:8000", True, f"127.0.0.1:{7700 + i}") for i in range(4)]
    (template,) = [b for b in blocks(("sh",)) if "trackside-agent@.service" in b]
    sed = template.replace("\\\n", " ").split(" | sudo tee ")[0]  # the sed of the unit file, as the guide has it
    unit = subprocess.run(["bash", "-c", moved(sed, {"/opt/trackside/src/": f"{ROOT}/"})], capture_output=True,
                          text=True, check=True).stdout
    (start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert "--config /etc/trackside/node-%i.toml" in start


# -- live: a simulated agent, the recorder unit, sql, prune, ctl and the console ----------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def simulated_agent(port: int, *extra: str) -> Iterator[None]:
    proc = subprocess.Popen([*TRACKSIDE, "agent", "--units", "2", "--workload", "sharegpt-like", "--listen",
                             f"127.0.0.1:{port}", *extra], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "trackside agent" in line and f":{port}" in line, line
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def run(line: str, paths: dict[str, str], tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    own, argv = split(line, paths)
    full_env = {**os.environ, "HOME": str(tmp_path), **(env or {}), **own}
    full_env.pop("SSL_CERT_FILE", None) if "SSL_CERT_FILE" not in own else None
    return subprocess.run([*TRACKSIDE, *argv, *extra], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def headless(argv_line: str) -> tuple[str, ...]:
    return ("--headless", "--exit-after", "3", *(() if "--db" in argv_line else ("--no-record",)))


def test_recorder_unit_sql_prune_ctl_and_console(tmp_path: Path) -> None:
    port = free_port()
    paths = {**node_paths(tmp_path), ":7700": f":{port}", "node1.duckdb": str(tmp_path / "node1.duckdb")}
    with simulated_agent(port, "--token-file", str(tmp_path / "token")):
        _, argv = split(unit_exec_starts()[1], paths)
        recorder = subprocess.Popen([*TRACKSIDE, *argv], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        # its hello from the agent, not 4 s: a start slower than that on a loaded machine was killed by the SIGTERM
        # before its handlers were in place (and had no store yet)
        assert recorder.stderr is not None
        said = []
        for line in recorder.stderr:
            said.append(line)
            if line.startswith("trackside record: ") and ": node " in line:
                break
        else:
            raise AssertionError(f"the recorder ended without a hello: {''.join(said)}")
        time.sleep(1.0)  # some steps for the commands below (nothing counts them)
        recorder.send_signal(signal.SIGTERM)
        assert recorder.wait(timeout=30) == 0
        assert (tmp_path / "telemetry.duckdb").is_file()
        for line in doc_commands():
            if " console ws://" in line or " ctl ws://127.0.0.1:7700 " in line:  # one agent (several: section 8)
                done = run(line, paths, tmp_path, *(headless(line) if " console " in line else ()))
                assert done.returncode == 0, (line, done.stderr)
    cp = next(line for line in shell_lines() if "cp /var/lib/trackside/telemetry.duckdb" in line)
    source, target = (moved(word, paths) for word in cp.split()[-2:])
    shutil.copy(source, target)
    queries = [line for line in doc_commands() if " sql " in line or " prune " in line]
    assert len(queries) == 2
    for line in queries:
        done = run(line, paths, tmp_path)
        assert done.returncode == 0, (line, done.stderr)


def test_tls_with_the_guides_certificates(tmp_path: Path) -> None:
    if shutil.which("openssl") is None or shutil.which("bash") is None:
        pytest.skip("needs openssl and bash")
    for line in shell_lines():
        if line.startswith("openssl "):
            done = subprocess.run(["bash", "-c", line.replace("node1.example.com", "localhost")], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (line, done.stderr)
    port = free_port()
    paths = {**node_paths(tmp_path), ":7700": f":{port}", "node1.example.com": "localhost"}
    with simulated_agent(port, "--token-file", str(tmp_path / "token"), "--tls-cert", str(tmp_path / "node1.pem"),
                         "--tls-key", str(tmp_path / "node1.key")):
        wss = [line for line in doc_commands() if "wss://node1.example.com:7700" in line and "--ca-file " in line]
        assert len(wss) == 2
        for line in wss:
            done = run(line, paths, tmp_path, *(headless(line) if " console " in line else ()))
            assert done.returncode == 0, (line, done.stderr)
            # Without the CA the certificate is not trusted; a ws:// client is refused.
            bare = re.sub(r" --ca-file \S+", "", line).replace(" console ", " ctl ", 1).split(" --token-file")[0]
            bare = bare if bare.rstrip().endswith("status") else bare + " status"
            done = run(bare, paths, tmp_path)
            assert done.returncode == 1 and "certificate verify failed" in done.stderr, done.stderr
        done = subprocess.run([*TRACKSIDE, "ctl", f"ws://127.0.0.1:{port}", "status"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and "did not receive a valid HTTP response" in done.stderr
