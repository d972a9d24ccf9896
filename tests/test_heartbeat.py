"""Rank 0's line while a part of the run goes long without one (fedcp_dist/engine/heartbeat.py).

A FedFomo run of 400 clients with a disk store spent 3 s hashing its banks at start-up, 5 s writing
its checkpoint and 4 s its final_global.pt without a line: at 10⁴ clients, minutes of silence. The
clock here is the test's, so the lines are exact; the thread polls every few milliseconds."""
import time

import pytest

from fedcp_dist.engine import heartbeat as hb
from tests.helpers import run


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def settle(beat: hb.Heartbeat) -> None:
    """Let the thread take at least two looks at the clock as it stands."""
    time.sleep(20 * beat.poll)


@pytest.fixture
def watched():
    clock, lines, state = Clock(), [], {"phase": "start-up"}
    beat = hb.Heartbeat(lines.append, lambda: state["phase"], first=15, longest=100, poll=0.002, clock=clock)
    with beat:
        yield beat, clock, lines, state


def at(beat, clock, t: float) -> None:
    clock.now = t
    settle(beat)


def test_a_long_phase_gets_lines_at_doubling_gaps_up_to_the_longest(watched):
    beat, clock, lines, _ = watched
    at(beat, clock, 14.9)
    assert lines == []
    for t in (15, 29, 30, 59, 60, 119, 120, 219, 220, 320):
        at(beat, clock, t)
    # 15, 30, 60, 120, then at most 100 s apart
    assert lines == [f"  start-up: {t} s so far" for t in (15, 30, 60, 120, 220, 320)]


def test_a_line_said_meanwhile_puts_the_next_off_and_a_new_phase_is_timed_from_its_start(watched):
    beat, clock, lines, state = watched
    at(beat, clock, 10)
    beat.echo("  evaluating: 100 of this rank's 400 clients after 10 s")
    at(beat, clock, 16)
    assert lines == ["  evaluating: 100 of this rank's 400 clients after 10 s"]  # quiet for 6 s only
    at(beat, clock, 25)
    assert lines[-1] == "  start-up: 25 s so far"
    state["phase"] = "start-up (the client states)"
    settle(beat)  # seen at 25
    at(beat, clock, 39)
    assert len(lines) == 2
    at(beat, clock, 40)
    assert lines[-1] == "  start-up (the client states): 15 s so far"


def test_rounds_after_the_first_of_an_attempt_are_left_alone_but_not_what_follows(watched):
    beat, clock, lines, state = watched
    state["phase"] = "round 3"  # the first round of a resumed attempt: no pace known yet
    at(beat, clock, 1)
    at(beat, clock, 16)
    assert lines == ["  round 3: 15 s so far"]
    beat.round_done()
    for phase in ("round 4", "round 4: peer exchange"):
        state["phase"] = phase
        at(beat, clock, clock.now + 1)
        at(beat, clock, clock.now + 100)
    assert len(lines) == 1
    state["phase"] = "checkpoint after round 4"
    at(beat, clock, clock.now + 1)
    at(beat, clock, clock.now + 15)
    assert lines[-1] == "  checkpoint after round 4: 15 s so far"
    beat.stop()
    beat.stop()  # idempotent
    assert not beat._thread.is_alive()


def test_a_run_says_which_part_goes_long(digits6, tmp_path, monkeypatch):
    """A run whose checkpoint and final files take long (slowed here) names them on rank 0; its results
    are those of a run without the lines."""
    from fedcp_dist.rundir import directory
    from fedcp_dist.rundir.checkpoint import Checkpointer

    slow_save, slow_final = Checkpointer.save, directory.RunWriter.save_final_global

    def save(self, *a, **k):
        time.sleep(0.4)
        return slow_save(self, *a, **k)

    def save_final(self, *a, **k):
        time.sleep(0.4)
        return slow_final(self, *a, **k)

    args = ["configs/digits_fedavg.yaml", [f"data.path={digits6}", "rounds=2", "threads=1", "checkpoint_every=1"]]
    quiet = run(args[0], args[1] + [f"out_dir={tmp_path / 'a'}"])
    monkeypatch.setattr(Checkpointer, "save", save)
    monkeypatch.setattr(directory.RunWriter, "save_final_global", save_final)
    monkeypatch.setattr(hb, "FIRST_S", 0.2)
    monkeypatch.setattr(hb, "POLL_S", 0.01)
    lines = []
    said = run(args[0], args[1] + [f"out_dir={tmp_path / 'b'}"], echo=lines.append)
    beats = [ln for ln in lines if ln.endswith(" s so far")]
    for phase in ("checkpoint after round 1", "checkpoint after round 2", "writing final_global.pt and summary.json"):
        assert any(ln.startswith(f"  {phase}: ") for ln in beats), lines
    assert said["final_acc"] == quiet["final_acc"] and said["best_acc"] == quiet["best_acc"]
