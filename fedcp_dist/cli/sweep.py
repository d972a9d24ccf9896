"""``fedcp-sweep``: run a grid of experiments, locally one after another or as one SLURM array job.

    fedcp-sweep configs/sweeps/digits_smoke.yaml --dry-run      # the points, their status and commands
    fedcp-sweep configs/sweeps/digits_smoke.yaml                # run what is not finished yet
    fedcp-sweep configs/sweeps/client_count.yaml --executor slurm --wait

A sweep file names a base run config, overrides applied to every point and a grid (a cartesian
product of config keys). Every point has a stable run directory named after its parameters,
``<root>/<name>/runs/<key>=<value>,...``: a point whose directory holds ``summary.json`` is finished
and skipped; any other is launched (again) and continues from its own checkpoint. An optional
``partition`` block makes the shards the grid needs once, under ``<root>/<name>/data/``.
``<root>/<name>/sweep.json`` records the points for ``fedcp-report``. The work is done by
:mod:`fedcp_dist.sweep`; this module reads the command line and prints the dry run.

Exit status of a local sweep: 0 when every point is finished, 1 when a point failed, 75 when a stop
signal (SIGINT, SIGTERM, SIGUSR2) stopped it, its running point checkpointed (run it again to
resume), 2 for a bad sweep file or argument.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from fedcp_dist.errors import ArgumentParser, UserError, check_open_files, cli_main, launched_copies, say
from fedcp_dist.rundir.directory import DIVERGED, DONE, FINISHED, UNFINISHED
from fedcp_dist.sweep import EXECUTORS, Sweep, config_drift, load_sweep, run_local, run_slurm, slurm_parameters
from fedcp_dist.sweep.names import display_path
from fedcp_dist.sweep.slurm import queued_points
from fedcp_dist.sweep.drift import resume_drift


def dry_run(sweep: Sweep) -> None:
    """Print every point's status and command, the shards and (slurm) the job; make and submit nothing."""
    statuses = [(s := p.status(), config_drift(sweep, p) if s == FINISHED else resume_drift(sweep, p)
                 if s == UNFINISHED else []) for p in sweep.points]
    counts = collections.Counter(s for s, _ in statuses)
    done = counts[FINISHED] + counts[DIVERGED]
    print(f"sweep {sweep.name}: {len(sweep.points)} point{'s' if len(sweep.points) != 1 else ''} over {' × '.join(sweep.dimensions)}; "
          f"{counts[FINISHED]} finished, " + (f"{counts[DIVERGED]} diverged, " if counts[DIVERGED] else "")
          + f"{len(sweep.points) - done} to run "
          f"(executor {sweep.kind}, {sweep.nproc} rank{'s' if sweep.nproc > 1 else ''} per run)"
          + (f"; {len(sweep.excluded)} excluded" if sweep.excluded else ""))
    print(f"directory {display_path(sweep.dir)}")
    shards = {}
    for p, (status, _) in zip(sweep.points, statuses):
        if p.data_path is not None:
            shards.setdefault(p.data_path, [0, 0])[status in DONE] += 1
    for data_path, (todo, done) in shards.items():
        state = "exists" if data_path.exists() else ("to be made" if todo else "missing (only finished runs use it)")
        print(f"partition {display_path(data_path)}: {state}")
    for k, (p, (status, drift)) in enumerate(zip(sweep.points, statuses), 1):
        shown = {UNFINISHED: "pending"}.get(status, status)
        note = " (resumes)" if status == UNFINISHED else ""
        if drift:
            note = f" (config differs: {', '.join(drift)})"
            if status == UNFINISHED:  # a resume would be refused: it would fail
                note = (f" (config differs: {', '.join(drift)}: it cannot resume; remove "
                        f"{display_path(p.run_dir)} to run it afresh)")
        print(f"{sweep.point_line(k, p, shown)}{note}  {sweep.display_command(p)}")
    for e in sweep.excluded:
        print(f"excluded   {e.name}: {e.reason}")
    if sweep.kind == "slurm":
        # the points an earlier submission's tasks still run are not submitted again (as the real run says)
        todo = {p.name for p, (status, _) in zip(sweep.points, statuses) if status not in DONE}
        queued = {k: v for k, v in ((queued_points(sweep) or {}) if todo else {}).items() if k in todo}
        n = len(todo) - len(queued)
        what = f"one array job of {n} tasks" if n > 1 else ("one job" if n else "nothing to submit")
        held = (f"{len(queued)} queued or running (job {', '.join(sorted(set(queued.values()))[:4])}), "
                if queued else "")
        print(f"slurm: {held}{what}; submitit parameters {json.dumps(slurm_parameters(sweep), sort_keys=True)}")
    print("dry run: nothing was made or submitted")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fedcp-sweep",
                description="Run a grid of fedcp_dist experiments: locally one after another, or as one SLURM array job.",
                epilog="A local sweep exits 0 when every point is finished, 1 when a point failed, 75 when a stop signal "
                       "(Ctrl-C, SIGTERM, SIGUSR2) stopped it after its running point checkpointed: run it again to "
                       "resume.")
    p.add_argument("sweep", help="sweep YAML file (see configs/sweeps/)")
    p.add_argument("--dry-run", action="store_true", help="print the points, their status and commands; run nothing")
    p.add_argument("--executor", choices=EXECUTORS, help="override executor.kind of the sweep file")
    p.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and print each result")
    return p


@cli_main
def main(argv=None) -> None:
    """Entry point of ``fedcp-sweep``."""
    args = build_parser().parse_args(argv)
    copies = launched_copies()
    if copies > 1 and not args.dry_run:
        raise UserError(f"fedcp-sweep was started {copies} times by a launcher (mpirun, srun or torchrun): it starts "
                        f"each point's ranks itself (executor.nproc); run one copy")
    sweep = load_sweep(args.sweep, kind=args.executor)
    check_open_files(several=sweep.nproc > 1, note=say)  # the points it starts inherit a raised limit
    if args.dry_run:
        dry_run(sweep)
        return
    failed = run_slurm(sweep, args.wait) if sweep.kind == "slurm" else run_local(sweep)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
