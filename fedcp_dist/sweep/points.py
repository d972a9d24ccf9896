"""A sweep's points: the sweep and point records, and the grid expanded into points, each with its
run directory, its command line, its partition and its config checked (:func:`expand`, which
:func:`fedcp_dist.sweep.spec.load_sweep` calls once the file is read)."""
from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fedcp_dist.config import Config, given_once, load_config
from fedcp_dist.data.make import PartitionSpec
from fedcp_dist.errors import UserError
from fedcp_dist.rundir.directory import DONE, RunDir
from fedcp_dist.sweep.names import display_path, partition_file_name, point_name, yaml_value

#: the parameter that names a point's variant (a key of the sweep's ``variants``)
VARIANT = "variant"


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
    #: the partition of the shard this point needs (None: the config's data.path)
    partition: Optional[PartitionSpec] = None
    data_path: Optional[Path] = None

    def status(self) -> str:
        """finished | unfinished (a run was started there) | pending: see :meth:`RunDir.status`."""
        return RunDir(self.run_dir).status()


@dataclass
class Excluded:
    """A point of the grid that an ``exclude`` rule keeps from running."""

    #: grid key -> value, as a point's
    params: dict
    name: str
    reason: str


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
    #: the base config file's mapping, read once (every point's config starts from it)
    base_values: Optional[dict] = None
    #: variant name -> its flat config keys (empty: no variants)
    variants: dict = field(default_factory=dict)
    #: the ``exclude`` rules: [(where: key -> list of values, reason)]
    exclude: list = field(default_factory=list)
    #: the grid's points those rules exclude, in grid order
    excluded: list = field(default_factory=list)

    @property
    def dimensions(self) -> list:
        """The keys a point's parameters have: the grid's, then ``variant`` when there are variants."""
        return list(self.grid) + ([VARIANT] if self.variants else [])

    @property
    def dir(self) -> Path:
        return self.root / self.name

    def run_args(self, point: Point) -> list:
        """The arguments of ``fedcp_dist.run`` for one point (absolute paths)."""
        return ["--config", str(self.base), *point.overrides]

    def command(self, point: Point, nproc: Optional[int] = None) -> list:
        nproc = self.nproc if nproc is None else nproc
        prefix = [sys.executable, "-m", "fedcp_dist.run"]
        if nproc > 1:  # torchrun behind fedcp-run --ranks: a stop ends the point as a run's (75), no traceback
            prefix += ["--ranks", str(nproc)]
        return prefix + self.run_args(point)

    def display_command(self, point: Point) -> str:
        words = []
        for w in self.command(point):
            if os.path.isabs(w):
                w = display_path(Path(w))
            elif "=" in w and os.path.isabs(w.split("=", 1)[1]):
                k, v = w.split("=", 1)
                w = f"{k}={display_path(Path(v))}"
            words.append(w)
        # the interpreter, by the short name that finds the same file on PATH
        first = self.command(point)[0]
        for short in ("python",):
            found = shutil.which(short)
            if found and os.path.abspath(found) == os.path.abspath(first) and Path(first).name.startswith(short):
                words[0] = short
        return shlex.join(words)

    def point_line(self, k: int, point: Point, status: str) -> str:
        """``[k/n] status  run_dir``: how both executors and --dry-run list a point."""
        return f"[{k}/{len(self.points)}] {status:<10} {display_path(point.run_dir)}"


def same_value(a, b) -> bool:
    """Equal as YAML values (1 and 1.0 alike, as the config reads them; lists element by element)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
        and not isinstance(b, bool) and float(a) == float(b))


def excluding_rule(sweep: Sweep, params: dict) -> Optional[int]:
    """The index of the first ``exclude`` rule that matches a point's parameters (None: it runs)."""
    for n, (where, _) in enumerate(sweep.exclude):
        if all(any(same_value(params.get(k), v) for v in values) for k, values in where.items()):
            return n
    return None


def _point_partition(sweep: Sweep, params: dict) -> PartitionSpec:
    """The partition of one point: the block, with the point's partition options and client count."""
    part = dict(sweep.partition)
    for k in sweep.partition_keys:
        part[k.split(".", 1)[1] if k.startswith("partition.") else k] = params[k]
    if "data.num_clients" in params:
        part["num_clients"] = params["data.num_clients"]
    if "num_clients" not in part:
        raise UserError("sweep key 'partition.num_clients' is required (in the block or the grid)")
    spec = PartitionSpec(**part)
    try:
        spec.check()
    except UserError as exc:
        raise UserError(f"sweep partition {partition_file_name(spec)}: {exc}") from None
    return spec


#: the most points a sweep file may make (a SLURM array takes at most MaxArraySize tasks, often 1,001)
MAX_POINTS = 20_000
#: from this many points on, checking them is said first
SAY_POINTS = 2_000


def expand(sweep: Sweep, override_args: list) -> None:
    keys = list(sweep.grid)
    runs_dir = (sweep.dir / "runs").resolve()
    data_dir = (sweep.dir / "data").resolve()
    names: dict = {}
    # the variants vary fastest: a sweep stopped part-way has every variant for its first grid values
    variants = list(sweep.variants) or [None]
    sizes = [len(sweep.grid[k]) for k in keys] + ([len(variants)] if sweep.variants else [])
    total = math.prod(sizes)
    if total > MAX_POINTS:
        raise UserError(f"sweep {sweep.name}: its grid makes {total:,} points ({' × '.join(map(str, sizes))}); more "
                        f"than {MAX_POINTS:,} is taken for a slip (a list where one value was meant?): split the study "
                        f"into sweeps")
    if total > SAY_POINTS:  # each point's config is checked: seconds, said before they pass
        print(f"sweep {sweep.name}: checking {total:,} points", file=sys.stderr, flush=True)
    used = [False] * len(sweep.exclude)
    shards: dict = {}  # the existing shards' headers, read once each
    for *combo, variant in itertools.product(*(sweep.grid[k] for k in keys), variants):
        params = dict(zip(keys, combo))
        if variant is not None:
            params[VARIANT] = variant
        name = point_name(params)
        if name in names:
            raise UserError(f"sweep points {names[name]} and {params} get the same directory name {name!r}; "
                            f"make the grid values distinct")
        names[name] = params
        rule = excluding_rule(sweep, params)
        if rule is not None:
            used[rule] = True
            sweep.excluded.append(Excluded(params, name, sweep.exclude[rule][1]))
            continue
        index = len(sweep.points)
        args = list(override_args)
        if variant is not None:
            args += [f"{k}={yaml_value(v)}" for k, v in sweep.variants[variant].items()]
        args += [f"{k}={yaml_value(v)}" for k, v in params.items() if k not in sweep.partition_keys and k != VARIANT]
        spec = data_path = None
        if sweep.partition is not None:
            spec = _point_partition(sweep, params)
            data_path = data_dir / partition_file_name(spec)
            args.append(f"data.path={data_path}")
            if "data.num_clients" not in params and "data.num_clients" not in sweep.overrides:
                args.append(f"data.num_clients={spec.num_clients}")
        run_dir = runs_dir / name
        args.append(f"out_dir={run_dir}")
        point = Point(index, params, name, run_dir, args, spec, data_path)
        _validate_point(sweep, point, shards)
        sweep.points.append(point)
    for n, hit in enumerate(used, 1):
        if not hit:
            raise UserError(f"sweep key 'exclude' rule {n} excludes no point (an earlier rule took them all)")


def point_config(sweep: Sweep, point: Point) -> Config:
    try:
        return load_config(str(sweep.base), point.overrides, validate=False, values=sweep.base_values)
    except UserError as exc:
        raise UserError(f"sweep point {point.name}: {exc}") from None


def _validate_point(sweep: Sweep, point: Point, shards: dict) -> None:
    """Full config validation; a shard the sweep makes later stands in as an existing file. The
    point's command line is the run's: a key in it twice is refused there, so here first. A point
    still to run whose shard exists is checked against it as its run would check it (the model's
    kind of data, ``data.clients``, ...), and the shard's header read (``shards``: path -> its
    header, or the one line that says why it cannot be read): otherwise every point would fail on
    the same line, one after another."""
    try:
        given_once(point.overrides)
    except UserError as exc:
        raise UserError(f"sweep point {point.name}: {exc}") from None
    cfg = point_config(sweep, point)
    if point.data_path is not None:
        cfg.data.path = str(sweep.base)
    try:
        cfg.validate()
    except UserError as exc:
        raise UserError(f"sweep point {point.name}: {exc}") from None
    path = point.data_path if point.data_path is not None else Path(cfg.data.path)
    if not path.is_file() or point.status() in DONE:  # a finished point reads no shard
        return
    from fedcp_dist.data.shards import read_info
    from fedcp_dist.engine.startup import check_shard

    if path not in shards:
        try:
            shards[path] = read_info(path, label_counts=False)
        except UserError as exc:
            remake = "; remove it and the sweep makes it again" if point.data_path is not None else ""
            shards[path] = f"{exc}{remake}"
    if isinstance(shards[path], str):
        raise UserError(f"sweep point {point.name}: {shards[path]}")
    cfg.data.path = str(path)
    try:
        check_shard(cfg, shards[path])
        if cfg.dp == "central":  # a target ε or δ the point's client count rules out, as its run would say
            _check_privacy_plan(cfg, shards[path].num_clients)
    except UserError as exc:
        raise UserError(f"sweep point {point.name}: {exc}") from None


#: what :func:`_check_privacy_plan` found for each mechanism (a calibration takes seconds, and the
#: seeds of a grid share one): "" or the refusal's line
_PLANS: dict = {}


def _check_privacy_plan(cfg, shard_clients: int) -> None:
    """The refusal a ``dp: central`` run would start with (a target ε not reachable in its rounds, a
    δ its client count rules out), raised here: the point would only fail when it starts."""
    from fedcp_dist.comm.privacy import plan_run
    from fedcp_dist.state.placement import client_subset

    n = len(client_subset(cfg.data.clients, cfg.seed, shard_clients))
    flat = cfg.to_dict()
    key = (n, *(repr(flat.get(k)) for k in ("rounds", "participation", "participation_sampling", "participation_range")),
           *sorted((k, repr(v)) for k, v in flat.items() if k.startswith("dp")))
    if key not in _PLANS:
        try:
            plan_run(cfg, n)
            _PLANS[key] = ""
        except UserError as exc:
            _PLANS[key] = str(exc)
    if _PLANS[key]:
        raise UserError(_PLANS[key])
