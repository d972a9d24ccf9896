"""``fedcp-sweep``: run a grid of experiments, locally one after another or as one SLURM array job.

    fedcp-sweep configs/sweeps/digits_smoke.yaml --dry-run      # the points, their status and commands
    fedcp-sweep configs/sweeps/digits_smoke.yaml                # run what is not finished yet
    fedcp-sweep configs/sweeps/client_count.yaml --executor slurm --wait

A sweep file names a base run config, overrides applied to every point and a grid (a cartesian
product of config keys). Every point has a stable run directory named after its parameters,
``<root>/<name>/runs/<key>=<value>,...``: a point whose directory holds ``summary.json`` is finished
and skipped; any other is launched (again) and continues from its own checkpoint. An optional
``partition`` block makes the shards the grid needs once, under ``<root>/<name>/data/``.
``<root>/<name>/sweep.json`` records the points for ``fedcp-report``.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import difflib
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from fedcp_dist.config import Config, flatten, load_config, read_yaml_mapping, type_ok
from fedcp_dist.errors import ArgumentParser, UserError, cli_main
from fedcp_dist.fileio import atomic_write_bytes

MANIFEST = "sweep.json"
MANIFEST_FORMAT = 1
DEFAULT_ROOT = "runs/sweeps"
TOP_KEYS = ("name", "root", "base", "overrides", "grid", "partition", "executor")
EXECUTOR_KEYS = ("kind", "nproc", "slurm")
EXECUTORS = ("local", "slurm")
#: the slurm block: key -> (type, meaning)
SLURM_KEYS = {
    "partition": (str, "SLURM partition"),
    "gpus_per_task": (int, "GPUs per rank"),
    "tasks_per_node": (int, "tasks (ranks) per node; defaults to nproc"),
    "cpus_per_task": (int, "CPUs per rank"),
    "nodes": (int, "nodes per run"),
    "time_min": (int, "time limit per run, minutes"),
    "mem_gb": (float, "memory per node, GB"),
    "array_parallelism": (int, "array tasks running at once"),
    "account": (str, "SLURM account"),
    "qos": (str, "quality of service"),
    "constraint": (str, "node constraint"),
    "setup": (list, "shell lines run before the job step (module load ...)"),
    "max_num_timeout": (int, "requeues after a timeout (submitit's, default 3)"),
    "signal_delay_s": (int, "seconds between the warning signal and the kill (default 120)"),
}
#: fedcp-partition options a partition block may set: key -> type (bool: a flag)
PARTITION_KEYS = {
    "source": str,
    "root": str,
    "download": bool,
    "partition": str,
    "num_clients": int,
    "beta": float,
    "classes_per_client": int,
    "unbalanced": bool,
    "batch_size": int,
    "train_ratio": float,
    "seed": int,
    "max_tries": int,
    "max_len": int,
    "vocab_size": int,
    "min_freq": int,
}
#: partition options that do not change which samples a client gets (left out of the file name)
PARTITION_LOCATION_KEYS = ("root", "download")
#: config keys a sweep sets itself
RESERVED = ("out_dir",)
#: config keys that may differ between a finished run and its point (see _config_drift)
DRIFT_IGNORED = ("out_dir", "overwrite", "resume")
SIGNAL_DELAY_S = 120
#: exit status of a run that checkpointed on a preemption signal (fedcp_dist.errors.EXIT_REQUEUE)
EXIT_REQUEUE = 75
#: whether runs continue from their own checkpoint (config key ``resume``)
HAS_RESUME = any(f.name == "resume" for f in dataclasses.fields(Config))


# ----------------------------------------------------------------------------- small helpers


def yaml_value(value: Any) -> str:
    """The text of ``value`` that ``key=value`` overrides read back as the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")].strip()
    elif text.endswith("..."):
        text = text[:-3].strip()
    return text


def _fmt(value: Any) -> str:
    """A value as it appears in a run directory name."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "-".join(_fmt(v) for v in value) or "empty"
    if value is None:
        return "null"
    return str(value)


_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]")


def point_name(params: dict) -> str:
    """A stable, readable directory name from a point's parameters, keys sorted.

    ``{"seed": 2, "method": "fedcp"}`` → ``method=fedcp,seed=2``. Characters outside
    ``[A-Za-z0-9._+=,-]`` become ``_``; a name longer than 150 characters is cut and ends in a hash
    of the full parameters.
    """
    if not params:
        return "default"
    name = ",".join(f"{k}={_fmt(params[k])}" for k in sorted(params))
    name = _UNSAFE.sub("_", name)
    if len(name) > 150:
        digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:10]
        name = f"{name[:120]}-{digest}"
    return name




def _config_keys() -> set:
    return set(flatten(Config().to_dict()))


def _display_path(path: Path) -> str:
    """A path relative to the current directory when it lies below it, else absolute."""
    try:
        return os.path.relpath(os.path.abspath(path)) if Path(os.path.abspath(path)).is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)


def _atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ----------------------------------------------------------------------------- the sweep


@dataclass
class Point:
    index: int
    #: grid key -> value, in grid order
    params: dict
    name: str
    run_dir: Path
    #: key=value overrides of fedcp_dist.run for this point, out_dir last
    overrides: list
    #: fedcp-partition arguments of the shard this point needs (None: the config's data.path)
    partition: Optional[dict] = None
    data_path: Optional[Path] = None

    def status(self) -> str:
        """finished (summary.json) | unfinished (a run was started there) | pending."""
        if (self.run_dir / "summary.json").exists():
            return "finished"
        if any((self.run_dir / f).exists() for f in ("metrics.jsonl", "config.yaml", "checkpoints")):
            return "unfinished"
        return "pending"


@dataclass
class Sweep:
    file: Path
    name: str
    root: Path
    base: Path
    overrides: dict
    grid: dict
    partition: Optional[dict]
    kind: str
    nproc: int
    slurm: dict
    points: list = field(default_factory=list)
    partition_keys: list = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return self.root / self.name

    def run_args(self, point: Point) -> list:
        """The arguments of ``fedcp_dist.run`` for one point (absolute paths)."""
        args = ["--config", str(self.base), *point.overrides]
        if not HAS_RESUME and point.status() == "unfinished":
            args.insert(len(args) - 1, "overwrite=true")  # this fedcp_dist cannot resume: start afresh
        return args

    def command(self, point: Point, nproc: Optional[int] = None) -> list:
        nproc = self.nproc if nproc is None else nproc
        if nproc > 1:
            torchrun = Path(sys.executable).with_name("torchrun")
            prefix = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
            prefix += ["--standalone", f"--nproc_per_node={nproc}", "-m", "fedcp_dist.run"]
        else:
            prefix = [sys.executable, "-m", "fedcp_dist.run"]
        return prefix + self.run_args(point)

    def display_command(self, point: Point) -> str:
        words = []
        for w in self.command(point):
            if os.path.isabs(w):
                w = _display_path(Path(w))
            elif "=" in w and os.path.isabs(w.split("=", 1)[1]):
                k, v = w.split("=", 1)
                w = f"{k}={_display_path(Path(v))}"
            words.append(w)
        if shutil.which("python") == sys.executable:
            words[0] = "python"
        return shlex.join(words)


def _read_yaml(path: Path) -> dict:
    values = read_yaml_mapping(path, "sweep file")
    if not values:
        raise UserError(f"sweep file {path} must hold a mapping (name, base, grid, ...)")
    return values


def _check_mapping(value, what: str, known) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"sweep key '{what}' must be a mapping, got {value!r}")
    for key in value:
        if key not in known:
            raise UserError(f"sweep key '{what}.{key}' is unknown{_did_you_mean(key, known)}; "
                            f"known: {', '.join(known)}")
    return value


def _partition_argv(params: dict) -> list:
    argv = []
    for key, value in params.items():
        flag = f"--{key.replace('_', '-')}"
        if PARTITION_KEYS[key] is bool:
            if value:
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _check_partition_value(key: str, value, where: str) -> None:
    tp = PARTITION_KEYS[key]
    if not type_ok(value, tp):
        raise UserError(f"{where}: expected {tp.__name__}, got {value!r}")


def partition_file_name(params: dict) -> str:
    """A readable shard name from fedcp-partition arguments: ``digits_dir0.1_n20_s1.h5``.

    Arguments other than source, scheme, its parameter, clients and seed that differ from the
    defaults add a short hash, so that different partitions never share a name.
    """
    from fedcp_dist.cli.partition import _build_parser

    args = _build_parser().parse_args(_partition_argv(params))  # fills the defaults, checks types
    defaults = vars(_build_parser().parse_args([]))
    scheme = args.partition
    if scheme == "dir":
        scheme += _fmt(args.beta)
    elif scheme == "pat":
        scheme += f"{args.classes_per_client}" + ("u" if args.unbalanced else "")
    name = f"{args.source or 'digits'}_{scheme}_n{args.num_clients}_s{args.seed}"
    named = {"source", "partition", "beta", "classes_per_client", "unbalanced", "num_clients", "seed",
             *PARTITION_LOCATION_KEYS}
    extra = {k: v for k, v in vars(args).items()
             if k in PARTITION_KEYS and k not in named and v != defaults.get(k)}
    if extra:
        name += "_" + hashlib.sha1(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:8]
    return _UNSAFE.sub("_", name) + ".h5"


def load_sweep(path, kind: Optional[str] = None) -> Sweep:
    """Read and check a sweep file; expand its grid into points. Raises :class:`UserError`."""
    path = Path(path)
    raw = _read_yaml(path)
    for key in raw:
        if key not in TOP_KEYS:
            raise UserError(f"sweep file {path}: unknown key '{key}'{_did_you_mean(key, TOP_KEYS)}; "
                            f"known: {', '.join(TOP_KEYS)}")

    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"sweep key 'name' is required: the sweep's directory under root ({path})")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"sweep key 'name': {name!r} must be a plain directory name (letters, digits, . _ -)")
    root = raw.get("root", DEFAULT_ROOT)
    if not isinstance(root, str) or not root:
        raise UserError(f"sweep key 'root' must be a directory path, got {root!r}")
    base = raw.get("base")
    if not isinstance(base, str) or not base:
        raise UserError("sweep key 'base' is required: the run config every point starts from")
    if not Path(base).is_file():
        raise UserError(f"sweep key 'base': config file not found: {base}")
    base_path = Path(base).resolve()

    # executor
    executor = _check_mapping(raw.get("executor"), "executor", EXECUTOR_KEYS)
    kind = kind or executor.get("kind", "local")
    if kind not in EXECUTORS:
        raise UserError(f"sweep key 'executor.kind': {kind!r} is not one of {', '.join(EXECUTORS)}")
    nproc = executor.get("nproc", 1)
    if not type_ok(nproc, int) or nproc < 1:
        raise UserError(f"sweep key 'executor.nproc' must be an integer >= 1, got {nproc!r}")
    slurm = dict(_check_mapping(executor.get("slurm"), "executor.slurm", SLURM_KEYS))
    for key, value in slurm.items():
        tp = SLURM_KEYS[key][0]
        if not type_ok(value, tp) or (tp in (int, float) and value < 0):
            raise UserError(f"sweep key 'executor.slurm.{key}': expected a {'non-negative ' if tp in (int, float) else ''}"
                            f"{tp.__name__} ({SLURM_KEYS[key][1]}), got {value!r}")
    tasks = slurm.get("tasks_per_node")
    if tasks is not None and nproc > 1 and tasks != nproc:
        raise UserError(f"sweep key 'executor.slurm.tasks_per_node' ({tasks}) must equal executor.nproc ({nproc}): "
                        f"on SLURM each rank is one task")

    # overrides: nested or dotted, applied to every point
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise UserError(f"sweep key 'overrides' must be a mapping of config keys to values, got {overrides!r}")
    overrides = flatten(overrides)
    for key in overrides:
        if key in RESERVED:
            raise UserError(f"sweep key 'overrides.{key}': {key} is set by the sweep (one run directory per point)")
    override_args = [f"{k}={yaml_value(v)}" for k, v in overrides.items()]
    try:
        load_config(str(base_path), override_args, validate=False)
    except UserError as exc:
        raise UserError(f"sweep key 'overrides': {exc}") from None

    # grid
    grid = raw.get("grid")
    if not isinstance(grid, dict) or not grid:
        raise UserError("sweep key 'grid' is required: a mapping of config keys to lists of values")
    grid = flatten(grid)
    config_keys = _config_keys()
    part_block = raw.get("partition")
    if part_block is not None:
        part_block = dict(_check_mapping(part_block, "partition", PARTITION_KEYS))
        for key, value in part_block.items():
            _check_partition_value(key, value, f"sweep key 'partition.{key}'")
        if "data.path" in overrides:
            raise UserError("sweep key 'overrides.data.path' conflicts with the partition block, which sets data.path")
    partition_keys = []  # grid key -> partition option
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"sweep grid key '{key}': expected a non-empty list of values, got {values!r}")
        seen = set()
        for v in values:
            token = json.dumps(v, sort_keys=True, default=str)
            if token in seen:
                raise UserError(f"sweep grid key '{key}': value {v!r} is listed twice")
            seen.add(token)
        if key in RESERVED:
            raise UserError(f"sweep grid key '{key}': {key} is set by the sweep (one run directory per point)")
        if key in overrides:
            raise UserError(f"sweep grid key '{key}' is also set in overrides; keep it in one place")
        opt = key[len("partition."):] if key.startswith("partition.") else key
        is_partition = key.startswith("partition.") or (key not in config_keys and opt in PARTITION_KEYS)
        if is_partition:
            if opt not in PARTITION_KEYS:
                raise UserError(f"sweep grid key '{key}': '{opt}' is not a fedcp-partition option"
                                f"{_did_you_mean(opt, PARTITION_KEYS)}")
            if part_block is None:
                raise UserError(f"sweep grid key '{key}' is a fedcp-partition option, but the sweep has no "
                                f"partition block")
            for v in values:
                _check_partition_value(opt, v, f"sweep grid key '{key}'")
            partition_keys.append(key)
            continue
        if key == "data.path" and part_block is not None:
            raise UserError("sweep grid key 'data.path' conflicts with the partition block, which sets data.path")
        for v in values:
            try:
                load_config(str(base_path), override_args + [f"{key}={yaml_value(v)}"], validate=False)
            except UserError as exc:
                raise UserError(f"sweep grid key '{key}': {exc}") from None

    sweep = Sweep(file=path, name=name, root=Path(root), base=base_path, overrides=overrides, grid=grid,
                  partition=part_block, kind=kind, nproc=nproc, slurm=slurm, partition_keys=partition_keys)
    _expand(sweep, override_args)
    return sweep


def _expand(sweep: Sweep, override_args: list) -> None:
    keys = list(sweep.grid)
    runs_dir = (sweep.dir / "runs").resolve()
    data_dir = (sweep.dir / "data").resolve()
    names: dict = {}
    for index, combo in enumerate(itertools.product(*(sweep.grid[k] for k in keys))):
        params = dict(zip(keys, combo))
        name = point_name(params)
        if name in names:
            raise UserError(f"sweep points {names[name]} and {params} get the same directory name {name!r}; "
                            f"make the grid values distinct")
        names[name] = params
        args = list(override_args)
        args += [f"{k}={yaml_value(v)}" for k, v in params.items() if k not in sweep.partition_keys]
        part = data_path = None
        if sweep.partition is not None:
            part = dict(sweep.partition)
            for k in sweep.partition_keys:
                part[k.split(".", 1)[1] if k.startswith("partition.") else k] = params[k]
            if "data.num_clients" in params:
                part["num_clients"] = params["data.num_clients"]
            if "num_clients" not in part:
                raise UserError("sweep key 'partition.num_clients' is required (in the block or the grid)")
            data_path = data_dir / partition_file_name(part)
            args.append(f"data.path={data_path}")
            if "data.num_clients" not in params:
                args.append(f"data.num_clients={part['num_clients']}")
        run_dir = runs_dir / name
        args.append(f"out_dir={run_dir}")
        point = Point(index, params, name, run_dir, args, part, data_path)
        _validate_point(sweep, point)
        sweep.points.append(point)


def _point_config(sweep: Sweep, point: Point) -> Config:
    try:
        return load_config(str(sweep.base), point.overrides, validate=False)
    except UserError as exc:
        raise UserError(f"sweep point {point.name}: {exc}") from None


def _validate_point(sweep: Sweep, point: Point) -> None:
    """Full config validation; a shard the sweep makes later stands in as an existing file."""
    cfg = _point_config(sweep, point)
    if point.data_path is not None:
        cfg.data.path = str(sweep.base)
    try:
        cfg.validate()
    except UserError as exc:
        raise UserError(f"sweep point {point.name}: {exc}") from None


def _config_drift(sweep: Sweep, point: Point) -> list:
    """Config keys whose value in a finished run's config.yaml differs from the point's."""
    try:
        with open(point.run_dir / "config.yaml", encoding="utf-8") as f:
            have = flatten(yaml.safe_load(f) or {})
    except (OSError, yaml.YAMLError):
        return []
    want = flatten(_point_config(sweep, point).to_dict())
    drift = []
    for key, value in want.items():
        if key in DRIFT_IGNORED or key not in have:
            continue
        other = have[key]
        if key == "data.path":
            if os.path.realpath(str(other)) != os.path.realpath(str(value)):
                drift.append(key)
        elif other != value:
            drift.append(key)
    return drift


# ----------------------------------------------------------------------------- partitions, manifest


def make_partitions(sweep: Sweep, points=None, say=print) -> list:
    """Write each distinct shard that ``points`` need and that does not exist yet; returns the made."""
    from fedcp_dist.cli import partition as partition_cli

    made = []
    todo = {}
    for p in sweep.points if points is None else points:
        if p.data_path is not None:
            todo.setdefault(p.data_path, p.partition)
    for data_path, params in todo.items():
        if data_path.exists():
            say(f"partition {_display_path(data_path)}: exists")
            continue
        data_path.parent.mkdir(parents=True, exist_ok=True)
        say(f"partition {_display_path(data_path)}: making it")
        argv = _partition_argv(params) + ["--out", str(data_path)]
        try:
            partition_cli.main.__wrapped__(argv)
        except UserError as exc:
            raise UserError(f"sweep partition {data_path.name}: {exc}") from None
        made.append(data_path)
    return made


def _manifest(sweep: Sweep, previous: Optional[dict]) -> dict:
    sweep_dir = sweep.dir.resolve()
    return {
        "format": MANIFEST_FORMAT,
        "name": sweep.name,
        "sweep_file": str(sweep.file.resolve()),
        "base": str(sweep.base),
        "overrides": sweep.overrides,
        "grid": sweep.grid,
        "grid_keys": list(sweep.grid),
        "partition_keys": sweep.partition_keys,
        "partition": sweep.partition,
        "executor": {"kind": sweep.kind, "nproc": sweep.nproc, "slurm": sweep.slurm},
        "points": [
            {
                "name": p.name,
                "run_dir": str(p.run_dir.relative_to(sweep_dir)),
                "params": p.params,
                "data_path": str(p.data_path.relative_to(sweep_dir)) if p.data_path else None,
                "command": sweep.command(p),
            }
            for p in sweep.points
        ],
        "submissions": (previous or {}).get("submissions", []),
    }


def write_manifest(sweep: Sweep, submission: Optional[dict] = None) -> Path:
    path = sweep.dir / MANIFEST
    previous = None
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            previous = None
    data = _manifest(sweep, previous)
    if submission:
        data["submissions"].append(submission)
    sweep.dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
    return path


# ----------------------------------------------------------------------------- running one point


def _stderr_tail(lines, n: int = 6) -> str:
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    return " | ".join(lines[-n:]) or "(no output on stderr)"


def _pump(proc: subprocess.Popen, sink, tail: collections.deque) -> None:
    """Copy the child's stderr to ``sink`` line by line, keeping the last lines."""
    for line in proc.stderr:
        tail.append(line)
        sink.write(line)
        sink.flush()


def _summary(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _submitit_requeue() -> bool:
    """Run submitit's own warning-signal handler (checkpoint, requeue, exit) if it is installed."""
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler) and getattr(handler, "__name__", "") == "checkpoint_and_try_requeue":
        handler(signal.SIGUSR2, None)  # the main task requeues the job and exits; the others return
        return True
    return False


class SweepRun:
    """The callable that one SLURM array task runs for one point (submitted by ``fedcp-sweep``).

    ``__call__(name, args)`` runs ``fedcp_dist.run`` with ``args`` in a subprocess, so that the
    job's environment and the runtime's launcher detection apply; with several tasks per run
    (``in_process``) every task calls ``fedcp_dist.run.main`` itself and the runtime reads
    ``SLURM_PROCID``. A failed run raises with the tail of its stderr. On the warning signal before
    a time limit or on preemption submitit calls :meth:`checkpoint`, which lets the run write its
    own checkpoint and requeues the same call: the run resumes from it.
    """

    def __init__(self, cwd: str, in_process: bool = False, stop_wait_s: float = 100.0):
        self.cwd = cwd
        self.in_process = in_process
        self.stop_wait_s = stop_wait_s
        self._proc: Optional[subprocess.Popen] = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_proc"] = None  # a running child never travels
        return state

    def __call__(self, name: str, args: list):
        out_dir = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("out_dir=")), None)
        if self.in_process:
            return self._in_process(name, args, out_dir)
        cmd = [sys.executable, "-m", "fedcp_dist.run", *args]
        print(f"fedcp-sweep: {name}: {shlex.join(cmd)}", flush=True)
        tail: collections.deque = collections.deque(maxlen=40)
        self._proc = subprocess.Popen(cmd, cwd=self.cwd, stderr=subprocess.PIPE, text=True, errors="replace")
        try:
            _pump(self._proc, sys.stderr, tail)
            rc = self._proc.wait()
        finally:
            self._proc = None
        if rc == EXIT_REQUEUE and _submitit_requeue():  # checkpointed on a signal: requeue
            return None
        summary = _summary(out_dir) if out_dir else None
        if rc != 0 or summary is None:
            why = f"exit status {rc}" if rc != 0 else "no summary.json written"
            raise RuntimeError(f"run {name} failed ({why}): {_stderr_tail(tail)}")
        return summary

    def _in_process(self, name: str, args: list, out_dir: Optional[str]):
        from fedcp_dist.run import main as run_main

        os.chdir(self.cwd)
        try:
            run_main.__wrapped__(list(args))
        except Exception as exc:
            if type(exc).__name__ == "Preempted" and _submitit_requeue():  # checkpointed: requeue
                return None
            raise
        summary = _summary(out_dir) if out_dir else None
        if summary is None and os.environ.get("SLURM_PROCID", "0") == "0":
            raise RuntimeError(f"run {name} failed: no summary.json in {out_dir}")
        return summary

    def checkpoint(self, *args):
        """Called by submitit on the warning signal: let the run checkpoint, then requeue this call."""
        import submitit

        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:  # the run checkpoints on SIGTERM too and exits with status 75; a repeat is harmless
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=self.stop_wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
            except OSError:
                pass
        return submitit.helpers.DelayedSubmission(self, *args)


# ----------------------------------------------------------------------------- executors


def _point_line(sweep: Sweep, k: int, point: Point, status: str) -> str:
    return f"[{k}/{len(sweep.points)}] {status:<10} {_display_path(point.run_dir)}"


def _status_word(sweep: Sweep, point: Point) -> tuple[str, list]:
    status = point.status()
    drift = _config_drift(sweep, point) if status == "finished" else []
    return status, drift


def dry_run(sweep: Sweep) -> None:
    statuses = [_status_word(sweep, p) for p in sweep.points]
    counts = collections.Counter(s for s, _ in statuses)
    print(f"sweep {sweep.name}: {len(sweep.points)} points over {' × '.join(sweep.grid)}; "
          f"{counts['finished']} finished, {len(sweep.points) - counts['finished']} to run "
          f"(executor {sweep.kind}, {sweep.nproc} rank{'s' if sweep.nproc > 1 else ''} per run)")
    print(f"directory {_display_path(sweep.dir)}")
    shards = {}
    for p, (status, _) in zip(sweep.points, statuses):
        if p.data_path is not None:
            shards.setdefault(p.data_path, [0, 0])[status == "finished"] += 1
    for data_path, (todo, done) in shards.items():
        state = "exists" if data_path.exists() else ("to be made" if todo else "missing (only finished runs use it)")
        print(f"partition {_display_path(data_path)}: {state}")
    for k, (p, (status, drift)) in enumerate(zip(sweep.points, statuses), 1):
        shown = {"unfinished": "pending"}.get(status, status)
        note = " (resumes)" if status == "unfinished" else ""
        if drift:
            note = f" (config differs: {', '.join(drift)})"
        print(f"{_point_line(sweep, k, p, shown)}{note}  {sweep.display_command(p)}")
    if sweep.kind == "slurm":
        n = len(sweep.points) - counts["finished"]
        what = f"one array job of {n} tasks" if n > 1 else ("one job" if n else "nothing to submit")
        print(f"slurm: {what}; submitit parameters {json.dumps(_slurm_parameters(sweep), sort_keys=True)}")
    print("dry run: nothing was made or submitted")


def _drift_warning(sweep: Sweep) -> None:
    stale = [(p, d) for p in sweep.points if p.status() == "finished" and (d := _config_drift(sweep, p))]
    if stale:
        keys = sorted({k for _, d in stale for k in d})
        print(f"warning: {len(stale)} finished run(s) were made with a different config ({', '.join(keys)}) "
              f"and were kept; remove their directories to run them again, e.g. {_display_path(stale[0][0].run_dir)}")


def _terminate(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_local(sweep: Sweep) -> int:
    """Run the unfinished points one after another; the number of failed points."""
    todo = [p for p in sweep.points if p.status() != "finished"]
    print(f"sweep {sweep.name}: {len(sweep.points)} points, {len(sweep.points) - len(todo)} finished, "
          f"{len(todo)} to run one after another (local, {sweep.nproc} rank{'s' if sweep.nproc > 1 else ''} per run)",
          flush=True)
    _drift_warning(sweep)
    make_partitions(sweep, todo)
    write_manifest(sweep, {"time": _now(), "executor": "local", "points": [p.name for p in todo]} if todo else None)
    logs = sweep.dir / "logs"
    failed = []
    for k, p in enumerate(sweep.points, 1):
        status = p.status()
        if status == "finished":
            print(_point_line(sweep, k, p, "finished") + "  (skipped)", flush=True)
            continue
        print(_point_line(sweep, k, p, "running") + (" (resuming)" if status == "unfinished" else ""), flush=True)
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{p.name}.log"
        cmd = sweep.command(p)
        t0 = time.perf_counter()
        tail: collections.deque = collections.deque(maxlen=40)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"# {_now()} {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, errors="replace")
            try:
                _pump(proc, log, tail)
                rc = proc.wait()
            except KeyboardInterrupt:
                print(f"interrupted: waiting for {p.name} to checkpoint and stop", file=sys.stderr, flush=True)
                _terminate(proc)
                raise
        seconds = time.perf_counter() - t0
        summary = _summary(p.run_dir)
        if rc == 0 and summary is not None:
            print(_point_line(sweep, k, p, "finished") + f"  {seconds:.1f} s, best_acc {summary.get('best_acc', float('nan')):.4f}",
                  flush=True)
            continue
        if rc == EXIT_REQUEUE:
            why = "stopped after a checkpoint (exit 75); run the sweep again to resume it"
        elif rc == 0:
            why = "exited 0 but wrote no summary.json"
        else:
            why = f"exit status {rc}: {_stderr_tail(tail, 2)}"
        print(_point_line(sweep, k, p, "FAILED") + f"  {seconds:.1f} s, {why}; log {_display_path(log_path)}", flush=True)
        failed.append((p, why, log_path))
    done = sum(p.status() == "finished" for p in sweep.points)
    print(f"sweep {sweep.name}: {done}/{len(sweep.points)} finished, {len(failed)} failed", flush=True)
    for p, why, log_path in failed:
        print(f"  failed: {p.name}: {why} (log {_display_path(log_path)})", flush=True)
    return len(failed)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def _slurm_parameters(sweep: Sweep) -> dict:
    s = sweep.slurm
    tasks = s.get("tasks_per_node", sweep.nproc)
    params: dict = {
        "name": f"fedcp-{sweep.name}",
        "timeout_min": s.get("time_min", 60),
        "tasks_per_node": tasks,
        "nodes": s.get("nodes", 1),
        "slurm_signal_delay_s": s.get("signal_delay_s", SIGNAL_DELAY_S),
    }
    if s.get("gpus_per_task"):
        params["gpus_per_node"] = s["gpus_per_task"] * tasks
    for key, target in (("partition", "slurm_partition"), ("cpus_per_task", "cpus_per_task"),
                        ("mem_gb", "mem_gb"), ("array_parallelism", "slurm_array_parallelism"),
                        ("account", "slurm_account"), ("qos", "slurm_qos"),
                        ("constraint", "slurm_constraint"), ("setup", "slurm_setup")):
        if key in s:
            params[target] = s[key]
    return params


def _file_tail(path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no log at {path}"
    return " | ".join(lines[-n:]) or f"empty log {path}"


def _in_queue(job_id: str) -> Optional[bool]:
    """Whether squeue still lists any task of ``job_id`` (None: squeue did not answer)."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return bool(out.stdout.strip())


def _wait_for(pairs: list, array_id: str, poll_s: float = 5.0, grace_s: float = 30.0):
    """Yield ``(job, point, gone)`` as each job's result appears, in completion order.

    Polls the result files and ``squeue`` rather than ``sacct`` (which clusters without accounting
    lack). A job still without a result ``grace_s`` after its array left the queue is yielded with
    ``gone=True``.
    """
    left = list(pairs)
    gone_since = None
    while left:
        for job, point in list(left):
            tasks = getattr(job, "_sub_jobs", None) or [job]
            if all(t.paths.result_pickle.exists() for t in tasks):
                left.remove((job, point))
                yield job, point, False
        if not left:
            return
        if _in_queue(array_id) is False:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > grace_s:
                for job, point in left:
                    yield job, point, True
                return
        else:
            gone_since = None
        time.sleep(poll_s)


def run_slurm(sweep: Sweep, wait: bool) -> int:
    """Submit one array job for the unfinished points; with ``wait``, the number of failed points."""
    try:
        import submitit
    except ImportError:
        raise UserError("--executor slurm needs submitit: pip install submitit") from None
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise UserError("--executor slurm needs sbatch and srun on PATH; this machine has no SLURM client "
                        "(use --executor local)")
    todo = [p for p in sweep.points if p.status() != "finished"]
    print(f"sweep {sweep.name}: {len(sweep.points)} points, {len(sweep.points) - len(todo)} finished, "
          f"{len(todo)} to submit (slurm)", flush=True)
    _drift_warning(sweep)
    if not todo:
        write_manifest(sweep)
        print("nothing to submit: every point is finished")
        return 0
    make_partitions(sweep, todo)
    folder = sweep.dir.resolve() / "submitit"
    params = _slurm_parameters(sweep)
    kwargs = {}
    if "max_num_timeout" in sweep.slurm:
        kwargs["slurm_max_num_timeout"] = sweep.slurm["max_num_timeout"]
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm", **kwargs)
    try:
        executor.update_parameters(**params)
    except ValueError as exc:
        raise UserError(f"sweep key 'executor.slurm': {str(exc).splitlines()[0]}") from None
    runner = SweepRun(cwd=os.getcwd(), in_process=params["tasks_per_node"] * params["nodes"] > 1)
    try:
        jobs = executor.map_array(runner, [p.name for p in todo], [sweep.run_args(p) for p in todo])
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError, OSError) as exc:
        raise UserError(f"sbatch refused the array job: {' '.join(str(exc).split())[:500]}") from None
    array_id = jobs[0].job_id.split("_")[0]
    print(f"submitted {'array job' if len(jobs) > 1 else 'job'} {array_id}: {len(jobs)} task(s), "
          f"logs in {_display_path(folder)}", flush=True)
    for job, p in zip(jobs, todo):
        print(f"  {job.job_id}  {_display_path(p.run_dir)}", flush=True)
    write_manifest(sweep, {"time": _now(), "executor": "slurm", "array_job": array_id,
                           "jobs": {p.name: job.job_id for job, p in zip(jobs, todo)}})
    if not wait:
        print(f"not waiting: watch with `squeue -j {array_id}`; run this command again to resubmit what did not finish")
        return 0
    print("waiting for the jobs ...", flush=True)
    failed = 0
    for job, p, gone in _wait_for(list(zip(jobs, todo)), array_id):
        if gone:  # left the queue without a result: killed, node failure, cancelled
            failed += 1
            print(f"  {job.job_id}  {p.name}: FAILED: left the queue without a result; "
                  f"{_file_tail(job.paths.stderr)}", flush=True)
            continue
        try:
            summary = job.results()[0]  # one result per task; the first is rank 0's
        except Exception as exc:  # submitit re-raises the task's error with its traceback
            failed += 1
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            print(f"  {job.job_id}  {p.name}: FAILED: {lines[-1] if lines else type(exc).__name__}", flush=True)
            continue
        acc = (summary or _summary(p.run_dir) or {}).get("best_acc")
        acc_text = f"best_acc {acc:.4f}" if isinstance(acc, (int, float)) else "no summary"
        print(f"  {job.job_id}  {p.name}: finished, {acc_text}", flush=True)
    done = sum(p.status() == "finished" for p in sweep.points)
    print(f"sweep {sweep.name}: {done}/{len(sweep.points)} finished, {failed} failed", flush=True)
    return failed


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fedcp-sweep",
                description="Run a grid of fedcp_dist experiments: locally one after another, or as one SLURM array job.")
    p.add_argument("sweep", help="sweep YAML file (see configs/sweeps/)")
    p.add_argument("--dry-run", action="store_true", help="print the points, their status and commands; run nothing")
    p.add_argument("--executor", choices=EXECUTORS, help="override executor.kind of the sweep file")
    p.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and print each result")
    return p


@cli_main
def main(argv=None) -> None:
    """Entry point of ``fedcp-sweep``."""
    args = build_parser().parse_args(argv)
    sweep = load_sweep(args.sweep, kind=args.executor)
    if args.dry_run:
        dry_run(sweep)
        return
    failed = run_slurm(sweep, args.wait) if sweep.kind == "slurm" else run_local(sweep)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
