"""Failures end cleanly: a dead rank, a non-finite update, a full disk, a damaged checkpoint,
a shared out_dir, bad shards. Each test provokes the real failure."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from conftest import BIN, REPO, run_cmd
from helpers import descendants, documented, nonfinite_at, rank_envs, run, tmpfs, wait_for
from helpers import kill_job as _kill_job
from helpers import start as _start

from fedcp_dist.cli import report
from fedcp_dist.rundir import checkpoint as ckpt_mod
from fedcp_dist.rundir.checkpoint import Checkpointer
from fedcp_dist.config import load_config, merged_overrides
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.runtime import init_runtime
from fedcp_dist.engine.simulator import Simulator


def _args(shard, out, *extra):
    return ["--config", "configs/digits_fedcp.yaml",
            *merged_overrides(["eval_every=1", f"data.path={shard}", f"out_dir={out}", "threads=1"], extra)]


def _lines(out: Path):
    p = out / "metrics.jsonl"
    return p.read_text().splitlines() if p.exists() else []


def _wait_rounds(out: Path, proc, n, timeout=180):
    t0 = time.time()
    while len(_lines(out)) < n:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.05)


# -- a rank dies -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dies", [1, 0])
def test_dead_rank_without_a_launcher_to_clean_up(digits6_16px, tmp_path, dies):
    """Ranks started as mpirun/srun would start them (no torchrun agent): when one rank is
    SIGKILLed, the other must stop on its own in one line, naming the dead rank and the round.
    Rank 0 holds the job's rendezvous store there: when it dies, the store goes with it, and the
    survivor says so without torch's C++ stack trace of the lost connection."""
    envs = rank_envs()
    procs = []
    for rank in (0, 1):
        env = envs[rank]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path, "rounds=500", "collective_timeout=30")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    survivor = procs[1 - dies]
    try:
        _wait_rounds(tmp_path, procs[0], 3)
        procs[dies].kill()
        t0 = time.time()
        out, err = survivor.communicate(timeout=90)
        elapsed = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert survivor.returncode == 1
    assert elapsed < 60
    lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "frame #" not in err, err[-2000:]
    assert "round" in lines[0]
    if dies == 1:
        assert "rank(s) 1 stopped answering" in lines[0]
    else:
        documented("checkpoints.md", "a collective failed: rank 0 is gone (the job's rendezvous store, which rank 0 held, "
                                 "no longer answers) (…)", lines[0])


@pytest.mark.slow
def test_dead_rank_under_torchrun(digits6_16px, tmp_path):
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path, "rounds=500", "collective_timeout=30")])
    _wait_rounds(tmp_path, proc, 3)
    kids = [int(k) for k in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    assert len(kids) == 2
    os.kill(kids[1], signal.SIGKILL)
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 90
    # torchrun stops the survivor with SIGTERM; the survivor's own one-line error names the dead rank
    assert re.search(r"^error: rank 0, round \d+: a collective failed: rank\(s\) 1 stopped answering", out, re.M), \
        out[-3000:]


@pytest.mark.parametrize("signalled", [0, 1])
def test_a_stop_during_start_up_under_mpirun_stops_every_rank_at_once(digits6_16px, tmp_path, signalled):
    """A preemption signal to mpirun during start-up reaches the ranks at their own moments: rank 1,
    waiting for rank 0's word, stopped (75), and rank 0 went on to open the process group, which
    waited for rank 1 for collective_timeout (10 minutes), then failed (exit 1: not requeued). A
    rank asked to stop tells the others over MPI and every rank stops at once, exit 75."""
    mpirun = shutil.which("mpirun", path=str(BIN))
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    cmd = [sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path / "run", "rounds=2")]
    ranks = [["-np", "1", *(["-x", "FEDCP_FAULT_AT=startup:SIGUSR2"] if r == signalled else []), *cmd] for r in (0, 1)]
    t0 = time.monotonic()
    r = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1", *ranks[0], ":",
                        *ranks[1]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 75 and time.monotonic() - t0 < 120, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("preempted: ")]
    assert len(lines) == 2 and all("before any training (nothing trained in this attempt)" in ln for ln in lines), \
        r.stderr[-3000:]
    assert f"rank {signalled}: got SIGUSR2; stopping during start-up" in r.stdout
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.slow
def test_dead_rank_under_mpirun(digits6_16px, tmp_path):
    mpirun = shutil.which("mpirun", path=str(BIN))
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    proc = _start([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "fedcp_dist.run",
                   *_args(digits6_16px, tmp_path, "rounds=500", "collective_timeout=30")])
    _wait_rounds(tmp_path, proc, 3)
    ranks = [p for p in descendants(proc.pid)[1:] if "fedcp_dist.run" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGKILL)
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 90, out[-3000:]
    # mpirun names the dead rank ("process rank 1 with PID ... exited on signal 9"), or the survivor does
    assert "rank 1" in out or "rank(s) 1" in out, out[-3000:]


@pytest.mark.slow
def test_a_sigterm_to_launch_mpirun_sh_checkpoints_the_round_and_exits_75(digits6_16px, tmp_path):
    """Open MPI's mpirun kills its ranks within a second of a SIGTERM (no checkpoint, exit 1, no
    line), so the launch script passed it on by exec lost the round under way: it now passes
    SIGTERM to mpirun as SIGUSR2, which mpirun forwards, and exits with the ranks' 75. The ranks
    are held in round 3's training while the signal comes (a round longer than mpirun's grace)."""
    if shutil.which("mpirun", path=str(BIN)) is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    held = tmp_path / "held"
    out = tmp_path / "run"
    proc = _start(["bash", "launch/mpirun.sh", "2", "configs/digits_fedcp.yaml",
                   *merged_overrides(["eval_every=1", f"data.path={digits6_16px}", f"out_dir={out}", "threads=1"],
                                     ["rounds=6"])],
                  MPIRUN_FLAGS="--oversubscribe", FEDCP_FAULT_AT=f"train@3:wait={held}",
                  FEDCP_STATUS_FILE=str(tmp_path / "status"))
    try:
        wait_for(held, proc)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(3)  # mpirun would have killed the ranks by now
        held.unlink(missing_ok=True)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert proc.returncode == 75, text[-3000:]
    assert (tmp_path / "status").read_text().strip() == "preempted"
    latest = Checkpointer(str(out), 0, 2, 6).latest()
    assert latest is not None and latest.name == "round_0000003", text[-3000:]


@pytest.mark.parametrize("sig, status", [("SIGUSR2", 75), ("SIGINT", 1)])
def test_launch_mpirun_sh_passes_a_usr2_or_int_on_to_mpirun(tmp_path, sig, status):
    """SIGUSR2 (the default preempt_signal) and SIGINT to launch/mpirun.sh reach mpirun, as when the
    script exec'd it: the shell's default action for them killed the script alone, and mpirun and
    its ranks trained on, out of the job's reach. Ranks here are a stand-in ``python`` that says
    which signal came (75 for SIGUSR2)."""
    if shutil.which("mpirun", path=str(BIN)) is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/usr/bin/env bash\n"
                                 f"trap 'echo got USR2; exit 75' USR2\ntrap 'echo got INT; exit 130' INT\n"
                                 f"echo started >> {tmp_path / 'started'}\n"
                                 "for i in $(seq 1 120); do sleep 0.25; done\necho finished\n")
    (fake / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
               MPIRUN_FLAGS="--oversubscribe")
    proc = subprocess.Popen(["bash", "launch/mpirun.sh", "2", "x"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while not ((tmp_path / "started").exists() and len((tmp_path / "started").read_text().split()) == 2):
            assert proc.poll() is None and time.time() - t0 < 60, proc.stdout.read() if proc.poll() is not None else ""
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(getattr(signal, sig))
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == status, out
        assert "finished" not in out, out
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    left = subprocess.run(["pgrep", "-f", str(fake / "python")], capture_output=True, text=True).stdout.split()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert not left, "ranks left running after the script ended"


@pytest.mark.slow
def test_a_hung_rank_under_mpirun_ends_the_job_after_collective_timeout(digits6_16px, tmp_path):
    """A rank that hangs (SIGSTOP here; a rank stuck on a file system alike) rather than dies: the
    other rank said its line after collective_timeout and then waited in MPI's finalize for the
    hung one, so mpirun never ended and the job held its allocation until walltime. A failing
    rank of an MPI job now aborts the job."""
    mpirun = shutil.which("mpirun", path=str(BIN))
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    proc = _start([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "fedcp_dist.run",
                   *_args(digits6_16px, tmp_path, "rounds=500", "collective_timeout=10", "checkpoint_every=2")])
    try:
        _wait_rounds(tmp_path, proc, 3)
        ranks = [p for p in descendants(proc.pid)[1:] if "fedcp_dist.run" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(ranks) == 2
        hung = next(p for p in ranks if "OMPI_COMM_WORLD_RANK=1\0" in Path(f"/proc/{p}/environ").read_text())
        os.kill(hung, signal.SIGSTOP)
        t0 = time.time()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert proc.returncode == 1 and time.time() - t0 < 60, out[-3000:]
    assert re.search(r"^error: rank 0, round \d+: a collective failed: rank\(s\) 1 stopped answering", out, re.M), \
        out[-3000:]
    assert Checkpointer(str(tmp_path), 0, 2, 2).latest() is not None  # the newest complete checkpoint is whole


@pytest.mark.slow
def test_an_mpirun_job_whose_port_is_taken_stops_at_once_in_one_line_a_rank(digits6_16px, tmp_path):
    """MASTER_PORT held by another process (a job before, another service) that accepts and never
    answers: rank 0 cannot open the store, and the other ranks used to connect to whatever held
    the port and wait there, past rendezvous_timeout, under torch's C++ stack traces. Rank 0's
    word over MPI stops every rank at once, each in the same one line."""
    import socket
    mpirun = shutil.which("mpirun", path=str(BIN))
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install '.[mpi]')")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        t0 = time.time()
        r = run_cmd([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", "-x", "MASTER_ADDR", "-x",
                     "MASTER_PORT", sys.executable, "-m", "fedcp_dist.run",
                     *_args(digits6_16px, tmp_path, "rounds=2", "rendezvous_timeout=100")],
                    env_extra={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout=90)
    finally:
        holder.close()
    out = r.stdout + r.stderr
    assert r.returncode != 0 and time.time() - t0 < 60, out[-3000:]
    for rank in (0, 1):
        line = next(l for l in out.splitlines() if l.startswith(f"error: rank {rank}: "))
        assert f"did not meet at 127.0.0.1:{port} (rank 0 could not open it: " in line, line
        assert "address already in use" in line.lower() or "EADDRINUSE" in line, line
    assert "frame #" not in out and "Exception raised from" not in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def _gone(pid: int) -> bool:
    """True when ``pid`` has ended (a zombie nobody reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.slow
def test_workers_stop_when_torchrun_is_killed(digits6_16px, tmp_path):
    """torchrun SIGKILLed (an OOM kill, a lost node agent): its workers, in sessions of their own,
    must not train on. Each notices within seconds, says so in one line and exits; the newest
    complete checkpoint stays loadable and the run resumes from it."""
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path, "rounds=500", "checkpoint_every=2")])
    ck = Checkpointer(str(tmp_path), 0, 2, 2)
    workers = []
    try:
        _wait_rounds(tmp_path, proc, 5)  # at least two checkpoints written
        workers = [int(k) for k in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.time()
        while not all(_gone(w) for w in workers) and time.time() - t0 < 30:
            time.sleep(0.05)
        elapsed = time.time() - t0
    finally:
        _kill_job(proc)
        for w in workers:  # orphans are no longer under torchrun
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
    out = proc.stdout.read()  # the workers held the pipe: it ends with them
    assert elapsed < 5, f"workers still running {elapsed:.1f} s after torchrun was killed"
    said = re.findall(rf"^error: rank (\d), round \d+.*: its launcher \(pid {proc.pid}\) is gone; stopping", out, re.M)
    assert sorted(said) == ["0", "1"], out[-3000:]
    assert "Traceback" not in out
    latest = ck.latest()
    assert latest is not None and ck.verify(latest) is None
    rounds_done, global_state, clients, _ = ck.load(latest, range(6), "cpu")
    assert rounds_done >= 4 and rounds_done % 2 == 0 and sorted(clients) == list(range(6))
    assert not (tmp_path / "summary.json").exists()
    # the run goes on from it: two more rounds, in this process
    said = []
    run("configs/digits_fedcp.yaml", _args(digits6_16px, tmp_path, f"rounds={rounds_done + 2}")[2:], echo=said.append)
    assert any(f"resuming from {latest}" in line for line in said), said
    assert json.loads((tmp_path / "summary.json").read_text())["rounds"] == rounds_done + 2


# -- non-finite updates --------------------------------------------------------------------------

@pytest.mark.slow
def test_nonfinite_update_stops_every_rank_and_keeps_the_checkpoint(digits6_16px, tmp_path):
    """Two ranks; the client's owner sees the NaN, both stop in the same round with exit status 1."""
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(REPO / "tests" / "helpers.py"), "4:2", *_args(digits6_16px, tmp_path, "rounds=6", "checkpoint_every=2")])
    assert r.returncode == 1, r.stderr[-2000:]
    assert "round 4: client 2 produced a non-finite loss or update (on_nonfinite=error)" in r.stderr
    latest = Checkpointer(str(tmp_path), 0, 2, 2).latest()
    assert latest is not None and latest.name == "round_0000002"
    assert not (tmp_path / "summary.json").exists()
    # the run continues from the good checkpoint once the cause is gone
    said = []
    run(_args(digits6_16px, tmp_path)[1], _args(digits6_16px, tmp_path, "rounds=6", "checkpoint_every=2")[2:], echo=said.append)
    assert any("resuming from" in line and "round_0000002" in line for line in said)


def test_nonfinite_update_skipped(digits6_16px, tmp_path, capsys):
    run(_args(digits6_16px, tmp_path)[1], _args(digits6_16px, tmp_path, "rounds=3", "on_nonfinite=skip")[2:], wrap=nonfinite_at("2:3"))
    assert "round 2: client 3 produced a non-finite loss or update (left out of the round)" in capsys.readouterr().out
    rows = [json.loads(l) for l in _lines(tmp_path) if '"round"' in l]
    assert [row.get("nonfinite_skipped") for row in rows if row["kind"] == "round"] == [0, 1, 0]
    assert [row["participants"] for row in rows if row["kind"] == "round"] == [6, 6, 6]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_acc"] > 0.5  # the global model stayed finite and kept learning


# -- checkpoints on a full disk, damaged checkpoints ------------------------------------------------

def test_full_disk_while_checkpointing_keeps_the_previous_one(digits6_16px, tmp_path, monkeypatch):
    real = ckpt_mod.atomic_torch_save
    calls = {"n": 0}

    def flaky(obj, path):
        if "round_0000004" in str(path):
            calls["n"] += 1
            # a partial temporary file, then the disk is full
            Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path)

    monkeypatch.setattr(ckpt_mod, "atomic_torch_save", flaky)
    cfg = load_config("configs/digits_fedcp.yaml", [f"data.path={digits6_16px}", f"out_dir={tmp_path}", "rounds=6",
                                                    "checkpoint_every=2", "eval_every=3"])
    rt = init_runtime("cpu", 1, env={})
    with pytest.raises(RunFailure, match=r"after round 4 could not be written \(\S*round_0000004/clients_0.pt: "
                                         r"No space left on device\); the previous"):
        Simulator(cfg, rt, echo=lambda *_: None).run()
    assert calls["n"] == 1
    ck = Checkpointer(str(tmp_path), 0, 1, 2)
    assert ck.latest().name == "round_0000002"
    assert not (ck.root / "round_0000004").exists()
    assert ck.verify(ck.latest()) is None


def _file_size_limit(nbytes: int):
    """A preexec_fn: files of the process may not grow past ``nbytes`` (a write past it fails with
    EFBIG, as one on a full disk fails with ENOSPC: the same error path, no privileges needed)."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


def test_a_write_that_fails_inside_torch_save_is_one_line(digits6_16px, tmp_path):
    """torch.save's zip writer raises a RuntimeError for a write the file system refused: the run
    still stops in one line naming the file, removes the half-written checkpoint and keeps the
    metrics line it wrote before."""
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.run",
                        *_args(digits6_16px, tmp_path, "rounds=2", "checkpoint_every=1")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(64 << 10),
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.fullmatch(r"error: the checkpoint after round 1 could not be written \(\S*/round_0000001/clients_0\.pt: "
                        r"File too large\); no earlier checkpoint was complete: a restart begins afresh", lines[0]), lines[0]
    assert not (tmp_path / "checkpoints" / "round_0000001").exists()
    assert [json.loads(line)["round"] for line in _lines(tmp_path)] == [1]
    documented("checkpoints.md", "The same for any write the file system refuses inside `torch.save` (whose writer reports it "
                             "as its own error): tested with a real file size limit, `File too large`")



@pytest.mark.parametrize("kib", [10, 500, 2000])
def test_a_shard_written_under_a_file_size_limit_is_one_line(tmp_path, kib):
    """fedcp-partition (and a sweep's partition) under ``ulimit -f``: HDF5 failed on a write past the
    limit inside its objects' finalizers, and the interpreter printed tracebacks and crashed
    (segfault, 139); a failure at its flush was a RuntimeError traceback. The writer now stops in
    one line before the rows it is given could take the file past the limit (10 KiB: at the first
    client; 500 KiB: part-way), leaves no file and exits 1; a limit the shard fits (2,000 KiB for
    its 0.8 MiB) writes it as before."""
    out = tmp_path / "s.h5"
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.cli.partition", "--source", "digits", "--num-clients", "6",
                        "--beta", "0.5", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       preexec_fn=_file_size_limit(kib << 10), env=dict(os.environ, OMP_NUM_THREADS="1"))
    if kib == 2000:
        from fedcp_dist.data.shards import read_info

        assert r.returncode == 0 and read_info(out).num_clients == 6, r.stderr[-3000:]
        return
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == (f"error: {out}: File too large: the shard could pass this process's file size "
                                         f"limit, {kib:,} KiB (ulimit -f {kib}), with its next rows (counted before "
                                         f"compression); raise the limit")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_a_run_whose_output_cannot_encode_its_symbols_goes_on(digits6_16px, tmp_path, encoding):
    """Output in a Latin-1 or ASCII encoding (PYTHONIOENCODING, an ISO-8859-1 locale): the DP start
    line's σ raised UnicodeEncodeError, a traceback that ended the run and left it unfinished. The
    symbols are replaced and the run finishes."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, out, "rounds=1", "dp=central",
                                                                       "dp_noise_multiplier=0.5")],
                       cwd=REPO, capture_output=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING=encoding))
    text = (r.stdout + r.stderr).decode(encoding)
    assert r.returncode == 0 and "Traceback" not in text, text[-3000:]
    assert "DP (?, ?)" in text and (out / "summary.json").is_file()


@pytest.mark.parametrize("module", ["fedcp_dist.run", "fedcp_dist.cli.partition", "fedcp_dist.cli.report"])
def test_a_command_started_in_a_removed_folder_says_so(tmp_path, module):
    """A shell left in a folder that was removed: loading torch died in its math library ("Intel
    oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"), which named nothing of the cause."""
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(["bash", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m {module} --help', sys.executable],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == ("error: the current directory no longer exists (it was removed while the shell was in it): cd "
                        "to a folder that exists and run the command again\n")


@pytest.mark.parametrize("hard", ["as it is", 12])
def test_an_open_file_limit_too_low_for_a_run_is_raised_or_refused(digits6_16px, tmp_path, hard):
    """``ulimit -n`` of 12: a run failed at its first checkpoint naming a source file of torch as the
    file it could not write, and ``--ranks 2`` with torchrun's traceback. The soft limit is raised
    within the hard one (a note says so), and a hard limit under what a run needs is one line."""
    import resource

    top = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard == "as it is" else hard
    if top != resource.RLIM_INFINITY and top < 64 and hard == "as it is":
        pytest.skip(f"this machine's hard open-file limit is {top}")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (12, top))

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, out, "rounds=1", "checkpoint_every=1")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limit,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {"OMP_NUM_THREADS": "1"})
    if hard == 12:
        assert r.returncode == 2 and r.stderr == (
            "error: the open-file limit (ulimit -n) is 12, and 12 at most (its hard limit): a run opens up to 16 files "
            "at once (its checkpoints); raise the hard limit\n"), r.stderr
        assert not out.exists()
    else:
        raised = 4096 if top == resource.RLIM_INFINITY else min(top, 4096)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert (f"note: the open-file limit (ulimit -n) was 12, too few for a run (up to 64 files at once); raised to "
                f"{raised} within its hard limit\n") in r.stderr
        assert (out / "summary.json").is_file()


def test_an_open_file_limit_between_a_runs_and_a_jobs_needs_is_refused_for_ranks_only(monkeypatch):
    """A hard limit of 32 files: enough for one process (it needs about 7), not for the ranks of a
    job (``--ranks 2`` needs about 32); one rank of a job a launcher started counts as a job."""
    import resource

    from fedcp_dist.errors import check_open_files

    calls, limits = [], [(20, 32)]
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", lambda _, v: calls.append(v))
    said = []
    check_open_files(several=False, note=said.append, env={})
    assert calls == [(32, 32)] and len(said) == 1
    limits.append((20, 100))
    check_open_files(several=False, note=said.append, env={"WORLD_SIZE": "4", "RANK": "2"})  # a rank other than 0
    assert calls == [(32, 32), (100, 100)] and len(said) == 1
    limits.append((20, 32))
    for several, env in ((True, {}), (False, {"OMPI_COMM_WORLD_SIZE": "2"})):
        with pytest.raises(UserError, match=r"is 20, and 32 at most \(its hard limit\): a job of several ranks opens up "
                                            r"to 64 files at once \(its checkpoints, the ranks' sockets\)"):
            check_open_files(several=several, env=env)


def test_a_fresh_run_that_cannot_write_its_config_says_nothing_was_trained(digits6_16px, tmp_path):
    """config.yaml, the first file a fresh run writes, refused (a 1 KiB file size limit): the error
    said "a restart resumes from its last complete checkpoint", of a run that had none."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, out, "rounds=1")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(1 << 10),
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == (
        f"error: cannot write {out}/config.yaml: File too large; nothing was trained yet: start the run again once "
        f"it can be written"), r.stderr[-2000:]


def test_hdf5s_own_report_of_a_failed_write_gives_its_errno():
    """h5py raises a flush that the file system refused as a RuntimeError whose message alone holds
    the errno: it is read from there, so the shard's writer names the reason in one line."""
    from fedcp_dist.data.shards.write import _hdf5_os_error

    err = _hdf5_os_error(RuntimeError("Unable to synchronously flush file (file write failed: time = X\n, filename = "
                                      "'/t/.s.h5.tmp-h-1', file descriptor = 3, errno = 27, error message = 'File too "
                                      "large', buf = 0x1, total write size = 96304)"))
    assert isinstance(err, OSError) and err.errno == errno.EFBIG and err.filename is None
    assert _hdf5_os_error(RuntimeError("Unable to open object (no errno here)")) is None
    behind = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise behind
        except OSError:
            raise RuntimeError("errno = 27")
    except RuntimeError as exc:
        assert _hdf5_os_error(exc) is behind  # an OSError in the chain wins


def test_a_disk_store_bank_without_room_is_one_line_before_training(digits6_16px, tmp_path):
    """FedFomo's per-client bank in the disk store is a file mapped into memory: its blocks are
    reserved before training (a write into a mapped page the file system cannot back would kill
    the process with SIGBUS), so a disk without room for it is one line naming the file, the file
    is not left behind, and no round is recorded."""
    store = tmp_path / "store"
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.run",
                        *_args(digits6_16px, tmp_path / "run", "rounds=1", "method=fedfomo", "client_state=disk",
                               f"client_state_dir={store}")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(64 << 10),
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    m = re.fullmatch(r"error: cannot reserve [\d.]+ MiB for fedfomo's per-client bank in (\S*/global_bank\.f32) "
                     r"\(File too large\): the disk client store needs the room for it \(client_state_dir chooses the "
                     r"folder\)", lines[0])
    assert m, lines[0]
    assert Path(m.group(1)).parent.is_dir() and not Path(m.group(1)).exists()
    assert _lines(tmp_path / "run") == []


def _one_error_line(capsys, exc, code: int) -> str:
    err = capsys.readouterr().err
    assert exc.value.code == code and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


class _FillsUp:
    """A file whose ``n``-th write (1-based) writes half its data, then meets a full disk."""

    def __init__(self, f, n, calls):
        self.__dict__.update(f=f, n=n, calls=calls)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, data):
        self.calls["n"] += 1
        if self.calls["n"] == self.n:
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)


def test_full_disk_while_appending_metrics_keeps_whole_lines(digits6_16px, tmp_path, capsys, monkeypatch):
    """The third record meets a full disk half-way: one line naming metrics.jsonl, exit 1, the two
    records before it whole and nothing after them, the checkpoint after round 2 intact; the run,
    restarted, resumes from it and finishes."""
    import builtins
    from fedcp_dist.run import main

    real_open, calls = builtins.open, {"n": 0}

    def fills_up(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FillsUp(f, 3, calls) if str(file).endswith("metrics.jsonl") and "a" in mode else f

    args = _args(digits6_16px, tmp_path, "rounds=4", "checkpoint_every=2", "eval_every=2")
    monkeypatch.setattr(builtins, "open", fills_up)
    with pytest.raises(SystemExit) as exc:
        main(args)
    monkeypatch.undo()
    err = _one_error_line(capsys, exc, 1)
    assert err.startswith(f"error: cannot append to {tmp_path / 'metrics.jsonl'}: No space left on device"), err
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(l)["round"] for l in text.splitlines()] == [1, 2]
    ck = Checkpointer(str(tmp_path), 0, 1, 2)
    assert ck.latest().name == "round_0000002" and ck.verify(ck.latest()) is None
    said = []
    run(args[1], args[2:], echo=said.append)
    assert any("(2 rounds done)" in l for l in said)
    rows = [json.loads(l) for l in _lines(tmp_path)]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 4] and rows[-1]["kind"] == "final_eval"


def test_full_disk_at_the_complete_marker_leaves_no_half_checkpoint(digits6_16px, tmp_path, capsys, monkeypatch):
    """The rename of round 4's COMPLETE marker meets a full disk: one line naming the marker, exit 1,
    no round_0000004 folder or temporary file left, the checkpoint after round 2 the newest."""
    from fedcp_dist.run import main

    real_replace = os.replace

    def fills_up(src, dst, *a, **k):
        if str(dst).endswith("round_0000004/COMPLETE"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src), None, str(dst))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", fills_up)
    with pytest.raises(SystemExit) as exc:
        main(_args(digits6_16px, tmp_path, "rounds=6", "checkpoint_every=2", "eval_every=3"))
    monkeypatch.undo()
    err = _one_error_line(capsys, exc, 1)
    marker = tmp_path / "checkpoints" / "round_0000004" / "COMPLETE"
    assert f"after round 4 could not be written ({marker}: No space left on device)" in err, err
    ck = Checkpointer(str(tmp_path), 0, 1, 2)
    assert sorted(p.name for p in ck.root.iterdir()) == ["round_0000002"]
    assert not [p for p in ck.root.rglob("*") if "tmp" in p.name] and ck.verify(ck.latest()) is None


@pytest.mark.slow
def test_full_disk_on_rank_1_is_one_line_on_each_rank(digits6_16px, tmp_path):
    """Two ranks rendezvous by themselves; rank 1's client store meets a full disk in round 2. Rank 1
    says so in one line naming its file (no traceback), rank 0 stops naming rank 1, no temporary file
    is left and the checkpoint after round 1 is the newest."""
    envs = rank_envs()
    procs = []
    for rank in (0, 1):
        env = envs[rank]
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "helpers.py"), "full-disk:1:4",
             *_args(digits6_16px, tmp_path, "rounds=3", "client_state=disk", "checkpoint_every=1", "collective_timeout=60",
                    "fused_group=3")],  # two fused groups: one on each rank
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1, 1], errs
    said = [[l for l in err.splitlines() if l.startswith("error:")] for err in errs]
    assert all(len(lines) == 1 for lines in said) and not any("Traceback" in err for err in errs), errs
    folder = tmp_path / "client_state" / "rank_1"
    assert re.fullmatch(rf"error: cannot write the client state file {re.escape(str(folder))}/client_\d{{7}}\.pt: "
                        r"No space left on device", said[1][0]), said[1]
    assert "rank(s) 1 stopped answering" in said[0][0] or "peer rank died" in said[0][0], said[0]
    assert not [p for p in (tmp_path / "client_state").rglob("*") if "tmp" in p.name]
    ck = Checkpointer(str(tmp_path), 0, 2, 2)
    assert ck.latest().name == "round_0000001" and ck.verify(ck.latest()) is None


@pytest.mark.slow
def test_damaged_newest_checkpoint_is_reported_and_the_previous_used(digits6_16px, tmp_path):
    args = _args(digits6_16px, tmp_path, "rounds=5", "checkpoint_every=1")
    with pytest.raises(RunFailure, match="round 4: client 0 produced a non-finite"):
        run(args[1], args[2:], wrap=nonfinite_at("4:0"))
    newest = tmp_path / "checkpoints" / "round_0000003" / "clients_0.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # truncated, as by a crash of the file system
    said = []
    run(args[1], args[2:], echo=said.append)
    assert any("round_0000003 is damaged (clients_0.pt does not match its checksum)" in line for line in said)
    assert any("resuming from" in line and "round_0000002" in line for line in said)


# -- a shared out_dir ------------------------------------------------------------------------------

def test_second_run_on_the_same_out_dir_is_refused(digits6_16px, tmp_path):
    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path, "rounds=500")])
    try:
        _wait_rounds(tmp_path, proc, 1)
        r = run_cmd([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, tmp_path, "rounds=500")])
        assert r.returncode == 2
        assert "is in use by another run" in r.stderr and "Traceback" not in r.stderr
        assert proc.poll() is None  # the first run is untouched
    finally:
        _kill_job(proc)


# -- bad shards ------------------------------------------------------------------------------------

def _refused(capsys, args, *words):
    """``fedcp-run args`` (its main, in this process) ends in one line naming ``words``, exit 2."""
    from fedcp_dist.run import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    err = _one_error_line(capsys, exc, 2)
    for w in words:
        assert w in err, err


def test_bad_shards_are_refused_before_training(digits6, tmp_path, capsys):
    trunc = tmp_path / "trunc.h5"
    data = Path(digits6).read_bytes()
    trunc.write_bytes(data[: len(data) // 3])
    _refused(capsys, _args(trunc, tmp_path / "a", "rounds=1"), "trunc.h5")
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not an hdf5 file" * 100)
    _refused(capsys, _args(garbage, tmp_path / "b", "rounds=1"), "garbage.h5")
    other = tmp_path / "v2.h5"
    shutil.copy(digits6, other)
    with h5py.File(other, "a") as f:
        f.attrs["format_version"] = 99
    _refused(capsys, _args(other, tmp_path / "c", "rounds=1"), "format", "99")
    _refused(capsys, _args(digits6, tmp_path / "d", "rounds=1", "data.source=mnist"), "'data.source'", "digits")
    _refused(capsys, _args(digits6, tmp_path / "e", "rounds=1", "data.input_shape=[3, 32, 32]"), "'data.input_shape'", "[1, 28, 28]")
    _refused(capsys, _args(digits6, tmp_path / "f", "rounds=1", "data.num_clients=20"), "'data.num_clients'")
    for sub in "abcdef":
        assert not (tmp_path / sub / "metrics.jsonl").exists()


# -- whole-file writes -----------------------------------------------------------------------------

def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """Every whole-file write of the project (run files, checkpoints, shards, spilled client states)
    goes through fileio: on an error the file keeps its old contents and nothing else is left."""
    import torch

    from fedcp_dist.fileio import atomic_path, atomic_torch_save, atomic_write_bytes

    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")
    for durable in (True, False):
        with pytest.raises(OSError, match="disk full"):
            with atomic_path(path, durable) as tmp:
                tmp.write_bytes(b"half")
                raise OSError(errno.ENOSPC, "disk full")
        assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    atomic_torch_save({"a": torch.arange(3.0)}, path, durable=False)
    assert torch.load(path, weights_only=True)["a"].tolist() == [0.0, 1.0, 2.0]
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


@pytest.mark.slow
def test_a_run_whose_out_dir_is_removed_while_it_runs_stops_without_making_it_again(digits6_16px, tmp_path):
    """``rm -rf out_dir`` while a run goes (a user clearing it to run afresh): the run made the
    folder again with its next writes, without config.yaml or the records, exited 0 with a
    "finished" folder, and its lock was gone, so a second run could share the folder. Now it stops
    at its next write in one line, writing nothing there."""
    out = tmp_path / "run"
    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, out, "rounds=200", "checkpoint_every=2")])
    try:
        _wait_rounds(out, proc, 2)
        for _ in range(100):  # as rm -rf does it, while the run writes there (a file made meanwhile: again)
            shutil.rmtree(out, ignore_errors=True)
            if not out.exists():
                break
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert proc.returncode == 1, text[-3000:]
    assert re.search(rf"^error: .*out_dir {re.escape(str(out))} was removed", text, re.M), text[-3000:]
    assert "Traceback" not in text and not out.exists()


@pytest.mark.slow
def test_a_checkpoint_folder_removed_while_it_is_written_is_named_as_removed(digits6_16px, tmp_path):
    """An ``rm -rf out_dir`` that reaches the checkpoint being written before it reaches out_dir
    itself: the failed write found out_dir still there and said only "no earlier checkpoint was
    complete". The round's folder going while it was written is named as a removal (here the
    folder alone goes, held at the checkpoint's fault point, so the order is fixed)."""
    held = tmp_path / "held"
    out = tmp_path / "run"
    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits6_16px, out, "rounds=4", "checkpoint_every=2")],
                  FEDCP_FAULT_AT=f"checkpoint@2:wait={held}")
    try:
        wait_for(held, proc)
        shutil.rmtree(out / "checkpoints" / "round_0000002")
        held.unlink()
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert proc.returncode == 1, text[-3000:]
    line = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1 and f"out_dir {out} was removed while the run was going, or a part of it" in line[0], text
    assert "round_0000002 went while it was written" in line[0] and "Traceback" not in text
    assert (out / "config.yaml").is_file() and not (out / "checkpoints" / "round_0000002").exists()


def test_a_temporary_file_removed_before_its_folder_is_taken_for_a_removal(tmp_path):
    """``rm -rf`` removes a folder's files before the folder: a write whose temporary file went
    (the folder still there for a moment) said "no earlier checkpoint was complete" (a CI run's
    failure). A file not found inside the round's folder, made by this save, is a removal; outside
    it, or in a folder this save did not make, it is not."""
    d = tmp_path / "checkpoints" / "round_0000002"
    d.mkdir(parents=True)
    gone = OSError(errno.ENOENT, "No such file or directory", str(d / ".COMPLETE.tmp-host-1"))
    assert Checkpointer._vanished(gone, d, made=True)  # the folder is still there
    assert not Checkpointer._vanished(gone, d, made=False)
    assert not Checkpointer._vanished(OSError(errno.ENOENT, "x", str(tmp_path / "other")), d, made=True)
    assert not Checkpointer._vanished(OSError(errno.ENOSPC, "x", str(d / "global.pt")), d, made=True)


def test_a_name_near_the_file_systems_limit_is_written_atomically(tmp_path):
    """A 250-byte file name is legal, but its temporary name (``.NAME.tmp-HOST-PID``) was not: every
    such write failed with "File name too long". The temporary name is cut, with a digest, and a
    killed writer's is still found and removed by the next."""
    from fedcp_dist import fileio

    for name in ("s" * 250 + ".h5", "é" * 120 + ".h5"):
        path = tmp_path / name
        assert len(name.encode()) <= 255
        fileio.atomic_write_bytes(path, b"data")
        assert path.read_bytes() == b"data" and [p.name for p in tmp_path.iterdir()] == [name]
        prefix = fileio._tmp_prefix(path)
        assert len(prefix.encode()) + 10 <= 255 and prefix != fileio._tmp_prefix(path.with_name("s" + name))
        dead = tmp_path / f"{prefix}999999"  # a pid no process has (pid_max is at most 4194304)
        dead.write_bytes(b"left by a killed writer")
        with fileio.atomic_path(path, orphans=True) as tmp:
            tmp.write_bytes(b"again")
        assert not dead.exists() and path.read_bytes() == b"again"
        path.unlink()


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a 256 KiB tmpfs, a disk that fills (mounting needs root: skipped where it fails)."""
    with tmpfs(tmp_path / "small", "256k") as folder:
        yield folder


def _fill(folder: Path, leave: int = 0) -> None:
    """Fill ``folder``'s file system up to ``leave`` bytes."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    if leave:
        size = (folder / "filler").stat().st_size
        os.truncate(folder / "filler", max(0, size - leave))


def test_a_disk_that_fills_under_a_whole_file_write_or_a_shard_is_one_line_naming_the_file(small_disk, digits6_16px,
                                                                                             tmp_path, capsys):
    """A full disk fails the buffered flush at close (an OSError with no file name: a traceback
    from fedcp-report, fedcp-sweep's sweep.json, fedcp-analyze) and HDF5's writes of a shard (two
    tracebacks, then a segfault at exit, 139). Now one line naming the file, exit 1, nothing left."""
    from fedcp_dist.fileio import atomic_write_bytes

    with pytest.raises(OSError) as exc:
        atomic_write_bytes(small_disk / "big.bin", b"x" * (1 << 20))
    assert exc.value.filename == str(small_disk / "big.bin") and exc.value.errno == errno.ENOSPC
    assert list(small_disk.iterdir()) == []
    r = run_cmd([sys.executable, "-m", "fedcp_dist.cli.partition", "--source", "digits", "--num-clients", "6",
                 "--out", str(small_disk / "d.h5")])
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == f"error: {small_disk / 'd.h5'}: No space left on device", \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr and list(small_disk.iterdir()) == []
    from test_sweep_report import fake_run

    fake_run(tmp_path / "runs" / "a", "fedcp", 1, 1.0, 0.9)
    _fill(small_disk, leave=2048)
    with pytest.raises(SystemExit) as stop:
        report.main([str(tmp_path / "runs"), "--out", str(small_disk), "--no-plots"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "No space left on device" in err and str(small_disk / "report") in err, err
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_disk_that_fills_under_tensorboards_events_is_one_line_naming_the_folder(small_disk, capfd):
    """TensorBoard writes from a thread of its own: a full disk printed that thread's traceback, then
    "error: rank 0, round 9: No space left on device" without a file name."""
    from fedcp_dist.errors import RunFailure
    from fedcp_dist.rundir.directory import RunWriter

    out = small_disk / "run"
    writer = RunWriter(out, True, logger="tensorboard")
    writer.start_metrics([])
    (out / "filler").write_bytes(b"\0" * (60 << 10))  # metrics.jsonl keeps its room; the events fill the rest
    _fill(small_disk, leave=32 << 10)
    (out / "filler").unlink()
    with pytest.raises(RunFailure) as exc:
        for t in range(1, 100000):
            writer.log({"kind": "round", "round": t, "seconds": 1.0, **{f"x{i}": float(i) for i in range(40)}})
    assert str(exc.value) == (f"cannot write TensorBoard events to {out / 'tensorboard'}: No space left on device; "
                              f"what the run wrote before is kept (a restart resumes from its last complete checkpoint)")
    writer.close()  # the writer that failed is not closed again (it would raise the same error)
    assert "Traceback" not in capfd.readouterr().err
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == list(range(1, len(lines) + 1))


def test_an_input_error_while_a_shard_is_written_is_said_as_itself(tmp_path):
    """An input file that fails while the shard is written (removed between the check and the write
    pass, a flaky source file system) is that file's error, not the shard's."""
    import numpy as np

    from fedcp_dist.data.shards import write_shard
    from fedcp_dist.errors import UserError

    def clients():
        rng = np.random.default_rng(0)
        yield (rng.integers(0, 256, (4, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, 4),
               rng.integers(0, 256, (2, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, 2))
        try:
            open(tmp_path / "gone.npz", "rb")
        except OSError:
            raise UserError(f"{tmp_path / 'gone.npz'} could not be read as npz") from None

    with pytest.raises(UserError, match="gone.npz could not be read"):
        write_shard(tmp_path / "s.h5", clients(), source="x", num_classes=3, input_shape=(1, 8, 8), mean=[0.5],
                    std=[0.25], partition="iid", partition_params={}, seed=0)
    assert list(tmp_path.iterdir()) == []


# -- output folders that cannot be written -------------------------------------------------------------

def _immutable(folder):
    """``chattr +i``: a folder even root cannot write in (None where the file system cannot mark it)."""
    r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    return folder if r.returncode == 0 else None


def test_tools_given_a_folder_they_cannot_write_in_say_so_before_working(digits6, tmp_path, capsys):
    """fedcp-report, fedcp-analyze and fedcp-dlg ended in PermissionError's traceback (fedcp-dlg
    after its whole attack, the results lost); fedcp-sweep likewise in a read-only root."""
    from fedcp_dist.cli import analyze, report
    from fedcp_dist.cli import sweep as sweep_cli
    from fedcp_dist.rundir.directory import CONFIG

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from fedcp_dist.config import Config, dump_config

    (run_dir / CONFIG).write_text(dump_config(Config(method="fedcp", rounds=1, out_dir=str(run_dir))))
    (run_dir / "summary.json").write_text(json.dumps({"method": "fedcp", "best_acc": 0.5, "rounds": 1}))
    if _immutable(run_dir) is None:
        pytest.skip("chattr +i is not available here")
    root = tmp_path / "sweeps"
    root.mkdir()
    _immutable(root)
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(f"name: s\nroot: {root}\nbase: configs/digits_fedcp.yaml\n"
                          f"overrides: {{data: {{path: {digits6}}}}}\ngrid: {{seed: [1]}}\n")
    try:
        cases = [(report.main, [str(run_dir), "--no-plots"], f"fedcp-report: cannot write in {run_dir}: "),
                 (analyze.main, [str(run_dir), "--out", str(run_dir)], f"cannot write in the analysis folder {run_dir}: "),
                 (analyze.main_dlg, [str(run_dir), "--out", str(run_dir)], f"cannot write in the analysis folder {run_dir}: "),
                 (sweep_cli.main, [str(sweep_file)], f"sweep s: cannot create its folder {root / 's'}: ")]
        for main, argv, start in cases:
            with pytest.raises(SystemExit) as exc:
                main(argv)
            err = capsys.readouterr().err
            assert exc.value.code == 2 and err.startswith(f"error: {start}") and err.count("\n") == 1, err
    finally:
        subprocess.run(["chattr", "-i", str(run_dir), str(root)])


def test_an_os_error_no_check_foresaw_is_one_line_naming_the_file(tmp_path, capsys):
    from fedcp_dist.errors import cli_main

    @cli_main
    def writes():
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".report.md.tmp-host-12"))

    with pytest.raises(SystemExit) as exc:
        writes()
    assert exc.value.code == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'report.md'}: Permission denied\n"
