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
from fedcp_dist.config import merged_overrides
from fedcp_dist.rundir.checkpoint import Checkpointer

ROUNDS = 6  # a SIGKILL in round 5, a preemption after round 3


def _args(shard, out, *extra):
    # fused=false: these runs check the sequential path across world sizes (the default fused path
    # is checked on 1, 2 and 3 ranks in tests/test_multiprocess.py)
    return ["--config", "configs/digits_fedcp.yaml",
            *merged_overrides([f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=2", f"data.path={shard}",
                               f"out_dir={out}", "threads=1", "fused=false"], extra)]


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
def reference(digits20_16px, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    r = run_cmd([*_torchrun(), *_args(digits20_16px, out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_sigkill_mid_round_then_exact_resume(reference, digits20_16px, tmp_path):
    proc = _start([*_torchrun(), *_args(digits20_16px, tmp_path)])
    _wait_for(tmp_path / "checkpoints" / "round_0000004" / "COMPLETE", proc)
    time.sleep(0.3)  # inside round 5
    _kill_job(proc)
    assert not (tmp_path / "summary.json").exists()
    done = [l for l in _strip(tmp_path) if l["kind"] == "round"]
    assert 4 <= len(done) < ROUNDS
    r = run_cmd([*_torchrun(), *_args(digits20_16px, tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    _same_run(reference, tmp_path)


@pytest.mark.slow
def test_preemption_signal_checkpoints_and_exits_75(reference, digits20_16px, tmp_path):
    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits20_16px, tmp_path, "checkpoint_every=0")])
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
    r = run_cmd([*_torchrun(), *_args(digits20_16px, tmp_path, "checkpoint_every=0")])
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
def test_resume_refuses_a_changed_config(digits6, tmp_path, capsys):
    from fedcp_dist.run import main

    proc = _start([sys.executable, "-m", "fedcp_dist.run", *_args(digits6, tmp_path, "rounds=100", "checkpoint_every=1")])
    _wait_for(tmp_path / "checkpoints" / "round_0000001" / "COMPLETE", proc)
    _kill_job(proc)
    for extra, said in (("lr=0.5", "'lr'"), ("resume=never", "resume=never")):  # fedcp-run's main, here
        with pytest.raises(SystemExit) as exc:
            main(_args(digits6, tmp_path, "rounds=100", extra))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and said in err and err.count("\n") == 1 and "Traceback" not in err, err


def _fake_ckpt(tmp_path, rounds, keep=2):
    ck = Checkpointer(str(tmp_path), 0, 1, keep)
    for r in rounds:
        ck.save(r, {"w": torch.full((3,), float(r))}, {0: {"h": torch.ones(2) * r}}, {"records": [], "round_seconds": [], "config": {}}, lambda ok: ok)
    return ck


def _damage(ck, rounds):
    part = ck.root / f"round_{rounds:07d}" / "global.pt"
    part.write_bytes(part.read_bytes()[:-10] + b"0123456789")


def test_a_damaged_checkpoint_never_takes_the_slot_of_an_intact_one(tmp_path):
    """keep_checkpoints=1: the run stopped after round 4, whose checkpoint is damaged, and resumed
    from round 2. Its checkpoint after round 3 is the newest intact one and must survive pruning
    (counting the damaged round 4 instead would leave nothing to resume from)."""
    ck = _fake_ckpt(tmp_path, [2, 4])
    _damage(ck, 4)
    assert ck.latest(warn=lambda *_: None).name == "round_0000002"
    ck = _fake_ckpt(tmp_path, [3], keep=1)
    assert sorted(d.name for d in ck.root.iterdir()) == ["round_0000003"]
    assert ck.latest().name == "round_0000003" and ck.load(ck.latest(), [0], "cpu")[0] == 3
    # keep 2: a damaged older checkpoint is removed and the intact one before it kept instead
    ck = _fake_ckpt(tmp_path, [5], keep=2)
    _damage(ck, 5)
    ck = _fake_ckpt(tmp_path, [6], keep=2)
    assert sorted(d.name for d in ck.root.iterdir()) == ["round_0000003", "round_0000006"]


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
    # a plain file in the place of a round's folder (a stray copy) neither counts nor stops that round's save
    (ck.root / "round_0000010").write_text("not a checkpoint")
    assert ck.latest(warn=seen.append).name == "round_0000004"
    ck.save(10, {"w": torch.zeros(3)}, {0: {"h": torch.zeros(2)}}, {"records": [], "round_seconds": [], "config": {}},
            lambda ok: ok)
    assert ck.latest().name == "round_0000010" and ck.load(ck.latest(), [0], "cpu")[0] == 10


# A run whose start-up (config read, shard load, checkpoint verification) is interrupted by a signal:
# PATCH names the function that sends it, to this process, when called.
_SIGNAL_DURING = """
import os, signal, sys
import fedcp_dist.rundir.checkpoint, fedcp_dist.config, fedcp_dist.engine.startup
module, name, sig = sys.argv[1].split(":")
module = {"config": fedcp_dist.config, "startup": fedcp_dist.engine.startup, "checkpoint": fedcp_dist.rundir.checkpoint}[module]
owner = module.Checkpointer if name == "verify" else module
real = getattr(owner, name)
def signalled(*args, **kwargs):
    os.kill(os.getpid(), getattr(signal, sig))
    return real(*args, **kwargs)
setattr(owner, name, signalled)
from fedcp_dist.run import main
main(sys.argv[2:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("during, sig", [("config:load_config", "SIGTERM"), ("startup:load", "SIGUSR2"),
                                         ("checkpoint:verify", "SIGTERM")])
def test_a_signal_during_start_up_exits_for_requeue(during, sig, digits6, tmp_path):
    """SLURM requeues on status 75 only: a preemption signal while the run starts (reading its config,
    loading the shard, verifying the checkpoint it resumes from) stops it before its first round with
    that status and the status file, the last checkpoint left as it was."""
    args = _args(digits6, tmp_path, "rounds=3", "checkpoint_every=1", "eval_every=3")
    if during.startswith("checkpoint"):  # a run to resume: two rounds checkpointed
        r = run_cmd([sys.executable, "-m", "fedcp_dist.run", *_args(digits6, tmp_path, "rounds=2", "checkpoint_every=1",
                                                                     "eval_every=3")])
        assert r.returncode == 0, r.stderr[-2000:]
        (tmp_path / "summary.json").unlink()  # stopped before its end, as far as the next start knows
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) if during.startswith("checkpoint") else []
    status = tmp_path / "status"
    r = run_cmd([sys.executable, "-c", _SIGNAL_DURING, f"{during}:{sig}", *args],
                env_extra={"FEDCP_STATUS_FILE": str(status)})
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert f"got {sig}" in r.stdout and "preempted: stopped" in r.stderr and "Traceback" not in r.stderr
    # nothing trained in this attempt: a job script requeues it once, not attempt after attempt
    assert status.read_text() == "stopped-at-start\n"
    assert not (tmp_path / "summary.json").exists()
    if before:
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
        assert Checkpointer(str(tmp_path), 0, 1, 2).latest().name == "round_0000002"


# -- resuming onto other data ------------------------------------------------------------------------

def _digits(path, seed, clients=4):
    from conftest import partition

    return partition(path, "--source", "digits", "--partition", "iid", "--num-clients", str(clients),
                     "--seed", str(seed))


def _drop_fingerprint(path):
    """The shard as versions before fingerprints wrote it."""
    import h5py

    with h5py.File(path, "a") as f:
        del f.attrs["fingerprint"]
        del f.attrs["array_digests"]


def _two_rounds_then(shard, out, *extra):
    from helpers import run

    args = [f"data.path={shard}", f"out_dir={out}", "rounds=2", "checkpoint_every=1", "eval_every=2", "threads=1"]
    run("configs/digits_fedcp.yaml", args)
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    said = []
    run("configs/digits_fedcp.yaml", args[:2] + ["rounds=3", *args[3:], *extra], echo=said.append)
    return said


def test_shards_carry_a_content_fingerprint(tmp_path):
    from fedcp_dist.data.shards import describe_lines, layout_digest, read_info

    a = read_info(_digits(tmp_path / "a.h5", seed=1))
    assert a.fingerprint.startswith("sha256:") and len(a.fingerprint) == 7 + 64
    assert read_info(_digits(tmp_path / "again.h5", seed=1)).fingerprint == a.fingerprint  # same content, same print
    b = read_info(_digits(tmp_path / "b.h5", seed=2))  # same source, clients and counts' sizes: other samples
    assert b.fingerprint != a.fingerprint
    _drop_fingerprint(tmp_path / "b.h5")
    old = read_info(tmp_path / "b.h5")
    assert old.fingerprint == "" and layout_digest(old) == layout_digest(b)
    assert any(line.startswith("fingerprint:") and "none" in line for line in describe_lines(old))


def test_resume_onto_a_shard_of_another_client_count_says_the_counts():
    """A shard swapped for one of other clients is named by its client counts, not by its arrays."""
    from fedcp_dist.errors import UserError
    from fedcp_dist.rundir.checkpoint import check_same_data, data_record

    was = data_record("d.h5", "sha256:a", "L4", num_clients=4)
    was.update(arrays={"train_x": "1", "train_y": "2"})
    now = data_record("/x/d.h5", "sha256:b", "L6", num_clients=6)
    now.update(arrays={"train_x": "3", "train_y": "4"})
    with pytest.raises(UserError, match=r"^data.path /x/d.h5 holds other data than the checkpointed run in out was made "
                                        r"on: it holds 6 clients, the checkpointed run's shard 4 \(partitioned again"):
        check_same_data(was, now, "out", print)
    del was["clients"]  # a checkpoint written before runs recorded their client count: the arrays say it
    with pytest.raises(UserError, match=r"its .*differ from the checkpoint's"):
        check_same_data(was, now, "out", print)


@pytest.mark.slow
def test_resume_onto_a_shard_partitioned_again_is_refused(tmp_path):
    """The same data.path, partitioned again with another seed after the checkpoints were written:
    the run must not go on training its checkpointed clients on other clients' samples."""
    from fedcp_dist.errors import UserError
    from helpers import run

    shard, out = _digits(tmp_path / "d.h5", seed=1), tmp_path / "run"
    with pytest.raises(UserError, match=r"d.h5 holds other data than the checkpointed run .*: its .*train_x \(training "
                                        r"samples\).* differ from the checkpoint's"):
        run("configs/digits_fedcp.yaml", [f"data.path={shard}", f"out_dir={out}", "rounds=2", "checkpoint_every=1",
                                          "eval_every=2", "threads=1"])
        (out / "summary.json").unlink()
        _digits(shard, seed=2)
        run("configs/digits_fedcp.yaml", [f"data.path={shard}", f"out_dir={out}", "rounds=3", "checkpoint_every=1",
                                          "eval_every=2", "threads=1"])
    assert Checkpointer(str(out), 0, 1, 2).latest().name == "round_0000002"  # left as it was


@pytest.mark.slow
def test_resume_onto_the_same_shard_goes_on_and_a_shard_without_a_fingerprint_is_checked_by_its_content(tmp_path):
    from helpers import run

    shard, out = _digits(tmp_path / "d.h5", seed=1), tmp_path / "run"
    said = _two_rounds_then(shard, out)
    assert any("resuming from" in line for line in said) and not any("fingerprint" in line for line in said)
    # a shard written before fingerprints: its content is hashed all the same, and resumes without a note
    _drop_fingerprint(shard)
    (out / "summary.json").unlink()
    said = []
    run("configs/digits_fedcp.yaml", [f"data.path={shard}", f"out_dir={out}", "rounds=4", "checkpoint_every=1",
                                      "eval_every=2", "threads=1"], echo=said.append)
    assert not any("note:" in line for line in said), said
    assert any("resuming from" in line and "round_0000003" in line for line in said)


@pytest.mark.slow
def test_resume_with_fewer_rounds_than_done_is_refused(tmp_path):
    from fedcp_dist.errors import UserError
    from helpers import run

    shard, out = _digits(tmp_path / "d.h5", seed=1), tmp_path / "run"
    args = [f"data.path={shard}", f"out_dir={out}", "checkpoint_every=1", "eval_every=1", "threads=1"]
    run("configs/digits_fedcp.yaml", [*args, "rounds=2"])
    (out / "summary.json").unlink()
    with pytest.raises(UserError, match="config key 'rounds' is 1 but the checkpointed run .* has done 2 rounds"):
        run("configs/digits_fedcp.yaml", [*args, "rounds=1"])
    assert not (out / "summary.json").exists()


def test_resume_refuses_tensors_of_another_shape(tmp_path):
    """A backstop behind the config and data checks: a checkpointed tensor of another shape is one
    line naming it, not a traceback from deep inside the model."""
    from types import SimpleNamespace

    from fedcp_dist.config import Config
    from fedcp_dist.errors import UserError

    cfg = Config(out_dir=str(tmp_path), rounds=5)
    ck = Checkpointer(str(tmp_path), 0, 1, 1)
    ck.save(1, {"w": torch.zeros(2, 3)}, {0: {"h": torch.zeros(4)}}, {"records": [], "round_seconds": [],
                                                                        "config": cfg.to_dict()}, lambda ok: ok)
    algo = SimpleNamespace(init_client_state=lambda c: {"h": torch.zeros(4)})
    store = SimpleNamespace(global_state={"w": torch.zeros(2, 4)}, algo=algo)
    with pytest.raises(UserError, match=r"global tensor 'w' has shape \[2, 3\] but this run's is \[2, 4\]"):
        ck.resume(store, cfg, [0], "cpu", echo=lambda *_: None)
    store.global_state = {"w": torch.zeros(2, 3)}
    algo.init_client_state = lambda c: {"h": torch.zeros(5)}
    with pytest.raises(UserError, match=r"client 0's tensor 'h' has shape \[4\] but this run's is \[5\]"):
        ck.resume(store, cfg, [0], "cpu", echo=lambda *_: None)


@pytest.mark.slow
def test_a_resume_under_another_thread_count_says_when_it_changes_the_rounding(tmp_path):
    """The sequential path's kernels round by their thread count: resumed with threads=2 after
    rounds on one thread, the run says it goes on equal up to rounding. The fused default trains
    each group on one thread however many the rank has: the same resume is bit for bit, and silent."""
    from helpers import run

    shard, out = _digits(tmp_path / "d.h5", seed=1), tmp_path / "seq"
    args = [f"data.path={shard}", f"out_dir={out}", "rounds=2", "checkpoint_every=1", "eval_every=2", "fused=false"]
    run("configs/digits_fedcp.yaml", [*args, "threads=1"])
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    said = []
    run("configs/digits_fedcp.yaml", [*args, "rounds=3", "threads=2"], echo=said.append)
    notes = [line for line in said if line.startswith("note: the rounds done")]
    cpu = torch.backends.cpu.get_cpu_capability()
    assert notes == [f"note: the rounds done were computed on cpu ({cpu}), sequential, 1 thread a computation, "
                     f"the rest on cpu ({cpu}), sequential, 2 threads a computation: the run goes on equal to an "
                     f"uninterrupted one up to floating-point rounding, not bit for bit"], said
    said = _two_rounds_then(shard, tmp_path / "fused", "threads=2")
    assert any("resuming from" in line for line in said) and not any(line.startswith("note:") for line in said), said
    meta = json.loads(torch.load(tmp_path / "fused" / "checkpoints" / "round_0000003" / "global.pt",
                                 weights_only=True)["meta_json"])
    assert meta["arithmetic"] == f"cpu ({cpu}), fused groups of 4, 1 thread a computation"


def test_a_checkpoint_of_other_code_resumes_with_a_note(tmp_path, monkeypatch):
    """A checkpoint written by older code was resumed silently: the run then mixed two versions'
    rounds (and summed byte counts the older code did not record). Its digest is recorded now."""
    from fedcp_dist.rundir.code import code_digest, code_note
    from fedcp_dist.engine import simulator

    from helpers import run

    shard, out = _digits(tmp_path / "d.h5", seed=1), tmp_path / "run"
    args = [f"data.path={shard}", f"out_dir={out}", "rounds=2", "checkpoint_every=1", "eval_every=2", "threads=1"]
    with monkeypatch.context() as m:  # the first two rounds by "other code"
        m.setattr(simulator, "code_digest", lambda: "feedfacefeedface")
        run("configs/digits_fedcp.yaml", args)
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    said = []
    run("configs/digits_fedcp.yaml", [*args, "rounds=3"], echo=said.append)
    notes = [line for line in said if line.startswith("note: the checkpoint was written")]
    assert notes == [code_note("feedfacefeedface")], said
    assert notes[0] == (f"note: the checkpoint was written by other fedcp_dist code (source digest feedfacefeedface), "
                        f"this is {code_digest()}: its rounds were trained by that code and the rest will be by this "
                        f"one, so the run is not bit for bit what either would make alone")
    assert code_note(None).startswith("note: the checkpoint was written by fedcp_dist code that recorded no digest")
    assert code_note(code_digest()) == ""


def test_the_code_digest_covers_every_source_file_of_the_package(tmp_path, monkeypatch):
    """Moved into rundir/, the digest hashed that folder's ten files only: a resume under changed
    algorithms, losses or engine code said nothing, and ranks running other training code were not
    refused. It covers every .py file of the package, and a change to one outside rundir/ (a copy
    of the package with one line added to losses.py) changes it."""
    import shutil

    import fedcp_dist
    from fedcp_dist.rundir import code

    package = Path(fedcp_dist.__file__).resolve().parent
    assert set(code.sources()) == set(package.rglob("*.py"))
    assert package / "losses.py" in code.sources() and package / "engine" / "simulator.py" in code.sources()
    copy = tmp_path / "fedcp_dist"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digests = []
    for change in ("", "# another line\n"):
        with (copy / "losses.py").open("a") as f:
            f.write(change)
        monkeypatch.setattr(code, "PACKAGE", copy)
        code.code_digest.cache_clear()
        digests.append(code.code_digest())
    code.code_digest.cache_clear()
    monkeypatch.undo()
    assert digests[0] != digests[1] and digests[0] == code.code_digest()


def test_a_restart_of_a_run_stopped_before_its_first_checkpoint_says_its_records_are_replaced(tmp_path):
    """A run killed before its first complete checkpoint (config.yaml and two rounds in
    metrics.jsonl, no checkpoint), started again: it began afresh and replaced those records
    without a word. A note now says how many it replaces and why."""
    import shutil

    from helpers import run

    shard, out = _digits(tmp_path / "d.h5", seed=1), tmp_path / "run"
    args = [f"data.path={shard}", f"out_dir={out}", "rounds=2", "checkpoint_every=0", "eval_every=1", "threads=1"]
    said = []
    run("configs/digits_fedcp.yaml", args, echo=said.append)
    assert not [line for line in said if line.startswith("note:")], said
    (out / "summary.json").unlink()  # as a SIGKILL in round 3 of a longer run leaves it
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / "final_global.pt").unlink(missing_ok=True)
    held = len((out / "metrics.jsonl").read_text().splitlines())
    said = []
    run("configs/digits_fedcp.yaml", [*args, "seed=7"], echo=said.append)
    assert held >= 2 and [line for line in said if line.startswith("note:")] == [
        f"note: {out} held {held} records (metrics.jsonl) of a run stopped before its first complete checkpoint "
        f"(checkpoint_every=0): nothing to resume from, so this run starts at round 1 and its records replace those"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == held
