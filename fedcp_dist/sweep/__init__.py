"""Sweeps: a grid of experiments, each point one run directory, run locally or as a SLURM array job.

* :mod:`~fedcp_dist.sweep.spec`: the sweep file, its grid, its points and their names
* :mod:`~fedcp_dist.sweep.manifest`: the shards the grid needs and ``sweep.json``
* :mod:`~fedcp_dist.sweep.local`: the points one after another on this machine
* :mod:`~fedcp_dist.sweep.slurm`: one submitit array job, tasks that requeue themselves

A point whose run directory holds a finished run is skipped; any other is launched (again) and
continues from its own checkpoint. ``fedcp-sweep`` (:mod:`fedcp_dist.cli.sweep`) is the command.
"""
from fedcp_dist.sweep.local import run_local
from fedcp_dist.sweep.manifest import MANIFEST, make_partitions, read_manifest, write_manifest
from fedcp_dist.sweep.slurm import SweepRun, run_slurm, slurm_parameters
from fedcp_dist.sweep.names import partition_file_name, point_name, yaml_value
from fedcp_dist.sweep.drift import config_drift
from fedcp_dist.sweep.points import Point, Sweep
from fedcp_dist.sweep.spec import EXECUTORS, load_sweep

__all__ = [
    "EXECUTORS", "MANIFEST", "Point", "Sweep", "SweepRun", "config_drift", "load_sweep", "make_partitions",
    "partition_file_name", "point_name", "read_manifest", "run_local", "run_slurm", "slurm_parameters",
    "write_manifest", "yaml_value",
]
