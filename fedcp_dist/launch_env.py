"""The launcher's environment, checked before anything waits on it, and the rendezvous of a job's
ranks, bounded in time: :func:`check_launcher_env` refuses variables that cannot describe this
process (one line naming the variable), :func:`rendezvous` meets the other ranks within
``rendezvous_timeout`` or says where it waited and which variables it read. Leftover
``RANK``/``WORLD_SIZE``/``MASTER_*`` variables (an ``srun --pty`` shell, an old export) otherwise make
a plain run wait for ranks that never come. :func:`fedcp_dist.runtime.detect_launcher` and
:func:`fedcp_dist.runtime.init_runtime` call them.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Optional

import torch.distributed as dist

from fedcp_dist.errors import Preempted, RunFailure, UserError, first_line, launched_copies

#: the variables torchrun gives each worker that make an env:// rendezvous
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: the variables a SLURM job step gives each task that the slurm launcher needs
SLURM_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")



def seen(env: Mapping[str, str], names) -> str:
    """``RANK='0' WORLD_SIZE='4'``: the variables among ``names`` that ``env`` sets."""
    return " ".join(f"{k}={env[k]!r}" for k in names if k in env) or "none of them"


def env_int(env: Mapping[str, str], name: str, lo: int = 0, hi: Optional[int] = None, default: Optional[int] = None,
            why: str = "") -> int:
    """The variable ``name`` of ``env`` as an integer in [lo, hi] (``default`` where it is unset or
    empty); anything else is a one-line UserError naming it (``why``: where the variable comes from)."""
    raw = env.get(name, "")
    if raw.strip() == "" and default is not None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < lo or (hi is not None and value > hi):
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise UserError(f"environment variable {name}={raw!r} is not {bound}{why}")
    return value


def check_launcher_env(launcher: str, env: Mapping[str, str], forced: bool = False) -> None:
    """Refuse, in one line naming the variable, launcher variables that cannot describe this process:
    not numbers, a rank outside its world, a forced launcher without its variables, or (no launcher
    found) a partial torchrun set that makes this process a rank of a larger job."""
    if launcher == "torchrun":
        missing = [k for k in TORCHRUN_VARS if not env.get(k)]
        if missing:
            how = "FEDCP_LAUNCHER=torchrun" if forced else "TORCHELASTIC_RUN_ID is set"
            raise UserError(f"{how} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set "
                            f"(torchrun sets {', '.join(TORCHRUN_VARS)} for each worker; seen: "
                            f"{seen(env, TORCHRUN_VARS)}); start the run with torchrun, or unset "
                            f"{'FEDCP_LAUNCHER' if forced else 'TORCHELASTIC_RUN_ID'} to run one process")
        why = (f" (read as torchrun's, since {', '.join(TORCHRUN_VARS)} are set; left over from an earlier job or "
               f"an srun --pty shell? unset them to run one process)")
        world = env_int(env, "WORLD_SIZE", 1, why=why)
        env_int(env, "RANK", 0, world - 1, why=f" (WORLD_SIZE is {world}){why}")
        local_world = env_int(env, "LOCAL_WORLD_SIZE", 1, default=world, why=why)
        env_int(env, "LOCAL_RANK", 0, local_world - 1, default=0, why=f" (LOCAL_WORLD_SIZE is {local_world}){why}")
        env_int(env, "MASTER_PORT", 1, 65535, why=why)
    elif launcher == "slurm":
        missing = [k for k in SLURM_VARS if not env.get(k)]
        if missing:
            raise UserError(f"FEDCP_LAUNCHER=slurm but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                            f"set (srun sets them for each task of a job step); start the run with srun, or unset "
                            f"FEDCP_LAUNCHER to run one process")
        why = " (read as a task of a SLURM job step: srun sets it)"
        tasks = env_int(env, "SLURM_STEP_NUM_TASKS", 1, why=why)
        env_int(env, "SLURM_PROCID", 0, tasks - 1, why=f" (SLURM_STEP_NUM_TASKS is {tasks}){why}")
        for name in ("SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID"):
            env_int(env, name, 0, default=0, why=why)
        env_int(env, "MASTER_PORT", 1, 65535, default=1, why=" (the rendezvous port of the job step)")
    elif launcher == "mpi":
        env_int(env, "MASTER_PORT", 1, 65535, default=1, why=" (the rendezvous port rank 0 opens)")
    elif launcher == "single":
        copies = launched_copies(env) if forced else 1
        if copies > 1:  # each copy would run the whole run alone, in the same out_dir
            raise UserError(f"FEDCP_LAUNCHER=single but a launcher started {copies} copies of this process "
                            f"({seen(env, ('SLURM_STEP_NUM_TASKS', 'OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'WORLD_SIZE'))}): "
                            f"each would run the whole run alone; unset FEDCP_LAUNCHER to run them as the ranks of one "
                            f"job, or start one copy (srun -n 1)")
        present = [k for k in TORCHRUN_VARS if k in env]
        if present and ("RANK" in env or "WORLD_SIZE" in env):
            rank = env_int(env, "RANK", 0, default=0, why=" (a torchrun variable)")
            world = env_int(env, "WORLD_SIZE", 1, default=1, why=" (a torchrun variable)")
            if rank > 0 or world > 1:
                missing = [k for k in TORCHRUN_VARS if k not in env]
                raise UserError(f"environment variables {seen(env, TORCHRUN_VARS)} make this process a rank of a job, "
                                f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: not a "
                                f"torchrun job (torchrun sets all of {', '.join(TORCHRUN_VARS)}); unset them to run "
                                f"one process, or start the run with torchrun")


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Return once something accepts a connection at ``host:port``; an OSError naming the last
    reason after ``deadline`` (``time.monotonic()``)."""
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise OSError(f"nothing answered at {host}:{port}: {exc.strerror or exc}") from None
        time.sleep(0.25)


#: the variables each launcher's rendezvous is read from, named when it fails
_RENDEZVOUS_VARS = {"torchrun": (*TORCHRUN_VARS, "TORCHELASTIC_RUN_ID"),
                    "slurm": (*SLURM_VARS, "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT"),
                    "mpi": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def job_identity(launcher: str, env: Mapping[str, str]) -> Optional[str]:
    """What names this job (step) on every one of its ranks: SLURM's job and step ids, torchrun's run
    id; None where the launcher gives none (ranks started by hand with torchrun's variables)."""
    if launcher == "slurm" and env.get("SLURM_JOB_ID"):
        return f"SLURM job {env['SLURM_JOB_ID']} step {env.get('SLURM_STEP_ID', '?')}"
    if launcher == "torchrun" and env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun run {env['TORCHELASTIC_RUN_ID']}"
    return None


#: the store key under which rank 0 says whose the store is (:func:`job_identity`)
OWNER_KEY = "fedcp/job"


def _check_owner(store, ep, ident: str, where: str, deadline: float, stopped) -> None:
    """Rank 0 says in the store whose it is; every other rank reads it and stops in one line when
    the store is another job's (another step of the same allocation on the same port): it joined
    that job's store, and waited in its process group until killed."""
    if ep.rank == 0:
        store.set(OWNER_KEY, ident)
        return
    owner = _within(lambda: store.get(OWNER_KEY).decode("utf-8", "replace"), deadline, stopped, where)
    if owner != ident:
        raise RunFailure(f"rank {ep.rank}: the rendezvous store at {where} belongs to another job ({owner}), not to "
                         f"this one ({ident}): two jobs or job steps on one port (srun steps of one allocation that "
                         f"set the same MASTER_PORT, say); give each its own MASTER_PORT")


def _port_taken(exc: BaseException) -> bool:
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def rendezvous(launcher: str, ep, timeout_s: float, env: Mapping[str, str], stopped: Optional[Callable[[], bool]] = None):
    """Meet the job's other ranks at the address of ``ep`` (a :class:`fedcp_dist.runtime.Endpoint`):
    the store the process group is made on.

    Waits at most ``timeout_s`` (the config's ``rendezvous_timeout``), then fails in one line naming
    the address, how many ranks were expected and the variables it was read from. A torchrun world
    whose variables no torchrun set (no ``TORCHELASTIC_RUN_ID``: an old export, say) is announced on
    stderr before the wait. ``stopped()`` true (a preemption signal noted) ends the wait with
    :class:`~fedcp_dist.errors.Preempted`: nothing was trained, and a requeued attempt starts
    where this one would have. Where the launcher names the job (:func:`job_identity`), a rank
    that reached another job's store (a port two steps share) stops in one line.
    """
    names = _RENDEZVOUS_VARS.get(launcher, ())
    if ep.init_method == "env://":
        host, port = env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT") or 0)
    else:
        host, _, port = (ep.init_method or "").removeprefix("tcp://").rpartition(":")
        port = int(port)
    where = f"{host}:{port}"
    if launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in env:
        print(f"note: {seen(env, TORCHRUN_VARS)} are set, but by no torchrun (no TORCHELASTIC_RUN_ID): rank "
              f"{ep.rank} of {ep.world_size} waits up to rendezvous_timeout={timeout_s:g} s for the others at {where} "
              f"(unset them to run one process)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    if launcher == "mpi":
        return _mpi_rendezvous(ep, host, port, deadline, f"rendezvous_timeout={timeout_s:g} s", stopped, lambda why: RunFailure(
            f"rank {ep.rank}: the {ep.world_size} ranks of the job did not meet at {where} "
            f"({why}); launcher {launcher} read from {seen(env, names)}: a rank "
            f"that did not start, a wrong address or port, or variables left over from an earlier job (unset them "
            f"to run one process)"))
    def meet():
        # a rank that connects to a store someone else serves waits here, in Python: torch's own retries
        # print a C++ stack trace at each one
        if ep.rank != 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            _wait_for_listener(host, port, deadline)
        left = max(1.0, deadline - time.monotonic())
        return next(dist.rendezvous(ep.init_method, rank=ep.rank, world_size=ep.world_size,
                                    timeout=datetime.timedelta(seconds=left)))[0]

    try:
        store = _within(meet, deadline + RENDEZVOUS_GRACE_S, stopped, where)
    except (RuntimeError, ValueError, OSError, TimeoutError) as exc:
        if ep.rank == 0 and _port_taken(exc):
            raise RunFailure(f"rank 0: cannot open the job's rendezvous store at {where}: the port is in use (another "
                             f"job, another step of this allocation or another service holds it); set MASTER_PORT to a "
                             f"free port; launcher {launcher} read from {seen(env, names)}") from None
        first = ("something took the connection there and never answered as a rendezvous store"
                 if isinstance(exc, TimeoutError) else first_line(exc))
        raise RunFailure(f"rank {ep.rank}: the {ep.world_size} ranks of the job did not meet at {where} within "
                         f"rendezvous_timeout={timeout_s:g} s ({first}); launcher {launcher} read from "
                         f"{seen(env, names)}: a rank that did not start, a wrong address or port, or variables left "
                         f"over from an earlier job (unset them to run one process)") from None
    ident = job_identity(launcher, env)
    if ident is not None:
        try:
            _check_owner(store, ep, ident, where, time.monotonic() + max(5.0, deadline - time.monotonic()), stopped)
        except (RuntimeError, ValueError, OSError, TimeoutError) as exc:
            raise RunFailure(f"rank {ep.rank}: the job's rendezvous store at {where} did not say whose it is within "
                             f"rendezvous_timeout={timeout_s:g} s ({first_line(exc) or 'no answer'}); launcher "
                             f"{launcher} read from {seen(env, names)}") from None
    return store


#: seconds past rendezvous_timeout that a rendezvous may take before it is given up: torch's store
#: client waits for the answer to its first message without a time limit, so a port that something
#: else holds (a web server, another service) kept a rank there for as long as that held it
RENDEZVOUS_GRACE_S = 5.0


#: seconds between two looks at whether a waiting rank was asked to stop
STOP_POLL_S = 0.2


def _within(work, deadline: float, stopped: Optional[Callable[[], bool]] = None, where: str = ""):
    """``work()`` in a thread of its own, its result or its error; a TimeoutError when it has not
    ended by ``deadline`` (``time.monotonic()``), :class:`~fedcp_dist.errors.Preempted` once
    ``stopped()`` (looked at every :data:`STOP_POLL_S`): the thread is left behind (it holds nothing the
    process needs, and a daemon thread does not keep the process from exiting). What torch's C++
    code prints meanwhile (a stack trace at each retry) is held back; other lines are passed on."""
    out: dict = {}

    def run():
        try:
            out["value"] = work()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name="fedcp-rendezvous", daemon=True)
    with stderr_held():
        thread.start()
        while thread.is_alive() and time.monotonic() < deadline and not (stopped is not None and stopped()):
            thread.join(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
    if thread.is_alive() and stopped is not None and stopped():
        raise Preempted(f"stopped while waiting for the job's other ranks at {where}, before any training (nothing "
                        f"trained in this attempt)", nothing_new=True)
    if thread.is_alive():
        raise TimeoutError("the rendezvous did not end")
    if "error" in out:
        raise out["error"]
    return out["value"]


#: how lines that torch's C++ code writes to stderr begin (glog's prefix, a stack trace's lines),
#: after the ``[rank N]:`` that torch puts before them once a process group exists
_CPP_NOISE = re.compile(r"^(\[rank\d+\]:)?"
                        r"(\[[WEIF]\d{4} |Exception raised from |frame #\d+|<omitting python frames>|\s*$)")


def cpp_noise(line: str) -> bool:
    """True for a line of torch's C++ logging (a log line, a stack trace's, a blank one)."""
    return bool(_CPP_NOISE.match(line))


@contextlib.contextmanager
def stderr_held(drop=cpp_noise):
    """File descriptor 2 (where C++ code writes directly) goes to a temporary file inside the block;
    afterwards its lines are written to stderr but those ``drop`` says are noise (by default torch's
    C++ log lines and stack traces; ``lambda line: True`` silences the block)."""
    try:
        sys.stderr.flush()
        held = tempfile.TemporaryFile()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        os.dup2(held.fileno(), 2)
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        kept = [line for line in held.read().decode("utf-8", "replace").splitlines(keepends=True) if not drop(line)]
        held.close()
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


#: the MPI tag of rank 0's word on the rendezvous store it opened (None) or could not open (why), or
#: :data:`STOPPED`
STORE_TAG = 7301
#: the MPI tag of a rank's word that a preemption signal stopped it during start-up: the others,
#: waiting for rank 0's word or for every rank in the process group's opening, stop too (75) at once
#: instead of waiting out collective_timeout and failing (exit 1, the job not requeued)
STOP_TAG = 7302
#: rank 0's word when it was asked to stop before the ranks met
STOPPED = "\0stopped"


def mpi_peer_stopped() -> bool:
    """Whether another rank of this MPI job said it stopped during start-up (:data:`STOP_TAG`)."""
    from mpi4py import MPI
    return bool(MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=STOP_TAG))


def mpi_say_stopped(ep) -> None:
    """Tell every other rank of this MPI job that this one stopped during start-up (a small message,
    sent eagerly: it does not wait for the others)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    for r in range(ep.world_size):
        if r != ep.rank:
            comm.send(None, dest=r, tag=STOP_TAG)


#: seconds rank 0 waits for its word of a failed or stopped rendezvous to reach the other ranks
WORD_WAIT_S = 10.0


def _deliver(comm, word, world_size: int) -> None:
    """Send ``word`` to every other rank and wait (at most :data:`WORD_WAIT_S`) until each has
    taken it: this rank then ends, and an MPI_Abort (a failed rank ends the job) lost a message not
    yet delivered, so that the others, stopped by mpirun's SIGTERM, said they were asked to stop."""
    requests = [comm.issend(word, dest=r, tag=STORE_TAG) for r in range(1, world_size)]
    end = time.monotonic() + WORD_WAIT_S
    while requests and time.monotonic() < end:
        requests = [q for q in requests if not q.test()[0]]
        if requests:
            time.sleep(STORE_POLL_S / 5)


def _stopped_at_start(where: str, by_another: bool = False):
    who = "another rank was asked to stop" if by_another else "stopped"
    return Preempted(f"{who} while the ranks met at {where}, before any training (nothing trained in this "
                     f"attempt)", nothing_new=True)
#: seconds between two looks of a waiting rank for rank 0's word
STORE_POLL_S = 0.05


def _mpi_rendezvous(ep, host: str, port: int, deadline: float, wait: str, stopped, failure):
    """The rendezvous of ranks that MPI started (and so can tell each other things): rank 0 opens
    the store first and sends every other rank its word over MPI, and only then do the others
    connect. A port rank 0 cannot open (in use by another job, say) is then said by every rank at
    once, instead of the others connecting to whatever holds the port and waiting there, past
    ``rendezvous_timeout``, behind torch's C++ stack traces. ``failure(why)`` makes the error;
    ``wait`` names the time allowed (``deadline``, of ``time.monotonic()``).

    A rank that waits for the word polls (``Iprobe``) and leaves no MPI request pending when the
    time is up, so that it can still exit."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    where = f"{host}:{port}"
    if ep.rank == 0:
        store, why = None, None
        if stopped is not None and stopped():  # asked to stop first: the others stop on the word
            why = STOPPED
        else:
            try:
                store = dist.TCPStore(host, port, ep.world_size, True, left, wait_for_workers=False, multi_tenant=True)
            except (RuntimeError, ValueError, OSError) as exc:
                why = f"rank 0 could not open it: {first_line(exc)}"
        if why is None:
            for r in range(1, ep.world_size):  # a small message: sent eagerly, whether rank r still lives or not
                comm.send(why, dest=r, tag=STORE_TAG)
        else:
            _deliver(comm, why, ep.world_size)
        if why == STOPPED:
            raise _stopped_at_start(where)
        if why:
            raise failure(why)
        return store
    while not comm.Iprobe(source=0, tag=STORE_TAG):
        if time.monotonic() >= deadline:
            raise failure(f"rank 0 had not opened it within {wait}")
        if stopped is not None and stopped():
            mpi_say_stopped(ep)  # rank 0 goes on to open the process group: it would wait for this rank
            raise _stopped_at_start(where)
        if mpi_peer_stopped():
            raise _stopped_at_start(where, by_another=True)
        time.sleep(STORE_POLL_S)
    why = comm.recv(source=0, tag=STORE_TAG)
    if why == STOPPED:
        raise _stopped_at_start(where, by_another=True)
    if why:
        raise failure(why)
    try:
        left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        return dist.TCPStore(host, port, ep.world_size, False, left)
    except (RuntimeError, ValueError, OSError) as exc:
        raise failure(f"{first_line(exc)}, within {wait}") from None
