"""The fault harness: a signal (SIGINT, SIGTERM, SIGUSR2, SIGKILL) at each phase of a run and of a
local sweep, then a restart, which must end bit for bit where an uninterrupted run ends (its final
global state and metric records) or with a one-line refusal.

The phases are hit deterministically through the engine's test hook ``FEDCP_FAULT_AT``
(``fedcp_dist/rundir/faults.py``): the process signals itself there, or waits there while the test signals
a sweep. One uninterrupted run is the reference for every case; the runs are 3 rounds of FedCP on 3
of the 6 digits clients at 16 x 16 pixels, checkpointing every round. SIGINT, SIGTERM and SIGUSR2
cases run ``fedcp-run``'s main in this process (a real signal, sent to this process, handled by the
run's own handlers); SIGKILL cases and sweeps run in processes of their own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import BIN, REPO
from fedcp_dist.rundir.checkpoint import Checkpointer
from fedcp_dist.cli import sweep as sweep_cli
from fedcp_dist.interrupts import RANKS_PAUSED
from fedcp_dist.run import main as fedcp_run

pytestmark = pytest.mark.slow

ROUNDS = 3
SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR2", "SIGKILL")
#: the run's phases (FEDCP_FAULT_AT): start-up, the shard's load, training and evaluation of round 2,
#: the checkpoint after round 2 half-written, the final write (final_global.pt written, summary.json not)
PHASES = ("startup", "shard", "train@2", "eval@2", "checkpoint@2", "final")


def settings(shard, out) -> list:
    return [f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=1", "threads=1", "data.clients=3",
            f"data.path={shard}", f"out_dir={out}"]


def args(shard, out) -> list:
    return ["--config", "configs/digits_fedcp.yaml", *settings(shard, out)]


def outcome(out: Path) -> tuple:
    """(final global state, metric records without their timings, (best_acc, final_acc)) of a finished run."""
    state = torch.load(out / "final_global.pt", weights_only=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    return state, rows, (summary["best_acc"], summary["final_acc"])


def assert_same_run(out: Path, ref: Path) -> None:
    (sa, ra, acc_a), (sb, rb, acc_b) = outcome(out), outcome(ref)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), f"{out}: another final state"
    assert ra == rb and acc_a == acc_b, f"{out}: other metric records"


def in_process(argv, capsys, said: list = None) -> tuple:
    """fedcp-run's main in this process: (exit status, stderr); its stdout appended to ``said``."""
    try:
        fedcp_run(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    got = capsys.readouterr()
    if said is not None:
        said.append(got.out)
    return code, got.err


@pytest.fixture(scope="module")
def reference(digits6_16px, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    fedcp_run(args(digits6_16px, out))
    assert (out / "summary.json").exists()
    return out


def env(**extra) -> dict:
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1", **extra)


# -------------------------------------------------------------------------------------------- a run


def expected(phase: str, sig: str) -> tuple:
    """(exit status, what stderr says) of a run that gets ``sig`` at ``phase``."""
    if sig == "SIGKILL":
        return -9, None
    if phase == "final":  # the run is finished: the signal asks for nothing more
        return 0, ""
    if sig == "SIGINT":  # at a checkpoint: once it is complete
        return 130, "interrupted\n"
    return 75, "preempted: "


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_signal_at_each_phase_of_a_run_then_a_restart_ends_as_an_uninterrupted_run(
        phase, sig, reference, digits6_16px, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    code, said = expected(phase, sig)
    if sig == "SIGKILL":
        p = subprocess.run([sys.executable, "-m", "fedcp_dist.run", *args(digits6_16px, out)], cwd=REPO,
                           env=env(FEDCP_FAULT_AT=f"{phase}:{sig}"), capture_output=True, text=True, timeout=300)
        assert p.returncode == code, p.stderr[-2000:]
    else:
        monkeypatch.setenv("FEDCP_FAULT_AT", f"{phase}:{sig}")
        stdout = []
        got, err = in_process(args(digits6_16px, out), capsys, stdout)
        assert "FEDCP_FAULT_AT" not in os.environ  # it fired
        assert got == code, err
        assert err.startswith(said) and err.count("\n") == (1 if said else 0) and "Traceback" not in err, err
        if phase == "final" and sig != "SIGINT":  # the rank's line does not promise a round and a checkpoint
            assert f"rank 0: got {sig}; the final evaluation is done: finishing the run's final files" in stdout[0]
    if phase == "checkpoint@2" and sig != "SIGKILL":  # a checkpoint being written is completed first; a stop
        # signal then stops the run at round 3's evaluation (eval_every=1), before it trains: round 2's is the newest
        assert Checkpointer(str(out), 0, 1, 2).latest().name == "round_0000002"
    if (out / "summary.json").exists():  # finished: a restart is refused in one line, nothing changed
        got, err = in_process(args(digits6_16px, out), capsys)
        assert got == 2 and err.startswith("error: out_dir") and "holds a finished run" in err and \
            err.count("\n") == 1, err
    else:
        got, err = in_process(args(digits6_16px, out), capsys)
        assert got == 0, err
    assert_same_run(out, reference)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR2", "SIGINT"])
def test_a_stop_signal_after_a_run_finished_leaves_its_exit_status_0(sig, digits6_16px, tmp_path):
    """A scheduler's SIGTERM (or the preempt signal, or a Ctrl-C) that comes once the run's files
    are written, while the process ends, finds nothing to stop: exit 0, not 128 + the signal or
    130 'interrupted' (which a job script or a sweep would take for a killed run)."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "fedcp_dist.run", *args(digits6_16px, out)], cwd=REPO,
                       env=env(FEDCP_FAULT_AT=f"exit:{sig}"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "interrupted" not in p.stderr, \
        (p.returncode, p.stderr[-2000:])
    assert "best_acc" in json.loads((out / "summary.json").read_text())


# ------------------------------------------------------------------------------------------ a sweep


def write_sweep(folder: Path, shard: Path, seeds=(1,)) -> Path:
    """A sweep whose point seed=1 is the reference run (the same settings: see :func:`settings`)."""
    doc = {"name": "s", "root": str(folder / "sweeps"), "base": str(REPO / "configs" / "digits_fedcp.yaml"),
           "overrides": {"rounds": ROUNDS, "eval_every": 1, "checkpoint_every": 1, "threads": 1,
                         "data": {"path": str(shard), "clients": 3}},
           "grid": {"seed": list(seeds)}}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_sweep(path: Path, **extra) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "fedcp-sweep"), str(path)], cwd=REPO, env=env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until(check, what: str, timeout: float = 120) -> None:
    t0 = time.time()
    while not check():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


def point_log(folder: Path, seed: int = 1) -> Path:
    return folder / "sweeps" / "s" / "logs" / f"seed={seed}.log"


def point_dir(folder: Path, seed: int = 1) -> Path:
    return folder / "sweeps" / "s" / "runs" / f"seed={seed}"


@pytest.mark.parametrize("sig, phase", [("SIGINT", "train@2"), ("SIGTERM", "startup"), ("SIGUSR2", "sweep_point"),
                                        ("SIGKILL", "checkpoint@2")])
def test_a_stopped_sweep_checkpoints_its_point_exits_75_and_resumes_it_bit_for_bit(
        sig, phase, reference, digits6_16px, tmp_path, capsys):
    """The sweep gets the signal while its point is at ``phase`` (held there by the hook); the point,
    asked by the sweep with a SIGTERM (or by the kernel when the sweep is killed), checkpoints after
    its round and stops; the sweep exits 75 (killed: 137) and leaves no run behind; run again, it
    resumes the point, whose results are the uninterrupted run's."""
    path = write_sweep(tmp_path, digits6_16px)
    marker = tmp_path / "held"
    proc = start_sweep(path, FEDCP_FAULT_AT=f"{phase}:wait={marker}")
    try:
        wait_until(marker.exists, f"the hook at {phase}")
        proc.send_signal(getattr(signal, sig))
        if phase != "sweep_point":  # the point hears of it, then goes on from where it was held
            wait_until(lambda: "got SIGTERM" in point_log(tmp_path).read_text(), "the point's SIGTERM")
        marker.unlink()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == "SIGKILL":
        assert proc.returncode == -9
        # the point, left alone, checkpoints and stops by itself (it holds its lock until then)
        wait_until(lambda: "preempted: checkpointed after 2 rounds" in point_log(tmp_path).read_text(), "the point")
    else:
        assert proc.returncode == 75, out + err
        assert f"preempted: sweep s stopped by {sig}; run it again to resume its points" in err, err
        assert "Traceback" not in err and "FAILED" not in out
    run_dir = point_dir(tmp_path)
    if phase == "sweep_point":
        assert not run_dir.exists()  # stopped before the point started
    elif phase == "startup":
        assert "[1/1] stopped" in out and not (run_dir / "checkpoints").exists()
    else:  # the round the point was in when the signal came, then a checkpoint (a checkpoint being written: it is
        # completed, and the point stops at the next round's evaluation, before training it)
        assert Checkpointer(str(run_dir), 0, 1, 2).latest().name == "round_0000002"
        assert not (run_dir / "summary.json").exists()
    wait_until(lambda: not _locked(run_dir), "the point's process to end")
    capsys.readouterr()
    sweep_cli.main([str(path)])  # again, here: its point still runs in a process of its own
    again = capsys.readouterr().out
    assert "1/1 finished, 0 failed" in again and ("(resuming)" in again) == (phase in ("train@2", "checkpoint@2")), again
    assert_same_run(run_dir, reference)


def held_sweep(path: Path, marker: Path) -> tuple:
    """(the sweep of ``path``, its point's pid), the point held in its round 2 until ``marker`` goes."""
    from helpers import descendants

    proc = start_sweep(path, FEDCP_FAULT_AT=f"train@2:wait={marker}")
    wait_until(marker.exists, "the point in round 2")
    point = [pid for pid in descendants(proc.pid) if pid != proc.pid]
    assert len(point) == 1, point
    return proc, point[0]


def test_a_sigint_sent_to_a_point_alone_stops_it_and_the_sweep_resumes_it(reference, digits6_16px, tmp_path, capsys):
    """``kill -INT`` to a running point (not to the sweep): the point stops (exit 130, its round under
    way lost); the sweep counted it FAILED and said so in its summary. It is ``stopped``, the sweep
    exits 75 naming no checkpoint of that round, and run again resumes the point bit for bit."""
    path = write_sweep(tmp_path, digits6_16px)
    proc, point = held_sweep(path, tmp_path / "held")
    try:
        os.kill(point, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out + err
    assert "[1/1] stopped" in out and "interrupted by a SIGINT sent to it (exit status 130)" in out, out
    assert "1/1 finished" not in out and "FAILED" not in out and "0 failed, 1 stopped (each resumes from its last complete" in out, out
    assert "preempted: sweep s: 1 point(s) stopped; run it again to resume them" in err and "Traceback" not in err, err
    run_dir = point_dir(tmp_path)
    assert Checkpointer(str(run_dir), 0, 1, 2).latest().name == "round_0000001"
    capsys.readouterr()
    sweep_cli.main([str(path)])
    again = capsys.readouterr().out
    assert "1/1 finished, 0 failed" in again and "(resuming)" in again, again
    assert_same_run(run_dir, reference)


def test_a_point_killed_by_a_signal_is_named_by_it():
    """A point's exit status is said in words; a negative one (the signal that ended it) by the
    signal's name, a SIGKILL with the likely cause."""
    from fedcp_dist.sweep.local import _exit_text, _stopped_text

    assert _exit_text(1) == "exit status 1" and _exit_text(-15) == "killed by SIGTERM"
    assert _exit_text(-9).startswith("killed by SIGKILL (an out-of-memory kill")
    assert _exit_text(-200) == "killed by signal 200"
    assert _stopped_text([]) == "" and _stopped_text([("a", True)]) == ", 1 stopped after a checkpoint"
    assert _stopped_text([("a", True), ("b", False)]) == (", 2 stopped (1 after a checkpoint, 1 from their last "
                                                           "complete checkpoint)")


def _locked(run_dir: Path) -> bool:
    from fedcp_dist.sweep.local import lock_held

    return lock_held(run_dir)


def test_two_sweeps_on_one_file_share_the_points_and_both_finish(reference, digits6_16px, tmp_path):
    """Sweep B runs point 1 (held at its first round); sweep A, let go just after it found point 1's
    lock free, launches it anyway: its run is refused (the lock), and A leaves the point to B, runs
    point 2 and waits for B's point 1. Both exit 0, nothing FAILED, and point 1 is the uninterrupted run."""
    path = write_sweep(tmp_path, digits6_16px, seeds=(1, 2))
    held_a, held_b = tmp_path / "a", tmp_path / "b"
    a = start_sweep(path, FEDCP_FAULT_AT=f"sweep_point@1:wait={held_a}")
    b = None
    try:
        wait_until(held_a.exists, "sweep A before point 1")
        b = start_sweep(path, FEDCP_FAULT_AT=f"train@1:wait={held_b}")
        wait_until(held_b.exists, "sweep B's point 1 in its first round")
        held_a.unlink()  # A launches point 1 now, whose lock B's run holds
        wait_until(lambda: (point_dir(tmp_path, 2) / "summary.json").exists(), "sweep A's point 2")
        held_b.unlink()
        outs = [p.communicate(timeout=300) for p in (a, b)]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    (out_a, err_a), (out_b, err_b) = outs
    assert (a.returncode, b.returncode) == (0, 0), (out_a, err_a, out_b, err_b)
    assert "[1/2] elsewhere" in out_a and "[1/2] finished   " in out_a and "(by another process)" in out_a, out_a
    assert "sweep s: 2/2 finished, 0 failed" in out_a and "sweep s: 2/2 finished, 0 failed" in out_b, (out_a, out_b)
    assert "FAILED" not in out_a + out_b
    assert "is in use by another run" in point_log(tmp_path, 1).read_text()  # A's attempt, refused
    assert_same_run(point_dir(tmp_path, 1), reference)


def test_a_ctrl_c_while_a_finished_runs_process_tears_down_prints_nothing(digits6_16px, tmp_path):
    """After fedcp-run's main returned (the process's own command line), a Ctrl-C during the
    interpreter's teardown raised KeyboardInterrupt there: a traceback under a finished run. It is
    ignored to the process's end, which exits 0; a caller in the same process gets its Ctrl-C back
    (the in-process runs of this file)."""
    out = tmp_path / "run"
    code = ("import os, signal, sys, time\nfrom fedcp_dist.run import main\nmain()\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.5)\nprint('ended', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code, *args(digits6_16px, out)], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.endswith("ended\n"), (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr[-2000:]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process's, after in-process runs


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_ctrl_z_to_a_sweep_suspends_its_point_and_fg_continues_both(digits6_16px, tmp_path):
    """A SIGTSTP (Ctrl-Z) to a local sweep stopped the sweep alone: its point, in a session of its
    own, trained on while the job was shown as stopped. The point is stopped with it, and the
    SIGCONT of ``fg``/``bg`` continues both; the sweep then finishes as usual."""
    path = write_sweep(tmp_path, digits6_16px)
    marker = tmp_path / "held"
    proc, point = held_sweep(path, marker)
    try:
        proc.send_signal(signal.SIGTSTP)
        wait_until(lambda: _state(proc.pid) == "T" and _state(point) == "T", "the sweep and its point stopped", 30)
        time.sleep(0.5)
        assert _state(point) == "T"
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _state(proc.pid) != "T" and _state(point) != "T", "both going again", 30)
        marker.unlink()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "1/1 finished, 0 failed" in out and "Traceback" not in err, out + err
    assert RANKS_PAUSED not in err  # one rank a point: no collective to time out


def test_a_ctrl_z_to_fedcp_run_ranks_suspends_the_ranks_too(digits6_16px, tmp_path):
    """``fedcp-run --ranks 2`` suspended with a SIGTSTP: torchrun stopped, its ranks (sessions of
    their own) trained on. They are stopped with it and continued with it; the run then finishes."""
    from helpers import descendants

    marker = tmp_path / "held"
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedcp_dist.run", "--ranks", "2", *args(digits6_16px, out)], cwd=REPO,
                            env=env(FEDCP_FAULT_AT=f"train@2:wait={marker}"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(marker.exists, "the ranks in round 2")
        below = [pid for pid in descendants(proc.pid) if pid != proc.pid]
        assert len(below) >= 2, below
        proc.send_signal(signal.SIGTSTP)
        wait_until(lambda: all(_state(p) == "T" for p in [proc.pid, *below]), "the launcher and its ranks stopped", 30)
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: not any(_state(p) == "T" for p in [proc.pid, *below]), "all going again", 30)
        marker.unlink()
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and (out / "summary.json").is_file() and "Traceback" not in text, text[-3000:]
    assert text.count(RANKS_PAUSED) == 1  # how long such a pause may last: the ranks' collective_timeout


def test_a_second_stop_signal_to_a_sweep_kills_its_point_and_says_so(digits6_16px, tmp_path):
    """The second stop signal kills the running point (SIGKILL): its line said "killed by SIGKILL
    (an out-of-memory kill, or a kill -9?)" for a kill the sweep made itself. It says the second
    signal stopped it, and the summary that it resumes from its last complete checkpoint."""
    path = write_sweep(tmp_path, digits6_16px)
    proc, _ = held_sweep(path, tmp_path / "held")
    try:
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "got SIGTERM" in point_log(tmp_path).read_text(), "the point's SIGTERM")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out + err
    assert "[1/1] stopped" in out and "stopped at once by a second stop signal; its last complete checkpoint kept" in out
    assert "out-of-memory" not in out and "0 failed, 1 stopped (each resumes from its last complete checkpoint)" in out
    assert Checkpointer(str(point_dir(tmp_path)), 0, 1, 2).latest().name == "round_0000001"


def test_an_in_process_run_gives_its_caller_every_stop_signal_handler_back(digits6_16px, tmp_path):
    """fedcp-run's main called in a process that goes on (a notebook, a test): once the run had
    finished, SIGTERM and SIGUSR2 stayed ignored in the caller (a finished run ignores them to its
    end), so a scheduler's SIGTERM no longer ended that process."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)}
    fedcp_run(args(digits6_16px, tmp_path / "run"))
    assert {sig: signal.getsignal(sig) for sig in before} == before
