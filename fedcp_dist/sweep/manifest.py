"""What a sweep writes besides its runs: the shards its grid needs and ``sweep.json``.

``<root>/<name>/sweep.json`` records the sweep's grid and points (name, run directory, parameters,
shard, command, the config keys that define it), the points its ``exclude`` rules keep from running (name, parameters, reason) and
every submission, for ``fedcp-report`` and for people.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from fedcp_dist.data.make import make_shard
from fedcp_dist.data.shards.write import WrittenElsewhere
from fedcp_dist.errors import UserError
from fedcp_dist.fileio import atomic_write_bytes, cannot_write_in
from fedcp_dist.sweep.names import display_path
from fedcp_dist.sweep.drift import defining_config
from fedcp_dist.sweep.points import Sweep

MANIFEST = "sweep.json"
MANIFEST_FORMAT = 1


def make_partitions(sweep: Sweep, points=None, say=print) -> list:
    """Write each distinct shard that ``points`` need and that does not exist yet; returns the made."""
    made = []
    todo = {}
    for p in sweep.points if points is None else points:
        if p.data_path is not None:
            todo.setdefault(p.data_path, p.partition)
    for data_path, spec in todo.items():
        if data_path.exists():
            say(f"partition {display_path(data_path)}: exists")
            continue
        data_path.parent.mkdir(parents=True, exist_ok=True)
        say(f"partition {display_path(data_path)}: making it")
        try:
            make_shard(spec, data_path)
        except WrittenElsewhere:  # a second sweep made it meanwhile: its name is its partition, so it is this one
            say(f"partition {display_path(data_path)}: made by another process meanwhile; using it")
            continue
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
        "grid_keys": sweep.dimensions,
        "variants": sweep.variants,
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
                # the keys that define its experiment, as now (those at their defaults left out)
                "config": defining_config(sweep, p),
            }
            for p in sweep.points
        ],
        "excluded": [{"name": e.name, "params": e.params, "reason": e.reason} for e in sweep.excluded],
        "submissions": (previous or {}).get("submissions", []),
    }


def write_manifest(sweep: Sweep, submission: Optional[dict] = None) -> Path:
    """Write ``sweep.json`` (atomically), keeping the earlier submissions and adding ``submission``."""
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
    try:
        sweep.dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"sweep {sweep.name}: cannot create its folder {sweep.dir}: {exc.strerror}") from None
    problem = cannot_write_in(sweep.dir)
    if problem:
        raise UserError(f"sweep {sweep.name}: cannot write in its folder {sweep.dir}: {problem}")
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode("utf-8"))
    return path


def read_manifest(path) -> Optional[dict]:
    """A sweep.json's contents, or None when it is unreadable or does not list points."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("points"), list) else None
