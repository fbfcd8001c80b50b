"""The shipped calibration profiles: finding, loading and checking them.

A profile (:class:`agent.engine.profile_types.Profile`, described there) is a measured step-time model and
the engine limits of one engine configuration, for the simulator and the policies. This module reads them:
:func:`load_profile` by name or from a file, :func:`load_records` for the steps a measured profile was
derived from, :func:`fit_report` for its error recomputed from them.

Files: ``profiles/<name>.json`` (human-readable, units in the key names: :mod:`agent.engine.profile_json`)
and, for measured profiles, ``profiles/<name>.records.csv.gz`` (the steps the profile was derived from:
:mod:`agent.engine.profile_records`), read with :mod:`importlib.resources`. The ``profiles/`` folder has no
``__init__.py`` on purpose: a package ``agent/engine/profiles/`` would shadow this module (a regular package
wins over a module of the same name), so it is a namespace data folder (setuptools still installs it through
``package-data``). Regenerate every file with ``python -m agent.engine.calibration``.

:func:`load_profile` also takes the path of a profile JSON file written elsewhere, by ``trackside calibrate
--out FILE.json`` (:mod:`agent.engine.step_calibration`), which any node can run on its own recorded steps.
"""

from __future__ import annotations

import gzip
import json
import os
from functools import cache, lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TypedDict

from agent.engine.profile_json import profile_from_json
from agent.engine.profile_records import Records, parse_records, select, stats_on
from agent.engine.profile_types import Profile

DEFAULT_PROFILE = "h100-llama31-8b"
"""The profile to use when none is named: Llama-3.1-8B, one H100, CUDA graphs."""


class UnknownProfileError(KeyError):
    """No shipped profile has this name; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProfileFileError(UnknownProfileError):
    """A profile file that is missing or is not a profile; the message says which. A subclass of
    :class:`UnknownProfileError` so that every command reporting an unknown profile reports this too."""


def _data_dir() -> Traversable:
    return resources.files("agent.engine").joinpath("profiles")


@lru_cache(maxsize=1)
def _profile_names() -> tuple[str, ...]:
    return tuple(sorted(e.name.removesuffix(".json") for e in _data_dir().iterdir() if e.name.endswith(".json")))


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return list(_profile_names())


def _check_name(name: str) -> None:
    known = _profile_names()
    if name not in known:
        raise UnknownProfileError(
            f"unknown profile {name!r}; known profiles: {', '.join(known)} (or the path of a profile JSON file, "
            "e.g. ./my-node.json from `trackside calibrate`)"
        )


def is_profile_path(name: str) -> bool:
    """True when ``name`` names a file rather than a shipped profile: it ends in ``.json``, has a directory or
    is an existing file."""
    return name.endswith(".json") or "/" in name or os.sep in name or Path(name).is_file()


def load_profile(name: str = DEFAULT_PROFILE) -> Profile:
    """The shipped profile ``name``, or the profile in the JSON file at path ``name`` (:func:`is_profile_path`).

    Raises :class:`UnknownProfileError` (a KeyError) listing the known ones for an unknown name, and
    :class:`ProfileFileError` (a subclass) for a file that is missing or not a profile. Shipped profiles are
    cached (the same object every time); a file is read again on every call.
    """
    if name not in _profile_names() and is_profile_path(name):
        return load_profile_file(name)
    return _load_shipped(name)


@cache
def _load_shipped(name: str) -> Profile:
    _check_name(name)
    return profile_from_json(json.loads(_data_dir().joinpath(f"{name}.json").read_text(encoding="utf-8")))


def load_profile_file(path: str | Path) -> Profile:
    """The profile in a JSON file (the layout of :func:`agent.engine.profile_json.profile_to_json`);
    :class:`ProfileFileError` if it cannot be read or is not a profile of this
    :data:`agent.engine.profile_json.SCHEMA_VERSION`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileFileError(f"no profile file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileFileError(f"cannot read profile file {path}: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"{path} is not a profile: invalid JSON ({exc})") from None
    if not isinstance(doc, dict) or "step_model" not in doc:
        raise ProfileFileError(f"{path} is not a profile: no step_model (write one with `trackside calibrate`)")
    try:
        return profile_from_json(doc)
    except (KeyError, TypeError, ValueError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ProfileFileError(f"{path} is not a usable profile: {what}") from None


class NoRecordsError(LookupError):
    """The profile was derived, not measured: it has no step records."""


@cache
def load_records(name: str = DEFAULT_PROFILE) -> Records:
    """The step records behind profile ``name`` (read-only structured array,
    :data:`agent.engine.profile_records.RECORD_DTYPE`).

    Raises :class:`NoRecordsError` for a derived profile. Shipped profiles only (a profile file's records lie
    next to it: :func:`agent.engine.profile_records.read_records_file`).
    """
    profile = _load_shipped(name)
    if profile.derived_from is not None:
        raise NoRecordsError(f"profile {name!r} is derived from {profile.derived_from.base_profile!r}, "
                             "not measured: it has no step records")
    raw = _data_dir().joinpath(f"{name}.records.csv.gz").read_bytes()
    records = parse_records(gzip.decompress(raw).decode("utf-8"))
    records.flags.writeable = False
    return records


class StatsReport(TypedDict):
    """Error of a profile's coefficients on one set of steps."""

    n: int
    r2: float
    mape: float


class FitReport(TypedDict):
    """Coefficients of a profile and their error on its calibration and holdout steps.

    ``calibration`` and ``holdout`` are None for a derived profile, whose ``derived_from`` names the
    measured profile it was computed from (None for measured ones).
    """

    name: str
    a_ms: float
    b_us_per_token: float
    c_ns_per_context_token: float
    interference_kappa: float
    derived_from: str | None
    calibration: StatsReport | None
    holdout: StatsReport | None


def fit_report(name: str = DEFAULT_PROFILE) -> FitReport:
    """Coefficients of profile ``name`` and their error, recomputed from its shipped records (none: derived)."""
    p = load_profile(name)
    report = FitReport(
        name=name, a_ms=p.coefficients.a_s * 1e3, b_us_per_token=p.coefficients.b_s * 1e6,
        c_ns_per_context_token=p.coefficients.c_s * 1e9, interference_kappa=p.interference_kappa,
        derived_from=None if p.derived_from is None else p.derived_from.base_profile,
        calibration=None, holdout=None,
    )
    if p.source is None:
        return report
    rec = load_records(name)
    cal = stats_on(p.coefficients, select(rec, p.source.calibration_workloads))
    hold = stats_on(p.coefficients, select(rec, p.source.holdout_workloads))
    report["calibration"] = StatsReport(n=cal.n, r2=cal.r2, mape=cal.mape)
    report["holdout"] = StatsReport(n=hold.n, r2=hold.r2, mape=hold.mape)
    return report
