"""Stop signals that land where Python drops exceptions (a weakref callback, a finalizer, an at-fork
hook) are not lost: fedcp-partition stopped by Ctrl-C or SIGTERM writes nothing and exits 130 or
143 (it printed a traceback, finished the shard and exited 0), and a local sweep passes a stop
that came while a point was starting on to that point (the point ran to its end). Two writers of
one shard without --force keep the first one's; a killed writer's temporary file is removed by the
next writer on its host."""
import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

from conftest import REPO
from fedcp_dist import fileio, interrupts
from fedcp_dist.data.shards import read_info, write_shard
from fedcp_dist.errors import Interrupted, Preempted, UserError
from fedcp_dist.sweep.local import SweepStop


class _Thing:
    pass


def test_a_stop_dropped_inside_a_weakref_callback_is_raised_at_the_next_check(capsys):
    with interrupts.stops_on(signal.SIGINT):
        thing = _Thing()

        def callback(_ref):  # the handler runs here, between two bytecodes of the callback
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass

        ref = weakref.ref(thing, callback)
        del thing
        gc.collect()
        assert ref() is None
        with pytest.raises(Interrupted) as exc:
            interrupts.check()
        assert exc.value.signum == signal.SIGINT
    assert "Exception ignored" not in capsys.readouterr().err  # the dropped stop is not printed
    assert interrupts.pending() is None  # cleared on leaving
    interrupts.check()


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_fedcp_partition_stopped_while_writing_writes_nothing(tmp_path, sig, status):
    out = tmp_path / "s.h5"
    proc = subprocess.Popen([sys.executable, "-m", "fedcp_dist.cli.partition", "--source", "synthetic", "--synthetic-alpha", "1", "--synthetic-beta", "1",
                             "--num-clients", "3000", "--seed", "1", "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    seen = ""
    while "Synthetic" not in seen:  # generating: then the writer starts
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        seen += line
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert err.rstrip().endswith("interrupted") and "Traceback" not in err and "Exception ignored" not in err, err
    assert list(tmp_path.iterdir()) == []  # neither the shard nor its temporary file


def test_a_sweep_stop_that_came_while_a_point_was_starting_reaches_the_point():
    stop = SweepStop("s")
    with stop:
        with pytest.raises(Preempted):  # no point running: the handler raises (and records) the stop
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert isinstance(interrupts.pending(), Preempted)
        # as if that Preempted had been dropped inside Popen: the point starts all the same
        stop.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            stop.started()
            assert stop.proc.wait(timeout=30) == -signal.SIGTERM  # asked to checkpoint and stop
            assert stop.forwarded and interrupts.pending() is None
        finally:
            stop.proc.kill()
    assert stop.signum == signal.SIGTERM and stop.name == "SIGTERM"


# -- two writers of one shard, and what killed writers leave -----------------------------------------

def _clients(n, then=None):
    rng = np.random.default_rng(0)
    for i in range(n):
        if i == n - 1 and then is not None:
            then()
        yield (rng.integers(0, 256, (4, 1, 8, 8), dtype=np.uint8), rng.integers(0, 10, 4),
               rng.integers(0, 256, (2, 1, 8, 8), dtype=np.uint8), rng.integers(0, 10, 2))


def _write(path, clients, replace):
    write_shard(path, clients, source="x", num_classes=10, input_shape=(1, 8, 8), mean=[0.5], std=[0.5],
                partition="x", partition_params={}, seed=0, replace=replace)


def test_a_shard_another_writer_finished_first_is_kept_without_force(tmp_path):
    """Two fedcp-partition to one --out without --force: both said `wrote`, and the one that ended
    last silently replaced the other's shard."""
    path = tmp_path / "s.h5"
    with pytest.raises(UserError, match=r"s.h5 was written by another process while this one wrote it .*pass --force"):
        _write(path, _clients(3, then=lambda: path.write_bytes(b"the other writer's")), replace=False)
    assert path.read_bytes() == b"the other writer's" and sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]
    _write(path, _clients(3, then=lambda: path.write_bytes(b"again")), replace=True)  # --force: replaced
    assert read_info(path).num_clients == 3


def test_a_killed_writers_temporary_shard_is_removed_by_the_next_writer_on_its_host(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    mine, other_host, alive = (tmp_path / f".s.h5.tmp-{name}" for name in (
        f"{fileio._HOST}-{pid}", f"elsewhere-{pid}", f"{fileio._HOST}-{os.getppid()}"))
    for p in (mine, other_host, alive):
        p.write_bytes(b"partial")
    _write(tmp_path / "s.h5", _clients(2), replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other_host.name, alive.name, "s.h5"])
