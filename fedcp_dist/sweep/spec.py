"""A sweep file, its grid, its points and their names.

A sweep file names a base run config, overrides applied to every point and a grid (a cartesian
product of config keys), and optionally named variants (``variants: {name: {key: value, ...}}``:
sets of config keys that belong together, crossed with the grid as one more dimension, the point's
parameter ``variant``). Every point has a stable run directory named after its parameters,
``<root>/<name>/runs/<key>=<value>,...``; an optional ``partition`` block makes the shards the grid
needs, one file per distinct partition, under ``<root>/<name>/data/``.

``exclude`` lists points of the grid that are not run, each rule with the reason a reader of the
results is given (a setting where the study reports a method as invalid, say)::

    exclude:
      - where: {method: perfedavg, num_clients: [200, 500]}   # a value or a list of values per key
        reason: the paper reports Per-FedAvg as invalid at N >= 200

A point is excluded when each key of a rule's ``where`` (a grid key or ``variant``) has one of the
listed values; every listed value must occur in the grid and every rule must exclude a point.
Excluded points are not expanded into runs; the dry run, ``sweep.json`` and ``fedcp-report`` list
them with their reasons.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Optional

from fedcp_dist.config import Config, flatten, from_here, load_config, read_yaml_mapping
from fedcp_dist.data.make import check_option, option_types
from fedcp_dist.errors import UserError
from fedcp_dist.options import shown, type_ok
from fedcp_dist.rundir.directory import RunDir
from fedcp_dist.options import did_you_mean
from fedcp_dist.sweep.names import yaml_value
from fedcp_dist.sweep.points import VARIANT, Sweep, expand, same_value

DEFAULT_ROOT = "runs/sweeps"
TOP_KEYS = ("name", "root", "base", "overrides", "grid", "variants", "partition", "executor", "exclude")
#: the keys of one ``exclude`` rule
EXCLUDE_KEYS = ("where", "reason")
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
#: fedcp-partition options a partition block (or a grid key) may set: option -> type
PARTITION_KEYS = option_types()
#: partition options that do not change which samples a client gets (left out of the file name)
#: config keys a sweep sets itself
RESERVED = ("out_dir",)
#: config keys whose value a sweep fixes: both executors launch an unfinished point again (a
#: requeue, a re-run of the sweep) and it must go on from its own checkpoint, which overwrite=true
#: would remove every time and resume=never would refuse
RERUN_KEYS = {"overwrite": False, "resume": "auto"}


def _check_mapping(value, what: str, known) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"sweep key '{what}' must be a mapping, got {shown(value)}")
    for key in value:
        if key not in known:
            raise UserError(f"sweep key '{what}.{key}' is unknown{did_you_mean(key, known)}; "
                            f"known: {', '.join(known)}")
    return value


def _check_partition_value(key: str, value, where: str) -> None:
    try:
        check_option(key, value)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def load_sweep(path, kind: Optional[str] = None) -> Sweep:
    """Read and check a sweep file; expand its grid into points. Raises :class:`UserError`."""
    path = Path(path)
    raw = read_yaml_mapping(path, "sweep file")
    if not raw:
        raise UserError(f"sweep file {path} must hold a mapping (name, base, grid, ...)")
    run_keys = {f.name for f in dataclasses.fields(Config)} - set(TOP_KEYS)
    for key in raw:
        if key in run_keys and not set(raw) & set(TOP_KEYS):  # a run's config, given where a sweep file goes
            raise UserError(f"{path} is a run's config (its keys are a run's: {key}, ...), not a sweep file: run "
                            f"it with fedcp-run --config {path}, or name it as a sweep file's base")
        if key not in TOP_KEYS:
            raise UserError(f"sweep file {path}: unknown key '{key}'{did_you_mean(key, TOP_KEYS)}; "
                            f"known: {', '.join(TOP_KEYS)}")

    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"sweep key 'name' is required: the sweep's directory under root ({path})")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"sweep key 'name': {name!r} must be a plain directory name (letters, digits, . _ -)")
    root = raw.get("root", DEFAULT_ROOT)
    if not isinstance(root, str) or not root:
        raise UserError(f"sweep key 'root' must be a directory path, got {root!r}")
    # the sweep's folder and every folder above it: a directory, or not there yet
    for folder in (Path(root) / name, *(Path(root) / name).parents):
        if folder.exists() and not folder.is_dir():
            what = "the sweep's directory" if folder == Path(root) / name else "a folder above the sweep's directory"
            raise UserError(f"sweep keys 'root'/'name': {folder} ({what}) is a file, not a directory")
    base = raw.get("base")
    if Path(base).is_dir() if isinstance(base, str) and base else False:
        raise UserError(f"sweep key 'base': {base} is a directory; name the run config file (a .yaml)")
    if not isinstance(base, str) or not base:
        raise UserError("sweep key 'base' is required: the run config every point starts from")
    if not Path(base).is_file():
        raise UserError(f"sweep key 'base': config file not found: {base}{from_here(base)}")
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
                            f"{tp.__name__} ({SLURM_KEYS[key][1]}), got {shown(value)}")
    tasks = slurm.get("tasks_per_node")
    if tasks is not None and nproc > 1 and tasks != nproc:
        raise UserError(f"sweep key 'executor.slurm.tasks_per_node' ({tasks}) must equal executor.nproc ({nproc}): "
                        f"on SLURM each rank is one task")

    # overrides: nested or dotted, applied to every point
    overrides = _config_keys(raw.get("overrides") or {}, "sweep key 'overrides'",
                             lambda key: f"sweep key 'overrides.{key}'")
    override_args = [f"{k}={yaml_value(v)}" for k, v in overrides.items()]
    try:
        base_cfg = load_config(str(base_path), [], validate=False)
    except UserError as exc:  # the base config itself, before any override
        raise UserError(f"sweep key 'base': {exc}") from None
    try:
        load_config(str(base_path), override_args, validate=False)
    except UserError as exc:
        raise UserError(f"sweep key 'overrides': {exc}") from None
    for key in RERUN_KEYS:
        _check_rerun_key(key, getattr(base_cfg, key), f"sweep key 'base' ({base}) sets config key '{key}'")

    variants = _check_variants(raw.get("variants"), overrides, override_args, base_path)

    # grid
    grid = raw.get("grid")
    if grid is None and variants:
        grid = {}
    elif not isinstance(grid, dict) or not grid:
        raise UserError("sweep key 'grid' is required: a mapping of config keys to lists of values"
                        + ("" if "variants" in raw else " (or 'variants')"))
    grid = flatten(grid)
    config_keys = set(flatten(Config().to_dict()))
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
        for v in values:
            _check_rerun_key(key, v, f"sweep grid key '{key}'")
        if key in overrides:
            raise UserError(f"sweep grid key '{key}' is also set in overrides; keep it in one place")
        in_variant = [n for n, keys in variants.items() if key in keys]
        if in_variant:
            raise UserError(f"sweep grid key '{key}' is also set by variant '{in_variant[0]}'; keep it in one place")
        opt = key[len("partition."):] if key.startswith("partition.") else key
        is_partition = key.startswith("partition.") or (key not in config_keys and opt in PARTITION_KEYS)
        if is_partition:
            if opt not in PARTITION_KEYS:
                raise UserError(f"sweep grid key '{key}': '{opt}' is not a fedcp-partition option"
                                f"{did_you_mean(opt, PARTITION_KEYS)}")
            if part_block is None:
                raise UserError(f"sweep grid key '{key}' is a fedcp-partition option, but the sweep has no "
                                f"partition block")
            for v in values:
                _check_partition_value(opt, v, f"sweep grid key '{key}'")
            partition_keys.append(key)
            continue
        if key == "data.path" and part_block is not None:
            raise UserError("sweep grid key 'data.path' conflicts with the partition block, which sets data.path")
        resolved: dict = {}
        for v in values:
            try:
                cfg = load_config(str(base_path), override_args + [f"{key}={yaml_value(v)}"], validate=False)
            except UserError as exc:
                if part_block is not None and str(exc).startswith(f"unknown config key '{key}'"):
                    # a grid key may be a fedcp-partition option too: the closest of both kinds is named
                    # (a mistyped num_clients was said to mean 'eval_clients')
                    raise UserError(f"sweep grid key '{key}': neither a config key nor a fedcp-partition option"
                                    f"{did_you_mean(key, sorted(config_keys | set(PARTITION_KEYS)))}") from None
                raise UserError(f"sweep grid key '{key}': {exc}") from None
            value = flatten(cfg.to_dict()).get(key, v)  # as the run reads it: '1e-1' and 0.1 alike
            marker = json.dumps(value, sort_keys=True, default=str)
            if marker in resolved:
                raise UserError(f"sweep grid key '{key}': {resolved[marker]!r} and {v!r} are the same value "
                                f"({value!r} in a run's config); keep one")
            resolved[marker] = v

    sweep = Sweep(file=path, name=name, root=Path(root), base=base_path, overrides=overrides, grid=grid,
                  partition=part_block, kind=kind, nproc=nproc, slurm=slurm, partition_keys=partition_keys,
                  base_values=read_yaml_mapping(base_path), variants=variants)
    sweep.exclude = _check_exclude(raw.get("exclude"), sweep)
    expand(sweep, override_args)
    if not sweep.points:
        raise UserError(f"sweep file {path}: 'exclude' leaves no point to run")
    for p in sweep.points:  # a finished point's summary that cannot be read: neither done nor to run
        run = RunDir(p.run_dir)
        if run.summary.exists() and run.read_summary() is None:
            raise UserError(f"{run.summary} is damaged (not a JSON object), so its point is neither finished nor "
                            f"to run; restore it, or move the point's folder away to run it again")
    return sweep


def _check_exclude(raw, sweep: Sweep) -> list:
    """The ``exclude`` rules as [(where, reason)], each value of ``where`` a list of grid values."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise UserError(f"sweep key 'exclude' must be a non-empty list of rules "
                        f"({{where: {{key: value(s)}}, reason: text}}), got {raw!r}")
    dims = {k: sweep.grid[k] for k in sweep.grid}
    if sweep.variants:
        dims[VARIANT] = list(sweep.variants)
    rules = []
    for n, rule in enumerate(raw, 1):
        what = f"sweep key 'exclude' rule {n}"
        if not isinstance(rule, dict):
            raise UserError(f"{what} must be a mapping with 'where' and 'reason', got {rule!r}")
        for key in rule:
            if key not in EXCLUDE_KEYS:
                raise UserError(f"{what}: unknown key '{key}'{did_you_mean(key, EXCLUDE_KEYS)}; "
                                f"known: {', '.join(EXCLUDE_KEYS)}")
        reason = rule.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise UserError(f"{what}: 'reason' is required: the text fedcp-report shows for the points it excludes")
        where = rule.get("where")
        if not isinstance(where, dict) or not where:
            raise UserError(f"{what}: 'where' must be a non-empty mapping of grid keys to a value or a list of values")
        checked = {}
        for key, values in where.items():
            if key not in dims:
                raise UserError(f"{what}: 'where.{key}' is not a grid key{did_you_mean(key, dims)}; "
                                f"grid keys: {', '.join(dims)}")
            listed = isinstance(values, list) and (
                not any(isinstance(g, list) for g in dims[key]) or all(isinstance(v, list) for v in values))
            values = values if listed else [values]
            for v in values:
                if not any(same_value(v, g) for g in dims[key]):
                    raise UserError(f"{what}: 'where.{key}' value {v!r} is not in the grid ({dims[key]!r})")
            checked[key] = values
        rules.append((checked, " ".join(reason.split())))
    return rules


def _check_rerun_key(key: str, value, where: str) -> None:
    """Refuse a value of a :data:`RERUN_KEYS` key other than the one every point runs under."""
    if key in RERUN_KEYS and value != RERUN_KEYS[key]:
        raise UserError(f"{where}: {key}={yaml_value(value)} cannot be part of a sweep: a point is launched again "
                        f"after a requeue or a re-run and must resume from its checkpoint; remove a point's run "
                        f"directory to run it afresh")


def _config_keys(keys, where: str, key_where) -> dict:
    """A block of config keys (nested or dotted) as a flat mapping; none of them set by the sweep itself."""
    if not isinstance(keys, dict):
        raise UserError(f"{where} must be a mapping of config keys to values, got {keys!r}")
    keys = flatten(keys)
    for key in keys:
        if key in RESERVED:
            raise UserError(f"{key_where(key)}: {key} is set by the sweep (one run directory per point)")
        _check_rerun_key(key, keys[key], key_where(key))
    return keys


def _check_variants(raw, overrides: dict, override_args: list, base_path: Path) -> dict:
    """The ``variants`` block: name -> flat config keys (nested or dotted; empty or null: the base)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"sweep key 'variants' must be a non-empty mapping of names to config keys, got {raw!r}")
    variants = {}
    resolved: dict = {}  # a variant's whole run config -> its name
    for name, keys in raw.items():
        where = f"sweep variant '{name}'"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
            raise UserError(f"sweep key 'variants': name {name!r} must be plain (letters, digits, . _ + -)")
        if keys is None:
            keys = {}
        keys = _config_keys(keys, where, lambda key: where)
        for key in keys:
            if key in overrides:
                raise UserError(f"{where} sets '{key}', which overrides also sets; keep it in one place")
        try:
            cfg = load_config(str(base_path), override_args + [f"{k}={yaml_value(v)}" for k, v in keys.items()],
                              validate=False)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        marker = json.dumps(flatten(cfg.to_dict()), sort_keys=True, default=str)
        if marker in resolved:  # two names for one run: each grid point would run it twice
            raise UserError(f"sweep variants '{resolved[marker]}' and '{name}' give the same run config; keep one")
        resolved[marker] = name
        variants[name] = keys
    return variants
