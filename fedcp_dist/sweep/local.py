"""The local executor: the unfinished points one after another, each a ``fedcp_dist.run`` process.

A point runs under torchrun when the sweep asks for several ranks per run. Its output (stdout and
stderr) goes to ``<root>/<name>/logs/<point>.log``, whose last lines also explain a failure.

Stopping a sweep (the contract ``docs/sweeps.md`` states): a stop signal to the sweep (SIGINT —
Ctrl-C —, SIGTERM, SIGUSR2) is passed on to the running point as SIGTERM, which checkpoints after
its round and exits 75; the sweep then launches nothing more and exits with the same status 75
(:data:`~fedcp_dist.errors.EXIT_REQUEUE`), and run again it resumes every point from its own
checkpoint. A second stop signal ends the point at once (it resumes from its last complete
checkpoint). A point runs in a session of its own, so a Ctrl-C in the terminal reaches the sweep
only; and it is asked to stop (SIGTERM) if the sweep dies (Linux's parent-death signal), so no run
trains on without its sweep. A point whose run directory is locked by another process (another
sweep running the same file) is left to it: the sweep goes on with the others, then waits for that
process and runs the point only if it did not finish it. Such a point is never counted as failed.
"""
from __future__ import annotations

import collections
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

from fedcp_dist import interrupts
from fedcp_dist.errors import EXIT_REQUEUE, Preempted
from fedcp_dist.rundir.faults import fault_point
from fedcp_dist.rundir.directory import DIVERGED, DONE, FINISHED, SUMMARY, UNFINISHED, RunDir
from fedcp_dist.sweep.manifest import make_partitions, write_manifest
from fedcp_dist.sweep.names import display_path, now
from fedcp_dist.sweep.drift import drift_warning, resume_drift
from fedcp_dist.sweep.points import Sweep


#: seconds torchrun lets its workers finish after it forwards a SIGTERM before it SIGKILLs them
#: (torchrun's own default is 30 s, shorter than many rounds: a preempted worker would die before
#: its checkpoint); the user's TORCH_ELASTIC_SHUTDOWN_TIMEOUT wins
SHUTDOWN_TIMEOUT_S = 1800


def run_env(base: Mapping[str, str] = os.environ) -> dict:
    """The environment of a point's process (or of ``fedcp-run --ranks``'s torchrun): ``base``, with
    torchrun's grace after a SIGTERM raised to :data:`SHUTDOWN_TIMEOUT_S` unless set (read by
    torchrun's launcher; ignored elsewhere)."""
    env = dict(base)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    return env


def stderr_tail(lines, n: int = 6) -> str:
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    return " | ".join(lines[-n:]) or "(no output on stderr)"


def pump(proc: subprocess.Popen, sink, tail: collections.deque) -> None:
    """Copy the child's stderr to ``sink`` line by line, keeping the last lines."""
    for line in proc.stderr:
        tail.append(line)
        sink.write(line)
        sink.flush()


#: the signals that stop a local sweep (each passed on to the running point as SIGTERM)
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR2")
#: seconds between two looks at the lock of a point that another process runs
LOCK_POLL_S = 1.0
#: what fedcp-run says when another run holds its out_dir (:func:`fedcp_dist.rundir.out_dir.prepare_out_dir`)
IN_USE = "is in use by another run"


def lock_held(run_dir: Path) -> bool:
    """Whether another process holds the run directory's lock (a run is using it now)."""
    path = RunDir(run_dir).lock
    try:
        f = open(path, "r")
    except OSError:  # no lock file: no run ever started there
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _parent_death_signal():
    """``preexec_fn`` for a point's process: SIGTERM to it when the sweep dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing), and at once if the sweep is already gone."""
    parent = os.getpid()
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def setup() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class SweepStop:
    """While active, the stop signals (:data:`STOP_SIGNALS`) are the sweep's: the first is passed
    on to the running point (``proc``) as SIGTERM, or, with none running, stops the sweep at once
    (:class:`~fedcp_dist.errors.Preempted`); the second ends the running point at once (SIGKILL)."""

    def __init__(self, sweep: str = "", ranks: int = 1):
        self.sweep = sweep
        self.ranks = ranks  # per point: a pause of several must stay within their collective_timeout
        self.signum: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self.point = ""
        #: whether the stop was passed on to a point (a further signal then kills it)
        self.forwarded = False
        #: whether a further signal killed the point (SIGKILL)
        self.killed = False
        self._previous: dict = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum
        running = self.proc is not None and self.proc.poll() is None
        if not running:
            # recorded too: raised where Python drops it (an at-fork hook of Popen, a finalizer
            # while a shard is written), it is raised again at the next check, or passed on to the
            # point just started (:meth:`started`)
            exc = Preempted(f"sweep {self.sweep} stopped by {signal.Signals(signum).name}; run it again to resume "
                            f"its points")
            interrupts.request(exc)
            raise exc
        if not self.forwarded:
            self._forward()
        else:
            print(f"got {signal.Signals(signum).name} again: stopping {self.point} at once (it resumes from its "
                  f"last complete checkpoint)", file=sys.stderr, flush=True)
            self.killed = True
            self.proc.kill()

    def _forward(self) -> None:
        self.forwarded = True
        print(f"got {self.name}: asking {self.point} to checkpoint after its round and stop "
              f"(a second signal stops it at once)", file=sys.stderr, flush=True)
        self.proc.send_signal(signal.SIGTERM)

    def started(self) -> None:
        """After a point's process started: a stop signal that came while it was being started
        (its Preempted dropped inside Popen) is passed on to it now."""
        if self.signum is not None and not self.forwarded and self.proc is not None:
            interrupts.clear()
            self._forward()

    def __enter__(self) -> "SweepStop":
        self._listening = interrupts.listening()
        self._listening.__enter__()
        # a Ctrl-Z suspends the point too
        self._job_control = interrupts.following_job_control(
            note=lambda: interrupts.RANKS_PAUSED if self.ranks > 1 and self.proc is not None else None)
        self._job_control.__enter__()
        for name in STOP_SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self._job_control.__exit__(None, None, None)
        self._listening.__exit__(None, None, None)


def _attempt_output(log_path: Path, offset: int) -> list:
    """The lines this attempt added to the point's log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _why(lines: list) -> str:
    """A failed point's reason: its one-line errors, else the last lines of its output."""
    errors = [ln for ln in lines if ln.startswith("error:")]
    return stderr_tail(errors or lines, 2)


#: a point's exit statuses after a SIGINT: the run's own "interrupted" (130), or the signal's
#: default action before the run's handlers were in place
INTERRUPTED = (128 + signal.SIGINT, -signal.SIGINT)


def _exit_text(rc: int) -> str:
    """A point's exit status in words: ``exit status N``, or the signal that ended it."""
    if rc >= 0:
        return f"exit status {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return f"killed by {name}" + (" (an out-of-memory kill, or a kill -9?)" if -rc == signal.SIGKILL else "")


def _stopped_text(stopped: list) -> str:
    """The sweep's summary of its stopped points: how many, and how many of them after a checkpoint
    of the round they were in (the others resume from their last complete one)."""
    if not stopped:
        return ""
    after = sum(1 for _, checkpointed in stopped if checkpointed)
    if after == len(stopped):
        return f", {len(stopped)} stopped after a checkpoint"
    if after == 0:
        return f", {len(stopped)} stopped (each resumes from its last complete checkpoint)"
    return (f", {len(stopped)} stopped ({after} after a checkpoint, {len(stopped) - after} from their last complete "
            f"checkpoint)")


def _launch(sweep: Sweep, k: int, p, stop: SweepStop, logs: Path) -> tuple:
    """Run point ``p`` (the k-th) to its end; (exit status, seconds, its output, its log)."""
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{p.name}.log"
    cmd = sweep.command(p)
    t0 = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"# {now()} {shlex.join(cmd)}\n")
        log.flush()
        offset = log.tell()
        stop.point = p.name
        # a session of its own: a Ctrl-C in the terminal reaches the sweep, which passes it on
        stop.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env(), start_new_session=True,
                                     preexec_fn=_parent_death_signal())
        stop.started()
        try:
            rc = stop.proc.wait()
        finally:
            stop.proc = None
    return rc, time.perf_counter() - t0, _attempt_output(log_path, offset), log_path


def run_local(sweep: Sweep) -> int:
    """Run the unfinished points one after another; the number of failed and diverged points (a
    diverged point, which learned nothing, is not run again: its directory must be removed first).
    A stop signal ends the sweep with :class:`~fedcp_dist.errors.Preempted` (exit 75), the running
    point checkpointed (see the module)."""
    todo = [p for p in sweep.points if p.status() not in DONE]
    print(f"sweep {sweep.name}: {len(sweep.points)} points, {len(sweep.points) - len(todo)} finished, "
          f"{len(todo)} to run one after another (local, {sweep.nproc} rank{'s' if sweep.nproc > 1 else ''} per run)"
          + (f"; {len(sweep.excluded)} excluded (fedcp-sweep --dry-run lists them)" if sweep.excluded else ""),
          flush=True)
    with SweepStop(sweep.name, sweep.nproc) as stop:
        drift_warning(sweep)
        make_partitions(sweep, todo)
        write_manifest(sweep, {"time": now(), "executor": "local", "points": [p.name for p in todo]} if todo else None)
        failed, stopped, diverged = _run_points(sweep, stop)
    done = sum(p.status() == FINISHED for p in sweep.points)
    print(f"sweep {sweep.name}: {done}/{len(sweep.points)} finished, "
          + (f"{len(diverged)} diverged, " if diverged else "") + f"{len(failed)} failed"
          + _stopped_text(stopped), flush=True)
    for p, why, log_path in failed:
        print(f"  failed: {p.name}: {why} (log {display_path(log_path)})", flush=True)
    for p in diverged:
        print(f"  diverged: {p.name}: learned nothing, not a result (remove {display_path(p.run_dir)} to run it "
              f"again)", flush=True)
    if stop.signum is not None:
        raise Preempted(f"sweep {sweep.name} stopped by {stop.name}; run it again to resume its points")
    if stopped and not failed:
        raise Preempted(f"sweep {sweep.name}: {len(stopped)} point(s) stopped; run it again to resume them")
    return len(failed) + len(diverged)


def _run_points(sweep: Sweep, stop: SweepStop) -> tuple:
    """Every unfinished point; those another process runs are waited for at the end and run only
    if that process did not finish them. (failed, stopped, diverged) points."""
    logs = sweep.dir / "logs"
    failed, stopped, elsewhere, diverged = [], [], [], []

    def launch(k: int, p, status: str) -> bool:
        """Run point k; False if another process runs it after all."""
        fault_point("sweep_point", k)  # the fault tests' hook
        drift = resume_drift(sweep, p) if status == UNFINISHED else []
        if drift:  # its run's resume would refuse the new config, and a sweep never overwrites
            why = (f"its checkpointed run was made with another {', '.join(drift)}, which a resume refuses; remove "
                   f"{display_path(p.run_dir)} to run it afresh")
            print(sweep.point_line(k, p, "FAILED") + f"  {why}", flush=True)
            failed.append((p, why, logs / f"{p.name}.log"))
            return True
        print(sweep.point_line(k, p, "running") + (" (resuming)" if status == UNFINISHED else ""), flush=True)
        rc, seconds, lines, log_path = _launch(sweep, k, p, stop, logs)
        summary = RunDir(p.run_dir).read_summary()
        if summary is not None and summary.get("status") == DIVERGED:
            print(sweep.point_line(k, p, "DIVERGED") + f"  {seconds:.1f} s, learned nothing: {_why(lines)}",
                  flush=True)
            diverged.append(p)
        elif rc == 0 and summary is not None:
            print(sweep.point_line(k, p, "finished") + f"  {seconds:.1f} s, best_acc {summary.get('best_acc', float('nan')):.4f}",
                  flush=True)
        elif rc == 2 and any(IN_USE in ln for ln in lines):  # another process took it first
            return False
        elif rc == EXIT_REQUEUE or stop.signum is not None or rc in INTERRUPTED:
            if rc == EXIT_REQUEUE:
                how = f"checkpointed (exit {EXIT_REQUEUE})"
            elif stop.signum is None:  # a Ctrl-C or kill -INT sent to the point itself, not to the sweep
                how = (f"interrupted by a SIGINT sent to it ({_exit_text(rc)}); its round under way is lost, its last "
                       f"complete checkpoint kept")
            elif stop.killed and rc == -signal.SIGKILL:
                how = "stopped at once by a second stop signal; its last complete checkpoint kept"
            else:
                how = f"{_exit_text(rc)} once asked to stop; its last complete checkpoint kept"
            print(sweep.point_line(k, p, "stopped") + f"  {seconds:.1f} s, {how}; the sweep run again resumes it",
                  flush=True)
            stopped.append((p, rc == EXIT_REQUEUE))
        else:
            why = f"exited 0 but wrote no {SUMMARY}" if rc == 0 else f"{_exit_text(rc)}: {_why(lines)}"
            print(sweep.point_line(k, p, "FAILED") + f"  {seconds:.1f} s, {why}; log {display_path(log_path)}", flush=True)
            failed.append((p, why, log_path))
        return True

    for k, p in enumerate(sweep.points, 1):
        if stop.signum is not None:
            break
        status = p.status()
        if status == FINISHED:
            print(sweep.point_line(k, p, "finished") + "  (skipped)", flush=True)
        elif status == DIVERGED:
            print(sweep.point_line(k, p, "diverged") + "  (skipped: it learned nothing)", flush=True)
            diverged.append(p)
        elif lock_held(p.run_dir) or not launch(k, p, status):
            print(sweep.point_line(k, p, "elsewhere") + "  (another process runs it; waited for at the end)", flush=True)
            elsewhere.append((k, p))
    while elsewhere and stop.signum is None:
        k, p = elsewhere.pop(0)
        if lock_held(p.run_dir):
            print(sweep.point_line(k, p, "waiting") + "  (for the other process that runs it)", flush=True)
            while lock_held(p.run_dir):
                time.sleep(LOCK_POLL_S)
        status = p.status()
        if status == FINISHED:
            print(sweep.point_line(k, p, "finished") + "  (by another process)", flush=True)
        elif status == DIVERGED:
            print(sweep.point_line(k, p, "diverged") + "  (by another process: it learned nothing)", flush=True)
            diverged.append(p)
        elif not launch(k, p, status):
            elsewhere.append((k, p))
    return failed, stopped, diverged
