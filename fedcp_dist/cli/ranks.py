"""What ``fedcp-run --ranks N`` becomes: torchrun in this process, with its ending said as a run's.

    python -m fedcp_dist.cli.ranks --standalone --nproc_per_node=2 -m fedcp_dist.run --config ...

The same arguments and behaviour as ``python -m torch.distributed.run``, except how it ends when
ranks fail or it is signalled. torchrun reports a failed rank with a Python traceback of its own
(``ChildFailedError``, a table of every rank) and exits 1 whatever the ranks said; the ranks have
already printed their own one-line errors by then. Here:

* every failed rank exited with the same status (2 for a refused config, 1 for a failed run, 75
  for a checkpointed stop): that status, and one line naming the ranks; ranks that torchrun then
  stopped (SIGTERM, which it sends the others once one has failed) do not count;
* ranks that failed differently (or a signal ended one): exit 1, and one line listing each rank's
  status or signal;
* torchrun itself signalled (SIGTERM from a scheduler, Ctrl-C, or SIGUSR2, the default
  ``preempt_signal``, which torchrun does not listen to: it is taken here as a SIGTERM, which every
  rank listens to): it stops the ranks, which checkpoint first when their round ends in time; then
  75 when rank 0 said so in the status file (``FEDCP_STATUS_FILE``, set here to a file of its own
  when the caller has not), 0 when rank 0 wrote there that the run had finished (a signal during
  the final evaluation or after the final files), else 128 + the signal's number, as a shell
  reports a process a signal ended;
* signalled before torchrun started the ranks (``fedcp-run --ranks`` blocks the stop signals before
  it execs this module, so one that comes while torch loads waits here instead of ending the
  process at once): nothing ran, so 75, as ``fedcp-run`` says for a stop during its start-up.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from typing import Dict, Optional

from fedcp_dist.errors import EXIT_REQUEUE, REFUSED_SUFFIX
from fedcp_dist.interrupts import RANKS_PAUSED, following_job_control


def failure_line(codes: Dict[int, int], signals: Dict[int, str]) -> tuple:
    """(exit status, one line) for ranks that failed: rank -> exit status (negative: ended by a
    signal, named in ``signals``)."""
    # torchrun ends the other ranks with SIGTERM once one has failed: those say nothing of the run
    stopped = [r for r in sorted(codes) if codes[r] in (-signal.SIGTERM, 128 + signal.SIGTERM)]
    ranks = [r for r in sorted(codes) if r not in stopped] or sorted(codes)
    stopped = [r for r in stopped if r not in ranks]
    names = ", ".join(map(str, ranks))
    statuses = {codes[r] for r in ranks}
    if len(statuses) == 1 and next(iter(statuses)) > 0:
        code = next(iter(statuses))
        what = {EXIT_REQUEUE: f"stopped after {'their' if len(ranks) > 1 else 'its'} checkpoint"}.get(
            code, f"exited with status {code}")
        then = (f"; torchrun then stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}"
                if stopped else "")
        return code, (f"fedcp-run --ranks: rank{'s' if len(ranks) > 1 else ''} {names} {what} (see the lines "
                      f"above){then}")
    parts = [f"rank {r}: {signals.get(r) or 'a signal'}" if codes[r] < 0 else f"rank {r}: status {codes[r]}"
             for r in ranks]
    return 1, f"fedcp-run --ranks: ranks failed ({'; '.join(parts)}); their own lines, if any, are above"


def stopped_status(status_file: Optional[str], signum: int) -> int:
    """The exit status after torchrun was signalled: 75 when rank 0 wrote ``preempted``, 0 when it
    wrote ``finished`` (the run's final files were written before the ranks stopped)."""
    try:
        with open(status_file or "", encoding="utf-8") as f:
            said = f.read().strip()
    except OSError:
        said = ""
    return {"preempted": EXIT_REQUEUE, "finished": 0}.get(said, 128 + signum)


#: signals a scheduler sends to ask for a checkpoint that torchrun does not listen to (it stops its
#: workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT); left alone, their default action ends torchrun at
#: once, and its workers with it, without a checkpoint
UNHEARD = (signal.SIGUSR2,)

#: the stop signals ``fedcp-run --ranks`` blocks across its exec into this module (they are delivered
#: once the handlers below are in place): torchrun's own (but SIGQUIT, a request for a core dump) and
#: :data:`UNHEARD`
HELD_ACROSS_EXEC = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *UNHEARD)


#: what torchrun's process logger says that the line :func:`failure_line` prints says again: the first
#: failed rank's status (an ``E…`` line) and the SIGTERM it sends the others (``W…`` lines); its other
#: warnings (a rank that would not stop) are kept
RESTATED = ("failed (exitcode: ", "Closing process ")


def _restated(record) -> bool:
    return not str(record.msg).startswith(RESTATED)


def main(argv=None) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_restated)
    asked: list = []
    early: list = []  # signals that came before torchrun put its own handlers in place

    def stop(signum, _frame):
        asked.append(signum)
        if signal.getsignal(signal.SIGTERM) is stop:
            # torchrun installs its handlers (SIGTERM, SIGINT, SIGHUP) just before it starts the
            # ranks: while this one is still SIGTERM's, no rank runs yet
            early.append(signum)
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signum)
        # a signal torchrun does not listen to (SIGUSR2, or one TORCHELASTIC_SIGNALS_TO_HANDLE leaves
        # out), taken as its SIGTERM: torchrun's handler raises this, and its agent then sends SIGTERM
        # to the ranks
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGTERM)

    for sig in HELD_ACROSS_EXEC:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored by the caller (nohup): left so
            signal.signal(sig, stop)
    own = None
    if not os.environ.get("FEDCP_STATUS_FILE"):
        try:
            fd, own = tempfile.mkstemp(prefix="fedcp-ranks-status-")
            os.close(fd)
            os.environ["FEDCP_STATUS_FILE"] = own  # the ranks inherit it
        except OSError:  # no writable temporary folder: a signalled launch then exits 128 + the signal
            own = None
    else:  # the caller's: what an earlier run wrote there must not speak for this one
        try:
            open(os.environ["FEDCP_STATUS_FILE"], "w").close()
        except OSError:
            pass
    try:
        # what came while torch loaded is delivered here, into the handlers above (and the ranks
        # torchrun starts must not inherit the block)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_ACROSS_EXEC)
        # a Ctrl-Z suspends the ranks too (they run in sessions of their own)
        with following_job_control(note=lambda: RANKS_PAUSED):
            torchrun(sys.argv[1:] if argv is None else argv)
        return 0
    except ChildFailedError as exc:
        codes = {int(r): int(f.exitcode) for r, f in exc.failures.items()}
        signals = {int(r): f.signal_name() for r, f in exc.failures.items() if f.exitcode < 0}
        code, line = failure_line(codes, signals)
        print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *UNHEARD):  # the ranks are gone: a second
            signal.signal(sig, signal.SIG_IGN)                                 # signal has nothing to stop
        signum = asked[0] if asked else int(exc.sigval)
        if early:  # no rank was started: nothing to checkpoint, and the launch may simply be made again
            from fedcp_dist.rundir.preemption import write_status

            try:
                write_status("preempted")
            except OSError:
                pass
            print(f"fedcp-run --ranks: got {signal.Signals(signum).name} before the ranks started; nothing ran",
                  file=sys.stderr, flush=True)
            return EXIT_REQUEUE
        code = stopped_status(os.environ.get("FEDCP_STATUS_FILE"), signum)
        said = {EXIT_REQUEUE: "stopped after their checkpoint", 0: "had finished the run"}.get(
            code, "stopped (no checkpoint was reported)")
        print(f"fedcp-run --ranks: got {signal.Signals(signum).name}; the ranks {said}", file=sys.stderr, flush=True)
        return code
    finally:
        for path in ([own, own + REFUSED_SUFFIX] if own else []):
            try:
                os.unlink(path)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
