"""A second writer of a store file: DuckDB locks it across processes, so a real ``trackside record`` child holds it
here. Another ``trackside record`` on it exits 2 with one line naming the file and the holder (its PID and command
line); the console's recorder says the same; DuckDB's message is parsed for the holder."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.recorder import ConsoleRecorder, RecordError
from store.schema import StoreError, StoreLockedError, connect, lock_holder

ROOT = Path(__file__).resolve().parents[2]
DUCKDB_MESSAGE = ('IO Error: Could not set lock on file "/data/x.duckdb": Conflicting lock is held in '
                  "/usr/bin/python3.11 (PID 28494). See also https://duckdb.org/docs/current/connect/concurrency")


def test_lock_holder_reads_the_pid_and_its_command_line(tmp_path: Path) -> None:
    (tmp_path / "28494").mkdir()
    (tmp_path / "28494" / "cmdline").write_bytes(b"/venv/bin/python3\0/venv/bin/trackside\0record\0ws://n1:7700\0"
                                                 b"--db\0/data/x.duckdb\0")
    assert lock_holder(DUCKDB_MESSAGE, proc=tmp_path) == "PID 28494 (trackside record ws://n1:7700 --db /data/x.duckdb)"
    assert lock_holder(DUCKDB_MESSAGE, proc=tmp_path, max_chars=20) == "PID 28494 (trackside record ...)"
    assert lock_holder(DUCKDB_MESSAGE, proc=tmp_path / "none") == "PID 28494 (python3.11)"
    assert lock_holder('IO Error: Could not set lock on file "/data/x.duckdb"') is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record_argv(db: Path) -> list[str]:
    """``trackside record`` of an agent that is not there: it opens the store, then retries the agent for ever."""
    return [sys.executable, "-m", "agent.cli", "record", f"ws://127.0.0.1:{free_port()}", "--db", str(db)]


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """A store file and the PID of the ``trackside record`` process that holds it (for the tests of this module)."""
    db = tmp_path_factory.mktemp("lock") / "held.duckdb"
    holder = subprocess.Popen(record_argv(db), cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # until the holder has the file open
            assert holder.poll() is None and time.monotonic() < deadline, "the holder did not start"
            try:
                connect(db, read_only=True).close()
            except StoreLockedError:
                break
            except StoreError:  # no file yet
                pass
            time.sleep(0.05)
        yield db, holder.pid
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=30)


def test_a_second_recorder_exits_2_naming_the_file_and_the_holder(held: tuple[Path, int]) -> None:
    db, pid = held
    done = subprocess.run(record_argv(db), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"trackside record: error: cannot record to {db}: PID {pid} (python")
    assert " -m agent.cli record ws://127.0.0.1:" in done.stderr
    assert done.stderr.rstrip().endswith("has it open, and DuckDB allows one writer per file: stop that process or "
                                         "give another --db")


def test_the_consoles_recorder_names_the_holder_too(held: tuple[Path, int]) -> None:
    db, pid = held
    with pytest.raises(RecordError, match=rf"^cannot record to {db}: PID {pid} \(python.* -m agent.cli record ws://"):
        ConsoleRecorder(db)
    with pytest.raises(StoreLockedError, match=rf"^{db} is open for writing by another process, PID {pid} \("):
        connect(db, read_only=True)


def test_a_memory_limit_bounds_duckdb_and_a_bad_one_is_a_store_error(tmp_path: Path) -> None:
    from store.schema import StoreError, connect
    from store.writer import StoreWriter

    con = connect(tmp_path / "a.duckdb", memory_limit="128MB")
    assert con.execute("SELECT current_setting('memory_limit')").fetchone() == ("122.0 MiB",)
    con.close()
    writer = StoreWriter(tmp_path / "a.duckdb", memory_limit="64MB")
    assert writer.cursor().execute("SELECT current_setting('memory_limit')").fetchone() == ("61.0 MiB",)
    writer.close()
    with pytest.raises(StoreError, match="memory limit 'lots'"):
        connect(tmp_path / "b.duckdb", memory_limit="lots")
