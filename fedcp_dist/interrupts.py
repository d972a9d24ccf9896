"""Stop signals that are never lost in a long write.

Python runs a signal handler between two bytecodes of the main thread, wherever they are: inside a
weakref callback, a finalizer or an at-fork hook (h5py's object finalizers while a shard is
written, ``subprocess.Popen``'s hooks while a sweep starts a point), an exception raised there is
printed as "Exception ignored in …" and dropped, and the program goes on as if no signal had come
(a Ctrl-C to ``fedcp-partition`` then ended in a shard written whole and exit status 0). So a
handler here both raises and records what it raised (:func:`request`), and the long loops call
:func:`check` at points where an exception cannot be lost (every client a shard writer adds, before
a finished file is renamed into place): a stop that was swallowed is raised there again.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator, Optional

from fedcp_dist.errors import Interrupted

#: the exception a stop signal raised, until :func:`check` raises it again or :func:`clear` drops it
_pending: Optional[BaseException] = None


def request(exc: BaseException) -> None:
    """Record ``exc`` as the stop a signal asked for (the handler raises it too)."""
    global _pending
    _pending = exc


def pending() -> Optional[BaseException]:
    return _pending


def clear() -> None:
    """Forget the recorded stop (its caller has acted on it)."""
    global _pending
    _pending = None


def check() -> None:
    """Raise the recorded stop, if a signal asked for one (raised once more if it was swallowed)."""
    if _pending is not None:
        raise _pending


def _unraisable(unraisable) -> None:
    """``sys.unraisablehook`` while stops are listened to: the recorded stop, dropped where Python
    cannot raise it, is left to :func:`check` without the "Exception ignored" traceback; anything
    else goes to Python's own hook."""
    if _pending is None or unraisable.exc_value is not _pending:
        sys.__unraisablehook__(unraisable)


@contextlib.contextmanager
def listening() -> Iterator[None]:
    """While active, a recorded stop dropped inside a callback prints nothing; on leaving, the
    record is cleared and Python's hook restored."""
    previous = sys.unraisablehook
    sys.unraisablehook = _unraisable
    try:
        yield
    finally:
        sys.unraisablehook = previous
        clear()


@contextlib.contextmanager
def stops_on(*signums: int) -> Iterator[None]:
    """While active, each of ``signums`` raises (and records) :class:`~fedcp_dist.errors.Interrupted`
    for it: SIGINT as Python's own KeyboardInterrupt would, SIGTERM likewise (exit 128 + signal),
    so that a command writing a file removes its temporary file and stops."""
    def handle(signum, frame):
        exc = Interrupted(signum)
        request(exc)
        raise exc

    previous = {s: signal.signal(s, handle) for s in signums}
    try:
        with listening():
            yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def descendants(pid: int) -> list:
    """The processes below ``pid`` (children, theirs, ...), read from /proc; [] where there is none."""
    import os

    children: dict = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


#: said when a launcher of several ranks is suspended: their clocks go on while they are stopped
RANKS_PAUSED = ("note: suspended with its ranks; continue it (fg, bg) within the run's collective_timeout (600 s "
                "unless set): a longer pause makes the ranks' next collective time out when they continue, and the "
                "run then stops (it resumes from its last complete checkpoint)")


@contextlib.contextmanager
def following_job_control(note=None) -> Iterator[None]:
    """A launcher whose workers run in sessions of their own (a sweep's point, torchrun's ranks)
    takes them along when it is suspended: a Ctrl-Z (SIGTSTP) stopped the launcher alone while the
    training went on. While active, SIGTSTP stops every process below this one (SIGSTOP) and then
    this one; the SIGCONT that continues it (``fg``, ``bg``, ``kill -CONT``) continues them.
    ``note`` (a callable, or None) gives a line to say on stderr as it suspends them. Linux only
    (/proc): elsewhere the launcher alone is suspended, as before."""
    import os

    if signal.getsignal(signal.SIGTSTP) is signal.SIG_IGN:  # a caller that keeps it ignored: left so
        yield
        return
    held: list = []

    def suspend(_signum, _frame):
        line = note() if note is not None else None
        if line:
            try:
                os.write(2, (line + "\n").encode("utf-8", "replace"))
            except OSError:
                pass
        for p in descendants(os.getpid()):
            try:
                os.kill(p, signal.SIGSTOP)
                held.append(p)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGSTOP)

    def resume(_signum, _frame):
        while held:
            try:
                os.kill(held.pop(), signal.SIGCONT)
            except OSError:
                pass

    previous = {sig: signal.signal(sig, handler) for sig, handler in ((signal.SIGTSTP, suspend),
                                                                      (signal.SIGCONT, resume))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        resume(None, None)
