"""A what-if session on one machine: record a simulated node, ask which policy would have served it best, apply it.

    python examples/whatif/run.py                      # record 30 s, what-if, show the answer (nothing applied)
    python examples/whatif/run.py --apply              # ... and apply the recommendation to the running agent
    python examples/whatif/run.py --record-s 10 --batch-policy eb --workload sharegpt-like:n=100000,rate=60

The steps an operator takes, as commands (each printed before it runs):

1. ``trackside agent``: a simulated node (4 units, ``--batch-policy`` on ``--trace`` or ``--workload``, ``--speed``
   node seconds per real second; by default vLLM's policy on the Azure code trace at 20x), its control token in
   ``--dir``/token (mode 0600, new each run);
2. ``trackside record``: every event into ``--dir``/telemetry.duckdb for ``--record-s`` seconds, then stopped (it
   flushes; DuckDB lets one process write a file and then no other open it);
3. ``trackside whatif``: the recorded window replayed under every batch policy, the ranked table, the fidelity and
   the recommendation (``--dir``/whatif.json has it all);
4. with ``--apply``: ``trackside whatif --apply`` sends the recommendation to the agent (its dry run, then the change;
   ``--yes`` here, as the script asks nothing), and ``trackside ctl status`` shows the units' policies after.

Run it with the Python that has trackside installed. The agent is stopped at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

TRACKSIDE = [sys.executable, "-m", "agent.cli"]
TRACE = Path(__file__).resolve().parents[1] / "traces" / "azure_code_2023.csv"
LISTENING = re.compile(r"trackside agent \S+: (wss?://\S+) \(")


def say_and_run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    print(f"\n$ trackside {shlex.join(argv[len(TRACKSIDE):])}", flush=True)
    return subprocess.run(argv, check=False, **kwargs)  # type: ignore[call-overload, no-any-return]


def start_agent(args: argparse.Namespace, token: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    source = ["--workload", args.workload] if args.workload else ["--trace", str(args.trace)]
    argv = [*TRACKSIDE, "agent", "--node-id", "whatif-demo", "--units", "4", "--batch-policy", args.batch_policy,
            *source, "--speed", f"{args.speed:g}", "--listen", f"127.0.0.1:{args.port}", "--token-file", str(token)]
    print(f"$ trackside {shlex.join(argv[len(TRACKSIDE):])} &", flush=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        match = LISTENING.search(log.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited with status {proc.returncode} (log: {log})")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the agent did not listen within 30 s (log: {log})")


def record(url: str, db: Path, seconds: float, log: Path) -> None:
    argv = [*TRACKSIDE, "record", url, "--db", str(db)]
    print(f"\n$ trackside {shlex.join(argv[len(TRACKSIDE):])}    # for {seconds:g} s", flush=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    time.sleep(seconds)
    proc.send_signal(signal.SIGINT)  # the recorder flushes what it has and exits
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"the recorder did not stop within 30 s (log: {log})") from None
    print(f"recorded into {db} (log: {log})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("whatif-run"),
                        help="where the files go (default ./whatif-run)")
    parser.add_argument("--batch-policy", default="vllm", help="the policy the node runs (default vllm)")
    parser.add_argument("--trace", type=Path, default=TRACE, help="the node's traffic (default the Azure code trace)")
    parser.add_argument("--workload", metavar="SPEC", help="synthetic traffic instead, e.g. sharegpt-like:n=100000")
    parser.add_argument("--speed", type=float, default=20.0, help="node seconds per real second (default 20)")
    parser.add_argument("--record-s", type=float, default=30.0, help="seconds to record (default 30)")
    parser.add_argument("--port", type=int, default=7741, help="the agent's port (default 7741)")
    parser.add_argument("--compare", metavar="P1,P2,...", help="candidate batch policies (default every built-in one)")
    parser.add_argument("--apply", action="store_true", help="apply the recommendation to the running agent")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    token, db = args.dir / "token", args.dir / "telemetry.duckdb"
    db.unlink(missing_ok=True)
    token.unlink(missing_ok=True)
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24) + "\n")
    agent, url = start_agent(args, token, args.dir / "agent.log")
    try:
        record(url, db, args.record_s, args.dir / "record.log")
        whatif = [*TRACKSIDE, "whatif", "--db", str(db), "--json", str(args.dir / "whatif.json")]
        if args.compare:
            whatif += ["--compare", args.compare]
        if args.apply:
            whatif += ["--apply", url, "--token-file", str(token), "--yes"]
        done = say_and_run(whatif)
        if done.returncode != 0:
            return done.returncode
        if args.apply:
            say_and_run([*TRACKSIDE, "ctl", url, "status"])
    finally:
        agent.terminate()
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
