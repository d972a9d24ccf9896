"""The SLURM executor: one submitit array job for the unfinished points, a task per point.

Each task runs :class:`SweepRun`; a task that gets the warning signal before its time limit (or is
preempted) lets its run checkpoint and requeues itself, and the next attempt resumes the run.
"""
from __future__ import annotations

import collections
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from fedcp_dist.errors import EXIT_REQUEUE, Preempted, UserError
from fedcp_dist.rundir.directory import DIVERGED, DONE, FINISHED, SUMMARY, RunDir
from fedcp_dist.sweep.local import IN_USE, pump, stderr_tail
from fedcp_dist.sweep.manifest import MANIFEST, make_partitions, read_manifest, write_manifest
from fedcp_dist.sweep.names import display_path, now
from fedcp_dist.sweep.drift import drift_warning
from fedcp_dist.sweep.points import Sweep

#: seconds between SLURM's warning signal and the kill, unless the sweep sets executor.slurm.signal_delay_s
SIGNAL_DELAY_S = 120


def slurm_parameters(sweep: Sweep) -> dict:
    """submitit's parameters for the sweep's array job, from its executor.slurm block."""
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


# ----------------------------------------------------------------------------- one array task


def _submitit_requeue() -> bool:
    """Run submitit's own warning-signal handler (checkpoint, requeue, exit) if it is installed."""
    handler = signal.getsignal(signal.SIGUSR2)
    if callable(handler) and getattr(handler, "__name__", "") == "checkpoint_and_try_requeue":
        handler(signal.SIGUSR2, None)  # the main task requeues the job and exits; the others return
        return True
    return False


#: how a task's error begins when its run checkpointed and stopped, so that the sweep run again
#: resumes it: ``fedcp-sweep --wait`` counts such a point as stopped, not failed
STOPPED = "stopped after a checkpoint:"
#: how a task's error begins when another task or sweep runs its point (its out_dir's lock is held):
#: ``fedcp-sweep --wait`` counts it as run elsewhere, not failed
ELSEWHERE = "run elsewhere:"


def slurm_task_fate(env=os.environ, scontrol=None) -> str:
    """What SLURM does with this task once its run checkpointed on a signal the task's wrapper did
    not get as the warning signal (a SIGTERM from SLURM): ``requeue`` when SLURM requeues it itself
    (``scontrol requeue``, a preemption that requeues: the job's restart count is already past
    this attempt's ``SLURM_RESTART_COUNT``), ``end`` when SLURM ends it (``scancel``, a preemption
    that cancels: the job is no longer running), ``run`` when it is still running (the signal came
    from elsewhere), ``unknown`` when ``scontrol`` does not say."""
    job = (f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
           if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID") else env.get("SLURM_JOB_ID"))
    if not job:
        return "unknown"
    try:
        out = (scontrol or _scontrol_show)(job)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    restarts, state = re.search(r"\bRestarts=(\d+)", out), re.search(r"\bJobState=([A-Z_]+)", out)
    attempt = env.get("SLURM_RESTART_COUNT", "0")
    if restarts and int(restarts.group(1)) > (int(attempt) if attempt.isdigit() else 0):
        return "requeue"
    if state:
        return "run" if state.group(1) == "RUNNING" else "end"
    return "unknown"


def _scontrol_show(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def _after_checkpoint(name: str) -> bool:
    """The task's run checkpointed on a signal and exited 75: leave the task to SLURM where SLURM
    requeues it (exit without a result, so ``--wait`` waits for the next attempt), stop it where
    SLURM ends it (an error beginning with :data:`STOPPED`), else requeue it through submitit
    (True where submitit's handler is installed and the task goes on: a rank other than the first)."""
    fate = slurm_task_fate()
    if fate == "requeue":
        print(f"fedcp-sweep: {name}: checkpointed; SLURM requeues this task, the next attempt resumes it", flush=True)
        sys.exit(EXIT_REQUEUE)  # not an Exception: submitit writes no result for this attempt
    if fate == "end":
        raise RuntimeError(f"{STOPPED} the job was ended (scancel, or a preemption that does not requeue) after "
                           f"its run checkpointed; run the sweep again to resume it")
    try:
        return _submitit_requeue()
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{STOPPED} the run checkpointed but {' '.join(map(str, exc.cmd))} failed; run the sweep "
                           f"again to resume it") from None


class SweepRun:
    """The callable that one SLURM array task runs for one point (submitted by ``fedcp-sweep``).

    ``__call__(name, args)`` runs ``fedcp_dist.run`` with ``args`` in a subprocess, so that the
    job's environment and the runtime's launcher detection apply; with several tasks per run
    (``in_process``) every task runs the config itself (:func:`fedcp_dist.run.run_config`) and the
    runtime reads ``SLURM_PROCID``. A failed run raises with the tail of its stderr. On the warning
    signal before a time limit or on preemption submitit calls :meth:`checkpoint`, which lets the
    run write its own checkpoint and requeues the same call: the run resumes from it.
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
        done = RunDir(out_dir).read_summary() if out_dir else None
        if done is not None and done.get("status") != DIVERGED:  # a task of an earlier submission finished it
            print(f"fedcp-sweep: {name}: already finished (by another task or sweep); nothing to run", flush=True)
            return done
        if self.in_process:
            return self._in_process(args)
        cmd = [sys.executable, "-m", "fedcp_dist.run", *args]
        print(f"fedcp-sweep: {name}: {shlex.join(cmd)}", flush=True)
        tail: collections.deque = collections.deque(maxlen=40)
        self._proc = subprocess.Popen(cmd, cwd=self.cwd, stderr=subprocess.PIPE, text=True, errors="replace")
        try:
            pump(self._proc, sys.stderr, tail)
            rc = self._proc.wait()
        finally:
            self._proc = None
        if rc == EXIT_REQUEUE and _after_checkpoint(name):  # checkpointed on a signal: requeued
            return None
        summary = RunDir(out_dir).read_summary() if out_dir else None
        if summary is not None and summary.get("status") == DIVERGED:
            raise RuntimeError(f"run {name} diverged (it learned nothing): {stderr_tail(tail, 1)}")
        if rc == 2 and any(IN_USE in line for line in tail):
            raise RuntimeError(f"{ELSEWHERE} run {name}'s out_dir is in use by another run (a task of another "
                               f"submission of this sweep): that one runs it")
        if rc != 0 or summary is None:
            why = f"exit status {rc}" if rc != 0 else f"no {SUMMARY} written"
            raise RuntimeError(f"run {name} failed ({why}): {stderr_tail(tail)}")
        return summary

    def _in_process(self, args: list):
        from fedcp_dist import run

        os.chdir(self.cwd)
        opts = run.build_parser().parse_args(list(args))
        try:
            return run.run_config(opts.config, opts.overrides)
        except UserError as exc:
            if IN_USE in str(exc):  # another task of another submission runs the point
                raise RuntimeError(f"{ELSEWHERE} {exc}") from None
            raise
        except Preempted:
            if _after_checkpoint(" ".join(args)):  # checkpointed: requeued
                return None
            raise

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


# ----------------------------------------------------------------------------- submitting and waiting


def _file_tail(path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no log at {path}"
    return " | ".join(lines[-n:]) or f"empty log {path}"


def _in_queue(job_id: str) -> Optional[bool]:
    """Whether squeue still lists any task of ``job_id`` (None: squeue did not answer)."""
    try:
        out = _squeue_tasks([job_id])
    except (OSError, subprocess.SubprocessError):
        return None
    return None if out is None else bool(out.strip())


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


def task_outcome(error_text: str) -> tuple:
    """("stopped" | "elsewhere" | "failed", why) from the text of a task's error as submitit re-raises
    it (a header, the task's traceback between two lines of dashes, then where its logs are):
    stopped where the run checkpointed and the sweep run again resumes it (:data:`STOPPED`;
    submitit's "timed-out too many times"), elsewhere where another task runs the point
    (:data:`ELSEWHERE`), else failed; ``why`` is the error's own line, not the log paths after it."""
    lines = [ln.strip() for ln in error_text.splitlines() if ln.strip()]
    for mark, outcome in ((STOPPED, "stopped"), (ELSEWHERE, "elsewhere")):
        said = next((ln for ln in lines if mark in ln), None)
        if said is not None:
            return outcome, said[said.index(mark) + len(mark):].strip()
    if any("timed-out too many times" in ln for ln in lines):
        return "stopped", ("the task reached its time limit more often than executor.slurm.max_num_timeout lets it "
                           "requeue (submitit's default: 3); its run checkpointed each time: run the sweep again to "
                           "resume it")
    dashes = [i for i, ln in enumerate(lines) if set(ln) == {"-"}]
    if len(dashes) >= 2 and dashes[1] > dashes[0] + 1:
        return "failed", lines[dashes[1] - 1]
    return "failed", lines[-1] if lines else "no error text"


def queued_points(sweep: Sweep, squeue=None) -> Optional[dict]:
    """{point name: job id} of the points whose task of an earlier submission (``sweep.json``) SLURM
    still holds, pending or running (None: squeue did not answer). Submitting them again would run
    each point twice: the second task would find it finished or in use."""
    manifest = read_manifest(sweep.dir / MANIFEST) or {}
    recorded = {}
    for sub in manifest.get("submissions") or []:
        if isinstance(sub, dict) and sub.get("executor") == "slurm" and isinstance(sub.get("jobs"), dict):
            recorded.update({str(k): str(v) for k, v in sub["jobs"].items()})  # a later submission's job wins
    if not recorded:
        return {}
    arrays = sorted({job.split("_")[0] for job in recorded.values()})
    try:
        out = (squeue or _squeue_tasks)(arrays)
    except (OSError, subprocess.SubprocessError):
        return None
    if out is None:
        return None
    held = set(out.split())
    return {name: job for name, job in recorded.items() if job in held}


def _squeue_tasks(jobs: list) -> Optional[str]:
    """squeue's ids of the tasks of ``jobs`` it holds, one per line (array tasks one by one)."""
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(jobs)], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None
    return out.stdout


def run_slurm(sweep: Sweep, wait: bool) -> int:
    """Submit one array job for the unfinished points; with ``wait``, the number of failed points."""
    try:
        import submitit
    except ImportError:
        raise UserError("--executor slurm needs submitit: pip install submitit") from None
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise UserError("--executor slurm needs sbatch and srun on PATH; this machine has no SLURM client "
                        "(use --executor local)")
    unfinished = [p for p in sweep.points if p.status() not in DONE]
    queued = queued_points(sweep) if unfinished else {}
    if queued is None:
        print("note: squeue did not answer: points an earlier submission still runs are submitted again (a "
              "second task of a point finds it finished or in use)", flush=True)
        queued = {}
    todo = [p for p in unfinished if p.name not in queued]
    print(f"sweep {sweep.name}: {len(sweep.points)} points, {len(sweep.points) - len(unfinished)} finished, "
          + (f"{len(queued)} queued or running (job {', '.join(sorted(set(queued.values()))[:4])}"
             f"{', …' if len(set(queued.values())) > 4 else ''}), " if queued else "")
          + f"{len(todo)} to submit (slurm)"
          + (f"; {len(sweep.excluded)} excluded (fedcp-sweep --dry-run lists them)" if sweep.excluded else ""),
          flush=True)
    drift_warning(sweep)
    if not todo:
        write_manifest(sweep)
        if not queued:
            print("nothing to submit: every point is finished")
            return 0
        print("nothing to submit: every unfinished point is queued or running already")
        if not wait:
            return 0
        print("waiting for them ... (Ctrl-C stops the waiting, not the jobs)", flush=True)
        return _wait_summary(sweep, 0, 0, 0, _wait_for_earlier(sweep, queued))
    make_partitions(sweep, todo)
    folder = sweep.dir.resolve() / "submitit"
    params = slurm_parameters(sweep)
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
          f"logs in {display_path(folder)}", flush=True)
    for job, p in zip(jobs, todo):
        print(f"  {job.job_id}  {display_path(p.run_dir)}", flush=True)
    write_manifest(sweep, {"time": now(), "executor": "slurm", "array_job": array_id,
                           "jobs": {p.name: job.job_id for job, p in zip(jobs, todo)}})
    if not wait:
        print(f"not waiting: watch with `squeue -j {array_id}`; run this command again to resubmit what did not finish")
        return 0
    print(f"waiting for the jobs ... (Ctrl-C stops the waiting, not the jobs: `squeue -j {array_id}`)", flush=True)
    failed = stopped = elsewhere = 0
    for job, p, gone in _wait_for(list(zip(jobs, todo)), array_id):
        if gone:  # left the queue without a result: killed, node failure, cancelled
            failed += 1
            print(f"  {job.job_id}  {p.name}: FAILED: left the queue without a result; "
                  f"{_file_tail(job.paths.stderr)}", flush=True)
            continue
        try:
            summary = job.results()[0]  # one result per task; the first is rank 0's
        except Exception as exc:  # submitit re-raises the task's error with its traceback
            outcome, why = task_outcome(str(exc) or type(exc).__name__)
            if outcome == "stopped":
                stopped += 1
                print(f"  {job.job_id}  {p.name}: stopped: {why}", flush=True)
            elif outcome == "elsewhere":
                elsewhere += 1
                print(f"  {job.job_id}  {p.name}: elsewhere: {why}", flush=True)
            else:
                failed += 1
                print(f"  {job.job_id}  {p.name}: FAILED: {why}", flush=True)
            continue
        acc = (summary or RunDir(p.run_dir).read_summary() or {}).get("best_acc")
        acc_text = f"best_acc {acc:.4f}" if isinstance(acc, (int, float)) else "no summary"
        print(f"  {job.job_id}  {p.name}: finished, {acc_text}", flush=True)
    return _wait_summary(sweep, failed, stopped, elsewhere, _wait_for_earlier(sweep, queued) if queued else 0)


def _wait_summary(sweep: Sweep, failed: int, stopped: int, elsewhere: int, earlier_unfinished: int) -> int:
    """``--wait``'s last line; the number of points that failed (or that an earlier submission left
    unfinished), or :class:`Preempted` where points stopped after a checkpoint and none failed."""
    failed += earlier_unfinished
    done = sum(p.status() == FINISHED for p in sweep.points)
    print(f"sweep {sweep.name}: {done}/{len(sweep.points)} finished, {failed} failed"
          + (f" (of which {earlier_unfinished} left unfinished by an earlier submission)" if earlier_unfinished else "")
          + (f", {stopped} stopped after a checkpoint" if stopped else "")
          + (f", {elsewhere} run by another submission" if elsewhere else ""), flush=True)
    if stopped and not failed:
        raise Preempted(f"sweep {sweep.name}: {stopped} point(s) stopped after a checkpoint; run it again to resume them")
    return failed


def _wait_for_earlier(sweep: Sweep, queued: dict, poll_s: float = 5.0, squeue=None) -> int:
    """``--wait`` for the points an earlier submission's tasks hold (``queued``: {point name: job id},
    not submitted again): until SLURM holds none of those tasks; then each point's state. Returns how
    many of them are not finished (failed, or stopped after a checkpoint: run the sweep again)."""
    arrays = sorted({job.split("_")[0] for job in queued.values()})
    held = set(queued.values())
    while held:
        try:
            out = (squeue or _squeue_tasks)(arrays)
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is None:
            print("note: squeue did not answer: the earlier submission's tasks are not waited for", flush=True)
            break
        held &= set(out.split())
        if held:
            time.sleep(poll_s)
    points = {p.name: p for p in sweep.points}
    unfinished = 0
    for name, job in sorted(queued.items(), key=lambda item: item[1]):
        if points[name].status() == FINISHED:
            print(f"  {job}  {name}: finished (a task of an earlier submission)", flush=True)
        else:
            unfinished += 1
            print(f"  {job}  {name}: not finished by its task of an earlier submission (its log: "
                  f"{display_path(sweep.dir / 'submitit')}); run the sweep again to resume it", flush=True)
    return unfinished
