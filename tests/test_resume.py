"""Checkpoints, exact resume after SIGKILL and after a preemption signal."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_cmd
from helpers import kill_job as _kill_job
from helpers import start as _start
from helpers import wait_for as _wait_for
from fedcp_dist.checkpoint import Checkpointer

ROUNDS = 10


def _args(shard, out, *extra):
    # fused=false: these runs check the sequential path across world sizes (the default fused path
    # is checked on 1, 2 and 3 ranks in tests/test_multiprocess.py)
    return ["--config", "configs/digits_fedcp.yaml", f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=2",
            f"data.path={shard}", f"out_dir={out}", "threads=1", "fused=false", *extra]


def _torchrun(nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "fedcp_dist.run"]


def _strip(out: Path):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def _same_run(a: Path, b: Path, exact_metrics=True):
    sa = torch.load(a / "final_global.pt", weights_only=True)
    sb = torch.load(b / "final_global.pt", weights_only=True)
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs by {(sa[k] - sb[k]).abs().max()}"
    if exact_metrics:
        assert _strip(a) == _strip(b)
    else:  # metric sums added in another order by another world size: equal up to the last bits
        ra, rb = _strip(a), _strip(b)
        assert len(ra) == len(rb)
        for x, y in zip(ra, rb):
            assert x.keys() == y.keys()
            assert x == {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for k, v in y.items()}
    ja, jb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert (ja["best_acc"], ja["final_acc"]) == pytest.approx((jb["best_acc"], jb["final_acc"]), rel=1e-12)


@pytest.fixture(scope="module")
def reference(digits20, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    r = run_cmd([*_torchrun(), *_args(digits20, out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_sigkill_mid_round_then_exact_resume(reference, digits20, tmp_path):
    proc = _start([*_torchrun(), *_args(digits20, tmp_path)])
    _wait_for(tmp_path / "checkpoints" / "round_0000004" / "COMPLETE", proc)
    time.sleep(0.3)  # inside round 5
    _kill_job(proc)
    assert not (tmp_path / "summary.json").exists()
    done = [l for l in _strip(tmp_path) if l["kind"] == "round"]
    assert 4 <= len(done) < ROUNDS
    r = run_cmd([*_torchrun(), *_args(digits20, tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    _same_run(reference, tmp_path)


@pytest.mark.slow
def test_preemption_signal_checkpoints_and_exits_75(reference, digits20, tmp_path):
    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits20, tmp_path, "checkpoint_every=0")])
    _wait_for(tmp_path / "metrics.jsonl", proc)
    while len((tmp_path / "metrics.jsonl").read_text().splitlines()) < 3:
        assert proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:]
    assert "checkpointed after" in out
    ckpts = Checkpointer(str(tmp_path), 0, 1, 2)
    latest = ckpts.latest()
    assert latest is not None and 3 <= int(latest.name[6:]) < ROUNDS
    assert not (tmp_path / "summary.json").exists()
    # resumed on another world size (1 → 2 ranks): client states are keyed by client id
    r = run_cmd([*_torchrun(), *_args(digits20, tmp_path, "checkpoint_every=0")])
    assert r.returncode == 0, r.stderr[-3000:]
    _same_run(reference, tmp_path, exact_metrics=False)


@pytest.mark.slow
def test_signal_to_one_rank_stops_every_rank(digits6, tmp_path):
    """Under torchrun: every worker checkpoints and exits 75 (torchrun reports its own status), and
    rank 0 leaves the status file job scripts read to requeue."""
    status = tmp_path / "status"
    proc = _start([*_torchrun(), *_args(digits6, tmp_path, "rounds=200", "eval_every=50", "checkpoint_every=0")],
                  FEDCP_STATUS_FILE=str(status))
    _wait_for(tmp_path / "metrics.jsonl", proc)
    children = []
    t0 = time.time()
    while len(children) < 2 and time.time() - t0 < 60:
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        children = [int(k) for k in kids]
        time.sleep(0.1)
    assert len(children) == 2
    time.sleep(1.0)
    os.kill(children[1], signal.SIGUSR2)  # only one worker hears it
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "checkpointed after" in out, out[-3000:]
    assert out.count("preempted: checkpointed after") == 2, out[-3000:]  # both workers, exit 75 (cli_main)
    assert status.read_text() == "preempted\n"
    assert Checkpointer(str(tmp_path), 0, 2, 2).latest() is not None
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_resume_refuses_a_changed_config(digits6, tmp_path):
    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits6, tmp_path, "rounds=100", "checkpoint_every=1")])
    _wait_for(tmp_path / "checkpoints" / "round_0000001" / "COMPLETE", proc)
    _kill_job(proc)
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", *_args(digits6, tmp_path, "rounds=100", "lr=0.5")])
    assert r.returncode == 2 and "'lr'" in r.stderr and "Traceback" not in r.stderr
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", *_args(digits6, tmp_path, "rounds=100", "resume=never")])
    assert r.returncode == 2 and "resume=never" in r.stderr


def _fake_ckpt(tmp_path, rounds, keep=2):
    ck = Checkpointer(str(tmp_path), 0, 1, keep)
    for r in rounds:
        ck.save(r, {"w": torch.full((3,), float(r))}, {0: {"h": torch.ones(2) * r}}, {"records": [], "round_seconds": [], "config": {}}, lambda ok: ok)
    return ck


def test_keeps_the_last_k_and_skips_damaged(tmp_path):
    ck = _fake_ckpt(tmp_path, [2, 4, 6])
    assert sorted(d.name for d in ck.root.iterdir()) == ["round_0000004", "round_0000006"]
    assert ck.latest().name == "round_0000006"
    # a corrupted newest checkpoint is reported and the previous one used
    part = ck.root / "round_0000006" / "global.pt"
    part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
    seen = []
    assert ck.latest(warn=seen.append).name == "round_0000004"
    assert "checksum" in seen[0]
    rounds, g, clients, _ = ck.load(ck.latest(), [0], "cpu")
    assert rounds == 4 and g["w"].tolist() == [4.0] * 3 and clients[0]["h"].tolist() == [4.0, 4.0]
    # a directory without its COMPLETE marker does not count
    (ck.root / "round_0000008").mkdir()
    assert ck.latest(warn=seen.append).name == "round_0000004"
