"""``trackside agent --engine vllm --agents N``: one command for several agents on one node.

One agent's front end is one process: one event loop streams every unit's tokens, and on an H100 it saturated at
about 24,000 output tokens a second where two agents streamed a third more (``docs/vllm.md``, "GPU run: one front end
against two"). ``--agents N`` splits the node's units into ``N`` agents of ``units / N`` each, every one a child
process that is a whole agent of its own (its units, dispatcher, telemetry and control), with

* its share of the GPUs (``--gpus``: consecutive units, as the node resolved them) and the same memory share per unit;
* node id ``NODE-i`` and telemetry port ``PORT + i`` (``--listen``; port 0 stays 0: the OS picks);
* the one OpenAI port, shared (``--openai-reuse-port``: Linux spreads the connections between the agents);
* its units' own engine arguments (``[unit.N]``, ``--engine-arg N:KEY=VALUE``) under their numbers in the agent.

Before anything starts, each agent's plan is resolved here as its own ``--dry-run`` would, and must give its units
what the node's plan gave them (GPUs, parallel sizes, memory shares, every engine argument).

The children start one after another (units sharing a GPU measure its free memory while they start), their output
comes through this process's stderr, and one that exits without being asked is started again with backoff (1 s,
doubling up to 60 s; back to 1 s once it has run a minute), after what it left running (its engine cores, when it was
killed) is killed too. SIGTERM or SIGINT stops them all. ``--dry-run`` prints
``{"agents": [...]}``, each child's own dry-run document. What it costs is in ``docs/deploy.md``, "Several agents on
one node": each agent's dispatcher sees only its own units.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from agent.cli.common import ServeError, parse_listen
from agent.telemetry.client import host_port

READY = "trackside agent: OpenAI API at "
"""The line an agent prints once its OpenAI port takes requests."""
TELEMETRY = re.compile(r"^trackside agent \S+: (wss?://\S+) ")
"""The line an agent prints once its telemetry listens (its URL)."""
BACKOFF_S = (1.0, 60.0)
"""A child that exited is started again after the first delay, doubling up to the second."""
STEADY_S = 60.0
"""A child that ran this long before it exited starts again after the shortest delay."""
STOP_TIMEOUT_S = 60.0
"""How long a stop waits for the children before it kills them (under systemd, before its own 90 s,
``TimeoutStopSec`` of ``examples/deploy/trackside-agent.service``)."""


def node_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` (the config file expanded) without ``--config FILE`` and without its per-unit engine arguments: a
    child that read the file again, or got ``N:KEY=VALUE`` as given, would have the node's unit numbers."""
    from agent.engine.vllm.engine_args import EngineArgError, parse_engine_arg

    def per_unit(value: str) -> bool:
        try:
            return parse_engine_arg(value).unit_id is not None
        except EngineArgError:
            return False  # left for the child's own check to refuse

    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--config" or (word == "--engine-arg" and i + 1 < len(argv) and per_unit(argv[i + 1])):
            i += 2
        elif word.startswith("--config=") or (word.startswith("--engine-arg=") and per_unit(word.partition("=")[2])):
            i += 1
        else:
            out.append(word)
            i += 1
    return out


def child_argvs(args: argparse.Namespace, plan: Any) -> list[list[str]]:
    """Each child's ``trackside agent`` arguments: the node's own (``args.argv``, the config file expanded), then
    what makes it one agent of ``--agents``. Raises :class:`ServeError` for a node that cannot be split."""
    n = int(args.agents)
    units = list(plan.units)
    if args.serve_openai is None or args.workload is not None or args.trace is not None:
        raise ServeError("--agents splits the node's OpenAI intake: give --serve-openai HOST:PORT and no "
                         "--workload/--trace (a replay runs in one agent)")
    if len(units) % n:
        raise ServeError(f"--agents {n}: the node has {len(units)} units, not a multiple of {n}")
    shares = sorted({u.placement.gpu_memory_utilization for u in units})
    host, port = parse_listen(args.listen)
    per = len(units) // n
    base = node_argv(args.argv)
    out = []
    for i in range(n):
        mine = units[i * per:(i + 1) * per]
        argv = [*base, "--agents", "1", "--units", str(per), "--node-id", f"{args.node_id}-{i}",
                "--listen", host_port(host, port + i if port else 0), "--openai-reuse-port"]
        for j, unit in enumerate(mine):  # a unit's own arguments, under its number in the agent
            own = [replace(a, unit_id=j) for a in unit.args if a.unit_id is not None]
            argv += [word for a in own for word in ("--engine-arg", str(a))]
        if plan.gpu_ids is not None:
            gpus = sorted({g for u in mine for g in u.placement.gpu_ids})
            argv += ["--gpus", ",".join(map(str, gpus))]
        if not plan.fake_executor and len(shares) == 1:  # the node's share per unit, also where a GPU is shared
            argv += ["--gpu-memory-utilization", str(shares[0])]
        out.append(argv)
    return out


def child_plans(argvs: Sequence[Sequence[str]], node_units: Sequence[dict[str, Any]],
                main: Callable[[Sequence[str]], int]) -> list[dict[str, Any]]:
    """Each child's ``--dry-run`` document, resolved in this process; raises :class:`ServeError` where a child's
    units differ from the node's units it takes (``node_units``: the node's plan, as ``--dry-run`` shows it)."""
    docs = []
    per = len(node_units) // len(argvs)
    for i, argv in enumerate(argvs):
        buffer, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(errors):
            code = main([*argv, "--dry-run"])
        if code != 0:
            raise ServeError(f"--agents: agent {i} does not resolve: {errors.getvalue().strip()}")
        text = buffer.getvalue()
        doc, _ = json.JSONDecoder().raw_decode(text[text.index("{\n"):])
        for j, (got, want) in enumerate(zip(doc["units"], node_units[i * per:(i + 1) * per], strict=True)):
            got, want = ({k: v for k, v in u.items() if k != "unit"} for u in (got, want))
            if got != want:
                diff = sorted(k for k in {*got, *want} if got.get(k) != want.get(k))
                raise ServeError(f"--agents: agent {i}'s unit {j} would not be the node's unit {i * per + j} "
                                 f"(it differs in {', '.join(diff)})")
        docs.append(doc)
    return docs


@dataclass
class Child:
    """One agent of the group: its arguments, its process and what its output said."""

    argv: list[str]
    proc: subprocess.Popen[str] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    telemetry: str = ""
    """Its telemetry's URL, once it said."""
    openai: str = ""
    """Its OpenAI API's URL, once it said."""
    started_at: float = 0.0
    delay_s: float = BACKOFF_S[0]
    due_at: float | None = None
    """When to start it again (None: running, or not to start)."""

    def start(self, err: IO[str]) -> None:
        self.ready.clear()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", *self.argv], stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        threading.Thread(target=self._pump, args=(self.proc, err), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str], err: IO[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if m := TELEMETRY.match(line):
                self.telemetry = m.group(1)
            if line.startswith(READY):
                self.openai = line[len(READY):].strip()
                self.ready.set()
            err.write(line)
            err.flush()


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the group's process dies (``prctl(PR_SET_PDEATHSIG)``), so that
    no agent outlives a group killed with SIGKILL."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def run_group(argvs: Sequence[Sequence[str]], *, err: IO[str] | None = None) -> int:
    """Start the children one after another, keep them running, stop them all on SIGTERM/SIGINT; 0 when every child
    stopped cleanly."""
    out = err or sys.stderr
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    children = [Child(list(argv)) for argv in argvs]
    try:
        for i, child in enumerate(children):
            child.start(out)
            while not child.ready.wait(0.2):
                assert child.proc is not None
                if stop.is_set():
                    return _stop(children, out)
                if child.proc.poll() is not None:
                    print(f"trackside agent group: agent {i} exited with code {child.proc.returncode} before it "
                          "served; stopping the others", file=out, flush=True)
                    _stop(children, out)
                    return 1
        print(f"trackside agent group: {len(children)} agents serve one OpenAI port, {children[0].openai}; "
              f"their telemetry: {' '.join(c.telemetry for c in children)}", file=out, flush=True)
        while not stop.wait(0.2):
            _keep(children, out)
        return _stop(children, out)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _keep(children: Sequence[Child], out: IO[str]) -> None:
    """Start again, with backoff, a child that exited without being asked."""
    now = time.monotonic()
    for i, child in enumerate(children):
        if child.due_at is not None:
            if now >= child.due_at:
                child.due_at = None
                print(f"trackside agent group: starting agent {i} again", file=out, flush=True)
                child.start(out)
            continue
        assert child.proc is not None
        code = child.proc.poll()
        if code is None:
            continue
        _sweep(child.proc)
        if now - child.started_at >= STEADY_S:
            child.delay_s = BACKOFF_S[0]
        child.due_at = now + child.delay_s
        print(f"trackside agent group: agent {i} exited with code {code}: starting it again in "
              f"{child.delay_s:.0f} s", file=out, flush=True)
        child.delay_s = min(child.delay_s * 2, BACKOFF_S[1])


def _sweep(proc: subprocess.Popen[str]) -> None:
    """SIGKILL what is left of an agent that exited: its engine cores, left behind by an agent that was killed, would
    keep their GPU memory from the agent started in its place. They stop by themselves too
    (:mod:`agent.engine.vllm.lifeline`, within seconds): this is at once, and covers what has no lifeline. Each agent
    leads a process group of its own, and its engine cores are in it (the group's id cannot be reused while any of
    them lives)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _stop(children: Sequence[Child], out: IO[str]) -> int:
    """SIGTERM to every running child, SIGKILL to any still running after :data:`STOP_TIMEOUT_S`; 0 when all exited
    with 0."""
    running = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    worst = 0
    for proc in running:
        try:
            code = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _sweep(proc)
            code = proc.wait()
        _sweep(proc)
        worst = worst or (0 if code == 0 else 1)
    print(f"trackside agent group: stopped ({len(running)} agents)", file=out, flush=True)
    return worst
