"""Checkpoints of a disk client store (client_state: disk): a file per client, a checkpoint writes
only the clients whose state changed since the previous one and carries the others as hard links,
verification still covers every file, pruning older checkpoints leaves newer ones whole, and a
resume from such a checkpoint is exact."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cmd
from helpers import PreemptAt, run
from fedcp_dist.errors import Preempted, UserError
from fedcp_dist.rundir import checkpoint as checkpoint_module
from fedcp_dist.rundir.checkpoint import Checkpointer
from fedcp_dist.state.disk_store import DiskClientStore

META = {"records": [], "round_seconds": [], "config": {}}


class _Algo:
    def set_global(self, gs):
        pass

    def init_client_state(self, cid):
        return {"w": torch.full((4,), -1.0)}


def _inodes(d: Path) -> dict:
    """{client file name: inode} of checkpoint ``d``."""
    return {p.name: p.stat().st_ino for p in (d / "clients").iterdir()}


def _two_rank_stores(tmp_path: Path, out: Path, clients: int, keep: int) -> list:
    """[(disk store, checkpointer)] of 2 ranks, client c (even ids on rank 0) holding w = c."""
    stores = [(DiskClientStore(_Algo(), {}, directory=str(tmp_path / f"s{r}")), Checkpointer(str(out), r, 2, keep))
              for r in (0, 1)]
    for c in range(clients):
        stores[c % 2][0].put(c, {"w": torch.full((4,), float(c))}, {})
    return stores


def _flip_byte(path: Path) -> None:
    """Flip one byte of ``path`` in place (its inode, and so every hard link to it, kept)."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _save_two_ranks(root: Path, stores, rounds: int, keep: int) -> Path:
    """A 2-rank checkpoint written in this process: rank 1's part first, then rank 0's (which writes
    COMPLETE over both parts and prunes)."""
    for rank in (1, 0):
        d = stores[rank][1].save(rounds, {"g": torch.full((2,), float(rounds))}, stores[rank][0].checkpoint_part(),
                                 META, lambda ok: ok)
    return d


def test_a_checkpoint_writes_only_changed_clients_and_links_the_rest(tmp_path, monkeypatch):
    """40 clients on 2 ranks (even / odd ids), all trained before checkpoint 1; 3 trained and one
    new client before checkpoint 2, which writes just those 4 files: the other 36 are the first
    checkpoint's files (the same inodes). keep_checkpoints=1 then removes checkpoint 1 and
    checkpoint 2 still verifies and loads on 1 and on 3 ranks, and a damaged file is found."""
    out = tmp_path / "run"
    stores = _two_rank_stores(tmp_path, out, 40, keep=1)
    first = _save_two_ranks(out, stores, 1, keep=1)
    assert sorted(_inodes(first)) == [f"client_{c:07d}.pt" for c in range(40)]
    before = _inodes(first)
    trained = {4: 104.0, 7: 107.0, 10: 110.0, 41: 141.0}
    for c, v in trained.items():
        stores[c % 2][0].put(c, {"w": torch.full((4,), v)}, {})
    read = []
    real_sha, real_copy = checkpoint_module._sha256, checkpoint_module._copy
    monkeypatch.setattr(checkpoint_module, "_sha256", lambda p: read.append(p.name) or real_sha(p))
    monkeypatch.setattr(checkpoint_module, "_copy", lambda src, dst: read.append(src.name) or real_copy(src, dst))
    second = _save_two_ranks(out, stores, 2, keep=1)
    # read: the changed clients' files (copied), the two indexes and global.pt (hashed); no other client's
    assert sorted(read) == sorted([f"client_{c:07d}.pt" for c in trained] + ["clients_0.json", "clients_1.json",
                                                                             "global.pt"])
    monkeypatch.undo()
    after = _inodes(second)
    written = {n for n, ino in after.items() if before.get(n) != ino}
    assert written == {f"client_{c:07d}.pt" for c in trained}
    assert len(after) == 41 and len(after) - len(written) == 37  # carried by reference, not copied
    # keep_checkpoints=1: the first is gone (the carried files lose a name, not their bytes)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round_0000002"]
    ck = Checkpointer(str(out), 0, 1, 1)
    assert ck.latest() == second and ck.verify(second) is None
    manifest = json.loads((second / "COMPLETE").read_text())
    assert set(manifest["sha256"]) == {"global.pt", "clients_0.json", "clients_1.json"}
    want = {c: float(c) for c in range(40)} | trained
    rounds, g, states, _ = ck.load(second, range(50), "cpu")
    assert rounds == 2 and g["g"].tolist() == [2.0, 2.0]
    assert {c: s["w"].tolist() for c, s in states.items()} == {c: [v] * 4 for c, v in want.items()}
    # another world size: each rank takes its own clients by id
    for r in range(3):
        _, _, part, _ = ck.load(second, range(r, 50, 3), "cpu")
        assert sorted(part) == [c for c in sorted(want) if c % 3 == r]
    for store, _ in stores:
        store.close()
    # the store's files changed in place (by hand: the store itself renames new files over old
    # ones) leave the checkpoint as it was: it shares no file with the store
    for f in (tmp_path / "s0").glob("client_*.pt"):
        torch.save({"w": torch.full((4,), 99.0)}, f)
    assert ck.verify(second) is None and ck.load(second, [4, 6], "cpu")[2][4]["w"].tolist() == [104.0] * 4
    # one flipped byte: resuming (deep) finds it; pruning checks the file is there with its size
    victim = second / "clients" / "client_0000013.pt"
    _flip_byte(victim)
    assert ck.verify(second) == "clients/client_0000013.pt does not match its checksum"
    assert ck.verify(second, deep=False) is None
    victim.unlink()
    assert ck.verify(second, deep=False) == "clients/client_0000013.pt is missing"


def test_a_damaged_file_shared_by_every_kept_checkpoint_is_refused_not_restarted(tmp_path):
    """keep_checkpoints=2: a client file unchanged between the two checkpoints is one file with two
    names, so a byte flipped in it damages both. The newer is skipped for the older, which is damaged
    too: resuming refuses in one line naming the file, instead of starting over on round 0."""
    out = tmp_path / "run"
    stores = _two_rank_stores(tmp_path, out, 6, keep=2)
    first = _save_two_ranks(out, stores, 1, keep=2)
    stores[0][0].put(0, {"w": torch.full((4,), 100.0)}, {})
    second = _save_two_ranks(out, stores, 2, keep=2)
    for store, _ in stores:
        store.close()
    shared = second / "clients" / "client_0000003.pt"
    assert shared.stat().st_ino == (first / "clients" / "client_0000003.pt").stat().st_ino
    ck = Checkpointer(str(out), 0, 1, 2)
    assert ck.latest() == second
    _flip_byte(shared)
    said = []
    with pytest.raises(UserError) as err:
        ck.latest(warn=said.append)
    assert said == [f"checkpoint {second} is damaged (clients/client_0000003.pt does not match its checksum); "
                    f"trying the previous one"]
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"checkpoint {first} is damaged (clients/client_0000003.pt does not match its checksum), and so is every "
        f"newer one in {out / 'checkpoints'}: nothing intact to resume from")
    assert "overwrite=true" in message
    # the byte restored, the newest is intact again
    _flip_byte(shared)
    assert ck.latest() == second


def test_checkpoints_copy_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    """No hard links (os.link fails): an unchanged client's file is copied from the previous
    checkpoint (not from the store), a changed one from the store; every file then has one name, and
    both checkpoints verify and load. A store file changed in place after a checkpoint (here by hand)
    leaves the checkpoint intact: its files are never the store's."""
    def no_link(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(checkpoint_module.os, "link", no_link)
    store_dir = tmp_path / "scratch"
    store, ck = DiskClientStore(_Algo(), {}, directory=str(store_dir)), Checkpointer(str(tmp_path / "run"), 0, 1, 2)
    for c in range(6):
        store.put(c, {"w": torch.full((4,), float(c))}, {})
    first = ck.save(1, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    store.put(2, {"w": torch.full((4,), 20.0)}, {})
    copied = []
    real_copy = checkpoint_module._copy
    monkeypatch.setattr(checkpoint_module, "_copy", lambda src, dst: copied.append(src) or real_copy(src, dst))
    second = ck.save(2, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    store.close()
    assert sorted(copied) == sorted([store_dir / "client_0000002.pt"]
                                    + [first / "clients" / f"client_{c:07d}.pt" for c in (0, 1, 3, 4, 5)])
    assert {p.stat().st_nlink for d in (first, second) for p in (d / "clients").iterdir()} == {1}
    for f in store_dir.glob("client_*.pt"):  # in place: the same inode, other bytes
        torch.save({"w": torch.full((4,), 99.0)}, f)
    assert ck.verify(first) is None and ck.verify(second) is None
    states = ck.load(second, range(6), "cpu")[2]
    assert [states[c]["w"][0].item() for c in range(6)] == [0.0, 1.0, 20.0, 3.0, 4.0, 5.0]


def test_a_store_file_that_cannot_be_read_fails_the_checkpoint_naming_it(tmp_path, monkeypatch):
    """An I/O error reading a changed client's file from the store: a RunFailure naming the file, the
    unfinished checkpoint removed, the previous one intact."""
    import errno

    from fedcp_dist.errors import RunFailure

    store, ck = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s")), Checkpointer(str(tmp_path / "run"), 0, 1, 2)
    for c in range(3):
        store.put(c, {"w": torch.full((4,), float(c))}, {})
    first = ck.save(1, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    store.put(1, {"w": torch.full((4,), 10.0)}, {})
    bad = tmp_path / "s" / "client_0000001.pt"

    def eio(path, *args, **kwargs):
        if Path(path) == bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "open", eio, raising=False)
    with pytest.raises(RunFailure, match=rf"after round 2 could not be written \({bad}: Input/output error\); the "
                                         rf"previous complete checkpoint in \S+ is intact"):
        ck.save(2, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    monkeypatch.undo()
    store.close()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [first.name]
    assert ck.latest() == first and ck.load(first, [1], "cpu")[2][1]["w"].tolist() == [1.0] * 4


def test_a_store_file_changed_on_disk_before_its_copy_fails_the_checkpoint(tmp_path):
    """A changed client's file whose bytes changed on disk after the store wrote them (a flipped
    bit torch's reader would take): the checkpoint would hash the damaged copy and pass it for
    intact, so a resume would go on from the wrong state. The copy is checked against what the store
    wrote: the checkpoint fails naming the file, nothing of it is left, the previous one is intact."""
    from fedcp_dist.errors import RunFailure

    store, ck = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s")), Checkpointer(str(tmp_path / "run"), 0, 1, 2)
    for c in range(3):
        store.put(c, {"w": torch.full((4,), float(c))}, {})
    first = ck.save(1, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    store.put(1, {"w": torch.full((4,), 10.0)}, {})
    store.flush()
    bad = tmp_path / "s" / "client_0000001.pt"
    _flip_byte(bad)
    with pytest.raises(RunFailure, match=rf"after round 2 could not be written \({bad}: it is not what the run wrote "
                                         rf"there \(changed on disk since; resume from the previous checkpoint\)\); "
                                         rf"the previous complete checkpoint in \S+ is intact"):
        ck.save(2, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    store.close()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [first.name]
    assert ck.latest() == first and ck.load(first, [1], "cpu")[2][1]["w"].tolist() == [1.0] * 4


def test_a_resumed_store_file_changed_on_disk_fails_the_checkpoint_that_copies_it(tmp_path):
    """States a resume wrote into the store (load_state_dict: not changed) are copied, not linked,
    by a checkpoint with no previous one of client files to link to (a resume from a checkpoint of
    another client_state, which client_state: auto may choose on another machine): such a copy of
    a file changed on disk since was taken for the client's state, unchecked."""
    from fedcp_dist.errors import RunFailure

    store, ck = DiskClientStore(_Algo(), {}, directory=str(tmp_path / "s")), Checkpointer(str(tmp_path / "run"), 0, 1, 2)
    store.load_state_dict({c: {"w": torch.full((4,), float(c))} for c in range(3)})
    store.flush()
    bad = tmp_path / "s" / "client_0000001.pt"
    _flip_byte(bad)
    with pytest.raises(RunFailure, match=rf"after round 1 could not be written \({bad}: it is not what the run wrote "):
        ck.save(1, {"g": torch.zeros(2)}, store.checkpoint_part(), META, lambda ok: ok)
    store.close()
    assert ck.latest() is None


# -- a whole run ---------------------------------------------------------------------------------

def _ditto(shard, out, *extra):
    # 20 clients, a cohort of 3 a round; fused=false: PreemptAt wraps local_train
    return [f"data.path={shard}", f"out_dir={out}", "rounds=4", "eval_every=2", "participation=0.15",
            "checkpoint_every=1", "threads=1", "fused=false", "client_state=disk", *extra]


def _records(out: Path):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


@pytest.fixture(scope="module")
def whole(digits20_16px, tmp_path_factory):
    """The uninterrupted run (keep_checkpoints=2)."""
    out = tmp_path_factory.mktemp("whole")
    run("configs/digits_ditto.yaml", _ditto(digits20_16px, out))
    return out


def _stopped_after_round_3(shard, out):
    """The run stopped by the preemption signal in round 3 with keep_checkpoints=1: round 3's
    checkpoint alone is left, its unchanged clients' files carried over from the removed ones."""
    args = _ditto(shard, out, "keep_checkpoints=1")
    with pytest.raises(Preempted, match="checkpointed after 3 rounds"):
        run("configs/digits_ditto.yaml", args, wrap=lambda a: PreemptAt(a, 3))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round_0000003"]
    return args


def test_disk_checkpoints_carry_unchanged_clients_and_resume_exactly(whole, digits20_16px, tmp_path):
    """The uninterrupted run's last checkpoint wrote only the clients whose state changed in the
    last round (at most the cohort), the rest are the previous checkpoint's files. The stopped run
    resumes from its only checkpoint to the same run, bit for bit."""
    ck = Checkpointer(str(whole), 0, 1, 2)
    r3, r4 = (whole / "checkpoints" / f"round_{r:07d}" for r in (3, 4))
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == [r3.name, r4.name]
    assert ck.verify(r3) is None and ck.verify(r4) is None  # round 3's links outlive rounds 1 and 2
    (_, _, s3, _), (_, _, s4, _) = ck.load(r3, range(20), "cpu"), ck.load(r4, range(20), "cpu")
    changed = {c for c in s4 if c not in s3 or any(not torch.equal(s3[c][k], s4[c][k]) for k in s4[c])}
    before, after = _inodes(r3), _inodes(r4)
    written = {int(n[7:14]) for n, ino in after.items() if before.get(n) != ino}
    participants = [r["participants"] for r in _records(whole) if r.get("kind") == "round"]
    assert written == changed and 0 < len(written) <= participants[3] == 3
    assert len(after) - len(written) >= 3  # some clients carried by reference

    stopped = tmp_path / "stopped"
    args = _stopped_after_round_3(digits20_16px, stopped)
    resumed_from = set(_inodes(stopped / "checkpoints" / r3.name).values())
    said = []
    run("configs/digits_ditto.yaml", args, echo=said.append)
    assert any("resuming from" in l and "(3 rounds done)" in l for l in said)
    # the checkpoint after the resumed round links the clients it did not train from the one resumed from
    carried = [n for n, ino in _inodes(stopped / "checkpoints" / r4.name).items() if ino in resumed_from]
    assert len(carried) >= len(after) - 3
    assert _records(stopped) == _records(whole)
    final = Checkpointer(str(stopped), 0, 1, 1)
    _, g, s, _ = final.load(final.latest(), range(20), "cpu")
    _, gw, sw, _ = ck.load(r4, range(20), "cpu")
    assert all(torch.equal(g[k], gw[k]) for k in gw) and s.keys() == sw.keys()
    assert all(torch.equal(s[c][k], sw[c][k]) for c in sw for k in sw[c])


@pytest.mark.parametrize("where", [["client_state_dir={scratch}"], ["client_state=device"]])
def test_a_requeue_may_keep_the_states_elsewhere_and_resumes_exactly(whole, digits20_16px, tmp_path, where):
    """client_state_dir (a node-local scratch folder, another on the node a requeue lands on) and
    client_state itself (a node with less memory) were refused on resume; the states are the
    checkpoint's either way, so the run goes on bit for bit."""
    args = _stopped_after_round_3(digits20_16px, tmp_path / "run")
    said = []
    run("configs/digits_ditto.yaml", args + [w.format(scratch=tmp_path / "scratch") for w in where], echo=said.append)
    assert any("(3 rounds done)" in line for line in said) and not any(line.startswith("note:") for line in said)
    assert _records(tmp_path / "run") == _records(whole)
    a, b = (torch.load(d / "final_global.pt", weights_only=True) for d in (whole, tmp_path / "run"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "scratch").is_dir() == ("client_state_dir" in where[0])


@pytest.mark.slow
def test_a_disk_checkpoint_resumes_on_two_ranks(whole, digits20_16px, tmp_path):
    """The stopped run resumed on 2 ranks (each takes its clients' files by id): the same final
    model and client states, bit for bit; the metrics equal up to the order of their sums."""
    args = _stopped_after_round_3(digits20_16px, tmp_path)
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "fedcp_dist.run", "--config", "configs/digits_ditto.yaml", *args])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(3 rounds done)" in r.stdout
    a, b = (torch.load(d / "final_global.pt", weights_only=True) for d in (whole, tmp_path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = _records(whole), _records(tmp_path)
    assert len(ra) == len(rb) and all(x == {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v
                                            for k, v in y.items()} for x, y in zip(ra, rb))
    ck = Checkpointer(str(tmp_path), 0, 2, 1)
    manifest = json.loads((ck.latest() / "COMPLETE").read_text())
    assert manifest["world_size"] == 2 and manifest["client_files"] == "clients"
    _, _, s, _ = ck.load(ck.latest(), range(20), "cpu")
    _, _, sw, _ = ck.load(whole / "checkpoints" / "round_0000004", range(20), "cpu")
    assert s.keys() == sw.keys() and all(torch.equal(s[c][k], sw[c][k]) for c in sw for k in sw[c])


@pytest.mark.parametrize("damage, problem", [
    (lambda m: m.update(world_size=2), "its parts ['clients_0.pt', 'global.pt'] are not those of 2 rank(s)"),
    (lambda m: m.update(world_size=True), "world_size True"),
    (lambda m: m.update(sha256=None), "sha256 is not a map of parts to checksums"),
    (lambda m: m.update(sha256=["global.pt"]), "sha256 is not a map of parts to checksums"),
    (lambda m: m.update(round=1), "round 1 in folder round_0000002"),
    (lambda m: m.update(client_files="clientz"), "client_files 'clientz'"),
])
def test_a_complete_marker_damaged_in_its_fields_is_damage_and_the_previous_checkpoint_serves(tmp_path, damage,
                                                                                              problem):
    """A flipped bit in COMPLETE's world_size (or the client_files key) kept every listed checksum
    right, passed verify, then failed to load: the run refused to resume though the previous
    checkpoint was intact. A sha256 of null or a list raised AttributeError inside verify."""
    ck = Checkpointer(str(tmp_path / "run"), 0, 1, 2)
    first = ck.save(1, {"w": torch.zeros(2)}, {0: {"v": torch.ones(2)}}, {}, lambda ok: ok)
    second = ck.save(2, {"w": torch.ones(2)}, {0: {"v": torch.ones(2)}}, {}, lambda ok: ok)
    assert ck.verify(second) is None and ck.latest() == second
    manifest = json.loads((second / "COMPLETE").read_text())
    damage(manifest)
    (second / "COMPLETE").write_text(json.dumps(manifest))
    assert ck.verify(second) == f"its COMPLETE marker is damaged ({problem})"
    said = []
    assert ck.latest(warn=said.append) == first
    assert said == [f"checkpoint {second} is damaged (its COMPLETE marker is damaged ({problem})); "
                    f"trying the previous one"]


def test_a_rank_whose_own_parts_were_written_does_not_take_rank_0s_cleanup_for_a_removal(tmp_path):
    """Rank 1's parts are written, rank 0's failed: rank 0 removes the half-made folder while rank
    1 still words its error. Rank 1 took the folder's going for an ``rm -rf`` of out_dir and said so
    beside rank 0's true reason. Only a rank whose own write found its folder gone says that;
    rank 1 here says a write failed on another rank, and that the previous checkpoint is intact."""
    out = tmp_path / "run"
    ck = Checkpointer(str(out), 1, 2, 2)
    ck.out_dir_made()
    out.mkdir()
    earlier = out / "checkpoints" / "round_0000001"
    earlier.mkdir(parents=True)
    (earlier / checkpoint_module.MARKER).write_text("{}")

    def rank_0_failed(ok):  # the collective's answer, with rank 0's cleanup done before rank 1 reads on
        import shutil

        shutil.rmtree(out / "checkpoints" / "round_0000002")
        return False

    with pytest.raises(checkpoint_module.RunFailure) as exc:
        ck.save(2, {"g": torch.zeros(2)}, {3: {"w": torch.ones(2)}}, META, rank_0_failed)
    text = str(exc.value)
    assert "(a write failed on another rank)" in text and "was removed" not in text, text
    assert text.endswith(f"the previous complete checkpoint in {out / 'checkpoints'} is intact"), text


def test_a_rank_whose_own_write_failed_outside_the_folder_does_not_name_a_removal(tmp_path, monkeypatch):
    """Rank 1's own write failed with ENOENT on a file outside the round's folder (its part's source
    gone), and rank 0 removed the half-made folder once both had said how they fared: rank 1, judging
    after that, took the folder's going for an rm -rf of out_dir. It is judged as the write fails,
    and only of a file inside the folder."""
    import errno as errno_module
    import shutil

    out = tmp_path / "run"
    ck = Checkpointer(str(out), 1, 2, 2)
    ck.out_dir_made()
    out.mkdir()

    def gone(obj, path, durable=True):
        raise OSError(errno_module.ENOENT, "No such file or directory", str(tmp_path / "scratch" / "client_3.pt"))

    monkeypatch.setattr(checkpoint_module, "atomic_torch_save", gone)

    def rank_0_cleans_up(ok):
        shutil.rmtree(out / "checkpoints" / "round_0000002", ignore_errors=True)
        return False

    with pytest.raises(checkpoint_module.RunFailure) as exc:
        ck.save(2, {"g": torch.zeros(2)}, {3: {"w": torch.ones(2)}}, META, rank_0_cleans_up)
    text = str(exc.value)
    assert "scratch/client_3.pt: No such file or directory" in text and "was removed" not in text, text


@pytest.mark.parametrize("first", [0, 1])
def test_two_ranks_stores_unmade_in_either_order_leave_no_folder(tmp_path, first):
    """Rank 0 made ``client_state/`` and its ``rank_0``, rank 1 only its ``rank_1`` (the parent was
    there by then): whichever rank undid its start first, the other could not remove the shared
    parent, which stayed behind empty. The last to leave removes it."""
    out = tmp_path / "run"
    out.mkdir()
    stores = [DiskClientStore(_Algo(), {}, directory=str(out / "client_state" / f"rank_{r}")) for r in (0, 1)]
    for store in stores:
        store.close()
    for store in (stores[first], stores[1 - first]):
        store.unmake()
    assert list(out.iterdir()) == []
