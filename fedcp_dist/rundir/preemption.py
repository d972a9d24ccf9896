"""The signals that ask a run to stop for a requeue (``preempt_signal`` and SIGTERM).

``fedcp-run`` listens from the moment it starts, before the config is read, the runtime started or
the shard loaded: a signal during start-up is noted like one during a round, and the run stops
before its first round with the requeue status (:data:`~fedcp_dist.errors.EXIT_REQUEUE`) instead
of dying of the signal (exit 128 + its number, which a job script does not requeue). This module
imports no torch, so that it can be in place before torch loads.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

from fedcp_dist.errors import job_rank

#: what ``fedcp-run`` listens to before it has read the config: SIGTERM and the default preempt_signal
AT_START = ("SIGTERM", "SIGUSR2")


def _launcher_rank() -> int:
    rank = job_rank()
    return int(rank) if rank.isdigit() else 0


class StopSignals:
    """While active (a context, which may be entered again), the signals that ask a run to stop
    after its round are noted instead of ending the process: ``signum`` is the first one received
    (None: none yet)."""

    def __init__(self, rank: Optional[int] = None, names=AT_START):
        # before the runtime says it (a signal during start-up): the rank the launcher gave this process
        self.rank = rank if rank is not None else _launcher_rank()
        self.names, self.signum = sorted(set(names)), None
        #: what a run is doing, for the line a signal prints: start-up until its rounds begin, then
        #: rounds, final (the evaluation after them, which a signal stops), writing (the final files,
        #: which it does not)
        self.stage = "start-up"
        self._previous: dict = {}
        self._depth = 0
        self._interrupt = None  # SIGINT's handler while a finished run ignores it
        self._before_finished: dict = {}  # the stop signals' handlers before a finished run ignored them

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            then = {"start-up": "stopping during start-up, before any training",
                    "final": "stopping the final evaluation (a restart does it again)",
                    "writing": "the final evaluation is done: finishing the run's final files"}.get(
                self.stage, "finishing the round, then checkpointing (during its evaluation: stopping before its training)")
            print(f"rank {self.rank}: got {signal.Signals(signum).name}; {then}", flush=True)

    def _install(self) -> None:
        for name in self.names:
            sig = getattr(signal, name)
            if sig in self._previous:
                continue
            try:
                self._previous[sig] = signal.signal(sig, self._note)
            except ValueError:  # not the main thread (embedded use): signals stay the caller's
                pass

    def listen(self, names) -> None:
        """Listen to ``names`` from now on (the config's preempt_signal and SIGTERM): the handlers of
        the signals no longer listened to are put back. A signal already noted stays noted."""
        self.names = sorted(set(names))
        if self._depth:
            for sig in [s for s in self._previous if signal.Signals(s).name not in self.names]:
                signal.signal(sig, self._previous.pop(sig))
            self._install()

    def finished(self) -> None:
        """The run's final files are written: from here to the process's end (the interpreter's
        shutdown, torch's and the collectives' teardown) a stop signal has nothing left to stop, so
        the signals listened to are ignored instead of given back to their default action, which
        would end a finished run with 128 + the signal's number. A Ctrl-C alike, which would say
        "interrupted" and exit 130, until :meth:`interruptible` gives its handler back."""
        self._before_finished = dict(self._previous)  # for a caller that goes on (:meth:`interruptible`)
        for sig in self._previous:
            self._previous[sig] = signal.SIG_IGN
        try:
            self._interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread (embedded use): signals stay the caller's
            pass

    def interruptible(self) -> None:
        """The handlers as they were before :meth:`finished`, once the context is left (for a caller
        in this process that goes on): a Ctrl-C's, and those of the stop signals, which a finished
        run ignores to its end."""
        if self._interrupt is not None:
            signal.signal(signal.SIGINT, self._interrupt)
            self._interrupt = None
        if self._depth == 0:
            for sig, handler in self._before_finished.items():
                try:
                    signal.signal(sig, handler)
                except ValueError:  # not the main thread
                    pass
            self._before_finished = {}

    def __enter__(self) -> "StopSignals":
        if self._depth == 0:
            self._install()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous = {}


def write_status(status: str = "preempted") -> None:
    """``FEDCP_STATUS_FILE``, when set: one line saying how the run ended, for job scripts behind a
    launcher (torchrun) that turns a worker's exit status into its own."""
    path = os.environ.get("FEDCP_STATUS_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{status}\n")


class interrupt_after:
    """A context in which a SIGINT (Ctrl-C) waits for the block to end: a checkpoint being written
    is finished whole, then the interrupt takes its course (the handler that was in place runs, as
    if the signal came then: ``KeyboardInterrupt`` by default). ``deliver=False`` (the run's final
    files): the interrupt is dropped once the block is done, since the run is then finished. A
    second SIGINT inside the block interrupts at once. Outside the main thread, where Python takes
    no signals, it does nothing."""

    def __init__(self, deliver: bool = True):
        self.deliver, self.pending, self._previous = deliver, False, None

    def _note(self, signum, frame) -> None:
        if self.pending:  # asked twice: do not wait
            raise KeyboardInterrupt
        self.pending = True
        then = "then stopping" if self.deliver else "the run is then finished"
        print(f"got {signal.Signals(signum).name}; finishing the files being written first ({then})", flush=True)

    def __enter__(self) -> "interrupt_after":
        try:
            self._previous = signal.signal(signal.SIGINT, self._note)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is None:
            return
        signal.signal(signal.SIGINT, self._previous)
        if self.pending and self.deliver and exc[0] is None:
            signal.raise_signal(signal.SIGINT)
