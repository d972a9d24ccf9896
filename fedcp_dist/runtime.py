"""Launcher detection, device pinning and the process group.

One process per rank. The launcher is read from the environment:

* ``torchrun`` — ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``;
* ``mpi`` — ``mpirun``/``mpiexec`` (Open MPI or MPICH): rank and size from mpi4py's
  ``COMM_WORLD``, the rendezvous address chosen by rank 0 and broadcast over MPI;
* ``slurm`` — ``srun`` job steps: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_STEP_NUM_TASKS``;
  the master is the first host of the step's node list (``scontrol show hostnames``, or this
  module's parser where scontrol is missing or cannot answer), the port derives from the job id,
  and a node's tasks (``SLURM_NODEID``'s count in ``SLURM_STEP_TASKS_PER_NODE``) share its cores
  and GPUs;
* ``single`` — anything else: one rank, no process group.

``FEDCP_LAUNCHER`` forces one of these names. A rank of a job (any launcher but ``single``) stops
within a second of its launcher's death (:func:`watch_launcher`).

The launcher's variables are checked before anything waits on them
(:func:`~fedcp_dist.launch_env.check_launcher_env`): a
value that is not a number, a rank outside the world, a forced launcher without its variables, or
a partial torchrun set that names a rank of a larger world is one :class:`UserError` naming the
variable. The rendezvous (every rank of the job meeting at ``MASTER_ADDR:MASTER_PORT``) waits at most
``rendezvous_timeout`` seconds and then fails in one line naming the address and the variables it
was read from: leftover ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables (an ``srun --pty`` shell, an
old export) otherwise make a plain run wait for ranks that never come.
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from fedcp_dist.errors import Preempted, RunFailure, UserError, first_line
from fedcp_dist.launch_env import (SLURM_VARS, TORCHRUN_VARS, _within, check_launcher_env, mpi_peer_stopped, mpi_say_stopped,
                                   rendezvous, stderr_held)

LAUNCHERS = ("torchrun", "mpi", "slurm", "single")


def detect_launcher(env: Mapping[str, str] = os.environ) -> str:
    """The launcher this process was started by (see the module's docstring), its variables checked
    (:func:`~fedcp_dist.launch_env.check_launcher_env`)."""
    forced = env.get("FEDCP_LAUNCHER")
    if forced:
        if forced not in LAUNCHERS:
            raise UserError(f"FEDCP_LAUNCHER={forced!r} is not one of {', '.join(LAUNCHERS)}")
        launcher = forced
    elif "TORCHELASTIC_RUN_ID" in env or all(k in env for k in TORCHRUN_VARS):
        launcher = "torchrun"
    elif "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        launcher = "mpi"
    elif all(k in env for k in SLURM_VARS):
        launcher = "slurm"
    else:
        launcher = "single"
    check_launcher_env(launcher, env, forced=bool(forced))
    return launcher


def expand_nodelist(nodelist: str) -> list:
    """A SLURM host list in its compressed form, expanded in order: ``"gpu[007-008,12],cpu1"`` →
    ``["gpu007", "gpu008", "gpu12", "cpu1"]`` (ranges keep their zero padding). The fallback of
    :func:`slurm_hosts` where ``scontrol`` is missing or cannot answer."""
    hosts = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)(?:,|$)", nodelist.strip()):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix and ranges is None:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise UserError(f"cannot read the SLURM node list {nodelist!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    if not hosts:
        raise UserError(f"cannot read the SLURM node list {nodelist!r}")
    return hosts


def slurm_hosts(nodelist: str) -> list:
    """The hosts of a SLURM node list: ``scontrol show hostnames`` where it is installed and
    answers (within 10 s), else :func:`expand_nodelist` (which reads the usual ``prefix[a-b,c]``
    forms; ``scontrol`` also knows the rarer ones, e.g. several bracket groups in one name)."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            p = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
            hosts = p.stdout.split()
            if p.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(nodelist)


def tasks_per_node(spec: str) -> list:
    """``SLURM_STEP_TASKS_PER_NODE`` such as ``"4(x2),3"`` → ``[4, 4, 3]`` (one count per node of the step)."""
    counts = []
    for part in (spec or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts or [1]


@dataclass
class Endpoint:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: Optional[str]  # None: one rank, no process group


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a SLURM job step without ``MASTER_PORT``: from the job id and the step id,
    so that the steps of one allocation (an ``salloc`` running two) each have their own, and jobs
    with consecutive ids (an array's tasks on one node) never share one; in 20000–31999, below
    Linux's range of ports handed to outgoing connections (32768 and up)."""
    def number(name: str) -> int:
        value = env.get(name) or ""
        return int(value) if value.isdigit() else 0
    return 20000 + (number("SLURM_JOB_ID") + 997 * number("SLURM_STEP_ID")) % 12000


def resolve_endpoint(launcher: str, env: Mapping[str, str] = os.environ) -> Endpoint:
    if launcher == "torchrun":
        world = int(env["WORLD_SIZE"])
        return Endpoint(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK") or 0),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE") or world),
            init_method="env://",
        )
    if launcher == "slurm":
        world = int(env["SLURM_STEP_NUM_TASKS"])
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
        addr = env.get("MASTER_ADDR") or slurm_hosts(nodelist)[0]  # task 0 runs on the step's first node
        port = int(env.get("MASTER_PORT") or slurm_port(env))
        # threads and devices are shared among the tasks of this node, not of the job
        counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        node = int(env.get("SLURM_NODEID") or 0)
        return Endpoint(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID") or 0),
            local_world_size=counts[min(node, len(counts) - 1)],
            init_method=f"tcp://{addr}:{port}",
        )
    if launcher == "mpi":
        try:
            from mpi4py import MPI
        except ImportError:
            raise UserError("started under MPI but mpi4py is not installed: pip install '.[mpi]'") from None
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        name = next((k for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") if k in env), None)
        if name is not None and env[name].strip() != str(world):
            # mpi4py started MPI on its own (a singleton): the variables are an earlier job's, exported
            raise UserError(f"{name}={env[name]} does not match the {world} rank{'s' if world > 1 else ''} MPI started "
                            f"this process among (no mpirun started it): variables left over from an mpirun or a job "
                            f"step; unset them to run one process, or start it with mpirun")
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_world = local.Get_rank(), local.Get_size()
        local.Free()
        addr = None
        if rank == 0:
            host = env.get("MASTER_ADDR") or socket.gethostname()
            addr = f"tcp://{host}:{int(env.get('MASTER_PORT') or _free_port())}"
        addr = comm.bcast(addr, root=0)
        return Endpoint(rank, world, local_rank, local_world, addr)
    return Endpoint(0, 1, 0, 1, None)


class Runtime:
    """This process's place in the job: rank, device, and the collectives the engine uses."""

    def __init__(self, launcher: str, endpoint: Endpoint, device: torch.device, backend: Optional[str], threads: int):
        self.launcher = launcher
        self.rank = endpoint.rank
        self.world_size = endpoint.world_size
        self.local_rank = endpoint.local_rank
        self.local_world_size = endpoint.local_world_size
        self.device = device
        self.backend = backend
        #: why the backend is not the device's usual one ("" when it is)
        self.backend_note = ""
        self.threads = threads
        self.timeout_s = 600.0
        #: what :func:`keep_freed_memory` did ("on", "off", "unavailable (...)")
        self.keep_freed = "off"
        #: what the run is doing, for failure messages ("round 12", "checkpoint after round 50")
        self.phase = "start-up"
        self.failed = False
        #: the launcher this rank watches (:func:`watch_launcher`; None: not watched)
        self.launcher_pid: Optional[int] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over all ranks (a no-op on one rank)."""
        if self.distributed:
            try:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
                self._fail(exc)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all ranks), stacked in rank order: (world_size, *shape)."""
        if not self.distributed:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, tensor.contiguous())
        except Exception as exc:
            self._fail(exc)
        return torch.stack(out)

    def barrier(self) -> None:
        if self.distributed:
            try:
                dist.barrier()
            except Exception as exc:
                self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.failed = True
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            # the launcher died and took the job's store with it: that is why the peer is gone. Its
            # watch (watch_launcher, which set launcher_pid) says so and ends the process within its
            # interval: waiting for it keeps the line one (both said it, at times); this, if it has not
            time.sleep(4 * LAUNCHER_POLL_S)
            raise RunFailure(f"rank {self.rank}, {self.phase}: its launcher (pid {self.launcher_pid}) is gone; stopping "
                             f"(the last complete checkpoint is kept)") from None
        first = first_line(exc)
        missing = self._silent_ranks()
        if missing:
            who = f"rank(s) {', '.join(map(str, missing))} stopped answering"
        elif missing is None and self.rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # without torchrun's agent holding it, rank 0 holds the job's rendezvous store: gone with it
            who = "rank 0 is gone (the job's rendezvous store, which rank 0 held, no longer answers)"
        else:
            who = f"a peer rank died or did not answer within collective_timeout={self.timeout_s:g} s"
        raise RunFailure(f"rank {self.rank}, {self.phase}: a collective failed: {who} ({first})") from None

    def _silent_ranks(self, wait_s: float = 3.0) -> Optional[list]:
        """Ranks that do not check in on the rendezvous store within ``wait_s`` (None: store gone).
        torch's C++ logger writes a stack trace to stderr for a store that is gone: stderr is
        silenced while the store is asked (the run says what happened in its own line)."""
        with stderr_held(lambda line: True):
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set(f"fedcp/alive/{self.rank}", self.phase)
                deadline = time.monotonic() + wait_s
                while True:
                    missing = [r for r in range(self.world_size) if not store.check([f"fedcp/alive/{r}"])]
                    if not missing or time.monotonic() > deadline:
                        return missing
                    time.sleep(0.2)
            except Exception:  # the store lived in the process that died
                return None

    def close(self) -> None:
        # after a failed collective, tearing down the group can block on the dead peer
        if self.distributed and dist.is_initialized() and not self.failed:
            dist.destroy_process_group()

    def describe(self) -> str:
        return (
            f"launcher={self.launcher} world_size={self.world_size} device={self.device} "
            f"backend={self.backend or 'none'}{f' ({self.backend_note})' if self.backend_note else ''} threads={self.threads}"
            + (f" keep_freed_memory={self.keep_freed}" if self.device.type == "cpu" else "")
        )


#: seconds between two looks of the launcher watch at this process's parent
LAUNCHER_POLL_S = 0.5


def watch_launcher(rt: "Runtime", parent: Optional[int] = None, interval: float = LAUNCHER_POLL_S) -> bool:
    """Stop this rank within ``interval`` seconds once its launcher (the parent process) is gone.

    torchrun starts its workers in sessions of their own, so a SIGKILLed torchrun (an OOM kill, a
    lost node agent) would leave them training on, holding the out_dir's lock. A daemon thread
    compares ``os.getppid()`` with the launcher's pid: when the launcher dies the worker is
    re-parented (to init or a subreaper), the thread prints one ``error:`` line and ends the
    process at once (``os._exit``: a gloo collective blocks the main thread and no signal handler
    would run). A checkpoint being written at that moment has no ``COMPLETE`` marker and does not
    count; the last complete one is what a restart resumes from. Works wherever ``getppid`` does
    (no Linux-only parent-death signal, which is also delivered when the parent's *thread* that
    started the worker ends). Returns whether a watch was started (not for a process whose parent
    is init already).
    """
    parent = os.getppid() if parent is None else parent
    if parent <= 1:
        return False
    rt.launcher_pid = parent

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                try:
                    print(f"error: rank {rt.rank}, {rt.phase}: its launcher (pid {parent}) is gone; stopping "
                          f"(the last complete checkpoint is kept)", file=sys.stderr, flush=True)
                except (OSError, ValueError):  # nobody reads the output any more
                    pass
                os._exit(1)

    threading.Thread(target=watch, name="fedcp-launcher-watch", daemon=True).start()
    return True


def _cpu_count(env: Mapping[str, str] = os.environ) -> int:
    """The cores this process may use: its CPU affinity, and within a SLURM job no more than the
    job's CPUs on this node (``SLURM_CPUS_ON_NODE``): a cluster that does not pin tasks to their
    CPUs (``TaskPlugin=task/none``) leaves every core of the node in the affinity, and 1-CPU array
    tasks sharing a node each ran as many threads as it has."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    on_node = env.get("SLURM_CPUS_ON_NODE") or ""
    return max(1, min(n, int(on_node))) if on_node.isdigit() and int(on_node) > 0 else n


#: glibc's mallopt parameters (malloc.h) and the values set by :func:`keep_freed_memory`
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap instead of a mapping of their own (glibc versions that
#: refuse it take 32 MiB, the largest every version accepts)
KEEP_MMAP_THRESHOLD = (1 << 30, 32 << 20)
#: freed memory at the heap's top up to this size is kept, not returned (mallopt takes a C int)
KEEP_TRIM_THRESHOLD = (1 << 31) - 1


def keep_freed_memory(setting, device: torch.device, mallopt=None) -> str:
    """Apply ``keep_freed_memory`` to this process's allocator; returns what the start line says.

    By default glibc serves a block above its mmap threshold (at most 32 MiB, adapting upward)
    from a mapping of its own and unmaps it when freed, and gives memory at the heap's top back to
    the system: a CPU rank then faults every page of such a block in again the next time, a
    convolution's output of an evaluation batch (73.7 MiB for 1,000 MNIST images) or a large
    gradient every step. Measured on a 2-core virtual machine: faulting in fresh memory ran at about
    2 GiB/s against 20 GiB/s for writing memory already held, and evaluation of MNIST batches of
    1,000 took 1.35× as long. ``true`` (or ``auto`` on a CPU device) raises both thresholds,
    so freed memory stays in the process for later allocations; the resident size after a peak
    stays at that peak. No effect on results. ``mallopt``: the C function (tests pass their own).
    """
    if setting is False or (setting == "auto" and device.type != "cpu"):
        return "off"
    if mallopt is None:
        try:
            import ctypes

            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return "unavailable (no glibc mallopt)"
    if not any(mallopt(_M_MMAP_THRESHOLD, v) == 1 for v in KEEP_MMAP_THRESHOLD):
        return "unavailable (mallopt refused)"
    mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
    return "on"


def cuda_backend(local_ranks: int, gpus: int) -> tuple:
    """(backend, why) for CUDA ranks: NCCL, one GPU per rank; gloo (over the same CUDA tensors) where
    more ranks of a node than it has visible GPUs share one, which NCCL refuses ("Duplicate GPU
    detected"): a one-GPU machine then still runs the multi-rank path, e.g. to check it."""
    if local_ranks > gpus:
        return "gloo", f"{local_ranks} ranks share {gpus} GPU{'s' if gpus > 1 else ''}: NCCL needs one GPU per rank"
    return "nccl", ""


def process_group_failure(rank: int, backend: str, exc: BaseException, env: Mapping[str, str] = os.environ) -> str:
    """One line for a process group that could not be opened after the ranks met: the backend's own
    reason (its first line, without the C++ source location) and the setting that most often causes it."""
    first = first_line(exc, limit=10**6)  # the reason is cut below, once its source location is dropped
    reason = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", first).strip()[:200]
    hints = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        if env.get(var):
            hints.append(f"{var}={env[var]} names the network interface to use: check that it exists on every node")
    if "Too many open files" in first:
        hints.append("the open-file limit (ulimit -n) is too low for the ranks' connections: raise it")
    hint = "; ".join(hints) or ("a rank that stopped or died while the group opened (its own line, if any, is in "
                                "its log), a network the ranks cannot reach each other on, or a firewall between nodes")
    return f"rank {rank}: the ranks met but could not open their {backend} process group ({reason}): {hint}"


def _open_group_mpi(ep, kwargs: dict, timeout_s: float, stopped: Optional[Callable[[], bool]]) -> None:
    """The process group's opening under mpirun, which waits for every rank: a rank asked to stop
    meanwhile (a preemption signal to mpirun reaches every rank, at its own moment) says so to the
    others over MPI and every rank stops (75) rather than waiting out ``collective_timeout`` for
    it and failing (exit 1: the job not requeued). mpirun, unlike torchrun and srun, does not stop
    the other ranks when one exits 75."""
    def halt() -> bool:
        return (stopped is not None and stopped()) or mpi_peer_stopped()

    try:
        _within(lambda: dist.init_process_group(**kwargs), time.monotonic() + timeout_s + 5.0, halt,
                "the opening of the process group")
    except TimeoutError:
        raise RuntimeError(f"the process group did not open within collective_timeout={timeout_s:g} s") from None
    except Preempted:
        if stopped is not None and stopped():
            mpi_say_stopped(ep)
        raise


def init_runtime(device: str = "auto", threads: int = 0, timeout_s: float = 600.0, env: Mapping[str, str] = os.environ,
                 keep_freed: object = "auto", rendezvous_timeout: float = 120.0,
                 stopped: Optional[Callable[[], bool]] = None) -> Runtime:
    """Detect the launcher, pin this rank's device and open the process group (the ranks meeting
    within ``rendezvous_timeout`` seconds, :func:`~fedcp_dist.launch_env.rendezvous`, which gives up
    with :class:`~fedcp_dist.errors.Preempted` once ``stopped()``: a preemption signal); on a CPU device the allocator keeps
    freed memory (``keep_freed``: the config's ``keep_freed_memory``)."""
    launcher = detect_launcher(env)
    ep = resolve_endpoint(launcher, env)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("device=cuda but no CUDA device is visible to this process")
        dev = torch.device("cuda", ep.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        # cuDNN's heuristics may pick algorithms that add with atomics (another order every run)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        backend, note = cuda_backend(ep.local_world_size, torch.cuda.device_count())
    else:
        dev = torch.device("cpu")
        backend, note = "gloo", ""
    n_threads = threads or max(1, _cpu_count() // max(1, ep.local_world_size))
    torch.set_num_threads(n_threads)
    rt = Runtime(launcher, ep, dev, None, n_threads)
    rt.timeout_s = timeout_s
    rt.backend_note = note if ep.world_size > 1 else ""
    rt.keep_freed = keep_freed_memory(keep_freed, dev)
    if launcher != "single":  # a rank of a job: its parent is the launcher (torchrun, mpirun, slurmstepd)
        watch_launcher(rt)
    if ep.world_size > 1:
        store = rendezvous(launcher, ep, rendezvous_timeout, env, stopped)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        kwargs = dict(
            backend=backend,
            # the prefix init_process_group gives a store it makes itself
            store=dist.PrefixStore("default_pg", store),
            rank=ep.rank,
            world_size=ep.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        if backend == "nccl":
            kwargs["device_id"] = dev
        try:
            if launcher == "mpi":
                _open_group_mpi(ep, kwargs, timeout_s, stopped)
            else:  # torchrun and srun stop every rank once one stops (exit 75) during start-up
                dist.init_process_group(**kwargs)
        except (RuntimeError, ValueError, OSError) as exc:  # gloo's and NCCL's errors are RuntimeErrors
            raise RunFailure(process_group_failure(ep.rank, backend, exc, env)) from None
        rt.backend = backend
    return rt
