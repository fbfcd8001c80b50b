"""``trackside calibrate``: profiles fitted from probe files and from recorded steps, and the simulator running them.

The end-to-end check: a store recorded from simulated units, whose step times the simulator draws from a known
profile (``h100-llama31-8b``: linear model, interference, engine-loop time per request, log-normal noise), must
give that profile's coefficients back.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import duckdb
import numpy as np
import pytest

from agent.bench.runner import BenchConfig
from agent.cli.calibrate import parse_when
from agent.cli.main import main
from agent.cli.serve import make_node
from agent.engine.profile_records import read_records_file, select, stats_on
from agent.engine.profiles import (
    DEFAULT_PROFILE,
    ProfileFileError,
    UnknownProfileError,
    load_profile,
    load_profile_file,
)
from agent.engine.step_calibration import MIN_STEPS, CalibrationError, StepCalibration, profile_from_steps
from agent.service.hub import Hub
from agent.telemetry import Event, NodeHello, StepEvent, UnitStatus
from agent.workload.spec import parse_workload
from policies.types import StepMode
from store.queries import step_records
from store.writer import StoreWriter

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "agent" / "engine" / "profiles"
WORKLOAD = "sharegpt-like:n=800"
"""About 6,000 steps on two units (ShareGPT-like lengths, Poisson 40 req/s): 1 s to simulate."""
T0 = 1_800_000_000_000_000_000


def shared_calibration() -> Path:
    env = os.environ.get("TRACKSIDE_SHARED")
    return (Path(env) if env else REPO.parent / "shared") / "calibration"


needs_shared = pytest.mark.skipif(not shared_calibration().is_dir(), reason="needs ../shared/calibration")


def record_sim(
    path: Path,
    *,
    noise: bool,
    seed: int = 1,
    node_id: str = "gpu-1",
    units: int = 2,
    workload: str = WORKLOAD,
    profile: str = DEFAULT_PROFILE,
    batch_policy: str = "vllm",
    dispatch: str = "least_loaded",
    instance_size: int = 0,
) -> Path:
    """Run simulated units until the workload is done and record every event into the store at ``path``."""
    config = BenchConfig(units=units, noise=noise, seed=seed, profile=profile, batch_policy=batch_policy,
                         dispatch=dispatch, instance_size=instance_size)
    node = make_node(config, parse_workload(workload, seed=seed))
    hub = Hub(node, node_id=node_id, profile=config.profile, token="t", replay_capacity=1 << 22, slack_sample_ms=0)
    hub.attach()
    hello = hub.hello()
    hub.node.advance(300.0)
    assert node.done
    with StoreWriter(path) as writer:
        writer.write([hello, *hub.replay.since(0).events])
        writer.flush()
    return path


@pytest.fixture(scope="module")
def noisy_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_sim(tmp_path_factory.mktemp("noisy") / "telemetry.duckdb", noise=True)


@pytest.fixture(scope="module")
def exact_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_sim(tmp_path_factory.mktemp("exact") / "telemetry.duckdb", noise=False)


def calibrate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["calibrate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def fitted(
    store: Path, *, block_size: int = 16, holdout_fraction: float = 0.2, drop: str | None = None
) -> StepCalibration:
    """:func:`profile_from_steps` on every step of ``store`` (without column ``drop``)."""
    columns = {k: v for k, v in step_records(store).columns.items() if k != drop}
    return profile_from_steps(
        columns,
        name="x",
        description="",
        gpu="g",
        model="m",
        mode="cuda-graphs",
        source_files=("s",),
        measured_date="2026-11-22",
        vllm_version="v",
        block_size=block_size,
        max_num_batched_tokens=8192,
        max_num_seqs=512,
        max_model_len=16384,
        holdout_fraction=holdout_fraction,
    )


# -- probe files: the shipped profiles' own derivation --------------------------------------------------------------
def _sections(doc: dict[str, object]) -> dict[str, object]:
    keys = (
        "step_model",
        "fit",
        "holdout",
        "decode_only",
        "mixed",
        "interference",
        "noise",
        "kv_cache",
        "engine",
        "gpu",
        "mode",
        "engines_per_gpu",
    )
    return {k: doc[k] for k in keys}


@needs_shared
@pytest.mark.parametrize(
    ("shipped", "files", "extra"),
    [
        ("h100-llama31-8b", ["llama31-8b_graphs.json"], []),
        ("h100-llama32-1b-shared", ["llama32-1b_pair_a.json", "llama32-1b_pair_b.json"], ["--engines-per-gpu", "2"]),
    ],
)
def test_a_probe_file_gives_the_shipped_profile(
    shipped: str, files: list[str], extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine.json"
    probes = [a for f in files for a in ("--probe", str(shared_calibration() / f))]
    code, stdout, err = calibrate(capsys, *probes, "--out", str(out), "--model", "Llama", *extra)
    assert code == 0, err
    mine = json.loads(out.read_text())
    reference = json.loads((SHIPPED / f"{shipped}.json").read_text())
    assert mine["step_model"] == reference["step_model"]  # same fit, same 6 significant digits
    assert _sections(mine) == _sections(reference)
    assert mine["name"] == "mine" and mine["source"]["records_file"] == "mine.records.csv.gz"
    assert (tmp_path / "mine.records.csv.gz").is_file()
    c = load_profile(shipped).coefficients
    assert f"a = {c.a_s * 1e3:.3f} ms" in stdout and "holdout" in stdout and "kappa" in stdout


@needs_shared
def test_probe_workloads_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    probe = str(shared_calibration() / "llama31-8b_graphs.json")
    out = tmp_path / "p.json"
    code, _, err = calibrate(capsys, "--probe", probe, "--out", str(out), "--calibration-workloads", "mix,nope")
    assert code == 2 and "has no workload nope" in err and "its workloads: warmup, mix" in err
    # Fitting on one workload and holding none out works, and says so.
    code, stdout, err = calibrate(
        capsys, "--probe", probe, "--out", str(out), "--calibration-workloads", "mix", "--holdout-workloads", ""
    )
    assert code == 0, err
    assert "holdout      none" in stdout
    assert load_profile_file(out).holdout is None
    code, _, err = calibrate(capsys, "--probe", probe, "--out", probe)
    assert code == 2 and "is one of the probe files" in err


# -- a store: the simulator's own coefficients come back --------------------------------------------------------
def test_exact_steps_give_the_simulators_coefficients(exact_store: Path) -> None:
    """Without noise each recorded step is (a + b*new + c*ctx) * interference + g0 + g1*requests exactly: the fit
    returns a + g0 (g0 is a constant per step), b, c and g1; only the small interference term (kappa 0.043, not in
    the joint fit) moves c and g1 a little."""
    truth = load_profile(DEFAULT_PROFILE)
    c0 = truth.coefficients
    cal = fitted(exact_store)
    profile, per_request = cal.profile, cal.per_request
    assert profile.fit is not None and profile.holdout is not None
    c = profile.coefficients
    assert len(cal.records) > 4000
    assert c.a_s == pytest.approx(c0.a_s + truth.loop_overhead_s, rel=0.002)
    assert c.b_s == pytest.approx(c0.b_s, rel=0.01)
    assert c.c_s == pytest.approx(c0.c_s, rel=0.04)
    assert per_request.kept
    assert per_request.seconds == pytest.approx(truth.loop_overhead_per_request_s, rel=0.15)
    assert profile.fit.mape < 0.005 and profile.holdout.mape < 0.005
    assert profile.noise_sigma < 0.01
    assert profile.usable_gpu_blocks == truth.usable_gpu_blocks
    assert cal.warnings == ()


def test_noisy_steps_give_the_simulators_coefficients_and_noise(noisy_store: Path) -> None:
    """With the profile's log-normal noise (sigma 0.059) on about 6,000 steps. Tolerances: about three standard
    errors over eight seeds (a 0.3%, b 2.4%, c 15%, sigma 2% at worst); c shares its signal with the per-request
    term (both grow with the batch in decode steps), so it is the loosest."""
    truth = load_profile(DEFAULT_PROFILE)
    c0 = truth.coefficients
    cal = fitted(noisy_store)
    p, per_request, records = cal.profile, cal.per_request, cal.records
    assert p.fit is not None and p.holdout is not None
    c = p.coefficients
    assert c.a_s == pytest.approx(c0.a_s + truth.loop_overhead_s, rel=0.01)
    assert c.b_s == pytest.approx(c0.b_s, rel=0.05)
    assert c.c_s == pytest.approx(c0.c_s, rel=0.2)
    assert per_request.kept
    assert p.noise_sigma == pytest.approx(truth.noise_sigma, rel=0.05)
    assert 0.0 <= p.interference_kappa < 0.2
    # The holdout is a fifth of the steps, never fitted, and predicted as well as the fitted ones.
    assert p.holdout.n == pytest.approx(0.2 * len(records), abs=1)
    assert p.holdout.mape == pytest.approx(p.fit.mape, rel=0.15)
    assert p.holdout.mape < 0.06 and p.holdout.r2 > 0.95
    assert p.usable_gpu_blocks == truth.usable_gpu_blocks and p.max_num_batched_tokens == 8192


def test_the_cli_writes_a_profile_the_simulator_runs(
    noisy_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles" / "my-node.json"
    code, stdout, err = calibrate(
        capsys, "--db", str(noisy_store), "--out", str(out), "--gpu", "NVIDIA H100", "--model", "Llama-3.1-8B"
    )
    assert code == 0, err
    profile = load_profile_file(out)
    assert profile.name == "my-node" and profile.gpu == "NVIDIA H100" and profile.model == "Llama-3.1-8B"
    assert profile.max_num_seqs == 512 and profile.max_model_len == 16384  # recorded; the default
    assert profile.source is not None and profile.source.files == ("telemetry.duckdb",)
    assert "node gpu-1 (units 0,1)" in profile.description
    for text in (
        "steps used",
        "held out",
        "R^2",
        "MAPE",
        "sigma",
        "kappa",
        "26,095 usable",
        "per request",
        "trackside bench --profile",
    ):
        assert text in stdout, text
    # The records written reproduce the profile's fit statistics.
    records = read_records_file(out.with_name("my-node.records.csv.gz"))
    assert profile.fit is not None and profile.holdout is not None
    refit = stats_on(profile.coefficients, select(records, ("calibration",)))
    assert refit.n == profile.fit.n and refit.mape == pytest.approx(profile.fit.mape, rel=1e-4)
    assert stats_on(profile.coefficients, select(records, ("holdout",))).n == profile.holdout.n
    # The simulator runs it: bench (and the agent's node) take the path wherever they take a profile name.
    report = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--workload",
            "sharegpt-like:n=120",
            "--units",
            "2",
            "--profile",
            str(out),
            "--json",
            str(report),
            "--no-progress",
        ]
    )
    capsys.readouterr()
    assert code == 0
    data = json.loads(report.read_text())
    assert data["summary"]["completed"] == 120 and data["config"]["profile"] == str(out)
    assert make_node(BenchConfig(units=1, profile=str(out)), []).units[0].load().num_blocks == 26_095


def test_selection_by_unit_and_time(noisy_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    everything = step_records(noisy_store)
    one = step_records(noisy_store, unit_ids=[1])
    assert 0 < one.num_steps < everything.num_steps and set(one.columns["unit_id"].tolist()) == {1}
    assert everything.max_num_seqs == 512 and everything.steps_per_node == {"gpu-1": everything.num_steps}
    times = everything.columns["time_ns"]
    assert np.all(np.diff(times) >= 0)
    middle = int(times[len(times) // 2])
    late = step_records(noisy_store, start_ns=middle)
    assert late.num_steps == int((times >= middle).sum())
    out = tmp_path / "u1.json"
    code, stdout, err = calibrate(capsys, "--db", str(noisy_store), "--unit", "1", "--out", str(out))
    assert code == 0, err
    assert f"{one.num_steps:,} steps used" in stdout


def test_parse_when() -> None:
    now = T0
    assert parse_when("2h", now) == now - 7200 * 10**9
    assert parse_when("1h30m", now) == now - 5400 * 10**9
    assert parse_when("2026-11-22T10:00", now) == parse_when("2026-11-22T10:00+00:00", now)
    assert parse_when("2026-11-22T11:00+01:00", now) == parse_when("2026-11-22T10:00", now)
    with pytest.raises(CalibrationError, match="invalid time"):
        parse_when("yesterday", now)


# -- errors: one line, exit 2, nothing written ------------------------------------------------------------------
def steps(n: int, *, node: str = "gpu-9", vary: bool = True) -> list[Event]:
    """A hello and ``n`` decode steps; with ``vary`` their size and context change (``t = 5 ms + 50 us * new + 10 ns
    * ctx`` exactly), without it every step is the same."""
    hello = NodeHello(
        node_id=node,
        time_ns=T0,
        boot_ns=T0,
        profile="h100-llama31-8b",
        units=(UnitStatus(unit_id=0, batch_policy="vllm", num_blocks=2000),),
        dispatch_policy="x",
    )
    out: list[Event] = [hello]
    for k in range(1, n + 1):
        pre, dec = ((k * 37) % 200, 1 + (k * 13) % 40) if vary else (100, 10)
        ctx = pre + dec * (300 + (k * 71) % 900) if vary else 5000
        measured = round((5e-3 + 50e-6 * (pre + dec) + 10e-9 * ctx) * 1e9)
        out.append(
            StepEvent(
                seq=k,
                node_id=node,
                time_ns=T0 + k * 10**7,
                unit_id=0,
                step_id=k,
                measured_ns=measured,
                predicted_ns=measured,
                mode=StepMode.MIXED,
                policy="vllm",
                num_prefill_tokens=pre,
                num_decode_tokens=dec,
                num_prefill_reqs=1 if pre else 0,
                num_decode_reqs=dec,
                context_tokens=ctx,
                budget_tokens=2048,
                kv_used_blocks=ctx // 16 + 1,
                num_blocks=2000,
                num_running=dec + 1,
                num_waiting=0,
                num_preempted=0,
                num_finished=0,
            )
        )
    return out


def write_store(path: Path, *streams: list[Event]) -> Path:
    with StoreWriter(path) as writer:
        for events in streams:
            writer.write(events)
        writer.flush()
    return path


def assert_fails(capsys: pytest.CaptureFixture[str], out: Path, message: str, *args: str) -> None:
    code, stdout, err = calibrate(capsys, *args, "--out", str(out))
    assert code == 2, (stdout, err)
    assert err.startswith("trackside calibrate: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not out.exists() and not out.with_name(f"{out.stem}.records.csv.gz").exists()


def test_a_small_store_fits_without_holdout_and_bad_stores_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "p.json"
    small = write_store(tmp_path / "small.duckdb", steps(60))
    code, stdout, err = calibrate(capsys, "--db", str(small), "--out", str(out), "--max-model-len", "4096")
    assert code == 0, err
    p = load_profile_file(out)  # an interference fit without holdout steps (null errors) reads back
    assert p.holdout is None and p.interference is not None and math.isnan(p.interference.holdout_mape)
    assert p.coefficients.a_s == pytest.approx(5e-3, rel=1e-3) and p.coefficients.c_s == pytest.approx(10e-9, rel=1e-2)
    assert "holdout      none" in stdout and "0 held out" in stdout
    out.unlink()
    out.with_name("p.records.csv.gz").unlink()

    assert_fails(capsys, out, "no database at", "--db", str(tmp_path / "missing.duckdb"))
    not_db = tmp_path / "notes.json"
    not_db.write_text("{}")
    assert_fails(capsys, out, "cannot open", "--db", str(not_db))
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).execute("CREATE TABLE t (x INT)").close()
    assert_fails(capsys, out, "not a trackside store", "--db", str(other))
    empty = write_store(tmp_path / "empty.duckdb", steps(0))
    assert_fails(capsys, out, "the store has none", "--db", str(empty))
    assert_fails(
        capsys,
        out,
        f"too few to fit a profile (at least {MIN_STEPS})",
        "--db",
        str(write_store(tmp_path / "few.duckdb", steps(MIN_STEPS - 1))),
    )
    assert_fails(
        capsys, out, "degenerate fit", "--db", str(write_store(tmp_path / "same.duckdb", steps(80, vary=False)))
    )
    two = write_store(tmp_path / "two.duckdb", steps(60, node="gpu-9"), steps(50, node="gpu-8"))
    assert_fails(capsys, out, "steps of 2 nodes (gpu-8: 50, gpu-9: 60): name one with --node", "--db", str(two))
    assert_fails(capsys, out, "no steps in", "--db", str(two), "--node", "gpu-7")
    assert_fails(
        capsys,
        out,
        "(units 3); the store has gpu-8: 50 steps on units 0; gpu-9: 60 steps on units 0",
        "--db",
        str(two),
        "--unit",
        "3",
    )
    assert_fails(capsys, out, "less than max_model_len 40,000", "--db", str(small), "--max-model-len", "40000")
    assert_fails(
        capsys, out, "--until must be later than --since", "--db", str(small), "--since", "1h", "--until", "2h"
    )
    assert_fails(capsys, tmp_path / "p.txt", "--out must name a .json file", "--db", str(small))
    assert_fails(capsys, out, "--max-num-seqs must be >= 1", "--db", str(small), "--max-num-seqs", "0")
    assert_fails(capsys, out, "--holdout must be in [0, 1)", "--db", str(small), "--holdout", "1")
    code, _, err = calibrate(capsys, "--db", str(two), "--node", "gpu-8", "--out", str(out), "--max-model-len", "4096")
    assert code == 0, err


def test_bad_probe_files_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert_fails(capsys, out, "no probe file at", "--probe", str(tmp_path / "missing.json"))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert_fails(capsys, out, "is not a probe file: invalid JSON", "--probe", str(garbage))
    profile = SHIPPED / f"{DEFAULT_PROFILE}.json"
    assert_fails(capsys, out, "is not a probe file: no eager, results, steps", "--probe", str(profile))
    tiny = tmp_path / "tiny.json"
    tiny.write_text(
        json.dumps(
            {
                "gpu": "g",
                "eager": False,
                "results": [
                    {"tag": t, "steps": [0, 5], "wall": 1.0}
                    for t in ("mix", "longctx", "small", "dec128", "sharegpt_like")
                ],
                "steps": [],
            }
        )
    )
    assert_fails(capsys, out, "calibration steps, too few", "--probe", str(tiny))


def test_a_bad_profile_path_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ProfileFileError, match="no profile file at"):
        load_profile(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"step_model": {"a_ms": 1}}')
    with pytest.raises(UnknownProfileError, match="is not a usable profile"):  # a subclass: every handler reports it
        load_profile(str(bad))
    not_json = tmp_path / "x.duckdb"
    not_json.write_bytes(b"\x00\x01")
    with pytest.raises(ProfileFileError, match="not a profile"):
        load_profile(str(not_json))  # an existing file is read as one, whatever its name
    assert load_profile(DEFAULT_PROFILE) is load_profile(DEFAULT_PROFILE)  # shipped ones stay cached
    for path, message in ((tmp_path / "nope.json", "no profile file at"), (bad, "is not a usable profile")):
        code = main(["bench", "--workload", "sharegpt-like:n=10", "--profile", str(path), "--no-progress"])
        _, err = capsys.readouterr()
        assert code == 2 and err.startswith("trackside bench: error: ") and message in err, err
    code = main(["bench", "--workload", "sharegpt-like:n=10", "--profile", "a100-nope", "--no-progress"])
    assert code == 2 and "or the path of a profile JSON file" in capsys.readouterr().err


def test_help_explains_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--db",
        "--probe",
        "--out",
        "--node",
        "--unit",
        "--since",
        "--until",
        "--holdout",
        "--block-size",
        "--max-model-len",
        "bench --profile",
    ):
        assert option in text, option


def test_profile_from_steps_checks_its_arguments(exact_store: Path) -> None:
    with pytest.raises(CalibrationError, match="holdout fraction"):
        fitted(exact_store, holdout_fraction=1.0)
    with pytest.raises(CalibrationError, match="lack the columns context_tokens"):
        fitted(exact_store, drop="context_tokens")
    # A wrong block size shows in the context per used block.
    assert any("check --block-size" in w for w in fitted(exact_store, block_size=64).warnings)
