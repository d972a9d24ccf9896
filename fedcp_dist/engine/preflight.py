"""A run's memory, checked before its first round: the peak it will reach, and a one-line refusal of
what cannot fit, naming a config key and a value that would.

The estimate is per rank, made after start-up (the model and method built, the rank's clients'
data resident, the client store and the all-reduce buffer made) and before resuming::

    peak = now + client states + max(training, evaluation, round) + peer exchange + checkpoint + margin

* **now**: what the process holds already: its resident memory on a CPU; on a GPU the bytes
  torch's allocator has handed out on the device (the host's resident memory for the host side).
* **client states**: twice every owned client's persistent state (with its BatchNorm statistics and
  its compression residual) that ``client_state: device`` or ``host`` keeps (a round makes the new
  states while the old ones are freed), less what the store holds already; ``client_state: disk``
  only those in flight (read ahead, recently used, a fused group's). On a GPU a store off the
  device (``host``, ``disk``) moves those in flight to it.
* **training**: fused, the groups trained side by side, each ``slots × per_slot`` (as
  :class:`~fedcp_dist.fused.memory.MemoryPlan` counts them, with the rows a step really has:
  :func:`~fedcp_dist.fused.slots.batch_rows`) and, per client of the group, every phase's starting
  values and outcome, held until the group returns; one client at a time, a batch's
  activations (``ACTIVATION_COPIES × 4`` bytes per element) and three copies of the global state
  and two of a client's (a method with a loop of its own: a pass without gradient over a chunk of
  ``eval_batch_size`` training samples besides, as FedRep computes its features).
* **evaluation**: a test batch's activations (4 bytes per element, no gradient) and a global state.
* **round**: the all-reduce's float64 mean and the server's new global state.
* **dp: central**: a participant's upload delta, float32, while it is clipped (training), and the
  round's float64 noise on the all-reduced sum (round).
* **peer exchange**: a peer method's (FedAMP's, FedFomo's) models of the other clients and its
  all-gather's buffer.
* **checkpoint**: on a GPU the client states copied to the host; with ``client_state: disk`` the
  checkpoint's client files mapped on resume to write them into the store.
* **margin**: :data:`MARGIN` of what is to come and :data:`MARGIN_BYTES`, for the allocator's own
  overhead and what the first round sets up besides.

The free memory is the smallest of every limit that applies: on the host, the memory the kernel
reports available, a cgroup's limit less its usage (v1 or v2, the process's group and those above
it), ``RLIMIT_AS`` less the address space in use and ``RLIMIT_DATA`` less the data segment (these two
count address space: each thread still to start adds :data:`THREAD_ADDRESS_SPACE`, and
:data:`ADDRESS_SLACK` is added for what is mapped beyond what is touched); on a GPU, the device's free
memory plus what torch's allocator holds unused. The arithmetic (:func:`estimate`, :func:`check`)
takes plain numbers (:class:`Figures`), so it is tested with made-up device figures as well.
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from fedcp_dist.algorithms.base import Context
from fedcp_dist.capabilities import PeerExchange, supports
from fedcp_dist.errors import UserError
from fedcp_dist.fused import groups as fused_groups
from fedcp_dist.fused import memory as fused_memory
from fedcp_dist.models import build_model, model_options
from fedcp_dist.state.client_store import HostClientStore, banks_in_files
from fedcp_dist.state.disk_store import PREFETCH_DEPTH, DiskClientStore
from fedcp_dist.state.process_memory import client_state_size, rss_bytes, state_bytes

MiB = 2**20
#: fraction of what is still to come added for the allocator's overhead, and a fixed part for what
#: the first round sets up besides (kernel caches, autograd's state, Python objects)
MARGIN, MARGIN_BYTES = 0.15, 32 * MiB
#: against RLIMIT_AS and RLIMIT_DATA, which count address space rather than resident memory: what a
#: thread started later takes (its 8 MiB stack and the 64 MiB malloc arena glibc reserves for it,
#: rounded up), and the address space mapped beyond what is touched
THREAD_ADDRESS_SPACE, ADDRESS_SLACK = 80 * MiB, 32 * MiB
ADDRESS_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA")
#: floats per activation element during training: the output kept for the backward pass and its gradient
ACTIVATION_COPIES = 2


@dataclass
class Figures:
    """What the estimate is made of, in bytes and counts (one rank)."""

    device: str  # "cpu" | "cuda"
    now: int  # the device's bytes in use now (a CPU: the process's resident memory)
    now_host: int  # the host's resident memory (a CPU: the same as ``now``)
    owned: int  # clients this rank owns
    held: int  # bytes of client state the store holds now
    per_client: int  # bytes one client keeps (state, BatchNorm statistics, residual)
    store: str  # device | host | disk
    in_flight: int  # clients a disk store holds at once (read ahead, recently used)
    global_bytes: int
    upload_elements: int
    batch_size: int
    max_train: int  # the run's largest client's training samples
    eval_batch_size: int
    max_test: int  # the rank's largest client's test samples
    act_train: int  # activation elements per training sample (the largest phase)
    act_eval: int  # activation elements per test sample
    #: the method trains in a loop of its own (FedRep, pFedMe, Per-FedAvg): it may also run the model
    #: without gradient over a client's training samples, in chunks of eval_batch_size
    own_loop: bool = False
    #: a peer method's models of the other clients and the round's all-gather (FedAMP, FedFomo)
    peer_bytes: int = 0
    #: ``dp: central``: each upload's delta is made to be clipped, and the round's sum is noised
    dp: bool = False
    fused: bool = False
    slot_params: int = 0  # a fused slot's bytes besides its activations
    per_result: int = 0
    #: bytes a fused group holds per client until it returns: every phase's starting values and outcome
    group_per_client: int = 0
    slot_cap: int = 1  # the device kind's cap on slots
    slot_budget: int = 0  # bytes the slots may take (a fraction of the device's total memory)
    group_clients: int = 0  # the rank's largest fused group
    fused_group: int = 0  # a smaller group size tried instead (0: the run's)
    groups: int = 0  # the rank's fused groups
    workers: int = 1  # fused groups trained side by side
    side_budget: int = 0  # bytes the groups side by side may take (a fraction of the free memory)

    def rows(self) -> int:
        return max(1, min(self.batch_size, self.max_train))

    def group(self) -> int:
        return min(self.group_clients, self.fused_group) if self.fused_group else self.group_clients

    def slots(self) -> int:
        """As :func:`fedcp_dist.fused.groups.group_slots` sizes them."""
        per_slot = self.slot_params + ACTIVATION_COPIES * 4 * self.rows() * self.act_train
        return max(1, min(self.slot_cap, max(1, self.group()), self.slot_budget // max(1, per_slot + self.per_result)))

    def threads_to_start(self) -> int:
        """Threads the rounds start: the groups trained side by side, a disk store's writer."""
        return (self.workers if self.fused and self.workers > 1 else 0) + (self.store == "disk")


def training_bytes(f: Figures) -> Tuple[int, str]:
    """(bytes, how) of the local training of one round at its peak."""
    act = ACTIVATION_COPIES * 4 * f.rows() * f.act_train
    clip = 4 * f.upload_elements if f.dp and f.owned else 0  # dp=central: the upload's delta being clipped
    if f.fused and f.group_clients:
        slots, clients = f.slots(), f.group()
        one = slots * (f.slot_params + act) + clients * (f.group_per_client or 2 * f.per_result)
        at_once = max(1, min(f.workers, f.groups, f.side_budget // max(1, one)))
        return (at_once * one + clip,
                f"{at_once} fused group(s) of {clients} at once, {slots} slots of {mib(f.slot_params + act)}")
    if f.owned == 0:
        return 0, "no client on this rank"
    chunks = 4 * max(1, min(f.eval_batch_size, f.max_train)) * f.act_eval if f.own_loop else 0
    return (act + chunks + 3 * f.global_bytes + 2 * f.per_client + clip,
            f"one client at a time, batches of {f.rows()} rows")


def estimate(f: Figures) -> Dict[str, Dict[str, int]]:
    """{pool: {item: bytes}} of what the rounds add to what is in use now: pool ``device`` (a CPU's
    is the host) and, on a GPU, ``host``; the margin is an item of its own."""
    gpu = f.device != "cpu"
    in_flight = min(f.owned, f.in_flight + max(1, f.group())) * f.per_client  # read ahead, recent, a group's
    # every client's, as the store keeps them, twice: a round allocates the new states while the old
    # ones are being freed, and the allocator keeps what it frees in between (measured: Ditto's
    # resident memory grows by about its states' size over its first rounds, then stays)
    kept = max(0, 2 * f.owned * f.per_client - f.held)
    train, _ = training_bytes(f)
    rows_e = max(1, min(f.eval_batch_size, f.max_test))
    evaluation = 4 * rows_e * f.act_eval + f.global_bytes
    round_ = (2 + f.dp) * 8 * f.upload_elements + f.global_bytes  # dp=central: the noise, float64
    # copied to the host to be written (a disk store's files go file to file, never held; see mapped_bytes)
    checkpoint = f.owned * f.per_client + f.global_bytes if gpu and f.store == "device" else 0
    if not gpu:  # one pool, the host's
        pools = {"device": {"client states": in_flight if f.store == "disk" else kept,
                            "training": max(train, evaluation, round_), "peer exchange": f.peer_bytes,
                            "checkpoint": checkpoint}}
    else:  # a store off the device moves the states in use to it
        pools = {"device": {"client states": kept if f.store == "device" else in_flight,
                            "training": max(train, evaluation, round_), "peer exchange": f.peer_bytes},
                 "host": {"client states": {"device": 0, "host": kept}.get(f.store, in_flight), "checkpoint": checkpoint}}
    for items in pools.values():
        items["margin"] = int(MARGIN * sum(items.values())) + MARGIN_BYTES
    return pools


def mapped_bytes(f: Figures) -> int:
    """Bytes of files mapped into memory at a resume (a disk store's checkpointed client files, read
    into its own): page cache, which the kernel may drop, yet address space."""
    return f.owned * f.per_client if f.store == "disk" else 0


def mib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / MiB:.1f} MiB" if n < 10 * MiB else f"{n / MiB:.0f} MiB"


@dataclass
class Free:
    """What a pool may still take: [(limit's name, bytes left)]."""

    limits: List[Tuple[str, int]]

    @staticmethod
    def counted(name: str, need: int, threads: int = 0, mapped: int = 0) -> int:
        """``need`` as the limit ``name`` counts it: the address-space limits add the threads still
        to start, the files to be mapped and the address space mapped beyond what is touched."""
        if name not in ADDRESS_LIMITS:
            return need
        return need + threads * THREAD_ADDRESS_SPACE + mapped + ADDRESS_SLACK

    def tightest(self, need: int, threads: int = 0, mapped: int = 0) -> Optional[Tuple[str, int, int]]:
        """(limit, what it counts, bytes left) of the first limit ``need`` does not fit, else None."""
        for name, left in self.limits:
            counted = self.counted(name, need, threads, mapped)
            if counted > left:
                return name, counted, left
        return None


def _host(f: Figures, pool: str) -> bool:
    """Whether ``pool`` is the host's (a CPU's pool ``device`` is)."""
    return pool == "host" or f.device == "cpu"


def _address(f: Figures, pool: str) -> dict:
    """What the address-space limits count besides the pool's bytes: the threads to start and the
    files to be mapped (the host's)."""
    return {"threads": f.threads_to_start(), "mapped": mapped_bytes(f)} if _host(f, pool) else {}


def fits(f: Figures, free: Dict[str, Free]) -> Optional[Tuple[str, str, int, int]]:
    """None when every pool's need fits its limits, else (pool, limit, need, left) of the first that does not."""
    for pool, items in estimate(f).items():
        bad = free[pool].tightest(sum(items.values()), **_address(f, pool))
        if bad is not None:
            return (pool, *bad)
    return None


def _halvings(n: int) -> List[int]:
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


def alternatives(f: Figures) -> List[Tuple[str, Figures]]:
    """(key=value, the figures with it) for the settings that take less memory, least disruptive first."""
    out = []
    if f.device != "cpu" and f.store == "device" and f.owned * f.per_client > 0:
        out.append(("client_state=host", dataclasses.replace(f, store="host")))
    if f.store != "disk" and f.owned * f.per_client > 0:
        out.append(("client_state=disk", dataclasses.replace(f, store="disk")))
    if f.fused:
        out += [(f"fused_group={g}", dataclasses.replace(f, fused_group=g)) for g in _halvings(f.group())]
        out.append(("fused=false", dataclasses.replace(f, fused=False)))
    out += [(f"eval_batch_size={b}", dataclasses.replace(f, eval_batch_size=b))
            for b in _halvings(min(f.eval_batch_size, f.max_test))]
    out += [(f"batch_size={b}", dataclasses.replace(f, batch_size=b)) for b in _halvings(f.rows())]
    return out


def _items(items: Dict[str, int], how: str = "") -> str:
    return ", ".join(f"{k} {mib(v)}" + (f" [{how}]" if how and k == "training" else "") for k, v in items.items() if v)


def check(f: Figures, free: Dict[str, Free], rank: int) -> str:
    """The line that says the run's estimated peak and what is free; a one-line UserError naming a
    key and a value that would fit when it does not fit."""
    pools = estimate(f)
    bad = fits(f, free)
    gpu = f.device != "cpu"
    if bad is None:
        parts = []
        for pool, items in pools.items():
            now, need = (f.now if pool == "device" else f.now_host), sum(items.values())
            left = ", ".join(f"{name}: {Free.counted(name, need, **_address(f, pool)) / MiB:.0f} of {room / MiB:.0f} MiB left"
                             if name in ADDRESS_LIMITS else f"{mib(room)} {name}" for name, room in free[pool].limits)
            parts.append(f"{'GPU' if gpu and pool == 'device' else 'host'} about {mib(now + need)} at the peak "
                         f"({mib(now)} now + {_items(items)}); free: {left}")
        return f"memory on rank {rank}: " + "; ".join(parts)
    pool, limit, need, left = bad
    where = "GPU memory" if gpu and pool == "device" else "host memory"
    what = "address space" if limit in ADDRESS_LIMITS else where
    head = (f"rank {rank} needs about {mib(need)} more {what} for its rounds ({_items(pools[pool], training_bytes(f)[1])}"
            f"{'; with threads, mapped files and slack' if limit in ADDRESS_LIMITS else ''}) but {mib(max(0, left))} "
            f"are left ({limit})")
    for setting, g in alternatives(f):
        if fits(g, free) is None:
            key = setting.split("=")[0]
            note = " (it changes the results)" if key == "batch_size" else ""
            raise UserError(f"config key '{key}': {head}; {setting} fits{note}")
    raise UserError(f"not enough memory: {head}; not even client_state=disk, fused=false, batch_size=1 and "
                    f"eval_batch_size=1 would fit: use more ranks (each holds fewer clients) or a machine with more "
                    f"memory")


# ----------------------------------------------------------------------------- measuring


def _status(field: str) -> int:
    """A ``Vm*`` figure of /proc/self/status in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:  # "max": no limit
        return None


def _inactive_file(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_left(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> Optional[int]:
    """Bytes left under the memory cgroup limits of this process (its group and those above; v1
    or v2; page cache the kernel may drop not counted as used), None when no limit applies."""
    try:
        with open(proc) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    best = None
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                         "memory.stat", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:i])
            limit, usage = _read_int(os.path.join(d, files[0])), _read_int(os.path.join(d, files[1]))
            if limit is None or usage is None or limit >= 1 << 60:
                continue
            left = limit - max(0, usage - _inactive_file(os.path.join(d, files[2]), files[3]))
            best = left if best is None else min(best, left)
    return best


def host_free() -> Free:
    """The host's limits: available memory, cgroup, RLIMIT_AS, RLIMIT_DATA (those that apply)."""
    limits = [("available memory", fused_memory._host_memory("available", "MemAvailable"))]
    left = cgroup_left()
    if left is not None:
        limits.append(("cgroup memory limit", left))
    for name, field in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            limits.append((name, soft - _status(field)))
    return Free(limits)


def resident_data_bytes(info, counts) -> int:
    """Bytes the clients with ``counts`` samples (train + test) keep resident: their inputs
    (images uint8, token ids int32 with a length, tables float32) and int64 labels."""
    per = math.prod(int(s) for s in info.input_shape)
    if info.kind == "text":
        per = 4 * per + 4
    elif info.kind == "table":
        per = 4 * per
    return int(sum(int(c) for c in counts)) * (per + 8)


def check_data(info, counts, rank: int, device) -> None:
    """Before the shard's clients are read: refuse in one line when this rank's clients' data
    (``counts``: each one's train + test samples) cannot fit in the memory free now (on a GPU: on
    the device, and in host memory, where it is read first)."""
    need = resident_data_bytes(info, counts)
    free = free_memory(device)
    for pool, limits in free.items():
        bad = limits.tightest(need, 0)
        if bad is not None:
            where = "GPU memory" if pool == "device" and "host" in free else "host memory"
            counted = "" if bad[1] == need else (f", {mib(bad[1])} of address space with what reading it maps "
                                                 f"beyond what it touches")
            advice = ("use more ranks (each holds fewer clients) or fewer of the shard's clients (data.clients)"
                      if need > bad[2] else f"raise or unset {bad[0]} ({'ulimit -d' if 'DATA' in bad[0] else 'ulimit -v'})")
            raise UserError(f"not enough memory: rank {rank}'s {len(counts)} clients hold {mib(need)} of data (in "
                            f"{where}{counted}) but {mib(max(0, bad[2]))} are left ({bad[0]}); {advice}")


def model_activations(cfg, info) -> int:
    """Output elements per sample of the model's layers on the shard's inputs: a copy of the model
    built and run (two zero samples, evaluation mode, no gradient) with torch's random state put
    back afterwards, so the run's own model and draws are untouched."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, info.input_shape, info.num_classes, vocab_size=info.vocab_size,
                            **model_options(cfg)).eval()
        x = torch.zeros(2, *[int(s) for s in info.input_shape], dtype=torch.long if info.vocab_size else torch.float32)
        return fused_memory.activation_elements(lambda: model(x), [model]) // 2


def _phase_figures(algo, data, rows: int, client: Optional[int]) -> Optional[Tuple[int, int, int, int]]:
    """(a fused slot's bytes besides activations, a result's bytes, activation elements per sample,
    the bytes a group holds per client) of a method that declares its phases, from a client with
    training data (None: no such method or client). Counted as the fused memory plan counts them,
    on the method's own loss; a group holds every phase's starting values and outcome."""
    if not hasattr(algo, "phases") or algo.fused_reason() is not None:
        return None
    if client is None:
        return None
    ctx = Context(0, client, torch.Generator(device=algo.device).manual_seed(0))
    plans = algo.phases(algo.init_client_state(client), data[client], ctx)
    params = result = act = held = 0
    for phase, cp in plans:
        trained = sum(t.numel() for n, t in cp.start.items() if n in phase.trainable)
        total = sum(t.numel() for t in cp.start.values())
        # a loss that reads trained values itself (a proximal term) keeps their differences and
        # squares in its graph and gets plain gradients for them: three more copies of them
        penalty = 3 * 4 * trained if phase.penalised else 0
        params, result, held = max(params, 4 * (trained + total) + penalty), max(result, 4 * total), held + 2 * 4 * total
        act = max(act, fused_groups._activations(algo, phase, cp, [data[client]]))
    return params, result, act, held


def _peer_bytes(cfg, algo, setup, world_size: int) -> int:
    """A peer method's models of the other clients (unless a disk store maps them from files) and
    its all-gather's buffer, as :func:`fedcp_dist.engine.startup.check_peer_memory` counts them."""
    if not supports(algo, PeerExchange):
        return 0
    bank = 0 if banks_in_files(cfg.client_state, algo.device) else algo.peer_memory_bytes(setup.num_clients)
    return bank + world_size * peer_rows(setup, world_size) * (algo.peer_dim + 1) * 4


def group_participants(cfg, device, setup, groups) -> int:
    """The most clients a fused group of this rank trains in one round: a round trains only its
    participants (at most the largest cohort), as one group of them all where the rank's groups
    train jointly (``fused_join``), else group by group. Counting every client of a group charged a
    small cohort with the population: at 1 % participation a group holds about 800 clients, of
    which a round trains a handful."""
    largest = sum(len(g) for g in groups) if fused_groups.trains_jointly(cfg, device) else max(len(g) for g in groups)
    return min(largest, setup.max_cohort) if setup.max_cohort else largest


def peer_rows(setup, world_size: int) -> int:
    """Rows a rank sends in a peer method's all-gather: as many as the fullest rank has
    participants in a round (:func:`~fedcp_dist.comm.aggregate.exchange_peers`), at most its
    clients and at most the largest cohort."""
    owned = int(setup.clients_per_rank(world_size).max())
    return max(1, min(owned, setup.max_cohort) if setup.max_cohort else owned)


def measure(cfg, rt, setup, algo, store, agg, compressor, groups) -> Figures:
    """This rank's :class:`Figures` after start-up (``groups``: its fused groups' trainer, None when
    its clients train one by one)."""
    device = rt.device
    gpu = device.type == "cuda"
    owned = list(setup.owned)
    data = setup.data
    train = setup.info.train_counts[setup.clients]
    # a client with training samples (None: none on this rank), from the counts, not from the data
    with_train = next((c for c in owned if train[c] > 0), None)
    gs = store.global_state
    upload = sum(s.numel() for s in agg.shapes.values())
    per_client = client_state_size(algo, store, agg, compressor, int(owned[0]))[0] if owned else 0
    kind = "disk" if isinstance(store, DiskClientStore) else "host" if isinstance(store, HostClientStore) else "device"
    rows = setup.batch_rows(cfg)
    act_eval = model_activations(cfg, setup.info)
    phase = _phase_figures(algo, data, rows, with_train) if owned else None
    if hasattr(data, "release"):  # data read on demand: what the figures read is not kept
        data.release()
    f = Figures(
        device=device.type, now=torch.cuda.memory_allocated(device) if gpu else rss_bytes(), now_host=rss_bytes(),
        owned=len(owned), held=store.held_bytes(), per_client=per_client, store=kind,
        in_flight=PREFETCH_DEPTH + DiskClientStore.RECENT, global_bytes=state_bytes(gs), upload_elements=upload,
        batch_size=cfg.batch_size, max_train=int(setup.info.train_counts[setup.clients].max()),
        eval_batch_size=cfg.eval_batch_size, max_test=max((int(setup.info.test_counts[setup.clients[c]]) for c in owned), default=0),
        act_train=phase[2] if phase else 2 * act_eval, act_eval=act_eval, own_loop=algo.own_loop is not None,
        peer_bytes=_peer_bytes(cfg, algo, setup, rt.world_size), dp=cfg.dp == "central")
    if groups is not None and groups.groups and phase is not None:
        threads = torch.get_num_threads()
        workers = fused_groups.workers_for(cfg.fused_workers, device, threads, len(groups.groups))
        f = dataclasses.replace(
            f, fused=True, slot_params=phase[0], per_result=phase[1], group_per_client=phase[3],
            slot_cap=fused_groups.slot_cap(device),
            slot_budget=int(fused_memory.MEMORY_FRACTION * fused_memory.total_memory(device)),
            group_clients=group_participants(cfg, device, setup, groups.groups), groups=len(groups.groups),
            workers=workers,
            side_budget=int(fused_memory.MEMORY_FRACTION * fused_memory.available_memory(device)))
    return f


def free_memory(device) -> Dict[str, Free]:
    """{pool: its limits}: the host's, and on a GPU the device's as well."""
    host = host_free()
    if torch.device(device).type != "cuda":
        return {"device": host}
    return {"device": Free([("the GPU's free memory", fused_memory.available_memory(torch.device(device)))]),
            "host": host}


def preflight(cfg, rt, setup, algo, store, agg, compressor, groups) -> str:
    """:func:`check` of this rank's figures against what is free now; the line saying its estimate."""
    return check(measure(cfg, rt, setup, algo, store, agg, compressor, groups), free_memory(rt.device), rt.rank)
