"""A line on rank 0 while a part of the run goes on long without one.

A run's output is a start line, a line a round and a final table; between them, the parts that do
not end in a line of their own can take minutes at scale and said nothing: the start-up (a shard's
digest, a peer method's per-client banks mapped and hashed, a checkpoint verified and loaded), a
checkpoint's write (FedFomo's banks at 10⁴ clients: gigabytes), the final evaluation and files, and
the first round of an attempt, before it has set a pace. :class:`Heartbeat`
watches the runtime's ``phase`` (the words its errors name too) from a thread of its own: once a
phase has gone :data:`FIRST_S` seconds without a line, it says so (``  start-up (resuming from the
checkpoint of round 40): 15 s so far``), again at twice as long, and so on, at most
:data:`LONGEST_GAP_S` apart. Rounds after the first of an attempt are left alone: the first set the pace
(and a long evaluation says how far it is). It writes nothing to a file, reads nothing
of the run's state and takes the interpreter's lock only to print: the results are the same with it.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable, Optional

from fedcp_dist.engine.evaluation import PROGRESS_S

#: seconds a phase goes without a line before the first one: as long as a long evaluation goes
#: between its own lines
FIRST_S = PROGRESS_S
#: the most seconds between two lines of one phase (the gaps double up to it)
LONGEST_GAP_S = 300.0
#: seconds between two looks at the phase
POLL_S = 1.0

_TRAINING = re.compile(r"round \d+(:.*)?")


class Heartbeat:
    """``echo`` (rank 0's print) made to note when it last said something, and a thread that says
    how long the runtime's current phase (``phase()``) has gone on when it goes on without a line.
    ``first``/``longest``/``poll``: by default :data:`FIRST_S`, :data:`LONGEST_GAP_S`, :data:`POLL_S`
    (tests shorten them); ``clock``: seconds, monotonic. A context manager; :meth:`stop` is idempotent."""

    def __init__(self, echo: Callable[[str], None], phase: Callable[[], str], first: Optional[float] = None,
                 longest: Optional[float] = None, poll: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._echo, self._phase, self._clock = echo, phase, clock
        self.first = FIRST_S if first is None else first
        self.longest = LONGEST_GAP_S if longest is None else longest
        self.poll = POLL_S if poll is None else poll
        self._lock = threading.Lock()
        self._last = clock()  # when a line was last said
        #: rounds done in this attempt: from the first, the rounds' pace is known
        self.rounds_done = 0
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def echo(self, line: str) -> None:
        with self._lock:
            self._last = self._clock()
            self._echo(line)

    def round_done(self) -> None:
        self.rounds_done += 1

    def start(self) -> "Heartbeat":
        first = (self._phase(), self._clock())  # timed from here, however late the thread first looks
        self._thread = threading.Thread(target=self._watch, args=first, name="fedcp-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def watched(self, phase: str) -> bool:
        """Whether ``phase`` gets lines: every phase but a round after the attempt's first round."""
        return not (self.rounds_done and _TRAINING.fullmatch(phase))

    def _watch(self, seen: str, since: float) -> None:
        next_at = self.first
        while not self._done.wait(self.poll):
            now, phase = self._clock(), self._phase()
            if phase != seen:  # a new phase: timed from here
                seen, since, next_at = phase, now, self.first
            if not self.watched(phase):
                continue
            quiet_for = now - max(self._last, since)
            if now - since >= next_at and quiet_for >= min(next_at, self.first):
                try:
                    self.echo(f"  {phase}: {now - since:.0f} s so far")
                except Exception:  # pragma: no cover - an output that is gone: the run goes on without lines
                    return
                next_at = min(2 * next_at, (now - since) + self.longest)
