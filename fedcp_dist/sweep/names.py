"""The names a sweep gives its points, shards and paths, and small text helpers of the sweep code.

A point's run directory is named after its parameters (:func:`point_name`), a partition's shard
after its options (:func:`partition_file_name`); both stay the same from one run of a sweep to the
next, which is how a re-run finds what is done.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from fedcp_dist.data.make import PartitionSpec
from fedcp_dist.data.sources import TEXT_SOURCES
from fedcp_dist.rundir.present import format_value

#: partition keys that say where the source data is, not how it is split (never in a shard's name)
PARTITION_LOCATION_KEYS = ("root", "download")

def yaml_value(value: Any) -> str:
    """The text of ``value`` that ``key=value`` overrides read back as the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")].strip()
    elif text.endswith("..."):
        text = text[:-3].strip()
    return text


_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]")


def point_name(params: dict) -> str:
    """A stable, readable directory name from a point's parameters, keys sorted.

    ``{"seed": 2, "method": "fedcp"}`` → ``method=fedcp,seed=2``. Characters outside
    ``[A-Za-z0-9._+=,-]`` become ``_``; a name longer than 150 characters is cut and ends in a hash
    of the full parameters.
    """
    if not params:
        return "default"
    name = ",".join(f"{k}={format_value(params[k])}" for k in sorted(params))
    name = _UNSAFE.sub("_", name)
    if len(name) > 150:
        digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:10]
        name = f"{name[:120]}-{digest}"
    return name


def partition_file_name(spec: PartitionSpec) -> str:
    """A readable shard name from a partition spec: ``digits_dir0.1_n20_s1.h5``.

    Options other than source, scheme, its parameter, clients and seed that differ from the
    defaults add a short hash, so that different partitions never share a name; a text source's
    ``text_pipeline`` always enters the hash. Synthetic shards are named by α and β
    (``synthetic_a1_b1_n1000_s1.h5``), LEAF shards by their task, with their ``root`` in the hash.
    """
    scheme = spec.partition
    if spec.source == "synthetic":  # synthetic_a1_b1_n1000_s1.h5, synthetic_iid_n1000_s1.h5
        scheme = "iid" if spec.synthetic_iid else \
            f"a{format_value(spec.synthetic_alpha)}_b{format_value(spec.synthetic_beta)}"
    elif spec.source == "leaf":  # leaf_femnist_s1.h5: LEAF's users, as many as its files hold
        scheme = spec.leaf_task or "auto"
    elif scheme == "dir":
        scheme += format_value(spec.beta)
    elif scheme == "pat":
        scheme += f"{spec.classes_per_client}" + ("u" if spec.unbalanced else "")
    clients = "" if spec.num_clients is None else f"_n{spec.num_clients}"
    name = f"{spec.source}_{scheme}{clients}_s{spec.seed}"
    named = {"source", "partition", "beta", "classes_per_client", "unbalanced", "num_clients", "seed",
             "synthetic_alpha", "synthetic_beta", "synthetic_iid", "leaf_task", *PARTITION_LOCATION_KEYS}
    defaults = PartitionSpec().to_dict()
    extra = {k: v for k, v in spec.to_dict().items() if k not in named and v != defaults[k]}
    if spec.source == "leaf":
        # LEAF's files are the data itself: two roots (FEMNIST sampled at 5 % and at 100 %, say)
        # are two data sets
        extra["root"] = os.path.abspath(spec.root) if spec.root else None
    if spec.source in TEXT_SOURCES:
        # always named, so that a shard made before the reference pipeline became the default
        # (same options, other tokens) is never taken for one made with it
        extra["text_pipeline"] = spec.text_pipeline
    if extra:
        name += "_" + hashlib.sha1(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:8]
    return _UNSAFE.sub("_", name) + ".h5"


def display_path(path: Path) -> str:
    """A path relative to the current directory when it lies below it, else absolute."""
    try:
        return os.path.relpath(os.path.abspath(path)) if Path(os.path.abspath(path)).is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)




def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")
