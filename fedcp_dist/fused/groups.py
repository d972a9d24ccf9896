"""Fused training on a rank: groups fixed by the configuration, their memory, trained side by side.

A client's fused result depends, in float rounding, on the clients it shares its steps with: the
stacked kernels block their sums by the number of active slots, so a group of 8 and a group of 20
give the same client different last bits (measured on a CPU: up to 2e-6 of a weight after one
round). For the same trajectory on any world size the groups are therefore a function of the
configuration and the shard alone (:func:`fedcp_dist.state.placement.form_groups`): the run's clients,
largest first, dealt to groups of at most :func:`group_size` so that the groups weigh alike;
placement puts whole groups on ranks, and each round a group's participants train together with
the same number of slots on whichever rank owns it.

The engine (:class:`GroupTrainer`) reads each group's client states from the store just before
the group trains and hands the results back group by group, so a rank holds the states of the
groups in training, not of its whole cohort. The algorithm only declares its phases and its
``finish``; the memory plan, the slots and the threads are decided here.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from fedcp_dist.fused import memory as fused_memory
from fedcp_dist.fused import slots as scheduler
from fedcp_dist.local_train import Step, amp_autocast, module_keys

#: {algorithm: {phase name: activation elements per sample}}, counted once per phase
_ACTIVATIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def slot_cap(device: torch.device) -> int:
    """Most clients one fused step trains at once on ``device``'s kind (see :mod:`fedcp_dist.fused.memory`)."""
    return fused_memory.CUDA_SLOTS if torch.device(device).type == "cuda" else fused_memory.CPU_SLOTS


#: the automatic group size on a GPU makes at least this many groups (where there are that many
#: clients): a node's GPUs, so that ``torchrun --nproc_per_node=8`` gives every GPU a group
GPU_SPREAD = 8


def group_size(cfg, device, num_clients: int) -> int:
    """Clients per fused group: ``fused_group``, or (0, auto) a size from the configuration and the
    run's client count alone, the same on every rank and world size. Auto: about a slot cap of
    participants a round (the cap of the device kind over the mean participation rate), in a
    number of groups G rounded up to a power of two, each of ⌈N / G⌉ clients (the last may hold
    fewer), so that 1, 2, 4, 8 … ranks can get equal shares of whole groups (20 clients, ρ = 1 on a
    CPU: 4 groups of 5, where groups of 8, cut 8, 8, 4, left 2 ranks at 1.26× their mean steps).
    On a GPU G is at least :data:`GPU_SPREAD` (a node's GPUs; the device kind is part of the
    configuration, the world size is not): the paper's 20 clients make 7 groups of at most 3, one
    for each of 7 GPUs, and a rank holding several trains them together
    (:func:`trains_jointly`)."""
    if cfg.fused_group:
        return int(cfg.fused_group)
    rng = cfg.participation_range
    rho = (float(rng[0]) + float(rng[1])) / 2 if rng else float(cfg.participation)
    per_group = int(slot_cap(device) * max(1, math.ceil(1.0 / max(rho, 1e-6) - 1e-9)))
    n = max(1, int(num_clients))
    groups = 1 << max(0, math.ceil(n / per_group) - 1).bit_length()  # the next power of two
    if torch.device(device).type == "cuda":
        groups = max(groups, GPU_SPREAD)
    return math.ceil(n / groups)


def trains_jointly(cfg, device) -> bool:
    """Whether a rank trains the round's participants of all its groups as one fused set of slots
    (``fused_join``; auto: on a GPU). A GPU's stacked kernels give each slot the same bits whatever
    the number of slots beside it (checked on the GPU by bench/gpu.sh), so the groups then fix only
    the placement and a rank's GPU stays full however many groups it holds; on a CPU the kernels
    block their sums by the number of slots, so each group trains alone there."""
    if cfg.fused_join == "auto":
        return torch.device(device).type == "cuda"
    return bool(cfg.fused_join)


def activation_counts(algo) -> Dict[str, int]:
    """Activation elements per sample of each phase the memory plan has counted for ``algo``."""
    return _ACTIVATIONS.setdefault(algo, {})


def _activations(algo, phase, cp, datas: list) -> int:
    """Output elements of the phase's modules' layers for one sample (counted once per phase)."""
    counted = activation_counts(algo)
    if phase.name not in counted:
        d = next(d for d in datas if d.n_train > 0)
        x, y = d.train_batch(torch.zeros(1, dtype=torch.long, device=d.train_y.device))
        names = module_keys(phase)
        consts = {k: v for k, v in cp.start.items() if k not in names}
        step = Step(x, y, phase.modules, consts, torch.Generator(device=y.device).manual_seed(0))
        counted[phase.name] = fused_memory.activation_elements(lambda: phase.loss(step), list(phase.modules.values()))
    return counted[phase.name]


def memory_plan(algo, plans: list, datas: list, rows: Optional[int] = None) -> fused_memory.MemoryPlan:
    """Per-client memory of fused training (the largest over the phases), from one client's
    phases ``plans`` = [(phase, ClientPhase)]: 4 bytes per stacked value, twice for trained
    ones (their gradient), plus activations counted on a one-sample forward of the loss, times
    ``rows``, a step's rows (None: :func:`fedcp_dist.fused.slots.batch_rows` of ``datas``; the
    engine passes the run's, the same on every rank)."""
    per_slot = per_result = 0
    x = probe_input(datas)
    if rows is None:
        rows = scheduler.batch_rows(algo.cfg.batch_size, [d.n_train for d in datas])
    for phase, cp in plans:
        trained = sum(t.numel() for n, t in cp.start.items() if n in phase.trainable)
        total = sum(t.numel() for t in cp.start.values())
        act = _activations(algo, phase, cp, datas) if x is not None else 0
        per_slot = max(per_slot, 4 * (trained + total) + fused_memory.ACTIVATION_COPIES * 4 * rows * act)
        per_result = max(per_result, 4 * total)
    return fused_memory.MemoryPlan(per_slot=per_slot, per_result=per_result)


def _outcomes(algo, items: list, plans: list, count: int) -> list:
    """Each item's phase outcomes, its clients trained fused, ``count`` at a time."""
    cfg = algo.cfg
    outcomes: List[list] = [[] for _ in items]
    for j, phase in enumerate(p for p, _ in plans[0]):
        runs = [scheduler.ClientRun(d, ctx.generator, plan[j][1].start, plan[j][1].index)
                for (_, d, ctx), plan in zip(items, plans)]
        done = scheduler.train_fused(runs, phase, slots=count, autocast=lambda: amp_autocast(cfg.amp, algo.device),
                                 tally=items[0][2].probe, **algo.sgd_settings(items[0][2]))
        for out, o, plan in zip(outcomes, done, plans):
            o.info = plan[j][1].info
            out.append(o)
    return outcomes


def train_group(algo, items: list, slots: Optional[int] = None, plans: Optional[list] = None) -> list:
    """The LocalResults of ``items`` = [(client_state, data, ctx), ...] trained as one fused group
    (the same results as the algorithm's ``local_train`` within float rounding), ``slots`` at a
    time (None: the slots of :func:`group_slots`)."""
    if not items:
        return []
    plans = plans or [algo.phases(state, data, ctx) for state, data, ctx in items]
    if slots is None:
        slots = group_slots(memory_plan(algo, plans[0], [d for _, d, _ in items]), algo.device)
    outcomes = _outcomes(algo, items, plans, slots)
    return [algo.finish(state, out, ctx) for (state, _, ctx), out in zip(items, outcomes)]


def group_slots(plan: fused_memory.MemoryPlan, device: torch.device) -> int:
    """Clients a group trains at once: the device kind's cap, fewer where that many would not fit
    in :data:`fedcp_dist.fused.memory.MEMORY_FRACTION` of the device's total memory (not its free memory, which
    differs between ranks and moments: the slots change a client's rounding)."""
    return plan.slots(device, slot_cap(device), int(fused_memory.MEMORY_FRACTION * fused_memory.total_memory(device)))


def probe_input(datas: Sequence) -> Optional[torch.Tensor]:
    """One training sample (a batch of 1) of the first client that holds any, else None."""
    for d in datas:
        if d.n_train > 0:
            return d.train_batch(torch.zeros(1, dtype=torch.long, device=d.train_y.device))[0]
    return None


def workers_for(setting, device: torch.device, threads: int, groups: int) -> int:
    """Fused groups trained side by side (``fused_workers``): ``auto`` takes one per thread of a
    CPU rank, an integer that many (on a CPU), never more than ``groups``; 1 on a GPU.

    Why: at B = 10 most of a fused step's kernels are too small to split well over threads
    (measured on 2 cores: the main thread still did 0.65–0.7 of a step's single-thread CPU time
    with 2 threads, a 1.45× speed-up at best), while groups of clients are independent, so one
    group per thread scales like one rank per core does.
    """
    if device.type != "cpu" or groups < 2:
        return 1
    n = threads if setting == "auto" else int(setting)
    return max(1, min(n, groups))


def run_in_workers(jobs: Sequence[Callable[[], object]], one_thread: bool = False) -> list:
    """``[job() for job in jobs]``, each in a thread of its own with one intra-op thread; the
    caller's thread count is restored afterwards. The jobs must be independent (their own
    clients, generators and tensors): results are then the same whatever the threads' timing.
    A single job runs in the caller's thread, on one intra-op thread with ``one_thread`` (the
    thread count changes a kernel's rounding), else on the caller's threads."""
    threads = torch.get_num_threads()
    if len(jobs) == 1:
        if not one_thread or threads == 1:
            return [jobs[0]()]
        torch.set_num_threads(1)
        try:
            return [jobs[0]()]
        finally:
            torch.set_num_threads(threads)

    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()  # thread-local in torch: carried over

    def one(job):
        torch.set_num_threads(1)  # per thread for OpenMP; the process-wide value is 1 meanwhile
        torch.set_default_dtype(dtype)
        with torch.set_grad_enabled(grad):
            return job()

    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(one, jobs))
    finally:
        torch.set_num_threads(threads)


def one_thread_each(cfg, device: torch.device, threads: int) -> bool:
    """Whether each group trains on one intra-op thread: on a CPU rank of several threads unless
    ``fused_workers`` = 1. The thread count changes a kernel's rounding, so under ``auto`` (one
    group per thread) a group trains alike however many threads its rank has and however many
    groups it trains at once; with ``fused_workers`` = 1 a group takes every thread of its rank,
    and the trajectory is then the same on ranks of the same thread count only."""
    return torch.device(device).type == "cpu" and threads > 1 and cfg.fused_workers != 1


def side_by_side(jobs: Sequence[Callable[[], list]], workers: int, group_bytes: int, device: torch.device,
                 one_thread: bool = False) -> list:
    """``[job() for job in jobs]`` (one job: one group), up to ``workers`` at once in threads of
    their own (:func:`run_in_workers`; ``one_thread``: a job alone too on one intra-op
    thread), fewer when that many groups of ``group_bytes`` each would not fit in the memory free
    now (which changes how many run at once, not their results)."""
    fit = int(fused_memory.MEMORY_FRACTION * fused_memory.available_memory(device)) // max(1, group_bytes)
    at_once = max(1, min(workers, fit))
    out: list = []
    for i in range(0, len(jobs), at_once):
        out.extend(run_in_workers(list(jobs[i:i + at_once]), one_thread))
    return out


class GroupTrainer:
    """A rank's fused training of a round: its groups' participants, a group's states read from the
    store just before it trains and its results handed back before the next groups' are read.

    ``groups``: this rank's groups (lists of client ids, the run's order), the same lists whichever
    rank owns them. ``fused_workers`` groups train side by side, one intra-op thread each
    (:func:`one_thread_each`); the slots are the same for every group of the run (:func:`group_slots`),
    sized for ``rows`` rows a step (:func:`fedcp_dist.fused.slots.batch_rows` of the run's clients;
    None: of this rank's)."""

    def __init__(self, cfg, algo, store, data: dict, groups: List[List[int]], device: torch.device,
                 rows: Optional[int] = None):
        self.cfg, self.algo, self.store, self.data, self.device = cfg, algo, store, data, device
        self.rows = rows
        self.groups = [list(g) for g in groups]
        self.slots: Optional[int] = None
        self.plan: Optional[fused_memory.MemoryPlan] = None
        # every member's (group, place in it): a round's groups follow its cohort, not the rank's clients
        self._where: Dict[int, Tuple[int, int]] = {int(c): (i, j) for i, g in enumerate(self.groups)
                                                   for j, c in enumerate(g)}

    def round_groups(self, participants: Sequence[int]) -> List[List[int]]:
        """This rank's groups restricted to the round's ``participants`` (empty ones left out), each in
        its group's order; the work follows the participants, not the rank's clients."""
        hits = sorted((*self._where[c], c) for c in {int(c) for c in participants} if c in self._where)
        out: List[List[int]] = []
        for k, (g, _, c) in enumerate(hits):
            if k == 0 or g != hits[k - 1][0]:
                out.append([])
            out[-1].append(c)
        return out

    def results(self, groups: List[List[int]], context: Callable[[int], object]) -> Iterator[tuple]:
        """(client, LocalResult) for every client of ``groups`` (each trained as one fused group),
        group by group; ``context(c)``: the client's :class:`~fedcp_dist.algorithms.base.Context`."""
        if trains_jointly(self.cfg, self.device) and len(groups) > 1:
            groups = [[c for g in groups for c in g]]  # one set of slots for all of them
        threads = torch.get_num_threads()
        workers = workers_for(self.cfg.fused_workers, self.device, threads, len(groups))
        one_thread = one_thread_each(self.cfg, self.device, threads)
        self.store.prefetch([c for g in groups for c in g])
        i = 0
        while i < len(groups):
            wave = groups[i:i + workers]
            items = [[(self.store.get(c), self.data[c], context(c)) for c in g] for g in wave]
            plans = [[self.algo.phases(*item) for item in group] for group in items]
            plan, slots = self.plan, self.slots
            if slots is None:  # from the first wave that holds a training sample: the same on every rank
                datas = [d for group in items for _, d, _ in group]
                plan = memory_plan(self.algo, plans[0][0], datas, self.rows)
                slots = group_slots(plan, self.device)
                if probe_input(datas) is not None:
                    self.plan, self.slots = plan, slots
            assert plan is not None  # set with the slots
            group_bytes = slots * plan.per_slot + max(len(g) for g in wave) * plan.per_result
            jobs = [functools.partial(train_group, self.algo, it, slots, pl) for it, pl in zip(items, plans)]
            done = side_by_side(jobs, len(wave), group_bytes, self.device, one_thread)
            del items, plans
            for g, res in zip(wave, done):
                yield from zip(g, res)
            i += len(wave)

