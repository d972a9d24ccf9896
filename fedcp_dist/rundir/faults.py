"""A hook for the fault tests: stop or hold the process at one named phase of a run or a sweep.

The fault tests (``tests/test_fault_harness.py``) send a signal at each phase of a run and of a
sweep. To hit a phase deterministically rather than by timing, the engine calls
:func:`fault_point` at each of them, and the environment variable ``FEDCP_FAULT_AT`` says where
to act and how::

    FEDCP_FAULT_AT=<phase>[@<n>]:<action>

``<phase>``: one of :data:`PHASES`; ``@<n>``: only the call with that round (``train``, ``eval``:
the round, 1-based; ``checkpoint``: the rounds the checkpoint holds; ``sweep_point``: the point's
number, 1-based), else the first call. ``<action>``: a signal name (``SIGINT``, ``SIGTERM``,
``SIGUSR2``, ``SIGKILL``), which the process sends to itself there; or ``wait=<path>``: the process
writes ``<path>`` and waits there (a signal's handler runs meanwhile) until the file is removed,
60 s at most. The hook acts once: it removes the variable from this process's environment when it
fires. Unset (every real run), a call costs one environment look-up. Nothing else in the project
reads it; it imports no torch.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

ENV = "FEDCP_FAULT_AT"
#: where the engine calls :func:`fault_point`: a run's start (before its config is read), its
#: shard's load, a round's training and evaluation, a checkpoint half-written (one part on disk,
#: not the others), the final write (final_global.pt written, summary.json not yet), the end of a
#: finished run (its files written, fedcp-run returning), a local sweep about to launch a point, and
#: ``fedcp-run --ranks`` about to exec torchrun
PHASES = ("startup", "shard", "train", "eval", "checkpoint", "final", "exit", "sweep_point", "exec")
#: longest a ``wait=`` action holds the process
WAIT_S = 60.0


def fault_point(phase: str, n: Optional[int] = None) -> None:
    """Act here if ``FEDCP_FAULT_AT`` names ``phase`` (and ``n``, when it gives one); see the module."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    where, _, action = spec.partition(":")
    name, _, at = where.partition("@")
    if name != phase or (at and (n is None or int(at) != n)):
        return
    del os.environ[ENV]
    if action.startswith("wait="):
        path = Path(action[len("wait="):])
        path.write_text(f"{phase} {n if n is not None else ''}\n")
        t0 = time.monotonic()
        while path.exists() and time.monotonic() - t0 < WAIT_S:
            time.sleep(0.01)
        return
    os.kill(os.getpid(), getattr(signal, action))
    time.sleep(0.05)  # the signal's handler runs here, at this phase
