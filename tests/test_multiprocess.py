"""1, 2 and 3 ranks (torchrun) and 2 ranks (mpirun) give the same trajectory: one by one
(fused=false) and on the default fused path, bit for bit."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import BIN, REPO, run_cmd

pytestmark = pytest.mark.slow

ROUNDS = 3


def _args(shard, out, method="fedcp"):
    # fused=false: clients train one by one, so a client's update is the same bits on any world size
    # and only the all-reduce's order of addition differs (the default fused path is checked below)
    return [
        "--config", "configs/digits_fedcp.yaml", "fused=false",
        f"method={method}", f"rounds={ROUNDS}", "eval_every=1", f"data.path={shard}", f"out_dir={out}", "threads=1",
    ]


def _load(out):
    state = torch.load(out / "final_global.pt", weights_only=True)
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return state, summary, lines


def _check_same(ref, other, label):
    s1, sum1, m1 = ref
    s2, sum2, m2 = other
    assert set(s1) == set(s2)
    for k in s1:
        assert torch.allclose(s1[k], s2[k], atol=1e-5, rtol=0), f"{label}: {k} differs by {(s1[k] - s2[k]).abs().max()}"
    accs1 = [l["acc"] for l in m1 if "acc" in l]
    accs2 = [l["acc"] for l in m2 if "acc" in l]
    assert len(accs1) == len(accs2) == ROUNDS + 1
    assert accs1 == pytest.approx(accs2, abs=1e-9), label
    assert sum1["final_acc"] == pytest.approx(sum2["final_acc"], abs=1e-9)


@pytest.fixture(scope="module")
def single(digits6_16px, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, out)])
    assert r.returncode == 0, r.stderr
    ref = _load(out)
    assert ref[1]["world_size"] == 1 and ref[1]["launcher"] == "single"
    # the trajectory really moved: the model learned something in three rounds
    accs = [l["acc"] for l in ref[2] if "acc" in l]
    assert accs[-1] > accs[0] + 0.2
    return ref


def test_fedcp_run_ranks_matches_single_rank(single, digits6_16px, tmp_path):
    """``fedcp-run --ranks 2``: the one command starts 2 ranks under torchrun, same trajectory (3 ranks:
    the default fused path below; every baseline on 2 ranks: tests/test_baselines.py)."""
    r = run_cmd([str(BIN / "fedcp-run"), "--ranks", "2", *_args(digits6_16px, tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    got = _load(tmp_path)
    assert got[1]["world_size"] == 2 and got[1]["launcher"] == "torchrun"
    assert "launcher=torchrun world_size=2" in r.stdout
    _check_same(single, got, "fedcp-run --ranks 2")

def test_fedcp_run_ranks_ends_as_a_run_does(digits6_16px, tmp_path):
    """``fedcp-run --ranks 2`` (torchrun behind fedcp_dist/cli/ranks.py) ends as one process would:
    ranks refusing alike exit 2 with one line each and one line for the launch, no traceback; a
    SIGUSR2, the default preempt_signal, checkpoints and exits 75 (torchrun exited 1 either way, the
    first with its traceback, and SIGUSR2, which torchrun does not listen to, ended it at once: no
    checkpoint, exit 140)."""
    import signal
    import subprocess
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1")
    (tmp_path / "file").write_text("x")
    r = run_cmd([str(BIN / "fedcp-run"), "--ranks", "2", "--config", "configs/digits_fedcp.yaml",
                 f"data.path={digits6_16px}", f"out_dir={tmp_path / 'file' / 'run'}", "rounds=1", "threads=1"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # which rank says it first is the machine's timing; torchrun stops the other one then
    assert r.stderr.splitlines()[-1] in (
        "fedcp-run --ranks: ranks 0, 1 exited with status 2 (see the lines above)",
        *(f"fedcp-run --ranks: rank {a} exited with status 2 (see the lines above); torchrun then stopped "
          f"rank {b}" for a, b in ((0, 1), (1, 0)))), r.stderr[-3000:]
    assert f"error: out_dir {tmp_path / 'file' / 'run'} cannot be written: Not a directory" in r.stderr
    # and nothing else: no rank says only that another failed (the ranks share this terminal), and
    # torchrun's log lines that the last line says again (the first failure, the SIGTERM it sends the
    # other rank) are left out
    assert not [ln for ln in r.stderr.splitlines()
                if "another rank failed" in ln or "failed (exitcode" in ln or "Closing process" in ln], r.stderr

    out = tmp_path / "run"
    p = subprocess.Popen([str(BIN / "fedcp-run"), "--ranks", "2", "--config", "configs/digits_fedcp.yaml",
                          f"data.path={digits6_16px}", f"out_dir={out}", "rounds=200", "threads=1"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGUSR2)  # the process is torchrun now (exec'd in fedcp-run's place)
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == "fedcp-run --ranks: got SIGUSR2; the ranks stopped after their checkpoint"
    assert any((d / "COMPLETE").exists() for d in (out / "checkpoints").iterdir())


def test_a_ranks_launch_signalled_just_before_its_exec_exits_75(digits6_16px, tmp_path):
    """A SIGTERM in the last moment before fedcp-run --ranks exec'd torchrun was noted after the last
    look and lost across the exec: the ranks trained every round and the launch exited 0. Held from
    before torch loads (a thread torch starts takes the mask: held only from just before the exec,
    in the main thread, one could still take it), it is taken after the exec as a stop (75)."""
    out = tmp_path / "run"
    r = run_cmd([str(BIN / "fedcp-run"), "--ranks", "2", "--config", "configs/digits_fedcp.yaml",
                 f"data.path={digits6_16px}", f"out_dir={out}", "rounds=2", "threads=1"],
                env_extra={"FEDCP_FAULT_AT": "exec:SIGTERM"})
    assert r.returncode == 75 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    assert r.stderr.splitlines()[-1] == "fedcp-run --ranks: got SIGTERM before the ranks started; nothing ran"
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR2"])
def test_a_ranks_launch_signalled_while_torch_loads_exits_75(sig, digits6_16px, tmp_path):
    """A stop signal after ``fedcp-run --ranks`` exec'd into torchrun and before torchrun's handlers
    were in place (while torch loaded, a second or more) ended the process by the signal's default
    action: 143 or 140, which a job script does not requeue. Now it waits, blocked, and the launch
    says that nothing ran and exits 75, as a stop during fedcp-run's own start-up does."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    p = subprocess.Popen([str(BIN / "fedcp-run"), "--ranks", "2", "--config", "configs/digits_fedcp.yaml",
                          f"data.path={digits6_16px}", f"out_dir={out}", "rounds=2", "threads=1"],
                         cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        cmdline = Path(f"/proc/{p.pid}/cmdline")
        while b"fedcp_dist.cli.ranks" not in cmdline.read_bytes():  # the exec has happened
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.005)
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75 and "Traceback" not in err, (p.returncode, err[-3000:])
    assert err.splitlines()[-1] == f"fedcp-run --ranks: got {sig} before the ranks started; nothing ran"
    assert not (out / "metrics.jsonl").exists()


def test_a_local_sweep_of_two_rank_points_stops_a_point_as_a_run_does(digits6_16px, tmp_path):
    """A local sweep with nproc 2 ran its points under bare torchrun: stopped, the point's log held
    torchrun's traceback and the point said "exit status 1 once asked to stop". Under fedcp-run
    --ranks the point checkpoints and says exit 75, without a traceback."""
    import signal
    import subprocess
    import time

    import yaml

    spec = {"name": "two", "root": str(tmp_path / "sweeps"), "base": str(REPO / "configs" / "digits_fedcp.yaml"),
            "overrides": {"rounds": 200, "threads": 1, "checkpoint_every": 2, "data.path": str(digits6_16px)},
            "grid": {"seed": [1]},
            "executor": {"kind": "local", "nproc": 2}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    p = subprocess.Popen([sys.executable, "-m", "fedcp_dist.cli.sweep", str(tmp_path / "s.yaml")], cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 150
        while not list((tmp_path / "sweeps").glob("two/runs/*/checkpoints/*/COMPLETE")):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75, (out[-2000:], err[-2000:])
    assert "checkpointed (exit 75); the sweep run again resumes it" in out, out[-2000:]
    log = next((tmp_path / "sweeps" / "two" / "logs").glob("*.log")).read_text()
    assert "Traceback" not in log and "fedcp-run --ranks: got SIGTERM; the ranks stopped after their checkpoint" in log


def test_mpirun_matches_single_rank(single, digits6_16px, tmp_path):
    mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    r = run_cmd([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2",
                 sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = _load(tmp_path)
    assert got[1]["world_size"] == 2 and got[1]["launcher"] == "mpi"
    _check_same(single, got, "mpirun x2")


def _free_port(lo=20000, hi=40000):
    """A free TCP port in [lo, hi) (the srun path derives its port as 20000 + job id % 20000)."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _start_all(cmds_envs):
    """Start every (cmd, env) at once from the repository; wait for all; (return codes, outputs)."""
    import os
    import subprocess


    procs = []
    for cmd, env in cmds_envs:
        full = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1", **env)
        for k in [k for k in full if k.startswith(("SLURM_", "FEDCP_"))]:
            if k not in env:
                del full[k]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outs


def test_two_nodes_of_two_ranks_under_torchrun_match_single_rank(single, digits6_16px, tmp_path):
    """2 "nodes" × 2 ranks: two torchrun agents (--nnodes=2, --node_rank=0/1) meeting at a c10d
    rendezvous on localhost, as on two hosts; each node's two workers share its cores."""
    port = _free_port()
    rc, outs = _start_all([
        ([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2",
          "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=fedcp-two-nodes",
          "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path)[:-1], "threads=0"], {})
        for node in (0, 1)])
    assert rc == [0, 0], "\n".join(o[-2000:] for o in outs)
    got = _load(tmp_path)
    assert got[1]["world_size"] == 4 and got[1]["launcher"] == "torchrun"
    # threads=0 is the cores of a node over its 2 ranks (LOCAL_WORLD_SIZE), not over the job's 4
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"world_size=4 device=cpu backend=gloo threads={threads}" in "".join(outs)
    _check_same(single, got, "torchrun, 2 nodes x 2")


def test_srun_path_on_two_hosts_matches_single_rank(single, digits6_16px, tmp_path):
    """The srun path as a 2-node step with 2 tasks per node sets it up: SLURM_* variables per task
    (a multi-host node list whose first host is this one), no srun needed."""
    port = _free_port()
    common = {"SLURM_JOB_ID": str(port - 20000), "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_NODELIST": "localhost,node2",
              "SLURM_STEP_NODELIST": "localhost,node2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    rc, outs = _start_all([
        ([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path)[:-1], "threads=0"],
         {**common, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank // 2), "SLURM_LOCALID": str(rank % 2)})
        for rank in range(4)])
    assert rc == [0, 0, 0, 0], "\n".join(o[-2000:] for o in outs)
    got = _load(tmp_path)
    assert got[1]["world_size"] == 4 and got[1]["launcher"] == "slurm"
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"launcher=slurm world_size=4 device=cpu backend=gloo threads={threads}" in outs[0]
    _check_same(single, got, "srun path, 2 nodes x 2")


def test_default_fused_path_is_bit_identical_on_one_two_and_three_ranks(digits20_16px, tmp_path):
    """The defaults (fused=auto, fused_group=auto, placement=auto): the 20 clients train in four
    fused groups fixed by the config (four of 5), which 2 and 3 ranks hold in different places; the
    final global state, every client's state, the metric records and the summary are the same bits
    on 1, 2 and 3 ranks (timings and the launch itself aside)."""
    from golden.record import digest_run

    def args(out):
        return ["--config", "configs/digits_fedcp.yaml", "rounds=2", "eval_every=1", "checkpoint_every=1",
                "keep_checkpoints=5", f"data.path={digits20_16px}", f"out_dir={out}", "threads=1"]

    digests, lines = {}, {}
    for n in (1, 2, 3):
        out = tmp_path / f"ranks{n}"
        launch = ["-m", "fedcp_dist.run"] if n == 1 else ["-m", "torch.distributed.run", "--standalone",
                                                            f"--nproc_per_node={n}", "-m", "fedcp_dist.run"]
        r = run_cmd([sys.executable, *launch, *args(out)], timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        lines[n] = next(line for line in r.stdout.splitlines() if line.startswith("fedcp_dist: fedcp"))
        digests[n] = digest_run(out)
    for n, line in lines.items():
        assert "placed by steps in 4 whole fused groups" in line and "training: fused (fused=auto, groups of 5" in line
    # the groups really are spread: every rank of 3 holds one (no rank's step count is 0)
    assert re.search(r"max/mean steps per rank [0-9.]+ \(\d+/\d+/\d+\)", lines[3])
    assert "/0/" not in lines[3] and "/0)" not in lines[3] and "(0/" not in lines[3]
    assert digests[1]["final_acc"] > 0.3  # the model learned: the comparison is not of untouched states
    assert digests[2] == digests[1]
    assert digests[3] == digests[1]
