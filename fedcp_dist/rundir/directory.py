"""The run directory (``out_dir``): its file names, its writer, the resume rules, and how to read it
(the lock and the overwrite rules: :mod:`fedcp_dist.rundir.out_dir`; the printed lines: :mod:`fedcp_dist.rundir.present`).

One run writes one directory; rank 0 alone writes it::

    config.yaml      the resolved config, written when the round loop starts
    metrics.jsonl    one JSON object per round (and a ``final_eval`` one), appended and flushed
    analysis.jsonl   with analysis on: per-client probes (PIR, s histograms, loss before/after)
    tensorboard/     with logger: tensorboard, the same numbers as TensorBoard events (:mod:`fedcp_dist.rundir.loggers`)
    checkpoints/     round-R checkpoints (:mod:`fedcp_dist.rundir.checkpoint` owns what is inside)
    final_global.pt  the global state after the last round (a plain tensor dict)
    summary.json     written last: its presence marks a finished run (``"status": "diverged"`` in it:
                     one that learned nothing, see :data:`DIVERGED`)
    .lock            held with ``flock`` by the run that uses the directory

Every other module names these files through this one: the engine (lock, overwrite and resume
rules, the writer), ``fedcp-sweep`` (a point's status, config drift) and ``fedcp-report`` (reading
runs).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from fedcp_dist.algorithms import ALGORITHMS
from fedcp_dist.comm.keys import rounds_scheduled as privacy_rounds_scheduled
from fedcp_dist.config import Config, flatten, legacy_defaults
from fedcp_dist.engine.probes import keep_before
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.fileio import AppendFile, atomic_torch_save, atomic_write_bytes, same_file
from fedcp_dist.rundir.loggers import make_logger

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
#: the probes of a run with analysis on (PIR, s histograms, loss before/after local learning)
ANALYSIS = "analysis.jsonl"
SUMMARY = "summary.json"
FINAL_GLOBAL = "final_global.pt"
CHECKPOINTS = "checkpoints"
#: ``checkpoints/round_{R:07d}/``: the checkpoint after R rounds (:mod:`fedcp_dist.rundir.checkpoint` writes it)
CHECKPOINT_DIR = re.compile(r"^round_(\d{7})$")
#: the file whose presence makes a checkpoint directory complete (its parts' checksums)
CHECKPOINT_MARKER = "COMPLETE"
#: the event files of ``logger: tensorboard``
TENSORBOARD = "tensorboard"
LOCK = ".lock"
#: the files of a run that ``overwrite=true`` removes (with ``checkpoints/`` and ``tensorboard/``)
RUN_FILES = (METRICS, ANALYSIS, SUMMARY, FINAL_GLOBAL, CONFIG)
#: what ``fedcp-report DIR`` and ``fedcp-analyze DIR`` write into a run's folder by default: read
#: from the run's results, so ``overwrite=true`` removes them with the run (a report of the old run
#: beside the new one would describe results that are gone). Globs, relative to the run folder.
DERIVED = ("report.md", "report.csv", "acc_vs_*.png", "selection_counts.png", "analysis")

FINISHED, UNFINISHED, PENDING = "finished", "unfinished", "pending"
#: a run that ran every round but learned nothing: every client's update was non-finite in every
#: round (``on_nonfinite: skip`` left them all out), so its model is the untrained one. Its
#: summary.json says ``"status": "diverged"``; it is not a result, and is not run again either
DIVERGED = "diverged"
#: the statuses of a run whose summary.json is written: it will not run again in its directory
DONE = (FINISHED, DIVERGED)


# ----------------------------------------------------------------------------- which keys define a run
#
# One list says which config keys do not define an experiment. Two runs whose configs differ only
# in these keys ran the same experiment, so:
#   * a run may resume with any of them changed (the checks on resume),
#   * a finished sweep point is not "made with a different config" when only they differ (drift),
#   * fedcp-report never makes them a column, whatever values its runs hold (grouping).
# The decisions, key by key (they reconcile three lists that disagreed: the resumable changes of
# the engine, the sweep's drift exceptions and the report's non-settings):
NOT_DEFINING: dict = {
    # where the run is written, and what happens to what was there
    "out_dir": "where the run is written",
    "overwrite": "what happens to an earlier run in out_dir",
    "resume": "whether an earlier run in out_dir is continued",
    # checkpointing: the state saved is the state the run goes on from, bit for bit
    "checkpoint_every": "how often the state is saved",
    "keep_checkpoints": "how many saved states are kept",
    "preempt_signal": "which signal asks for a checkpoint",
    # execution: the same computation on other hardware or with another schedule of it; results are
    # equal up to floating-point rounding (fused training is tested equal to the sequential path)
    "device": "which hardware computes",
    "threads": "how many CPU threads compute",
    "collective_timeout": "how long a rank waits for a silent peer",
    "rendezvous_timeout": "how long the ranks may take to meet at start-up",
    "fused": "whether a rank trains its clients one by one or in fused groups",
    "fused_group": "how many clients a fused group holds",
    "fused_workers": "how many fused groups a CPU rank trains side by side",
    "placement": "which rank trains which client",
    "eval_batch_size": "how many test samples one forward pass takes",
    "peer_memory_mb": "a memory budget that refuses a run, never changes one",
    # where the client states are kept between rounds: the same states, bit for bit, in memory or
    # in files (a requeue onto a node with another scratch folder or less memory resumes)
    "client_state": "where a rank keeps its clients' states (device, host or files)",
    "client_state_dir": "the folder of a rank's state files (a node-local scratch disk)",
    "client_state_budget_mb": "the memory client_state=auto lets a rank's states take",
    # probes: what is recorded besides the run (analysis.jsonl); the run's results are the same with them
    "analysis": "whether the probes write analysis.jsonl",
    "analysis_every": "how often the training probes are taken",
    "logger": "where the metrics are written besides metrics.jsonl",
    "record_memory": "whether round records carry the memory numbers",
    # failures: a run that meets no non-finite update runs the same under either policy, and one that
    # meets it under 'error' has stopped; switching to 'skip' on resume is how such a run goes on
    "on_nonfinite": "what a non-finite client update does to the run",
    # checks of the shard against the config: data.path names the data, these only assert what the
    # file holds (0, '' and null accept any)
    "data.num_clients": "a check of the shard's client count",
    "data.source": "a check of the shard's source",
    "data.input_shape": "a check of the shard's input shape",
}

#: Keys that define what a run records but may still change when it resumes: ``rounds`` extends
#: or shortens the same sequence of rounds (round t trains the same way whatever the total), and
#: ``eval_every`` only chooses the rounds that are evaluated (evaluation has its own random streams
#: and leaves the training state as it was). Both change the result a report shows (best_acc is
#: the best evaluated accuracy, over the rounds run), so they are not in NOT_DEFINING: they are
#: report columns and sweep drift like any defining key.
RESUMABLE_DEFINING = ("rounds", "eval_every")
#: every key that may change when a run resumes; any other change is refused
RESUMABLE_CHANGES = (*NOT_DEFINING, *RESUMABLE_DEFINING)


def rounds_scheduled(cfg: dict) -> str:
    """Why this (flat) config's training depends on the total number of rounds ("": it does not):
    the method's class answers (:meth:`~fedcp_dist.algorithms.base.Algorithm.rounds_scheduled`)."""
    cls = ALGORITHMS.get(cfg.get("method"))
    why = (cls.rounds_scheduled(cfg) if cls is not None else None) or privacy_rounds_scheduled(cfg)
    return f"{why}; " if why else ""


def _same(key: str, a: Any, b: Any) -> bool:
    """Equal values; ``data.path`` is equal when both name the same file."""
    if key == "data.path" and isinstance(a, str) and isinstance(b, str):
        return a == b or os.path.realpath(a) == os.path.realpath(b)
    return a == b


def _flat_with_defaults(config: dict) -> dict:
    """A config (nested or flat) as a flat dict; keys it lacks (an older version's) take their defaults,
    or the value then in effect where that differs (:func:`~fedcp_dist.config.legacy_defaults`)."""
    flat = flatten(config)
    return {**flatten(Config().to_dict()), **legacy_defaults(flat), **flat}


def config_changes(before: dict, after: dict) -> list:
    """Flat keys whose values differ between two configs (nested or flat dicts), sorted.

    A key one side lacks (written by an older version) counts with its default value.
    """
    old, new = _flat_with_defaults(before), _flat_with_defaults(after)
    return [k for k in sorted(set(old) | set(new)) if not _same(k, old.get(k), new.get(k))]


def defining_changes(before: dict, after: dict) -> list:
    """The keys of :func:`config_changes` that change the experiment (those not in NOT_DEFINING)."""
    return [k for k in config_changes(before, after) if k not in NOT_DEFINING]


def check_resume_config(checkpointed: dict, current: dict, out_dir, same_data: bool = False) -> None:
    """Refuse to resume the checkpointed run in ``out_dir`` under ``current``: a UserError naming the key.

    Any change of a key outside RESUMABLE_CHANGES is refused, and so is a change of ``rounds`` for
    a method whose training depends on it (:func:`rounds_scheduled`). ``same_data``: the shard at
    ``data.path`` was verified to hold the checkpointed run's data, so ``data.path`` may differ.
    """
    old, new = _flat_with_defaults(checkpointed), _flat_with_defaults(current)
    for key in config_changes(old, new):
        why = rounds_scheduled(new) if key == "rounds" else ""
        if not why and (key in RESUMABLE_CHANGES or (key == "data.path" and same_data)):
            continue
        raise UserError(
            f"config key '{key}' is {new.get(key)!r} but the checkpointed run in {out_dir} used "
            f"{old.get(key)!r}; {why}use another out_dir, or overwrite=true to start afresh"
        )


# ----------------------------------------------------------------------------- reading a run


def contradiction(config: dict, summary: Optional[dict]) -> str:
    """"" or what a finished run's summary.json contradicts in its flat config.yaml (the method or
    the rounds): one of the two edited or replaced, so the result cannot be told whose it is."""
    for key in ("method", "rounds"):
        if isinstance(summary, dict) and key in summary and summary[key] != config.get(key):
            return f"{CONFIG} says {key} {config.get(key)} but {SUMMARY} says {summary[key]}: one of them was edited or replaced"
    return ""


class RunDir:
    """The paths of one run directory and what can be read from it (whether or not it exists)."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def final_global(self) -> Path:
        return self.path / FINAL_GLOBAL

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    def lock_held(self) -> bool:
        """Whether a process holds the ``flock`` on the lock file, as the kernel lists it in
        /proc/locks (Linux; a lock held on another node of a shared file system is not seen),
        without taking it: a reader taking it, even for a moment, could make a run starting then
        refuse its out_dir as in use."""
        try:
            st = self.lock.stat()
            with open("/proc/locks", encoding="ascii", errors="replace") as f:
                held = f.read().splitlines()
        except OSError:
            return False
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        return any(len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == want
                   for fields in (line.split() for line in held))

    def checkpoint_dirs(self) -> list:
        """[(R, path)] of every ``checkpoints/round_R`` directory, complete or not, R ascending."""
        if not self.checkpoints.is_dir():
            return []
        out = []
        for d in self.checkpoints.iterdir():
            m = CHECKPOINT_DIR.match(d.name)
            if m and d.is_dir():
                out.append((int(m.group(1)), d))
        return sorted(out)

    def has_checkpoint(self) -> bool:
        """Whether a checkpoint directory is marked complete (whether its parts are intact is
        :meth:`fedcp_dist.rundir.checkpoint.Checkpointer.verify`'s question)."""
        return any((d / CHECKPOINT_MARKER).exists() for _, d in self.checkpoint_dirs())

    def status(self) -> str:
        """finished (summary.json) | diverged (summary.json, which says so) | unfinished (a run was
        started there) | pending."""
        if self.summary.exists():
            summary = self.read_summary()
            return DIVERGED if summary is not None and summary.get("status") == DIVERGED else FINISHED
        if any(p.exists() for p in (self.metrics, self.config, self.checkpoints)):
            return UNFINISHED
        return PENDING

    def read_summary(self) -> Optional[dict]:
        """summary.json, or None when it is missing or not a JSON object."""
        try:
            data = json.loads(self.summary.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def read_config(self) -> Optional[dict]:
        """config.yaml as a flat dict (``data.path``, ...), or None when it is missing or unreadable."""
        try:
            with open(self.config, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            return None
        return flatten(data) if isinstance(data, dict) else None

    def lines_recorded(self) -> int:
        """The lines metrics.jsonl holds (0 when there is none or it cannot be read): a run's records."""
        try:
            with open(self.metrics, "rb") as f:
                return sum(1 for line in f if line.strip())
        except OSError:
            return 0

    def read_metrics(self) -> list:
        """The records of metrics.jsonl ([] when there is none); see :func:`read_jsonl`."""
        if not self.metrics.exists():
            return []
        return [record for _, record in read_jsonl(self.metrics)]


def read_jsonl(path) -> list:
    """[(line number, object)] of a JSON-lines file such as metrics.jsonl or analysis.jsonl.

    A last line that is not a whole JSON object is dropped: the run was stopped while writing it.
    Any other bad line means the file was damaged: a UserError naming the file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            out.append((i, record))
        elif i == len(lines):
            break  # torn by a stop mid-write
        else:
            raise UserError(f"{path}: line {i} is not a JSON object; the file is damaged")
    return out


# ----------------------------------------------------------------------------- writing (rank 0)


def _json_default(o: Any):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


#: what a failed write leaves, said after its reason
KEPT = "what the run wrote before is kept (a restart resumes from its last complete checkpoint)"


@contextlib.contextmanager
def _writing(path: Path, what: str = "write", after: str = KEPT):
    """An OSError while writing ``path`` as a one-line RunFailure naming it (what was written
    before stays: whole files are replaced atomically, appends are cut back to whole lines)."""
    try:
        yield
    except OSError as exc:
        raise RunFailure(f"cannot {what} {path}: {exc.strerror or exc}; {after}") from None


class RunWriter:
    """Rank 0 writes the run directory; on any other rank (``enabled=False``) every call does nothing.

    Whole-file writes go to a temporary name and are renamed when complete; metrics.jsonl is
    appended to one whole record at a time (:class:`~fedcp_dist.fileio.AppendFile`). An I/O error
    (a full disk) is a one-line RunFailure naming the file. ``logger`` (the config key: none |
    tensorboard) also receives every metrics record and analysis line written (:mod:`fedcp_dist.rundir.loggers`),
    the analysis lines as ``analysis_scalars`` (the method's probe layout's) makes them scalars.
    """

    def __init__(self, out_dir, enabled: bool, logger: str = "none", analysis_scalars=None):
        self.enabled = enabled
        self.dir = Path(out_dir)
        self._metrics: Optional[AppendFile] = None
        self._analysis: Optional[AppendFile] = None
        self._analysis_kept: list = []  # the lines start_analysis kept, for the logger's start
        self._lock = None  # the out_dir lock's open file (hold)
        self.logger = make_logger(logger if enabled else "none", self.dir / TENSORBOARD, analysis_scalars)
        if enabled:
            with _writing(self.dir, "create"):
                self.dir.mkdir(parents=True, exist_ok=True)

    def hold(self, lock) -> None:
        """Check, before each write, that the out_dir lock ``lock`` (the open file
        :func:`~fedcp_dist.rundir.out_dir.prepare_out_dir` returned) is still the folder's."""
        self._lock = lock

    def check_held(self) -> None:
        """A RunFailure when out_dir is no longer this run's: removed (``rm -rf`` while it runs: the
        writes made it again, without config.yaml or the records, and its lock went with it, so a
        second run could take the folder) or replaced. Rank 0 stops before writing anything there."""
        if not self.enabled:
            return
        gone = ""
        if self._metrics is not None and not self._metrics.still_there():
            gone = METRICS
        elif self._lock is not None and not same_file(self._lock.fileno(), self.dir / LOCK):
            gone = f"its lock {LOCK}"
        if gone:
            raise RunFailure(f"out_dir {self.dir} was removed or replaced while the run was going ({gone} is no longer "
                             f"the run's): stopped, so as to write nothing into a folder that is not its own; what it "
                             f"had written went with the folder: start the run again")

    def write_text(self, name: str, text: str, after: str = KEPT) -> None:
        """``name`` in out_dir, whole; ``after``: what a failure says is left."""
        if self.enabled:
            self.check_held()
            with _writing(self.dir / name, after=after):
                atomic_write_bytes(self.dir / name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        if self.enabled:
            self.write_text(name, json.dumps(obj, indent=2, default=_json_default) + "\n")

    def save_tensors(self, name: str, state: dict) -> None:
        if self.enabled:
            self.check_held()
            with _writing(self.dir / name):
                atomic_torch_save({k: v.detach().cpu() for k, v in state.items()}, self.dir / name)

    def write_config(self, text: str, fresh: bool = False) -> None:
        """config.yaml: the resolved config. ``fresh``: the run starts at round 1 (nothing of it
        trained yet, which a failure says)."""
        self.write_text(CONFIG, text, "nothing was trained yet: start the run again once it can be written" if fresh
                        else KEPT)

    def write_summary(self, summary: dict) -> None:
        """summary.json; write it last, since its presence marks the run finished."""
        self.write_json(SUMMARY, summary)

    def save_final_global(self, state: dict) -> None:
        """final_global.pt: the global state after the last round, on the CPU."""
        self.save_tensors(FINAL_GLOBAL, state)

    def start_metrics(self, records: list) -> None:
        """Begin metrics.jsonl afresh with ``records`` (those of a resumed checkpoint, or none)."""
        if not self.enabled:
            return
        if self._metrics is not None:
            self._metrics.close()
        text = "".join(json.dumps(r, default=_json_default) + "\n" for r in records)
        with _writing(self.dir / METRICS):
            atomic_write_bytes(self.dir / METRICS, text.encode("utf-8"))
            self._metrics = AppendFile(self.dir / METRICS)
        with _writing(self.dir / TENSORBOARD, "write TensorBoard events to"):
            self.logger.start(records, self._analysis_kept)

    def log(self, record: dict) -> None:
        """Append one line to metrics.jsonl (whole, or not at all)."""
        if not self.enabled:
            return
        if self._metrics is None:
            self.start_metrics([])
        self.check_held()
        with _writing(self.dir / METRICS, "append to"):
            self._metrics.append(json.dumps(record, default=_json_default) + "\n")
        with _writing(self.dir / TENSORBOARD, "write TensorBoard events to"):
            self.logger.log_record(record)

    def start_analysis(self, rounds_done: int, create: bool) -> None:
        """Begin analysis.jsonl: keep the lines of the first ``rounds_done`` rounds of one already
        there (a resumed run: the rest is computed again), start it empty when ``create`` (analysis
        on), and leave it absent otherwise."""
        if not self.enabled:
            return
        path = self.dir / ANALYSIS
        if path.is_file():
            kept = [obj for _, obj in read_jsonl(path) if keep_before(obj, rounds_done)] if rounds_done else []
        elif create:
            kept = []
        else:
            return
        if self._analysis is not None:
            self._analysis.close()
        self._analysis_kept = kept
        text = "".join(json.dumps(r, default=_json_default) + "\n" for r in kept)
        with _writing(path):
            atomic_write_bytes(path, text.encode("utf-8"))
            self._analysis = AppendFile(path)

    def log_analysis(self, records: list) -> None:
        """Append lines to analysis.jsonl (begun by :meth:`start_analysis`), whole or not at all."""
        if not self.enabled or not records:
            return
        with _writing(self.dir / ANALYSIS, "append to"):
            if self._analysis is None:  # a writer used without start_analysis: the file begins here
                self._analysis = AppendFile(self.dir / ANALYSIS)
            self._analysis.append("".join(json.dumps(r, default=_json_default) + "\n" for r in records))
        with _writing(self.dir / TENSORBOARD, "write TensorBoard events to"):
            self.logger.log_analysis(records)

    def close(self) -> None:
        try:
            with _writing(self.dir / TENSORBOARD, "write TensorBoard events to"):
                self.logger.close()
        finally:
            self._close_files()

    def _close_files(self) -> None:
        for f in (self._metrics, self._analysis):
            if f is not None:
                f.close()
        self._metrics = self._analysis = None
