"""The room a run's checkpoints take on out_dir's disk, checked at start: the arithmetic on
hand-computed figures, the estimate against the checkpoints a run really writes, a refusal on a
disk too small for the first checkpoint, and the note when only the peak does not fit."""
from pathlib import Path

import pytest

from conftest import run_cmd
from helpers import run, tmpfs

from fedcp_dist.errors import UserError
from fedcp_dist.rundir import room
from fedcp_dist.rundir.room import RECORD_BYTES as REC, Figures


def _du(folder: Path) -> int:
    """Bytes of the files under ``folder``, a file with several names counted once."""
    seen, total = set(), 0
    for p in folder.rglob("*"):
        if p.is_file() and (p.stat().st_dev, p.stat().st_ino) not in seen:
            seen.add((p.stat().st_dev, p.stat().st_ino))
            total += p.stat().st_size
    return total


def test_full_participation_keeps_every_client_in_every_checkpoint():
    f = Figures(clients=10, participation=1.0, client_bytes=100, global_bytes=1000, rounds=6, start=0, every=2, keep=2)
    assert f.checkpoint_rounds() == [2, 4, 6]
    sizes = room.checkpoints(f)
    assert [(c.round, c.global_part, c.clients) for c in sizes] == [(2, 1000 + 2 * REC, 1000), (4, 1000 + 4 * REC, 1000),
                                                                     (6, 1000 + 6 * REC, 1000)]
    assert room.need_at(f, 0) == 2000 + 2 * REC
    # writing round 6's: rounds 2 and 4 are still kept
    assert room.peak(f) == (3 * 2000 + (2 + 4 + 6) * REC, 6)
    assert room.peak(Figures(**{**f.__dict__, "keep": 1})) == (2 * 2000 + (4 + 6) * REC, 6)


def test_partial_participation_counts_the_distinct_clients_expected_and_links_share_files():
    # 100 clients at rho = 0.1: after t rounds 100 (1 - 0.9^t) have a state: 19 (t=2), 35 (t=4), 47 (t=6)
    f = Figures(clients=100, participation=0.1, client_bytes=10, global_bytes=0, rounds=6, start=0, every=2, keep=1)
    assert [f.with_state(t) for t in (0, 1, 2, 4, 6)] == [0, 10, 19, 35, 47]
    plain = room.checkpoints(f)
    assert [(c.clients, c.unshared) for c in plain] == [(190, 190), (350, 350), (470, 470)]
    linked = room.checkpoints(Figures(**{**f.__dict__, "linked": True}))
    # the first is whole; after it a checkpoint adds the clients of two rounds (20) at most
    assert [(c.clients, c.unshared) for c in linked] == [(190, 190), (350, 200), (470, 200)]
    lf = Figures(**{**f.__dict__, "linked": True})
    # while round 6's is written round 4's is kept: its 35 files, of which round 6's replace 20, + round 6's 47
    assert room.need_at(lf, 2) == (4 + 6) * REC + 470 + 200
    assert room.need_at(f, 2) == (4 + 6) * REC + 350 + 470
    # a disk store's own files on the same disk: every client with a state once more
    sf = Figures(**{**lf.__dict__, "store_here": True})
    assert room.need_at(sf, 2) == room.need_at(lf, 2) + 470


def test_a_resume_writes_only_the_rest_and_links_from_the_checkpoint_it_resumed():
    f = Figures(clients=100, participation=0.1, client_bytes=10, global_bytes=0, rounds=7, start=4, every=2, keep=2,
                linked=True)
    assert f.checkpoint_rounds() == [6, 7]  # the last round always checkpoints
    assert [(c.round, c.unshared) for c in room.checkpoints(f)] == [(6, 200), (7, 100)]
    assert Figures(clients=1, participation=1, client_bytes=1, global_bytes=1, rounds=4, start=4, every=2,
                   keep=1).checkpoint_rounds() == []


def test_check_refuses_a_first_checkpoint_that_cannot_fit_and_notes_a_peak_that_cannot():
    f = Figures(clients=10, participation=1.0, client_bytes=2**20, global_bytes=2**20, rounds=6, start=0, every=2,
                keep=2)
    first, (top, at) = room.need_at(f, 0), room.peak(f)
    assert at == 6 and first < top
    line = room.check(f, top, "/x/run")
    assert line == (f"checkpoints on disk: about {room.mib(top)} at the peak (after round 6, 2 kept + 1 being "
                    f"written); {room.mib(top)} free on the file system of out_dir /x/run")
    note = room.check(f, top - 1, "/x/run")
    assert note.startswith(f"note: the checkpoints will need about {room.mib(top)} at their peak (after round 6, "
                           f"2 kept + 1 being written) but ")
    assert note.endswith("the previous one intact; keep_checkpoints=1 fits")
    assert room.check(f, first, "/x/run").endswith("not even keep_checkpoints=1 fits: free space there or choose an "
                                                   "out_dir on a larger disk")
    with pytest.raises(UserError, match=r"^config key 'out_dir': the first checkpoint \(after round 2\) needs about "
                                        r"11\.0 MiB \(about 10 clients' states of 1\.0 MiB each, and the global "
                                        r"state's 1\.0 MiB\) but 11\.0 MiB are free on the file system of out_dir "
                                        r"/x/run: free space there"):
        room.check(f, first - 1, "/x/run")
    # a file system that cannot say its free space: the figure only
    assert room.check(f, None, "/x/run") == (f"checkpoints on disk: about {room.mib(top)} at the peak (after round 6); "
                                             f"the free space on the file system of out_dir /x/run is unknown")
    assert room.free_bytes("/no/such/folder") is None and room.free_bytes("/") > 0
    # checkpoints only on a preemption signal: never refused, the worst case said
    f0 = Figures(**{**f.__dict__, "every": 0})
    assert room.check(f0, 1, "/x/run").startswith("checkpoints on disk: only on a preemption signal "
                                                  "(checkpoint_every=0), about ")


@pytest.mark.parametrize("method,extra", [("fedcp", []), ("fedavg", ["participation=0.5"]),
                                          ("ditto", ["client_state=disk", "participation=0.5"])])
def test_the_estimate_covers_the_checkpoints_a_run_writes(digits6_16px, tmp_path, method, extra):
    """The line's figure against the bytes on disk at the end, which hold every checkpoint the run
    wrote (keep 3 of 3: the peak's window) and a disk store's own files: at or above them, by 30 %
    at most (at half participation of 6 clients, the expected distinct clients rounded up run ahead)."""
    said = []
    run("configs/digits_fedcp.yaml", [f"data.path={digits6_16px}", f"out_dir={tmp_path}", f"method={method}",
                                      "rounds=3", "eval_every=3", "checkpoint_every=1", "keep_checkpoints=3",
                                      "threads=1", *extra], echo=said.append)
    line = next(s for s in said if s.startswith("checkpoints on disk"))
    assert "(after round 3, 3 kept + 1 being written)" in line, line
    assert len(list((tmp_path / "checkpoints").iterdir())) == 3
    written = _du(tmp_path / "checkpoints") + _du(tmp_path / "client_state") * ("client_state=disk" in extra)
    number, unit = line.split("about ")[1].split()[:2]
    estimate = float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert written <= estimate * 1.01 and estimate <= 1.3 * written, (estimate, written)


def test_a_run_whose_first_checkpoint_cannot_fit_is_refused_before_its_first_round(digits6_16px, tmp_path):
    """out_dir on a 1 MiB tmpfs: refused at start in one line, exit 2, nothing left there."""
    with tmpfs(tmp_path / "small", "1m") as small:
        out = small / "run"
        r = run_cmd(["fedcp-run", "--config", "configs/digits_fedcp.yaml", f"data.path={digits6_16px}",
                     f"out_dir={out}", "rounds=4", "checkpoint_every=2", "threads=1"])
        assert r.returncode == 2, r.stdout + r.stderr
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: config key 'out_dir': the first checkpoint (after round 2) "
                                                   "needs about "), r.stderr
        assert f"are free on the file system of out_dir {out}: free space there" in err[0]
        assert "[round" not in r.stdout and list(small.iterdir()) == []
