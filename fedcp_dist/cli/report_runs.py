"""The runs under a directory as ``fedcp-report`` reads them: finding and reading the runs and their
metrics (:func:`collect`, :class:`Run`, the metrics computed from records) and the swept keys that
make a table's columns (:func:`setting_keys`). The table itself is :mod:`fedcp_dist.cli.report_table`."""
from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fedcp_dist.analysis.records import read_probes, weighted_mean
from fedcp_dist.cli.report_damage import config_problem, cut_short, no_summary
from fedcp_dist.config import Config, flatten
from fedcp_dist.errors import UserError
from fedcp_dist.options import did_you_mean
from fedcp_dist.rundir.directory import (ANALYSIS, CHECKPOINTS, CONFIG, DIVERGED, NOT_DEFINING, RunDir,
                                         defining_changes)
from fedcp_dist.rundir.present import format_value
from fedcp_dist.sweep.drift import goes_on
from fedcp_dist.sweep.manifest import MANIFEST, read_manifest

#: keys that are never columns: a row is a method, a cell pools the seeds (and the keys that do not
#: define an experiment, fedcp_dist.rundir.directory.NOT_DEFINING, never are either)
ROW_KEYS = ("method", "seed")
#: metrics computed from a summary's keys: name -> (function of the summary, or None where it lacks them)
DERIVED = {
    "uplink_bytes_per_round": lambda s: (s["uplink_bytes"] / s["rounds"]
                                         if _numeric(s.get("uplink_bytes")) and _numeric(s.get("rounds"))
                                         and s["rounds"] > 0 else None),
}
#: metrics read from a finished run's records instead of its summary (:func:`record_metric`)
RECORD_METRICS = {
    "rounds_to_P": "the first round after which the accuracy evaluated is >= P % (e.g. rounds_to_95); "
                   "a run that never gets there is counted apart",
    "acc_after_R": "the accuracy evaluated after R rounds (e.g. acc_after_10)",
    "pir_test": "FedCP's PIR over the test samples at the last evaluation, the sample-weighted mean over the "
                "clients (runs with analysis: true)",
    "pir_test_spread": "the population std over the clients of their test PIR at the last evaluation (analysis: true)",
}
_ROUNDS_TO = re.compile(r"rounds_to_(\d+(?:\.\d+)?)")
_ACC_AFTER = re.compile(r"acc_after_(\d+)")
#: a run's value of a rounds_to_P metric when its accuracy never reached P
NOT_REACHED = "not reached"


def is_record_metric(name: str) -> bool:
    """Whether ``name`` is one of :data:`RECORD_METRICS` (``rounds_to_95``, ``acc_after_10``, ``pir_test``…)."""
    m = _ROUNDS_TO.fullmatch(name)
    if m:
        return 0 < float(m.group(1)) <= 100
    return bool(_ACC_AFTER.fullmatch(name)) or name in ("pir_test", "pir_test_spread")


def record_metric(curve: list, path: Path, name: str):
    """The value of a :data:`RECORD_METRICS` metric from a run's curve [(evaluated_after, acc)] and, for
    the PIR, its ``analysis.jsonl``: a number, :data:`NOT_REACHED`, or None where the run does not
    record it (no evaluation after that round, no probes)."""
    m = _ROUNDS_TO.fullmatch(name)
    if m:
        target = float(m.group(1)) / 100.0
        return next((t for t, acc in curve if acc >= target - 1e-12), NOT_REACHED)
    m = _ACC_AFTER.fullmatch(name)
    if m:
        return dict(curve).get(int(m.group(1)))
    analysis = path / ANALYSIS
    if not analysis.is_file():
        return None
    _, evals = read_probes(analysis)
    if not evals:
        return None
    last = max(p.evaluated_after for p in evals)
    at_last = [p for p in evals if p.evaluated_after == last]
    if name == "pir_test":
        return weighted_mean((p.samples, p.pir) for p in at_last)
    mean = sum(p.pir for p in at_last) / len(at_last)
    return math.sqrt(sum((p.pir - mean) ** 2 for p in at_last) / len(at_last))


SKIP_DIRS = ("submitit", "logs", "data", CHECKPOINTS, "__pycache__")
#: why a sweep point's run made under another version of the sweep file has no result here
STALE_WHY = ("made under an earlier sweep file (its config differs from the point's now in {keys}): not averaged "
             "in; remove its folder and run fedcp-sweep again")
#: the same for a run that goes on to the point's values from its last checkpoint (more rounds, say)
STALE_GOES_ON_WHY = ("made under an earlier sweep file (its config differs from the point's now in {keys}): not "
                     "averaged in; remove its summary.json and run fedcp-sweep again (it resumes from its last "
                     "checkpoint)")

#: why a run whose summary says it diverged has no result
DIVERGED_WHY = "diverged: it learned nothing (every client's update non-finite in every round)"


@dataclass
class Run:
    path: Path
    #: the parameters that define the run: a sweep point's grid values, then the flat config
    params: dict
    config: dict
    summary: Optional[dict]
    label: str
    #: why it has no result, when it has none
    why: str = ""
    sweep: Optional[str] = None
    #: the key whose value is the run's row (``--rows``)
    row_key: str = "method"
    #: a sweep point's run made under another version of the sweep file: the keys that differ
    stale: list = field(default_factory=list)
    _curve: Optional[list] = field(default=None, repr=False)
    #: what is wrong with metrics.jsonl ("" while it reads whole): the metrics read from it have no value
    records_problem: str = field(default="", repr=False)

    @property
    def finished(self) -> bool:
        """Whether the run has a result: a summary that does not say it diverged, of the point's
        config as its sweep file now says it."""
        return self.summary is not None and not self.diverged and not self.stale

    @property
    def diverged(self) -> bool:
        """Whether the run ran to its end but learned nothing (see :data:`fedcp_dist.rundir.directory.DIVERGED`)."""
        return self.summary is not None and self.summary.get("status") == DIVERGED

    def value(self, key: str):
        if key in self.params:
            return self.params[key]
        return self.config.get(key)

    @property
    def method(self) -> str:
        """The run's row: its method, or its value of the ``--rows`` key."""
        return str(self.value(self.row_key))

    def metric(self, name: str):
        """The summary's value of ``name`` (or of a :data:`DERIVED` or :data:`RECORD_METRICS` metric:
        then perhaps :data:`NOT_REACHED`); None when it has none or no result (diverged)."""
        if not self.finished:
            return None
        if name not in self.summary and is_record_metric(name):
            if name.startswith("pir"):  # from analysis.jsonl
                return record_metric([], self.path, name)
            curve = self.curve()
            if self.records_problem:  # not "not reached": unknown
                self.why = self.records_problem
                return None
            return record_metric(curve, self.path, name)
        if name in DERIVED and name not in self.summary:
            return DERIVED[name](self.summary)
        return self.summary.get(name)

    @property
    def seed(self):
        return self.value("seed")

    def curve(self) -> list:
        """[(evaluated_after, acc)] from metrics.jsonl, the last record of each evaluation point."""
        if self._curve is None:
            try:
                records = RunDir(self.path).read_metrics()
            except UserError as exc:
                print(f"warning: {exc}; its curve is left out", file=sys.stderr)
                self.records_problem = f"{exc}"
                records = []
            self._curve = _curve_of(records)
        return self._curve


def _curve_of(records: list) -> list:
    """[(evaluated_after, acc)] of metrics records, the last record of each evaluation point."""
    points = {int(r["evaluated_after"]): float(r["acc"]) for r in records if "acc" in r and "evaluated_after" in r}
    return sorted(points.items())


def _read(path: Path) -> tuple:
    """(flat config, summary, curve, what is wrong with its config.yaml, what is wrong with its
    metrics.jsonl) of the run in ``path``; {},
    None, None (the curve read when asked, naming a damaged file) and "" for what it lacks. metrics.jsonl is read once, for the curve and
    for ``eval_every``: a run resumed under another (a key a resume may change) has config.yaml's
    last value only, so its value is then :func:`_eval_every_as_run`'s, and it is not reported
    beside the runs evaluated on that schedule throughout."""
    run = RunDir(path)
    config = run.read_config()
    summary = run.read_summary()
    problem = config_problem(path, config, summary)
    config = config or {}
    try:
        records = run.read_metrics()
    except UserError:
        records = None
    changed = _eval_every_as_run(records or [], config.get("eval_every"))
    if changed:
        config["eval_every"] = changed
    short = cut_short(records, summary) if records is not None else ""
    return config, summary, None if records is None else [] if short else _curve_of(records), problem, short


def _eval_every_as_run(records: list, every) -> str:
    """"" when the round ``records`` were evaluated on ``every``'s schedule (round r evaluated
    before training when (r − 1) mod every = 0), else what to report for it: ``"changed (now E)"``."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        return ""
    for r in records:
        if r.get("kind", "round") != "round" or not isinstance(r.get("round"), int):
            continue
        if ("evaluated_after" in r) != ((r["round"] - 1) % every == 0):
            return f"changed (now {every})"
    return ""


def _label(params: dict, keys) -> str:
    return ",".join(f"{k}={format_value(params.get(k))}" for k in keys) or "run"


def _sort_key(value: Any):
    """Numbers by value, before strings and lists; None first."""
    if value is None:
        return (0, 0, "")
    if isinstance(value, bool):
        return (2, int(value), "")
    if isinstance(value, (int, float)):
        return (1, float(value), "")
    if isinstance(value, (list, tuple)):
        return (3, 0, tuple(_sort_key(v) for v in value))
    return (4, 0, str(value))


# ----------------------------------------------------------------------------- collecting


def _find(root: Path) -> tuple[list, list]:
    """Run directories (holding config.yaml) and sweep manifests under ``root``, any depth."""
    runs, manifests = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if MANIFEST in filenames:
            manifests.append(here / MANIFEST)
        if CONFIG in filenames:
            runs.append(here)
            dirnames[:] = []  # a run holds no runs
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
    parent = root.parent / MANIFEST  # DIR may be a sweep's runs/ folder
    if parent.is_file() and parent not in manifests:
        manifests.append(parent)
    return sorted(runs), sorted(manifests)


@dataclass
class Collection:
    runs: list
    #: grid keys of the sweeps found, in their order (None: no manifest)
    grid_keys: Optional[list]
    method_order: list
    sweeps: list
    #: key -> its values in the sweep files' order (the grid's lists, the variants' names)
    orders: dict = field(default_factory=dict)
    #: the points the sweeps' exclude rules kept from running: [(params, reason, sweep name)]
    excluded: list = field(default_factory=list)
    #: run folders with a result whose setting cannot be read (a damaged config.yaml): [(path, why)]
    unreadable: list = field(default_factory=list)


def collect(root) -> Collection:
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"fedcp-report: {root} is not a directory")
    run_dirs, manifest_paths = _find(root)
    root_abs = root.resolve()
    grid_keys: list = []
    method_order: list = []
    orders: dict = {}
    sweeps: list = []
    expected = []  # (path, params, sweep name) from manifests
    excluded = []
    for mpath in manifest_paths:
        m = read_manifest(mpath)
        if m is None:
            print(f"warning: {mpath} is not a sweep manifest; ignored", file=sys.stderr)
            continue
        rel = os.path.relpath(mpath.parent.resolve(), root.resolve())
        # the sweep's directory tells sweeps apart (two may share a name)
        name = str(m.get("name", mpath.parent.name)) if rel in (".", "..") else rel
        sweeps.append(name)
        for k in m.get("grid_keys") or list(m.get("grid", {})):
            if k not in grid_keys:
                grid_keys.append(k)
        for v in (m.get("grid") or {}).get("method", []):
            if v not in method_order:
                method_order.append(v)
        for k, values in [*(m.get("grid") or {}).items(), ("variant", list(m.get("variants") or {}))]:
            order = orders.setdefault(k, [])
            order += [v for v in (values if isinstance(values, list) else []) if v not in order]
        for point in m["points"]:
            path = (mpath.parent / point["run_dir"]).resolve()
            if not (path == root_abs or root_abs in path.parents):
                continue
            expected.append((path, dict(point.get("params") or {}), name, point.get("config")))
        for point in m.get("excluded") or []:
            if isinstance(point, dict) and isinstance(point.get("params"), dict):
                excluded.append((dict(point["params"]), str(point.get("reason", "")), name))
    runs, unreadable = [], []
    seen = set()
    for path, params, name, wanted in expected:
        if path in seen:
            continue
        seen.add(path)
        config, summary, curve, problem, short = _read(path)
        if not config and summary is None and isinstance(wanted, dict):
            # no result and no readable config.yaml (a point not started, or refused at its start): its row and seed are
            # the point's as sweep.json records it, not None
            config = {**flatten(Config().to_dict()), **wanted}
        why, stale = "", []
        if summary is not None and problem:
            why, summary = problem, None
        elif summary is None:
            why = "not started" if not path.exists() else no_summary(path)
        elif summary.get("status") == DIVERGED:
            why = DIVERGED_WHY
        elif isinstance(wanted, dict):  # a manifest that says what the point is now (written since it does)
            stale = _stale_keys(RunDir(path).read_config(), wanted)
            if stale:
                extends = goes_on(RunDir(path), stale, {**flatten(Config().to_dict()), **wanted})
                why = (STALE_GOES_ON_WHY if extends else STALE_WHY).format(
                    keys=", ".join(stale[:4]) + (", …" if len(stale) > 4 else ""))
        runs.append(Run(path, params, config, summary, "", why, name, _curve=curve, stale=stale, records_problem=short))
    for path in run_dirs:
        path = path.resolve()
        if path in seen:
            continue
        seen.add(path)
        config, summary, curve, problem, short = _read(path)
        why = (no_summary(path) if summary is None
               else DIVERGED_WHY if summary.get("status") == DIVERGED else "")
        if problem:  # no setting to file it under (nor a row): listed apart
            unreadable.append((path, problem))
            continue
        runs.append(Run(path, {}, config, summary, "", why, _curve=curve, records_problem=short))
    if not runs:
        if unreadable:
            raise UserError(f"fedcp-report: no readable runs under {root}: {unreadable[0][0]}: {unreadable[0][1]}"
                            + (f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""))
        raise UserError(f"fedcp-report: no runs under {root} (a run is a directory holding {CONFIG})")
    return Collection(runs, grid_keys if manifest_paths and sweeps else None, method_order, sweeps, orders, excluded,
                      unreadable)


def _stale_keys(have: Optional[dict], wanted: dict) -> list:
    """The keys defining the experiment in which a point's run (its flat config.yaml, ``have``)
    differs from what ``sweep.json`` says the point is now (``wanted``: the keys off their
    defaults). ``wanted`` is completed with today's defaults first: a key it lacks is at its
    default, not at the value an older version of the package had for a config that lacks it."""
    if have is None:
        return []
    full = {**flatten(Config().to_dict()), **wanted}
    return [k for k in defining_changes(have, full)
            if k != "data.path" or _shard_name(have.get(k)) != _shard_name(full.get(k))]


def _shard_name(path) -> Optional[str]:
    """A shard's file name: a sweep's shards are named by their partition, and a sweep folder moved
    or copied with its shards (run again there, its points name the new copy) is the same sweep."""
    return os.path.basename(path) if isinstance(path, str) else None


def setting_keys(col: Collection, by: Optional[list], rows: str = "method") -> list:
    keys = _setting_keys(col, by, rows)
    if "data.path" in keys:
        _pool_copies(col.runs)
    return keys


def _pool_copies(runs: list) -> None:
    """Runs on copies of one shard (:func:`_data_identity`) under one ``data.path`` value, the first
    of their paths, so that a ``data.path`` column pools them too."""
    first: dict = {}
    for r in sorted(runs, key=lambda r: str(r.config.get("data.path"))):
        if "data.path" not in r.params and r.config.get("data.path") is not None:
            r.params["data.path"] = first.setdefault(_data_identity(r), r.config["data.path"])


def _setting_keys(col: Collection, by: Optional[list], rows: str = "method") -> list:
    runs = col.runs
    row_keys = ROW_KEYS if rows == "method" else ("seed", rows)
    if by:
        for key in by:
            if not any(r.value(key) is not None for r in runs):
                known = sorted({k for r in runs for k in (*r.params, *r.config)})
                raise UserError(f"fedcp-report: --by '{key}' is not a key of any run{_keys_hint(key, known)}")
        return list(by)
    if col.grid_keys is not None:
        keys = [k for k in col.grid_keys if k not in row_keys]
        extra = [r for r in runs if r.sweep is None]
        if extra:  # runs outside the sweeps: add what else tells them apart
            keys += [k for k in _differing(runs, row_keys) if k not in keys]
        if len(col.sweeps) > 1:
            keys = ["sweep"] + keys
            for r in runs:
                r.params.setdefault("sweep", r.sweep or "-")
        return keys
    return _differing(runs, row_keys)


def _data_identity(run) -> str:
    """What ``data.path`` stands for when runs are told apart: the shard's content (the fingerprint
    its summary recorded, or the file's own), so that seeds run on copies of one shard (node-local
    copies) pool into one cell; the path itself where neither is known."""
    fingerprint = (run.summary or {}).get("data_fingerprint")
    path = run.config.get("data.path")
    if not fingerprint and isinstance(path, str) and os.path.isabs(path):  # relative: to where the run started
        fingerprint = _shard_fingerprint(path)
    return f"shard {fingerprint}" if fingerprint else json.dumps(path, default=str)


@functools.lru_cache(maxsize=None)
def _shard_fingerprint(path: str) -> str:
    """The content fingerprint written into the shard at ``path`` ("" when it cannot be read or has none)."""
    try:
        import h5py

        from fedcp_dist.data.shards import FINGERPRINT

        with h5py.File(path, "r") as f:
            v = f.attrs.get(FINGERPRINT, "")
    except Exception:  # a shard gone or unreadable here (a node-local copy): told apart by its path
        return ""
    return v.decode() if isinstance(v, bytes) else str(v)


def _differing(runs, row_keys=ROW_KEYS) -> list:
    keys: list = []
    for r in runs:
        for k in r.config:
            if k not in keys:
                keys.append(k)
    out = []
    for k in keys:
        if k in row_keys or k in NOT_DEFINING:
            continue
        if k == "data.path":
            values = {_data_identity(r) for r in runs}
        else:
            values = {json.dumps(r.config.get(k), sort_keys=True, default=str) for r in runs}
        if len(values) > 1:
            out.append(k)
    return out


# ----------------------------------------------------------------------------- the table


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _keys_hint(key: str, known) -> str:
    """What to say of an unknown ``key``: the closest known key, else the list of them."""
    return did_you_mean(key, known) or f"; keys: {', '.join(known)}"
