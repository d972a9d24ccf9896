"""Stop signals that land where Python drops exceptions (a weakref callback, a finalizer, an at-fork
hook) are not lost: fedcp-partition stopped by Ctrl-C or SIGTERM writes nothing and exits 130 or
143 (it printed a traceback, finished the shard and exited 0), and a local sweep passes a stop
that came while a point was starting on to that point (the point ran to its end)."""
import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest

from conftest import REPO
from fedcp_dist import interrupts
from fedcp_dist.errors import Interrupted, Preempted
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
