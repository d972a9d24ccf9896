"""The ranks of one job run one experiment: the same config (but for the keys a rank sets for
itself), the same shard content, one out_dir they all see. The checks' logic runs on two ranks
played by two threads (their all-gathers meet at a barrier); one real two-process start shows the
refusal as a user sees it."""
import dataclasses
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from helpers import documented, rank_envs, run_hand_ranks
from fedcp_dist.config import load_config
from fedcp_dist.data.shards import read_info
from fedcp_dist.engine import agreement
from fedcp_dist.errors import UserError


class _Ranks:
    """Two ranks in threads: :meth:`run` calls ``fn(rt)`` on each; an all-gather stacks what both gave."""

    def __init__(self, world_size: int = 2):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots = [None] * world_size

    def runtime(self, rank: int):
        ranks = self

        class RT:
            world_size, device, is_main = ranks.world_size, torch.device("cpu"), rank == 0

            def all_gather(self, tensor):
                ranks.slots[rank] = tensor.clone()
                ranks.barrier.wait()
                out = torch.stack(list(ranks.slots))
                ranks.barrier.wait()  # every rank has read before the next gather writes
                return out

        rt = RT()
        rt.rank = rank
        return rt

    def run(self, fns) -> list:
        """``fns[r](rt)`` on rank r, side by side; each rank's UserError (or None)."""
        errors = [None] * self.world_size

        def one(r):
            try:
                fns[r](self.runtime(r))
            except UserError as exc:
                errors[r] = exc

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        return errors


def _cfg(*overrides):
    return load_config("configs/digits_fedcp.yaml", list(overrides), validate=False)


def test_ranks_with_one_config_pass_and_per_rank_keys_may_differ():
    a = _cfg("threads=1", "data.path=/nodeA/shard.h5", "client_state=disk", "client_state_dir=/scratch/a")
    b = _cfg("threads=2", "data.path=/nodeB/copy.h5", "client_state=disk", "client_state_dir=/scratch/b")
    assert _Ranks().run([lambda rt: agreement.check_same_config(a, rt),
                         lambda rt: agreement.check_same_config(b, rt)]) == [None, None]


def test_a_rank_started_with_another_value_stops_every_rank_naming_the_key():
    a, b = _cfg("lr=0.05", "seed=1"), _cfg("lr=0.1", "seed=2")
    errors = _Ranks().run([lambda rt: agreement.check_same_config(a, rt),
                           lambda rt: agreement.check_same_config(b, rt)])
    # the first key that differs in sorted order is lr; seed is counted among the others
    assert str(errors[0]) == ("the ranks were started with different configs: lr differs between rank 0 and rank 1 "
                              "(and 1 more: seed); this is rank 0, where lr = 0.05. Start every rank with the "
                              "same config and overrides")
    assert "this is rank 1, where lr = 0.1." in str(errors[1])


def test_a_rank_of_another_version_is_named():
    a = _cfg()

    class Newer:
        def to_dict(self):
            return {**a.to_dict(), "a_key_of_a_newer_version": 1}

    errors = _Ranks().run([lambda rt: agreement.check_same_config(a, rt),
                           lambda rt: agreement.check_same_config(Newer(), rt)])
    assert all(str(e) == "rank 1 run a fedcp_dist whose config keys differ from rank 0's: install the same version "
               "on every node" for e in errors)


def test_a_rank_of_other_code_with_the_same_keys_is_named(monkeypatch):
    """Code edited on one node (another checkout, a stale install) with the config keys unchanged
    trained apart silently: the ranks now compare their source digests."""
    a, local = _cfg(), threading.local()
    monkeypatch.setattr(agreement, "code_digest", lambda: local.digest)

    def rank(digest):
        def fn(rt):
            local.digest = digest
            agreement.check_same_config(a, rt)
        return fn

    assert _Ranks().run([rank("0" * 16), rank("0" * 16)]) == [None, None]
    errors = _Ranks().run([rank("0" * 16), rank("1" * 16)])
    assert [str(e) for e in errors] == [
        f"rank 1 run other fedcp_dist code than rank 0 (source digest {d * 16} on rank {r}): install the same version "
        f"on every node" for r, d in ((0, "0"), (1, "1"))]


def test_a_copy_of_the_shard_passes_and_another_shard_is_refused(digits6, tmp_path):
    info = read_info(str(digits6))
    copy = tmp_path / "copy.h5"
    shutil.copyfile(digits6, copy)
    assert _Ranks().run([lambda rt: agreement.check_same_shard(rt, info),
                         lambda rt: agreement.check_same_shard(rt, read_info(str(copy)))]) == [None, None]
    counts = info.train_counts.copy()
    counts[0] += 1
    for other in (dataclasses.replace(info, fingerprint="f" * 64), dataclasses.replace(info, train_counts=counts)):
        errors = _Ranks().run([lambda rt: agreement.check_same_shard(rt, info),
                               lambda rt, o=other: agreement.check_same_shard(rt, o)])
        assert str(errors[0]) == (f"rank 1 read another shard than rank 0 (its fingerprint or its clients' sample counts "
                                  f"differ; this is rank 0, reading {info.path} with 6 clients): every rank must read "
                                  f"the same shard (a copy with the same content is fine)")
        assert errors[1] is not None
    documented("checkpoints.md", "`error: rank 1 read another shard than rank 0 (its fingerprint or its clients' sample counts "
                             "differ; …): every rank must read the same shard (a copy with the same content is fine)`",
               f"error: {errors[0]}")


def test_an_out_dir_that_a_rank_does_not_see_stops_every_rank(tmp_path, monkeypatch):
    shared, local = tmp_path / "shared", tmp_path / "node_local"
    shared.mkdir()
    local.mkdir()
    (local / agreement.MARKER).write_text("12345\n")  # files of another job: not rank 0's token
    (local / f"{agreement.MARKER}-{12345:016x}").write_text("12345\n")
    monkeypatch.setattr(agreement, "MARKER_WAIT_SECONDS", 0.5)
    errors = _Ranks().run([lambda rt: agreement.check_shared_out_dir(rt, shared),
                           lambda rt: agreement.check_shared_out_dir(rt, local)])
    assert str(errors[0]) == (f"out_dir {shared} is not the folder rank 0 writes in on rank 1 (they do not see the "
                              f"file rank 0 wrote there): out_dir must be on a file system every rank shares, not a "
                              f"node-local disk")
    assert errors[1] is not None
    documented("checkpoints.md", "`error: out_dir … is not the folder rank 0 writes in on rank 1 (they do not see the file "
                             "rank 0 wrote there): out_dir must be on a file system every rank shares, not a node-local "
                             "disk`", f"error: {errors[0]}")
    assert os.listdir(shared) == []  # rank 0 removes its marker
    assert _Ranks().run([lambda rt: agreement.check_shared_out_dir(rt, shared)] * 2) == [None, None]
    assert os.listdir(shared) == []
    # a full disk: the marker is made and its write fails; every rank refuses, and no marker is left
    real = Path.write_text

    def full(path, text, *a, **kw):
        real(path, "", *a, **kw)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(Path, "write_text", full)
    errors = _Ranks().run([lambda rt: agreement.check_shared_out_dir(rt, shared)] * 2)
    assert str(errors[0]) == f"out_dir {shared}: rank 0 could not write in it (No space left on device)", errors
    assert errors[1] is not None and os.listdir(shared) == []


def test_one_rank_started_with_another_override_refuses_before_anything_is_written(digits6, tmp_path):
    """Two processes as mpirun or srun start them, rank 1 with another lr: both exit 2 in one line
    each, naming lr, and out_dir is never made."""
    out = tmp_path / "run"
    cmds = [[sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", f"data.path={digits6}",
             f"out_dir={out}", "threads=1", "rounds=1", f"lr={lr}"] for lr in ("0.05", "0.1")]
    done = run_hand_ranks(cmds, rank_envs())
    errs = [err for _, _, err in done]
    assert [rc for rc, _, _ in done] == [2, 2], errs
    for rank, err in enumerate(errs):
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert lines[0].startswith("error: the ranks were started with different configs: lr differs between rank 0 "
                                   f"and rank 1; this is rank {rank}, where lr = ")
        if rank == 0:
            documented("checkpoints.md", "`error: the ranks were started with different configs: lr differs between rank 0 "
                                     "and rank 1; this is rank 0, where lr = 0.05. Start every rank with the same config "
                                     "and overrides`", lines[0])
    assert not out.exists()
