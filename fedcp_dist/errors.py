"""User-facing errors: one line, a non-zero exit, never a traceback."""
from __future__ import annotations

import argparse
import functools
import io
import os
import sys


#: exit status of a run that was asked to stop (preemption signal), checkpointed and can be requeued
EXIT_REQUEUE = 75
#: exit status when the reader of our output went away (``fedcp-sweep --dry-run | head``): a shell's 128 + SIGPIPE
EXIT_BROKEN_PIPE = 141


class Preempted(Exception):
    """Raised on every rank after the checkpoint that a preemption signal asked for is complete.
    ``nothing_new``: the attempt stopped before it trained a round (during start-up, the ranks'
    rendezvous or its first round's evaluation), so it leaves nothing new behind."""

    def __init__(self, *args, nothing_new: bool = False):
        super().__init__(*args)
        self.nothing_new = nothing_new


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM) that a command ends on: "interrupted", exit 128 + its number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)


class RunFailure(Exception):
    """The run cannot go on (a rank died, a non-finite update, a full disk): one line, exit 1.

    What is on disk stays as the last complete checkpoint left it.
    """


class UserError(Exception):
    """A mistake in what the user gave us (config, file, argument).

    The message is printed as one line; the process exits with status 2. ``said=True``: another
    process printed it on the same terminal (a rank that stops because another rank of
    ``fedcp-run --ranks`` refused the run): the exit status only.
    """

    said = False

    def __init__(self, *args, said: bool = False):
        super().__init__(*args)
        self.said = said


#: set by ``fedcp-run --ranks`` for the ranks it starts: they share one terminal, so a rank that stops
#: only because another refused the run need not say so (the refusing rank's line is the one to read)
ONE_TERMINAL = "FEDCP_ONE_TERMINAL"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (a library's C++ errors add a stack below it), at
    most ``limit`` characters; its type's name when it has no message."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


#: the address-space limit under which loading torch and its libraries fails in ways no handler
#: can turn into a line: measured with a CUDA build of torch 2.14.1 (numpy, OpenBLAS, SciPy), up to
#: 2.9 GiB the process aborts (std::bad_alloc, OpenBLAS's allocation error) and at 3.0 GiB numpy's
#: import hangs on a lock; a run maps about 3.15 GiB once loaded. Above the floor a failed import is
#: caught by :func:`cli_main`, and the run's own pre-flight names the limit.
ADDRESS_SPACE_FLOOR = int(3.25 * 2**30)


def address_space_limit() -> "int | None":
    """The process's RLIMIT_AS in bytes, None when unlimited."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def check_address_space(floor: int = ADDRESS_SPACE_FLOOR) -> None:
    """Refuse, before torch is imported, an address-space limit under which loading it fails."""
    limit = address_space_limit()
    if limit is not None and limit < floor:
        raise UserError(f"the address-space limit (ulimit -v) is {limit / 2**20:,.0f} MiB; loading torch and its "
                        f"libraries needs more than {floor / 2**30:g} GiB of address space before anything is trained "
                        f"(address space, not memory): raise or unset the limit (SLURM's VSizeFactor, SGE's h_vmem "
                        f"set it)")


def launched_copies(env=os.environ) -> int:
    """How many copies of this process a launcher started (mpirun -n, srun -n, torchrun): 1 when
    none did. A batch script's own step (SLURM's ``batch``) is one copy."""
    sizes = [env.get("OMPI_COMM_WORLD_SIZE"), env.get("PMI_SIZE")]
    if "TORCHELASTIC_RUN_ID" in env or "RANK" in env:
        sizes.append(env.get("WORLD_SIZE"))
    if env.get("SLURM_STEP_ID", "batch") not in ("batch", "extern", "interactive"):
        sizes.append(env.get("SLURM_STEP_NUM_TASKS"))
    return max([int(s) for s in sizes if s and s.strip().isdigit()] or [1])


def job_rank(env=os.environ) -> str:
    """This process's rank as a launcher set it (srun, torchrun, mpirun); "0" when none did."""
    return next((env[k] for k in ("SLURM_PROCID", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if env.get(k)), "0")


#: open files a run may need: measured (2026-12-05, digits, 1 thread) a run of one process needs 7 and
#: ``fedcp-run --ranks 2`` (torchrun, its store, gloo's sockets) 32; a larger job opens a few more per
#: peer, and a disk store or an mpirun job a few more again. Under these a run is refused (a hard
#: limit that low cannot be raised); a soft limit under the larger is raised within the hard one.
OPEN_FILES_FLOOR = {"one process": 16, "several ranks": 64}
#: the soft limit a run raises a lower one to, within the hard limit
OPEN_FILES_WANTED = 4096


def check_open_files(several: bool = False, note=None, env=os.environ) -> None:
    """An open-file limit (``ulimit -n``) under :data:`OPEN_FILES_FLOOR`: the soft limit is raised
    within the hard one (to :data:`OPEN_FILES_WANTED`; ``note`` says so, on the first rank only),
    and a hard limit under what the run needs (``several``: ranks started by this command, else
    one process, or one rank of a job a launcher started) is refused in one line. Under a few dozen
    files a run failed at its first checkpoint (naming a source file of the package as the file it
    could not write), and torchrun with a traceback."""
    import resource

    need = OPEN_FILES_FLOOR["several ranks" if several or launched_copies(env) > 1 else "one process"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= OPEN_FILES_FLOOR["several ranks"]:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        who, what = (("a job of several ranks", "its checkpoints, the ranks' sockets") if need > 16 else
                     ("a run", "its checkpoints"))
        raise UserError(f"the open-file limit (ulimit -n) is {soft}, and {hard} at most (its hard limit): {who} opens "
                        f"up to {need} files at once ({what}); raise the hard limit")
    raised = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (ValueError, OSError):  # left as it was: the run goes on under it
        return
    if note is not None and job_rank(env) == "0":
        note(f"note: the open-file limit (ulimit -n) was {soft}, too few for a run (up to "
             f"{OPEN_FILES_FLOOR['several ranks']} files at once); raised to {raised} within its hard limit")


def say(line: str) -> None:
    """``line`` on stderr in one write: the ranks of a job share a log, and print() writes the text
    and its newline apart, so two ranks' lines could run into one."""
    data = (line + "\n").encode("utf-8", "backslashreplace")
    stream = sys.stderr if sys.stderr is not None else sys.stdout  # stderr closed (2>&-): stdout, as print does
    try:
        stream.flush()
        os.write(stream.fileno(), data)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no real file under the stream
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _mpi_world():
    """MPI's COMM_WORLD when this process is a rank of an MPI job of several (MPI started, not yet
    finished), else None; mpi4py is only looked at when something imported it."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
            return mpi.COMM_WORLD
    except Exception:  # an MPI that cannot say: leave as usual
        pass
    return None


#: beside a job script's ``FEDCP_STATUS_FILE``: the ranks that refused the run (exit 2), one a line
REFUSED_SUFFIX = ".refused"


def note_refusal(env=os.environ) -> None:
    """A rank that refuses the run (exit 2: its config, its data) says so beside the job script's
    status file (``FEDCP_STATUS_FILE`` + :data:`REFUSED_SUFFIX`), appending its rank: the other
    ranks, stopped by the launcher meanwhile, may exit 75, which alone would read as a preemption
    to requeue, and a requeued attempt would only be refused again."""
    path = env.get("FEDCP_STATUS_FILE")
    if not path:
        return
    try:
        fd = os.open(path + REFUSED_SUFFIX, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{job_rank(env)}\n".encode())
        finally:
            os.close(fd)
    except OSError:  # the job script then goes by the exit statuses alone
        pass


def leave(code: int):
    """Exit with ``code``. A rank of an MPI job that fails aborts the job instead: exiting, it
    would wait in MPI's finalize for the other ranks, and one that hangs (stopped, stuck on a file
    system) or waits for this one would keep the whole job, and its allocation, until walltime.
    A requeue (every rank stopping together, after their checkpoint) finishes as usual. A refusal
    (2) is noted for the job script (:func:`note_refusal`)."""
    if code == 2:
        note_refusal()
    world = _mpi_world() if code not in (0, EXIT_REQUEUE) else None
    if world is not None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        world.Abort(code)
    sys.exit(code)


def encodable_output() -> None:
    """stdout and stderr replace what their encoding cannot write (σ, ±, é under a Latin-1 or ASCII
    locale: ``PYTHONIOENCODING``, an ISO-8859-1 ``LANG``) instead of raising UnicodeEncodeError in
    the middle of a run, which ended it with a traceback."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if reconfigure is not None and encoding not in ("utf8", "utf8sig", ""):
            try:
                if getattr(stream, "errors", "strict") == "strict":
                    reconfigure(errors="replace")
            except (ValueError, OSError, TypeError):  # a stream already closed, or not a TextIOWrapper
                pass


def cli_main(func):
    """Wrap a console-script ``main`` so that a :class:`UserError` ends in one line on stderr."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        encodable_output()
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            if not exc.said:
                say(f"error: {' '.join(str(exc).split())}")
            leave(2)
        except RunFailure as exc:
            say(f"error: {' '.join(str(exc).split())}")
            leave(1)
        except Preempted as exc:
            say(f"preempted: {exc}")
            leave(EXIT_REQUEUE)
        except KeyboardInterrupt as exc:
            say("interrupted")
            leave(128 + exc.signum if isinstance(exc, Interrupted) else 130)
        except BrokenPipeError:
            # the reader closed the pipe (head, less): stop quietly, and keep the interpreter's
            # final flush of stdout from raising the same error again
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            leave(EXIT_BROKEN_PIPE)
        except OSError as exc:
            # a file the command could not read or write (a folder made read-only or immutable
            # after the checks, a disk that filled): named, in one line
            if not isinstance(exc.filename, (str, os.PathLike)):
                _unexpected()
                raise
            say(f"error: {os_error_subject(exc)}: {exc.strerror or exc}")
            leave(1)
        except (ImportError, MemoryError) as exc:
            limit = address_space_limit()
            if limit is None:
                _unexpected()
                raise
            first = first_line(exc)
            say(f"error: {type(exc).__name__} under an address-space limit of {limit / 2**20:,.0f} MiB (ulimit -v): "
                f"{first}; raise or unset the limit (it counts the libraries torch maps, not memory used)")
            leave(1)
        except Exception as exc:
            # a Ctrl-C inside a library's writer (torch.save's zip writer) comes out as that
            # library's error about the write it cut short: still an interrupt, said in one line
            if not _after_interrupt(exc):
                _unexpected()
                raise
            say("interrupted")
            leave(130)

    return wrapper


def _unexpected() -> None:
    """An error no handler knows (a bug): a rank of an MPI job prints its traceback and aborts the
    job (see :func:`leave`); anywhere else the interpreter prints it, as usual."""
    if _mpi_world() is not None:
        import traceback

        traceback.print_exc()
        leave(1)


class StdoutThatMayGo(io.TextIOBase):
    """``sys.stdout`` of a training run: when it can no longer be written (its reader went away,
    ``| head -1``; a full device, ``>/dev/full``), the run goes on without it, saying so once on
    stderr, instead of dying at its next progress line (its results are in out_dir, not on stdout)."""

    def __init__(self, stream):
        super().__init__()
        self._stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._lost(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lost(exc)

    def _lost(self, exc: OSError) -> None:
        self.gone = True
        try:  # the interpreter's last flush of the real stream must not fail again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        try:
            print(f"note: stdout cannot be written ({exc.strerror or exc}); the run goes on without it (its "
                  f"progress is in metrics.jsonl)", file=sys.stderr, flush=True)
        except OSError:
            pass

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return not self.gone and self._stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return self._stream.encoding


def os_error_subject(exc: OSError) -> str:
    """The file an OSError is about; for a whole-file write's temporary name (``.NAME.tmp-…``), the
    file it was to become."""
    path = os.fspath(exc.filename)
    folder, name = os.path.split(path)
    if name.startswith(".") and ".tmp-" in name:
        return os.path.join(folder, name[1:name.index(".tmp-")])
    return path


def _after_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was being handled (its context chain)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one-line :class:`UserError` s (exit 2, no usage dump)."""

    def error(self, message):
        for mark, arg in getattr(self, "_marks", {}).items():  # the stand-ins of parse_args, as typed
            message = message.replace(mark, arg)
        raise UserError(f"{self.prog}: {message}")

    def given(self, argv) -> set:
        """The destinations of the options (and positionals) ``argv`` names, at their default value
        too: parsed into a namespace whose every destination holds a mark, which argparse replaces
        only for what the command line gives (an option that applies only with another is then
        refused even when given at its default)."""
        mark = object()
        ns = argparse.Namespace(**{a.dest: mark for a in self._actions if a.dest != argparse.SUPPRESS})
        self.parse_args(argv, namespace=ns)
        return {k for k, v in vars(ns).items() if v is not mark}

    def parse_args(self, args=None, namespace=None):
        """Positional arguments on either side of an option: ``fedcp-run --config F rounds=3
        --print-config lam=1`` and ``fedcp-analyze runs/a --gradcam runs/b`` (plain argparse took
        the positionals after the option for unrecognized arguments). What follows a ``--`` is
        positional, as in plain argparse, even where it begins with a dash (intermixed parsing
        takes it for options again): it is parsed as stand-ins no option takes, then put back."""
        args = sys.argv[1:] if args is None else list(args)
        if "--" not in args:
            return self.parse_intermixed_args(args, namespace)
        cut = args.index("--")
        after = args[cut + 1:]
        marks = [f"\0{i}\0" for i in range(len(after))]
        self._marks = dict(zip(marks, after))
        try:
            ns = self.parse_intermixed_args(args[:cut] + ["--"] + marks, namespace)
        finally:
            back, self._marks = self._marks, {}
        for action in self._get_positional_actions():
            value = getattr(ns, action.dest, None)
            if isinstance(value, list):
                setattr(ns, action.dest, [back.get(v, v) if isinstance(v, str) else v for v in value])
            elif isinstance(value, str):
                setattr(ns, action.dest, back.get(value, value))
        return ns
