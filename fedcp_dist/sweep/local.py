"""The local executor: the unfinished points one after another, each a ``fedcp_dist.run`` process.

A point runs under torchrun when the sweep asks for several ranks per run. Its stdout goes to
``<root>/<name>/logs/<point>.log`` and so does its stderr, whose last lines also explain a failure.
"""
from __future__ import annotations

import collections
import os
import shlex
import subprocess
import sys
import time
from typing import Mapping

from fedcp_dist.errors import EXIT_REQUEUE
from fedcp_dist.rundir import DIVERGED, DONE, FINISHED, SUMMARY, UNFINISHED, RunDir
from fedcp_dist.sweep.manifest import make_partitions, write_manifest
from fedcp_dist.sweep.names import display_path, now
from fedcp_dist.sweep.spec import Sweep, drift_warning


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


def _terminate(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_local(sweep: Sweep) -> int:
    """Run the unfinished points one after another; the number of failed and diverged points (a
    diverged point, which learned nothing, is not run again: its directory must be removed first)."""
    todo = [p for p in sweep.points if p.status() not in DONE]
    print(f"sweep {sweep.name}: {len(sweep.points)} points, {len(sweep.points) - len(todo)} finished, "
          f"{len(todo)} to run one after another (local, {sweep.nproc} rank{'s' if sweep.nproc > 1 else ''} per run)"
          + (f"; {len(sweep.excluded)} excluded (fedcp-sweep --dry-run lists them)" if sweep.excluded else ""),
          flush=True)
    drift_warning(sweep)
    make_partitions(sweep, todo)
    write_manifest(sweep, {"time": now(), "executor": "local", "points": [p.name for p in todo]} if todo else None)
    logs = sweep.dir / "logs"
    failed, diverged = [], []
    for k, p in enumerate(sweep.points, 1):
        status = p.status()
        if status == FINISHED:
            print(sweep.point_line(k, p, "finished") + "  (skipped)", flush=True)
            continue
        if status == DIVERGED:
            print(sweep.point_line(k, p, "diverged") + "  (skipped: it learned nothing)", flush=True)
            diverged.append(p)
            continue
        print(sweep.point_line(k, p, "running") + (" (resuming)" if status == UNFINISHED else ""), flush=True)
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{p.name}.log"
        cmd = sweep.command(p)
        t0 = time.perf_counter()
        tail: collections.deque = collections.deque(maxlen=40)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"# {now()} {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, errors="replace",
                                    env=run_env())
            try:
                pump(proc, log, tail)
                rc = proc.wait()
            except KeyboardInterrupt:
                print(f"interrupted: waiting for {p.name} to checkpoint and stop", file=sys.stderr, flush=True)
                _terminate(proc)
                raise
        seconds = time.perf_counter() - t0
        summary = RunDir(p.run_dir).read_summary()
        if summary is not None and summary.get("status") == DIVERGED:
            print(sweep.point_line(k, p, "DIVERGED") + f"  {seconds:.1f} s, learned nothing: {stderr_tail(tail, 1)}",
                  flush=True)
            diverged.append(p)
            continue
        if rc == 0 and summary is not None:
            print(sweep.point_line(k, p, "finished") + f"  {seconds:.1f} s, best_acc {summary.get('best_acc', float('nan')):.4f}",
                  flush=True)
            continue
        if rc == EXIT_REQUEUE:
            why = f"stopped after a checkpoint (exit {EXIT_REQUEUE}); run the sweep again to resume it"
        elif rc == 0:
            why = f"exited 0 but wrote no {SUMMARY}"
        else:
            why = f"exit status {rc}: {stderr_tail(tail, 2)}"
        print(sweep.point_line(k, p, "FAILED") + f"  {seconds:.1f} s, {why}; log {display_path(log_path)}", flush=True)
        failed.append((p, why, log_path))
    done = sum(p.status() == FINISHED for p in sweep.points)
    print(f"sweep {sweep.name}: {done}/{len(sweep.points)} finished, "
          + (f"{len(diverged)} diverged, " if diverged else "") + f"{len(failed)} failed", flush=True)
    for p, why, log_path in failed:
        print(f"  failed: {p.name}: {why} (log {display_path(log_path)})", flush=True)
    for p in diverged:
        print(f"  diverged: {p.name}: learned nothing, not a result (remove {display_path(p.run_dir)} to run it "
              f"again)", flush=True)
    return len(failed) + len(diverged)
