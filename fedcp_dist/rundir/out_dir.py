"""The run directory's lock and the rules a start obeys there (rank 0, before anything is written):
refuse a finished run, keep an unfinished one for resuming, or clear it for ``overwrite=true``."""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path
from typing import IO

from fedcp_dist.errors import UserError
from fedcp_dist.rundir.directory import DERIVED, DIVERGED, RUN_FILES, SUMMARY, TENSORBOARD, RunDir


def clear_run(out: Path, run: "RunDir") -> None:
    """What ``overwrite=true`` removes: ``checkpoints/``, ``tensorboard/``, the run files and what
    fedcp-report and fedcp-analyze wrote there from them (DERIVED). What
    cannot be removed (an immutable file, a folder in a file's place, no permission) stops the start
    in one line naming it, so that a fresh run never starts beside an old run's leftovers."""
    failed = []

    def note(_func, path, exc):
        failed.append((path, exc[1] if isinstance(exc, tuple) else exc))

    for folder in (run.checkpoints, out / TENSORBOARD):
        if folder.is_symlink() or folder.is_file():
            try:
                folder.unlink()
            except OSError as exc:
                failed.append((folder, exc))
        elif folder.exists():
            if sys.version_info >= (3, 12):
                shutil.rmtree(folder, onexc=note)
            else:
                shutil.rmtree(folder, onerror=note)
    derived = sorted(p for pattern in DERIVED for p in out.glob(pattern))
    for path in [out / name for name in RUN_FILES] + derived:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            failed.append((path, exc))
    if failed:
        path, exc = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise UserError(f"overwrite=true could not remove {path}{more}: {getattr(exc, 'strerror', None) or exc}; "
                        f"remove it by hand (an immutable file needs chattr -i) or choose another out_dir")


def refusal(run: RunDir, resume: str) -> str:
    """Why a run without ``overwrite`` may not start in ``run``'s folder ("" when it may): a finished
    (or diverged) run there, or with ``resume='never'`` an unfinished one."""
    out = run.path
    if run.summary.exists():
        what = "a run that diverged (it learned nothing; " if run.status() == DIVERGED else "a finished run ("
        if run.read_summary() is None:
            what = "a finished run whose summary is damaged (not a JSON object: "
        return f"out_dir {out} holds {what}{SUMMARY}); choose another out_dir or pass overwrite=true"
    if resume == "never" and (run.has_checkpoint() or run.metrics.exists()):
        return f"out_dir {out} holds an unfinished run and resume=never; use resume=auto or overwrite=true"
    return ""


def prepare_out_dir(out_dir, *, overwrite: bool, resume: str) -> IO:
    """Rank 0, before anything is written: lock ``out_dir``, then refuse, clear or leave it.

    Creates ``out_dir`` and takes an exclusive, non-blocking ``flock`` on ``out_dir/.lock``; the
    returned open file holds it, and closing it releases it (so does the process ending). Then:
    ``overwrite`` removes ``checkpoints/``, ``tensorboard/``, the run files (RUN_FILES) and the reports
    made from them (DERIVED) and nothing else;
    otherwise a finished run (summary.json) is refused, and with ``resume='never'`` so is an
    unfinished one (a complete checkpoint or metrics.jsonl). Every refusal is a UserError, and the
    lock is released before it is raised.
    """
    run = RunDir(out_dir)
    out = run.path
    if out.is_symlink() and not out.exists():  # mkdir said only "File exists"
        raise UserError(f"out_dir {out} is a symbolic link to {os.readlink(out)}, which does not exist (or is a loop); "
                        f"mend the link or choose another out_dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(run.lock, "a+")
    except OSError as exc:
        if out.exists() and not out.is_dir():  # mkdir said only "File exists"
            raise UserError(f"out_dir {out} is a file, not a folder; move it away or choose another out_dir") from None
        # the path that failed, where it is not out_dir itself (a folder in the place of out_dir/.lock)
        where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != out else ""
        raise UserError(f"out_dir {out} cannot be written{where}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"out_dir {out} is in use by another run (lock {run.lock} is held)") from None
        except OSError as exc:  # ENOLCK, ENOSYS: a file system without locks (NFS without lockd, Lustre -o noflock)
            raise UserError(f"out_dir {out} cannot be locked ({exc.strerror}): its file system has no file locks; "
                            f"choose an out_dir on one that has (a run's lock keeps two runs out of one folder)") from None
        if run.checkpoints.is_symlink() and not run.checkpoints.is_dir() and not overwrite:
            # a link to nowhere (a scratch file system not mounted) or a loop: the run would start afresh
            # beside an unreadable history, then fail at its first checkpoint
            raise UserError(f"{run.checkpoints} is a symbolic link to {os.readlink(run.checkpoints)}, which is not a "
                            f"folder that can be reached (not mounted? a loop?); mount or mend it, or pass "
                            f"overwrite=true to start afresh")
        if run.checkpoints.exists() and not run.checkpoints.is_dir() and not overwrite:
            raise UserError(f"{run.checkpoints} is not a folder: the run keeps its checkpoints there; move it away "
                            f"or pass overwrite=true")
        if overwrite:
            clear_run(out, run)
            return lock
        problem = refusal(run, resume)
        if problem:
            raise UserError(problem)
    except BaseException:
        lock.close()
        raise
    return lock


def unmake_out_dir(out_dir, made=()) -> None:
    """Undo :func:`prepare_out_dir`'s making of ``out_dir`` for a start refused after it (a shard
    that cannot be read, say): the folder goes again when it holds nothing but the lock file, and
    so do the folders above it in ``made`` (:func:`~fedcp_dist.fileio.folders_to_make`, taken before) that are empty
    then. Call it while the lock is still held, so that no other run can have taken the folder
    meanwhile."""
    run = RunDir(out_dir)
    try:
        if [p.name for p in run.path.iterdir()] == [run.lock.name]:
            run.lock.unlink()
            run.path.rmdir()
        else:
            return
        for folder in made:
            if folder != run.path.absolute():
                folder.rmdir()  # not empty (another run made something there meanwhile): it stays
    except OSError:  # another process put something there meanwhile: left as it is
        pass
