"""slurm/train.sbatch and slurm/sweep.sbatch as real batch jobs on the local one-node cluster.

The module starts the cluster with `bash slurm/local_cluster.sh start` (root; it installs slurm-wlm
and munge with apt-get on a fresh machine) and fails when it cannot; FEDCP_SKIP_SLURM=1 skips it.
Jobs run as the submitting user with the test's tmp_path as their submit directory, so every path
given to them is absolute. Every wait is bounded: a job that has not finished in time fails the
test (with the controller's view of it) and is killed.
"""
import json
import os
import signal
import sys
import re
import subprocess
import time
import uuid

import pytest

from conftest import BIN, REPO, unpinned
from fedcp_dist.cli import report
from fedcp_dist.cli import sweep as sweep_cli

pytestmark = pytest.mark.slow

CLUSTER = REPO / "slurm" / "local_cluster.sh"
TRAIN = REPO / "slurm" / "train.sbatch"
SWEEP = REPO / "slurm" / "sweep.sbatch"
CONFIG = REPO / "configs" / "digits_fedcp.yaml"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def _env(extra=None):
    """This environment with the venv first on PATH and no SLURM job of our own (sbatch propagates it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "FEDCP_"))}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", ""), "/usr/sbin", "/sbin"])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


@pytest.fixture(scope="module")
def cluster():
    if os.environ.get("FEDCP_SKIP_SLURM") == "1":
        pytest.skip("FEDCP_SKIP_SLURM=1")
    was_up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True,
                            env=_env(), timeout=60).returncode == 0
    try:
        p = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, env=_env(),
                           stdin=subprocess.DEVNULL, timeout=600, preexec_fn=unpinned)
    except subprocess.TimeoutExpired:
        pytest.fail("slurm/local_cluster.sh start did not finish in 600 s (set FEDCP_SKIP_SLURM=1 to skip)")
    if p.returncode != 0:
        pytest.fail(f"the local SLURM cluster did not start (set FEDCP_SKIP_SLURM=1 to skip these tests):\n"
                    f"{p.stdout}{p.stderr}")
    yield
    if not was_up:  # leave the machine as we found it
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, env=_env(), timeout=120)


#: set when a job did not finish in time: the cluster is broken, later tests fail at once
_HUNG = []


def submit(tmp_path, *args, env=None):
    """sbatch ARGS from tmp_path; returns (job id, job name). Every job gets a 10-minute limit."""
    if _HUNG:
        pytest.fail(f"not submitted: an earlier job hung ({_HUNG[0]})")
    name = f"fedcp-test-{uuid.uuid4().hex[:8]}"
    p = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "--time=10", *map(str, args)],
                       cwd=tmp_path, env=_env(env), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"sbatch failed: {p.stdout}{p.stderr}"
    return p.stdout.strip().split(";")[0], name


def _field(record, key):
    m = re.search(rf"(?:^| ){key}=(\S*)", record)
    return m.group(1) if m else None


def _records(job_id):
    """The controller's record of the job, one `key=value ...` line per array task."""
    p = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                       env=_env(), timeout=30)
    return [line for line in p.stdout.splitlines() if "JobId=" in line]


def wait(job_id, name, timeout, start_timeout=90):
    """Poll the controller until every record of the job (each array task) has ended. Bounded: a
    job that has not started within start_timeout s or ended within timeout s fails the test."""
    t0 = time.monotonic()
    started = False
    while True:
        records = _records(job_id)
        states = [_field(r, "JobState") for r in records]
        if records and all(s in TERMINAL for s in states):
            return records
        started = started or any(s != "PENDING" for s in states)
        elapsed = time.monotonic() - t0
        if elapsed >= timeout or (not started and elapsed >= start_timeout):
            break
        time.sleep(1)
    subprocess.run(["scancel", "--full", "--signal=KILL", f"--name={name}"], capture_output=True, timeout=30)
    subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=30)
    what = [(_field(r, "JobId"), _field(r, "JobState"), _field(r, "Reason")) for r in records]
    msg = f"job {job_id} {'did not finish' if started else 'did not start'} in {elapsed:.0f} s: {what}"
    _HUNG.append(msg)
    pytest.fail(msg)


def _logs(tmp_path):
    return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("slurm-*.out")))


def _ok(records, tmp_path):
    for r in records:
        assert (_field(r, "JobState"), _field(r, "ExitCode")) == ("COMPLETED", "0:0"), f"{r}\n{_logs(tmp_path)}"


def _overrides(shard, out, seed=1):
    return [f"data.path={shard}", "rounds=2", "eval_every=1", "threads=1", f"seed={seed}", f"out_dir={out}"]


def test_a_requeued_attempt_resumes_whatever_the_command_line_or_the_config_file_says(tmp_path):
    """A requeue appended overwrite=false after the job's overwrite=true: with a key given twice
    refused, every requeued attempt of such a job failed at once (exit 2, not requeued). And
    ``overwrite: true`` or ``resume: never`` in the config file itself, which the command line did
    not show, cleared the checkpoint on every attempt or failed the job. A requeued attempt drops
    both keys from the command line and ends it with overwrite=false resume=auto."""
    script = tmp_path / "t.sh"
    script.write_text('srun() { while [[ "$1" == --* ]]; do shift; done; "$@"; }\n'
                      f'source {REPO / "slurm" / "_common.sh"}\n'
                      'FEDCP_RUN_CMD=echo fedcp_launch --config c.yaml overwrite=true "out_dir=a b" resume=never '
                      'rounds=2\n')
    for restart, args in (("1", "--config c.yaml out_dir=a b rounds=2 overwrite=false resume=auto"),
                          ("0", "--config c.yaml overwrite=true out_dir=a b resume=never rounds=2")):
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "SLURM_RESTART_COUNT": restart})
        assert r.returncode == 0 and r.stdout.splitlines()[-1] == args, r.stdout + r.stderr


REFUSING_RANKS = """
# srun's stand-in: two tasks one after the other, its status the highest of theirs
srun() {
    while [[ "$1" == --* ]]; do shift; done
    local top=0 rc
    for p in 1 0; do SLURM_PROCID=$p "$@"; rc=$?; [ $rc -gt $top ] && top=$rc; done
    return $top
}
"""


def test_a_rank_that_refuses_the_run_is_not_taken_for_a_preemption(tmp_path):
    """Rank 1 refused the run (exit 2: its data, its config) and srun's --kill-on-bad-exit stopped
    rank 0, which exited 75 as a preempted run does: srun returned 75 and the job requeued itself,
    to be refused again, attempt after attempt. The refusal is noted beside the status file and the
    job ends with 2; earlier attempts' status files (left when a requeue ends the batch shell) are
    removed, and this attempt's too."""
    rank = tmp_path / "rank.sh"
    rank.write_text('if [ "$SLURM_PROCID" = 1 ]; then exec "$PYTHON" -c "from fedcp_dist.errors import leave; leave(2)"; fi\n'
                    'echo preempted > "$FEDCP_STATUS_FILE"; exit 75\n')
    script = tmp_path / "t.sh"
    script.write_text(REFUSING_RANKS + f'source {REPO / "slurm" / "_common.sh"}\n'
                      f'FEDCP_RUN_CMD="bash {rank}" fedcp_launch --config c.yaml; echo "status $?"\n')
    (tmp_path / ".fedcp-status-7-0").write_text("preempted\n")  # attempt 1's, left by its requeue
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "7",
                            "SLURM_RESTART_COUNT": "1", "PYTHON": sys.executable, "PYTHONPATH": str(REPO)})
    lines = r.stdout.splitlines()
    assert lines[-2:] == ["fedcp: srun ended with status 75 after rank(s) 1 refused the run (exit 2, their lines are "
                          "above): not requeued", "status 2"], r.stdout + r.stderr
    assert not list(tmp_path.glob(".fedcp-status-*"))


BATCH_SHELL = """set -euo pipefail
# srun's and scontrol's stand-ins: the step is the rank script itself; a requeue is said, not done
srun() { while [[ "$1" == --* ]]; do shift; done; exec "$@"; }
scontrol() { if [ "$1" = requeue ]; then echo "scontrol requeue $2"; fi; }
source %s
status=0
FEDCP_RUN_CMD="bash $RANK_SCRIPT" fedcp_launch --config c.yaml || status=$?
fedcp_finish "$status"
"""

SIGNALLED_RANK = """trap 'echo preempted >"$FEDCP_STATUS_FILE"; echo "rank: USR2, FEDCP_FINISHED_OK=$FEDCP_FINISHED_OK"; exit 75' USR2
trap 'echo preempted >"$FEDCP_STATUS_FILE"; echo "rank: TERM"; exit 75' TERM
echo up >"$READY"
while :; do sleep 0.1; done
"""


def _batch_shell(tmp_path, rank_script: str, extra_env=None):
    (tmp_path / "rank.sh").write_text(rank_script)
    script = tmp_path / "job.sh"
    script.write_text(BATCH_SHELL % (REPO / "slurm" / "_common.sh"))
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0",
           "RANK_SCRIPT": str(tmp_path / "rank.sh"), "READY": str(tmp_path / "ready"), **(extra_env or {})}
    return subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_the_batch_shell_passes_a_signal_on_to_the_step(tmp_path, sig):
    """`scancel --full --signal=USR2` and `--signal=B:USR2@120` signal the batch shell too, which
    died of it: the job FAILED and was not requeued though its ranks had checkpointed, and its status
    file stayed. The shell passes the signal on to the step and requeues on the ranks' 75; a SIGTERM
    (scancel, the time limit) is passed on the same way but ends the job without a requeue. The
    ranks run with FEDCP_FINISHED_OK=1; no status file is left, and no stray error line is printed."""
    p = _batch_shell(tmp_path, SIGNALLED_RANK)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        os.kill(p.pid, getattr(signal, f"SIG{sig}"))
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    if sig == "USR2":
        assert p.returncode == 0, out + err
        assert "rank: USR2, FEDCP_FINISHED_OK=1" in out and "fedcp: checkpointed (exit 75); requeueing job 7" in out
        assert out.splitlines()[-1] == "scontrol requeue 7", out
    else:
        assert p.returncode == 143, out + err
        assert "rank: TERM" in out and "scontrol requeue" not in out
        assert ("fedcp: SIGTERM to the job (scancel, its time limit, or a requeue by SLURM itself) while the ranks ran: "
                "they stopped (exit 75); this script does not requeue it") in out, out
    assert err == "", err
    assert not list(tmp_path.glob(".fedcp-*"))


@pytest.mark.parametrize("case", ["rank failed", "rank 1 killed after rank 0 stopped at start", "signal before the step",
                                  "signal before the ranks listen"])
def test_how_the_batch_shell_reads_a_step_that_ended_at_start(tmp_path, case):
    """A re-probe of the job scripts: one rank failing at start-up (exit 1; srun's SIGTERM made the
    others exit 75, srun returned 75) was requeued for ever, each time saying it had checkpointed; a
    rank stopped at start whose peer srun killed (status 143) left the job FAILED; a SIGUSR2 in the
    batch shell's first moments, or one that reached the ranks before they listened, left it FAILED
    with no word. A 75 without rank 0's word is a failure; the others are a stop at start, requeued."""
    rank = {"rank failed": "exit 75\n",
            "rank 1 killed after rank 0 stopped at start": 'echo stopped-at-start >"$FEDCP_STATUS_FILE"; exit 143\n',
            "signal before the step": "echo ran; exit 0\n",
            "signal before the ranks listen": 'echo up >"$READY"; while :; do sleep 0.1; done\n'}[case]
    p = _batch_shell(tmp_path, rank, {"FEDCP_USR2": "1"} if case == "signal before the step" else None)
    if case == "signal before the ranks listen":
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGUSR2)  # passed on to the step, whose process has no handler: it dies of it
    out, err = p.communicate(timeout=60)
    assert err == "", err
    if case == "rank failed":
        assert p.returncode == 1, out
        assert ("fedcp: srun ended with status 75, but rank 0 did not stop for a requeue (a rank failed; its lines "
                "are above): not requeued") in out and "requeue 7" not in out
    else:
        assert p.returncode == 0 and out.splitlines()[-1] == "scontrol requeue 7", out
        assert "fedcp: stopped before it trained a round (nothing new to checkpoint); requeueing job 7" in out
        assert "ran" not in out.splitlines()
    assert not list(tmp_path.glob(".fedcp-status-*"))


def test_attempts_stopped_before_training_are_requeued_once_then_not(tmp_path):
    """Each attempt was signalled during its start-up (a short --time, a slow start-up against
    USR2@120): it exited 75, said it had checkpointed and requeued, attempt after attempt, forever.
    The first such attempt is requeued and says nothing new was checkpointed; the second in a row is
    not requeued; an attempt that trains clears the count."""
    rank = 'echo stopped-at-start >"$FEDCP_STATUS_FILE"; exit 75\n'
    said = []
    for attempt in ("0", "1"):
        p = _batch_shell(tmp_path, rank, {"SLURM_RESTART_COUNT": attempt})
        out, err = p.communicate(timeout=60)
        said.append((p.returncode, out.splitlines()[-1]))
        assert err == "", err
    assert said[0] == (0, "scontrol requeue 7")
    assert said[1][0] == 75 and said[1][1].startswith("fedcp: stopped before it trained a round on 2 attempts in a "
                                                      "row (each time the signal came during start-up): not requeued"), said
    assert not list(tmp_path.glob(".fedcp-*"))


STAND_INS = {
    "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"\n',
    "scontrol": 'if [ "$1" = requeue ]; then echo "scontrol requeue $2"; else echo "JobId=$4 SubmitTime=$SUBMITTED"; fi\n',
    # what squeue lists of the array (a file the test writes); no file: squeue fails
    "squeue": 'cat "$LISTED"\n',
}


def _sweep_task(tmp_path, task: int, status: int = 0, count: int = 0):
    """One attempt of sweep.sbatch's array task ``task`` of array 8, with stand-ins for srun, scontrol
    and squeue on PATH, and a rank that prints its arguments and exits ``status``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + text)
        (bin_dir / name).chmod(0o755)
    said = 'echo preempted >"$FEDCP_STATUS_FILE"; ' if status == 75 else ""  # rank 0's word for a requeue
    (tmp_path / "rank.sh").write_text(f'echo "args: $*"; {said}exit {status}\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": str(task), "SLURM_JOB_ID": str(9 + task),
           "SLURM_RESTART_COUNT": "0", "FEDCP_SLURM_DIR": str(REPO / "slurm"),
           "FEDCP_RUN_CMD": f"bash {tmp_path / 'rank.sh'}", "LISTED": str(tmp_path / "listed"),
           "SUBMITTED": time.strftime("%Y-%m-%dT%H:%M:%S"), **({"SLURM_ARRAY_TASK_COUNT": str(count)} if count else {})}
    return subprocess.run(["bash", str(SWEEP), "grid.txt"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_grid_copy_goes_with_the_arrays_last_task(tmp_path):
    """The copy of the grid an array's tasks read (.fedcp-grid-ARRAYJOBID) stayed in the submit
    directory for ever. The last task to end without a requeue removes it: not while squeue lists
    another task of the array, not after a stop for a requeue (75), not when squeue cannot say
    (then the tasks' marks count them: below)."""
    (tmp_path / "grid.txt").write_text("# two points\nseed=1 out_dir=a\n\nseed=2 out_dir=b\n")
    copy = tmp_path / ".fedcp-grid-8"
    (tmp_path / "listed").write_text("8_0\n8_1\n")
    r = _sweep_task(tmp_path, 0)
    assert r.returncode == 0 and "args: seed=1 out_dir=a" in r.stdout, r.stdout + r.stderr
    assert copy.read_text() == (tmp_path / "grid.txt").read_text()  # task 1 still to come
    (tmp_path / "grid.txt").write_text("seed=9 out_dir=z\nseed=1 out_dir=a\nseed=2 out_dir=b\n")  # edited meanwhile
    (tmp_path / "listed").write_text("8_1\n")
    r = _sweep_task(tmp_path, 1, status=75)  # stopped for a requeue: it comes back
    assert "args: seed=2 out_dir=b" in r.stdout and r.stdout.splitlines()[-1] == "scontrol requeue 8_1", r.stdout
    assert copy.exists()
    (tmp_path / "listed").unlink()  # squeue fails
    assert _sweep_task(tmp_path, 1).returncode == 0 and copy.exists()
    (tmp_path / "listed").write_text("8_1\n")
    r = _sweep_task(tmp_path, 1)
    assert r.returncode == 0 and "args: seed=2 out_dir=b" in r.stdout, r.stdout + r.stderr  # its line as submitted
    assert "changed since the array's first task read it" in r.stdout and not copy.exists()
    assert r.stderr == "" and not list(tmp_path.glob(".fedcp-*"))


def test_tasks_ending_together_count_their_marks(tmp_path):
    """Two tasks ending at once each see the other in squeue: the copy stayed. Each task that ends
    marks it; the one that finds the array's every task marked removes the copy and the marks."""
    (tmp_path / "grid.txt").write_text("seed=1 out_dir=a\nseed=2 out_dir=b\n")
    (tmp_path / "listed").write_text("8_0\n8_1\n")  # squeue lists both, each time
    for task in (0, 1):
        r = _sweep_task(tmp_path, task, count=2)
        assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
        assert (tmp_path / ".fedcp-grid-8").exists() == (task == 0)
    assert not list(tmp_path.glob(".fedcp-*"))


def test_train_sbatch_tiny_run(cluster, digits6, tmp_path):
    out = tmp_path / "run"
    job, name = submit(tmp_path, TRAIN, CONFIG, *_overrides(digits6, out))
    _ok(wait(job, name, timeout=180), tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert summary["launcher"] == "slurm" and summary["world_size"] == 1
    assert (tmp_path / f"slurm-{name}-{job}.out").exists()


def test_sweep_array_two_seeds(cluster, digits6, tmp_path):
    grid = tmp_path / "grid.txt"
    lines = ["# seed sweep: blank and comment lines are not counted", ""]
    lines += [" ".join(["--config", str(CONFIG), *_overrides(digits6, tmp_path / f"seed{s}", seed=s)]) for s in (1, 2)]
    grid.write_text("\n".join(lines) + "\n")
    job, name = submit(tmp_path, "--array=0-1", SWEEP, grid)
    records = wait(job, name, timeout=180)
    assert sorted(_field(r, "ArrayTaskId") for r in records) == ["0", "1"]
    _ok(records, tmp_path)
    for s in (1, 2):
        assert (tmp_path / f"seed{s}" / "summary.json").exists()
    assert {p.name for p in tmp_path.glob("slurm-*.out")} == {f"slurm-{name}-{job}_{t}.out" for t in (0, 1)}
    assert not list(tmp_path.glob(".fedcp-*")), list(tmp_path.glob(".fedcp-*"))  # the grid's copy went with the last task


def test_usr2_checkpoints_requeues_and_resumes(cluster, digits6, tmp_path):
    """The warning signal of --signal=USR2@120, sent now: the run checkpoints and exits 75, the job
    requeues itself and the second attempt resumes from the checkpoint and finishes."""
    out = tmp_path / "run"
    overrides = [o for o in _overrides(digits6, out) if not o.startswith("rounds=")] + ["rounds=6"]
    job, name = submit(tmp_path, TRAIN, CONFIG, *overrides)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()):  # the run is inside its round loop
        if time.monotonic() > deadline:
            wait(job, name, timeout=0, start_timeout=0)  # fails with the job's state and kills it
        assert _field(_records(job)[0], "JobState") not in TERMINAL, f"the run ended early:\n{_logs(tmp_path)}"
        time.sleep(0.5)
    p = subprocess.run(["scancel", "--signal=USR2", job], capture_output=True, text=True, env=_env(), timeout=30)
    assert p.returncode == 0, p.stderr
    (record,) = wait(job, name, timeout=180)
    _ok([record], tmp_path)
    log = _logs(tmp_path)
    assert _field(record, "Restarts") == "1", log
    assert "got SIGUSR2" in log and f"requeueing job {job}" in log and "resuming from" in log, log
    assert json.loads((out / "summary.json").read_text())["rounds"] == 6


STUB = """#!/usr/bin/env bash
# stands in for `python -m fedcp_dist.run`: exit 75 ("checkpointed, requeue me") on the first
# attempt, then FINAL; every attempt appends its restart count and arguments to the marker
marker=$1; final=$2; shift 2
printf 'restart=%s id=%s args=' "${SLURM_RESTART_COUNT:-0}" "${SLURM_ARRAY_TASK_ID:-none}" >>"$marker"
printf '<%s>' "$@" >>"$marker"; echo >>"$marker"
if [ "$(wc -l <"$marker")" -lt 2 ]; then echo preempted >"$FEDCP_STATUS_FILE"; exit 75; fi  # as rank 0 says it
exit "$final"
"""


def test_exit_75_requeues_the_job(cluster, tmp_path):
    """train.sbatch and an array task of sweep.sbatch: status 75 → scontrol requeue → second attempt."""
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    m_train, m_sweep = tmp_path / "train.marker", tmp_path / "sweep.marker"
    grid = tmp_path / "grid.txt"
    grid.write_text("--config a.yaml 'participation_range=[0.5, 1.0]' seed=7\n")
    j1, n1 = submit(tmp_path, TRAIN, "a.yaml", "rounds=3", env={"FEDCP_RUN_CMD": f"bash {stub} {m_train} 0"})
    j2, n2 = submit(tmp_path, "--array=0", SWEEP, grid, env={"FEDCP_RUN_CMD": f"bash {stub} {m_sweep} 0"})
    r1, r2 = wait(j1, n1, timeout=120), wait(j2, n2, timeout=120)
    _ok(r1 + r2, tmp_path)
    assert _field(r1[0], "Restarts") == "1" and _field(r2[0], "Restarts") == "1"
    assert m_train.read_text().splitlines() == [
        "restart=0 id=none args=<--config><a.yaml><rounds=3>",
        "restart=1 id=none args=<--config><a.yaml><rounds=3><overwrite=false><resume=auto>",
    ]
    assert m_sweep.read_text().splitlines() == [
        "restart=0 id=0 args=<--config><a.yaml><participation_range=[0.5, 1.0]><seed=7>",
        "restart=1 id=0 args=<--config><a.yaml><participation_range=[0.5, 1.0]><seed=7><overwrite=false><resume=auto>",
    ]
    logs = _logs(tmp_path)
    assert f"requeueing job {j1}" in logs and f"requeueing job {j2}_0" in logs



RANKS_STUB = """#!/usr/bin/env bash
# two ranks of a preempted run: rank 0 checkpointed (writes `preempted`) and exits 75 at once, rank 1
# is still closing when srun's --kill-on-bad-exit kills it; the next attempt finishes (exit 0)
marker=$1
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then echo "attempt 2 rank $SLURM_PROCID" >>"$marker"; exit 0; fi
if [ "$SLURM_PROCID" = 0 ]; then echo preempted >"$FEDCP_STATUS_FILE"; exit 75; fi
sleep 60
"""


def test_a_rank_killed_after_rank_0_checkpointed_still_requeues(cluster, tmp_path):
    """sbatch -n 2: rank 0 exits 75 first and srun's --kill-on-bad-exit kills rank 1 (srun returns
    143, not 75); rank 0's status file says the checkpoint is complete, so the job requeues and the
    second attempt runs both ranks (it ended FAILED, never requeued, before)."""
    stub = tmp_path / "ranks.sh"
    stub.write_text(RANKS_STUB)
    marker = tmp_path / "marker"
    job, name = submit(tmp_path, "-n", "2", TRAIN, "a.yaml", env={"FEDCP_RUN_CMD": f"bash {stub} {marker}"})
    (record,) = wait(job, name, timeout=150)
    log = _logs(tmp_path)
    assert (_field(record, "JobState"), _field(record, "Restarts")) == ("COMPLETED", "1"), log
    assert sorted(marker.read_text().splitlines()) == ["attempt 2 rank 0", "attempt 2 rank 1"]
    assert "after rank 0 stopped for a requeue (preempted): treated as 75" in log and f"requeueing job {job}" in log
    assert not list(tmp_path.glob(".fedcp-status-*"))


def test_other_exit_status_passes_through(cluster, tmp_path):
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    marker = tmp_path / "marker"
    marker.write_text("an earlier attempt\n")  # so the stub exits with the final status at once
    job, name = submit(tmp_path, TRAIN, "a.yaml", env={"FEDCP_RUN_CMD": f"bash {stub} {marker} 3"})
    (record,) = wait(job, name, timeout=120)
    assert (_field(record, "JobState"), _field(record, "ExitCode"), _field(record, "Restarts")) == ("FAILED", "3:0", "0")


def test_submitit_sweep_completes_reports_and_is_not_resubmitted(cluster, digits6, tmp_path, capsys, monkeypatch):
    """fedcp-sweep's SLURM executor: one submitit array job of 2 tasks on the real cluster, the
    report has both rows, and a second invocation over the finished sweep submits nothing (the
    report and the second invocation run in this process: neither starts a run)."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({
        "name": "two", "root": str(tmp_path / "sweeps"), "base": str(CONFIG),
        "overrides": {"rounds": 2, "eval_every": 1, "threads": 1, "data.path": str(digits6)},
        "grid": {"method": ["fedcp", "fedavg"]},
        "executor": {"kind": "slurm", "nproc": 1, "slurm": {"partition": "debug", "gpus_per_task": 0,
                     "tasks_per_node": 1, "cpus_per_task": 1, "time_min": 10}},
    }))
    run = lambda *a: subprocess.run([str(BIN / "fedcp-sweep"), str(sweep), *a], cwd=REPO, env=_env(),  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    p = run("--wait")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "array job" in p.stdout and "2 task(s)" in p.stdout
    rows = list((tmp_path / "sweeps" / "two" / "runs").glob("*/summary.json"))
    assert len(rows) == 2
    assert {json.loads(r.read_text())["launcher"] for r in rows} == {"slurm"}
    report.main([str(tmp_path / "sweeps" / "two"), "--no-plots"])
    table = (tmp_path / "sweeps" / "two" / "report.md").read_text()
    assert re.search(r"\| fedcp \|.*±", table) and re.search(r"\| fedavg \|.*±", table), table
    capsys.readouterr()
    monkeypatch.setenv("PATH", _env()["PATH"])
    sweep_cli.main([str(sweep), "--wait"])
    again = capsys.readouterr().out
    assert "nothing to submit" in again and "submitted" not in again and "warning" not in again


def test_a_sweep_task_cancelled_stops_and_one_requeued_by_slurm_resumes(cluster, digits6_16px, tmp_path):
    """Two points of a submitit sweep, `fedcp-sweep --wait` watching: scancel of one task ends it
    after its run checkpointed (not requeued: Restarts stays 0; the point is reported stopped, not
    FAILED), `scontrol requeue` of the other lets SLURM requeue it alone (no second requeue, no
    traceback, no result for that attempt), its next attempt resumes and finishes; the sweep exits 75
    (run it again to resume the stopped point)."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({
        "name": "stops", "root": str(tmp_path / "sweeps"), "base": str(CONFIG),
        "overrides": {"rounds": 60, "eval_every": 20, "checkpoint_every": 1, "threads": 1,
                      "data.path": str(digits6_16px)},
        "grid": {"seed": [1, 2]},
        "executor": {"kind": "slurm", "nproc": 1, "slurm": {"partition": "debug", "gpus_per_task": 0,
                     "tasks_per_node": 1, "cpus_per_task": 1, "time_min": 10}},
    }))
    watcher = subprocess.Popen([str(BIN / "fedcp-sweep"), str(sweep), "--wait"], cwd=REPO, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        runs = tmp_path / "sweeps" / "stops" / "runs"
        deadline = time.monotonic() + 180
        while len({c.parts[-4] for c in runs.glob("*/checkpoints/round_*/COMPLETE")}) < 2:  # both in their rounds
            assert watcher.poll() is None, watcher.communicate()
            assert time.monotonic() < deadline, "the sweep's runs did not checkpoint in time"
            time.sleep(0.5)
        manifest = json.loads((tmp_path / "sweeps" / "stops" / "sweep.json").read_text())
        cancelled, requeued = sorted(manifest["submissions"][-1]["jobs"].values())
        # the same sweep run again meanwhile submits neither point a second time (squeue holds both)
        again = subprocess.run([str(BIN / "fedcp-sweep"), str(sweep)], cwd=REPO, env=_env(), capture_output=True,
                               text=True, timeout=120)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"2 queued or running (job {cancelled}, {requeued}), 0 to submit" in again.stdout, again.stdout
        assert "nothing to submit: every unfinished point is queued or running already" in again.stdout
        dry = subprocess.run([str(BIN / "fedcp-sweep"), str(sweep), "--dry-run"], cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=120)
        # the dry run says what the real run would (it said 'one array job of 2 tasks')
        assert f"slurm: 2 queued or running (job {cancelled}, {requeued}), nothing to submit;" in dry.stdout, dry.stdout
        assert subprocess.run(["scancel", cancelled], env=_env(), timeout=30).returncode == 0
        assert subprocess.run(["scontrol", "requeue", requeued], env=_env(), timeout=30).returncode == 0
        out, err = watcher.communicate(timeout=420)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            subprocess.run(["scancel", "--name=fedcp-stops"], capture_output=True, timeout=30)
    assert watcher.returncode == 75, out[-3000:] + err[-3000:]
    assert re.search(rf"{re.escape(cancelled)}\s+\S+: stopped: the job was ended \(scancel", out), out
    assert re.search(rf"{re.escape(requeued)}\s+\S+: finished, best_acc", out), out
    assert "FAILED" not in out and "1 stopped after a checkpoint" in out, out
    assert "preempted: sweep stops: 1 point(s) stopped after a checkpoint" in err, err
    folder = tmp_path / "sweeps" / "stops" / "submitit"
    log = lambda job, kind: (folder / f"{job}_0_log.{kind}").read_text(errors="replace")  # noqa: E731
    # one attempt of the cancelled task, two of the requeued one (SLURM's requeue, not a second one of ours)
    assert log(cancelled, "out").count("Starting with JobEnvironment") == 1
    assert log(requeued, "out").count("Starting with JobEnvironment") == 2
    assert "checkpointed; SLURM requeues this task, the next attempt resumes it" in log(requeued, "out")
    assert "resuming from" in log(requeued, "out")
    assert "CalledProcessError" not in log(cancelled, "err") + log(requeued, "err")


def _rank_pids(out_dir):
    pids = []
    for cmd in os.listdir("/proc"):
        if not cmd.isdigit():
            continue
        try:
            argv = open(f"/proc/{cmd}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"python" in os.path.basename(argv[0]) and b"fedcp_dist.run" in argv and f"out_dir={out_dir}".encode() in argv:
            pids.append(int(cmd))
    return sorted(pids)


def test_dead_rank_under_srun_ends_the_job(cluster, digits6, tmp_path):
    """A 2-rank job step: SIGKILL one rank mid-run; the job ends (FAILED) within bounded time."""
    out = tmp_path / "run"
    overrides = [o for o in _overrides(digits6, out) if not o.startswith("rounds=")] + ["rounds=500", "collective_timeout=30"]
    job, name = submit(tmp_path, "-n", "2", TRAIN, CONFIG, *overrides)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 150
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            if time.monotonic() > deadline:
                wait(job, name, timeout=0, start_timeout=0)
            time.sleep(0.5)
        pids = _rank_pids(out)
        assert len(pids) == 2, pids
        os.kill(pids[-1], 9)
        t0 = time.monotonic()
        (record,) = wait(job, name, timeout=120)
        assert time.monotonic() - t0 < 90
        assert _field(record, "JobState") == "FAILED", f"{record}\n{_logs(tmp_path)}"
        log = _logs(tmp_path)
        # srun names the dead task ("task 1: Killed"), or the survivor names the silent rank
        assert re.search(r"task 1: (Killed|Exited)", log) or "rank(s) 1" in log, log
        assert not (out / "summary.json").exists()
        assert _rank_pids(out) == []
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, env=_env(), timeout=30)
