"""A sweep's finished and unfinished points against the sweep file as it is now: the config keys a
point's run was made with another value of (:func:`config_drift`, :func:`resume_drift`), the
warning that names them, and what ``sweep.json`` records of each point (:func:`defining_config`)
so that ``fedcp-report`` can tell such runs apart without the sweep file."""
from __future__ import annotations

from fedcp_dist.config import Config, flatten
from fedcp_dist.rundir.directory import (CHECKPOINT_MARKER, FINISHED, NOT_DEFINING, RESUMABLE_CHANGES,
                                         RESUMABLE_DEFINING, RunDir,
                                         config_changes, defining_changes, rounds_scheduled)
from fedcp_dist.sweep.names import display_path
from fedcp_dist.sweep.points import Point, Sweep, point_config


def config_drift(sweep: Sweep, point: Point) -> list:
    """Keys that define the experiment whose value in a run's config.yaml differs from the point's.

    Keys that do not define it (:data:`fedcp_dist.rundir.directory.NOT_DEFINING`) never count; ``[]`` when the
    run wrote no readable config.
    """
    have = RunDir(point.run_dir).read_config()
    if have is None:
        return []
    return defining_changes(have, point_config(sweep, point).to_dict())


def defining_config(sweep: Sweep, point: Point) -> dict:
    """The point's flat config keys that define its experiment (outside NOT_DEFINING) and differ
    from their defaults: what ``sweep.json`` keeps per point, so that ``fedcp-report`` can tell a run
    made under an earlier sweep file (:func:`~fedcp_dist.rundir.directory.defining_changes` against
    its config.yaml) without the sweep file."""
    defaults = flatten(Config().to_dict())
    return {k: v for k, v in flatten(point_config(sweep, point).to_dict()).items()
            if k not in NOT_DEFINING and (k not in defaults or v != defaults[k])}


def resume_drift(sweep: Sweep, point: Point) -> list:
    """Keys an unfinished point's checkpointed run was made with another value of, that a resume
    refuses (those outside RESUMABLE_CHANGES, and ``rounds`` where the training depends on the
    total: :func:`~fedcp_dist.rundir.directory.rounds_scheduled`; ``data.path`` is checked by
    content when it runs):
    such a point cannot go on, and a sweep cannot overwrite it."""
    have = RunDir(point.run_dir).read_config()
    if have is None:
        return []
    wanted = point_config(sweep, point).to_dict()
    scheduled = bool(rounds_scheduled(flatten(wanted)))  # a total the training depends on (a target ε, say)
    drift = [k for k in config_changes(have, wanted)
             if (k not in RESUMABLE_CHANGES or (k == "rounds" and scheduled)) and k != "data.path"]
    # fewer rounds than its newest complete checkpoint holds: the resume refuses it ("resume with rounds >= R")
    rounds = flatten(wanted).get("rounds")
    done = [r for r, d in RunDir(point.run_dir).checkpoint_dirs() if (d / CHECKPOINT_MARKER).exists()]
    if "rounds" not in drift and isinstance(rounds, int) and done and max(done) > rounds:
        drift.append("rounds")
    return drift


def _goes_on(sweep: Sweep, point: Point, changed: list) -> bool:
    return goes_on(RunDir(point.run_dir), changed, flatten(point_config(sweep, point).to_dict()))


def goes_on(run: RunDir, changed: list, wanted: dict) -> bool:
    """Whether the finished run in ``run`` resumes to the values ``wanted`` (a flat config) once its
    summary.json is gone: only keys a resume may change differ (``changed``), it has a checkpoint to
    resume from, and a change of rounds is to more rounds, of a method whose training does not
    depend on the total."""
    if not set(changed) <= set(RESUMABLE_DEFINING) or not run.has_checkpoint():  # checkpoint_every: 0 — from round 0
        return False
    if "rounds" not in changed:
        return True
    done, rounds = (run.read_config() or {}).get("rounds"), wanted.get("rounds")
    return isinstance(done, int) and isinstance(rounds, int) and rounds >= done and not rounds_scheduled(wanted)


def drift_warning(sweep: Sweep) -> None:
    """Print what to do about finished points whose runs were made with another config: a warning
    per kind. Runs that differ only in keys a resume may change (``rounds``, ``eval_every``: not for a
    method whose training depends on the total of rounds) go on from their last checkpoint once
    their summary.json is removed; the others run again only from an empty directory."""
    stale = [(p, d) for p in sweep.points if p.status() == FINISHED and (d := config_drift(sweep, p))]
    go_on = [(p, d) for p, d in stale if set(d) <= set(RESUMABLE_DEFINING) and _goes_on(sweep, p, d)]
    afresh = [(p, d) for p, d in stale if (p, d) not in go_on]
    if go_on:
        keys = ", ".join(sorted({k for _, d in go_on for k in d}))
        print(f"warning: {len(go_on)} finished run(s) were made with another value of {keys} and were kept; to take them "
              f"on to the new value, remove their summary.json and run the sweep again (each resumes from its "
              f"last checkpoint), e.g. rm {display_path(go_on[0][0].run_dir / 'summary.json')}")
    if afresh:
        keys = ", ".join(sorted({k for _, d in afresh for k in d}))
        print(f"warning: {len(afresh)} finished run(s) were made with a different config ({keys}) and were kept; "
              f"remove their directories to run them again, e.g. {display_path(afresh[0][0].run_dir)}")
