"""The scheduler of slots: several clients' SGD steps in one forward/backward.

A rank trains its participants one after another with batches of ``B`` = 10 samples, far too few
to keep a CPU's or a GPU's arithmetic units busy. Here the parameters of up to ``S`` clients are
stacked along a leading dimension (one *slot* per client) and every step runs the forward and
backward pass of all active slots at once (:class:`~fedcp_dist.fused.step.FusedStep`, which says how
the group is computed); each client still draws its own batches from its own generator, takes its
own SGD step and gets exactly the result it would get alone (up to float rounding).

Unequal clients
    Clients run ``ceil``-many steps that differ widely (Dirichlet partitions). Instead of padding
    every client's step sequence to the longest one, the slots are refilled continuously: the
    clients enter longest first, a finished client's slot is taken by the next waiting client,
    and once none waits the last active slot is moved into the hole, so the active slots are
    always the prefix ``[:k]`` of the stacked tensors (plain views, no gathering) and no step
    computes anything for a client that has no step left. A client's batch that is shorter than
    ``B`` (its last batch with ``drop_last=false``, or a client holding fewer than ``B`` samples)
    is padded with copies of its first sample and a 0/1 mask: losses are means over the real
    samples only (the MMD as well), so padded rows get zero gradient.

Randomness
    Each client's batch indices come from :func:`~fedcp_dist.local_train.batch_indices` on its own
    generator, advanced one batch per step exactly as the sequential loop advances it, and noise
    inside a step (FedCP's Gumbel noise) is drawn per client from its generator after that step's
    batch, so every generator is consumed in the same order as in the sequential path.

:func:`train_fused` is the loop; its parts: :class:`Slots` (the stacked values and what each slot
has summed), :func:`next_batch` (each active client's next batch, padded), :func:`sgd_step` (the
forward, the backward and the update) and :func:`retire` (finished clients leave, waiting ones
enter, the rest close up). Which clients form a group and how a rank's groups train side by side:
:mod:`fedcp_dist.fused.groups`; memory and the caps on slots: :mod:`fedcp_dist.fused.memory`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

from fedcp_dist.data.resident import ClientData, stacked_train_batches
from fedcp_dist.fused.forward import InBackwardSGD
from fedcp_dist.fused.step import Batch, FusedStep, stacked_like
from fedcp_dist.local_train import Phase, PhaseOutcome, batch_indices, finished_tallies, lr_of, num_batches

Tensor = torch.Tensor


@dataclass
class ClientRun:
    """One client of a fused group: its data, generator, starting values and training rows."""

    data: ClientData
    generator: torch.Generator
    start: Dict[str, Tensor]  # {name: per-client tensor} for every stacked name
    index: Optional[Tensor] = None  # the training rows it uses (None: all)

    @property
    def n(self) -> int:
        return self.data.n_train if self.index is None else int(self.index.numel())


class Active:
    """A client in a slot: which client, its batches, the steps it has left and the samples it has seen."""

    __slots__ = ("index", "batches", "left", "seen")

    def __init__(self, index: int, batches: Iterator[Tensor], left: int):
        self.index, self.batches, self.left, self.seen = index, batches, left, 0


class Slots:
    """The stacked values of ``slots`` clients (slot j: ``values[name][j]``), each slot's loss sum
    (Σ mean batch loss · real batch size) and its sums of what the loss tallied."""

    def __init__(self, first: Mapping[str, Tensor], names: List[str], slots: int):
        self.names = names
        self.values = {n: stacked_like(first[n], slots) for n in names}
        self.loss = torch.zeros(slots, dtype=torch.float32, device=first[names[0]].device)
        self.tallies: Dict[str, Tensor] = {}  # {name: (slots, ...)} with tallying on
        self.size = slots

    @torch.no_grad()
    def load(self, slot: int, client: ClientRun) -> None:
        """Put ``client``'s starting values in ``slot``; its sums start at 0."""
        for n in self.names:
            self.values[n][slot].copy_(client.start[n])
        self.loss[slot] = 0.0
        for acc in self.tallies.values():
            acc[slot] = 0.0

    @torch.no_grad()
    def move(self, src: int, dst: int) -> None:
        """Slot ``src``'s values and sums into slot ``dst``."""
        for n in self.names:
            self.values[n][dst].copy_(self.values[n][src])
        self.loss[dst] = self.loss[src]
        for acc in self.tallies.values():
            acc[dst] = acc[src]

    def views(self, k: int) -> Dict[str, Tensor]:
        """The first ``k`` slots' values (views: a step updates them in place)."""
        return {n: self.values[n][:k] for n in self.names}

    @torch.no_grad()
    def add(self, losses: Tensor, count: Tensor, tallies: Mapping[str, Tensor]) -> None:
        """A step's (k,) mean losses (each weighted by its real batch size) and its tallies, into the first k slots."""
        k = int(count.shape[0])
        self.loss[:k] += losses.detach().float() * count
        for name, v in tallies.items():
            if name not in self.tallies:
                self.tallies[name] = torch.zeros((self.size, *v.shape[1:]), dtype=v.dtype, device=v.device)
            self.tallies[name][:k] += v

    def outcome(self, slot: int, seen: int, tally: bool, phase: Phase) -> PhaseOutcome:
        """What the client in ``slot`` ends with: copies of its values, its sums."""
        values = {n: self.values[n][slot].clone(memory_format=torch.contiguous_format) for n in self.names}
        tallies = finished_tallies({n: acc[slot] for n, acc in self.tallies.items()}, tally, phase)
        return PhaseOutcome(values, float(self.loss[slot]), seen, tallies=tallies)


def batch_rows(batch_size: int, train_counts) -> int:
    """Rows of a fused step's padded batch: ``batch_size``, or the largest of ``train_counts`` when
    that is smaller (no batch is longer than its client's samples), at least 1."""
    return max(1, min(int(batch_size), max((int(n) for n in train_counts), default=1)))


def next_batch(clients: Sequence[ClientRun], active: Sequence[Active], rows: int, alike: bool = False) -> Batch:
    """Each active client's next batch (its epoch's permutation drawn here, as in the sequential
    loop), a short one padded with copies of its first row to ``rows`` rows (:func:`batch_rows`),
    stacked with the mask of real rows. ``alike``: the clients' batches are prepared alike (see
    :func:`~fedcp_dist.data.resident.stacked_train_batches`), so all at once."""
    idxs, sizes = [], []
    for a in active:
        idx = next(a.batches)
        b = int(idx.shape[0])
        if b < rows:
            idx = torch.cat([idx, idx[:1].expand(rows - b)])
        c = clients[a.index]
        idxs.append(idx if c.index is None else c.index[idx])
        sizes.append(b)
    k = len(active)
    x, y = stacked_train_batches([clients[a.index].data for a in active], idxs, alike)
    count = torch.tensor(sizes, dtype=torch.float32, device=x.device)
    if min(sizes) == rows:
        mask = torch.ones(k, rows, dtype=torch.float32, device=x.device)
    else:
        mask = (torch.arange(rows, device=x.device)[None, :] < count[:, None]).to(torch.float32)
    return Batch(x, y, mask, count, sizes, [clients[a.index].generator for a in active], k)


def sgd_step(phase: Phase, views: Dict[str, Tensor], batch: Batch, trainable: Sequence[str], lr: float,
             param_lr: Optional[Mapping[str, float]], autocast: Callable[[], contextlib.AbstractContextManager],
             tallies: Optional[dict], shared_params: dict) -> Tensor:
    """One step of every active client: the loss on a :class:`FusedStep`, its backward pass (the
    grouped Linear layers step inside it) and the other trained values' step; returns the (k,) losses."""
    leaves = []
    for n in trainable:
        views[n] = views[n].detach().requires_grad_(True)
        leaves.append(views[n])
    rates = None if param_lr is None else {id(views[n]): lr_of(n, lr, param_lr) for n in trainable}
    sgd = None if phase.penalised else InBackwardSGD(lr, rates)
    with autocast():
        losses = phase.loss(FusedStep(views, batch, phase.modules, sgd, shared_params, tallies))
    # the backward pass takes the grouped Linear layers' steps itself; the rest step here
    if losses.requires_grad:
        losses.sum().backward()
    done = sgd.done if sgd is not None else set()
    rest = [t for t in leaves if id(t) not in done and t.grad is not None]
    grads = [t.grad for t in rest if t.grad is not None]
    with torch.no_grad():
        if rest and rates is None:
            torch._foreach_add_(rest, grads, alpha=-lr)
        elif rest and rates is not None:
            for r in sorted(set(rates[id(t)] for t in rest)):
                group = [(t, g) for t, g in zip(rest, grads) if rates[id(t)] == r]
                torch._foreach_add_([t for t, _ in group], [g for _, g in group], alpha=-r)
    return losses


def retire(active: List[Optional[Active]], slots: Slots, sizes: Sequence[int], queue: List[int],
           clients: Sequence[ClientRun], start: Callable[[int], Active], outcomes: list, tally: bool,
           phase: Phase) -> None:
    """After a step: every active client has one step less; a finished one leaves with its outcome
    and the next waiting client (``queue``) takes its slot; once none waits, the last active slot
    is moved into each hole so that the active slots stay the prefix of the stacked values."""
    finished = False
    for j, a in enumerate(active):
        assert a is not None
        a.left -= 1
        a.seen += sizes[j]
        if a.left == 0:
            finished = True
            outcomes[a.index] = slots.outcome(j, a.seen, tally, phase)
            active[j] = None
            if queue:
                i = queue.pop(0)
                slots.load(j, clients[i])
                active[j] = start(i)
    if not finished:
        return
    j = 0
    while j < len(active):
        if active[j] is None:
            while active and active[-1] is None:
                active.pop()
            if j < len(active):
                slots.move(len(active) - 1, j)
                active[j] = active.pop()
        j += 1


def untrained(client: ClientRun) -> PhaseOutcome:
    """The outcome of a client with no step to take: its starting values."""
    return PhaseOutcome({n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in client.start.items()},
                        0.0, 0)


def train_fused(
    clients: Sequence[ClientRun],
    phase: Phase,
    *,
    slots: int,
    batch_size: int,
    drop_last: bool,
    lr: float,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    tally: bool = False,
    param_lr: Optional[Mapping[str, float]] = None,
) -> List[PhaseOutcome]:
    """Plain SGD on ``phase.loss`` for every client of ``clients``, up to ``slots`` at a time.

    Each client's step is ``w ← w − lr·∇(its loss)`` on its ``phase.trainable`` values (``param_lr``:
    {value-name prefix: rate} for the values it names, as in the sequential path), its batches
    come from ``batch_indices(n, batch_size, phase.epochs, drop_last, its generator)``. Returns one
    outcome per client, in order, with every stacked name's final value (and, with ``tally`` or
    the phase's ``tallied``, the sums of what the loss tallied over its real samples, as the
    sequential path has them). A step's batches are padded to :func:`batch_rows` rows, so its
    memory follows the clients' samples, not a ``batch_size`` beyond them.
    """
    if not clients:
        return []
    names = list(clients[0].start)
    trainable = [n for n in names if n in set(phase.trainable)]
    steps = [num_batches(c.n, batch_size, phase.epochs, drop_last) for c in clients]
    outcomes: List[Optional[PhaseOutcome]] = [None if s else untrained(c) for c, s in zip(clients, steps)]
    queue = sorted((i for i in range(len(clients)) if steps[i] > 0), key=lambda i: (-steps[i], i))
    if not queue:
        return all_outcomes(outcomes)
    held = Slots(clients[queue[0]].start, names, max(1, min(int(slots), len(queue))))
    # rows of a step: no batch is longer than the largest client's samples (batch_size may be far larger)
    rows = batch_rows(batch_size, [c.n for c in clients])
    shared_params: dict = {}

    def start(i: int) -> Active:
        c = clients[i]
        return Active(i, batch_indices(c.n, batch_size, phase.epochs, drop_last, c.generator), steps[i])

    active: List[Optional[Active]] = []
    while len(active) < held.size:
        i = queue.pop(0)
        held.load(len(active), clients[i])
        active.append(start(i))
    alike = all(clients[0].data.prepared_alike(c.data) for c in clients[1:])
    while active:
        running = [a for a in active if a is not None]
        batch = next_batch(clients, running, rows, alike)
        step_tallies: Optional[dict] = {} if tally or phase.tallied else None
        losses = sgd_step(phase, held.views(batch.k), batch, trainable, lr, param_lr, autocast, step_tallies,
                          shared_params)
        held.add(losses, batch.count, step_tallies or {})
        retire(active, held, batch.sizes, queue, clients, start, outcomes, tally, phase)
    return all_outcomes(outcomes)


def slot_occupancy(steps: Sequence[int], slots: int) -> List[int]:
    """The active slots of every step :func:`train_fused` takes for clients of ``steps`` local
    steps each with ``slots`` slots: the clients enter longest first (ties: the lower index), a
    finished client's slot is taken by the next waiting one. A step costs a fixed part plus a part
    per active slot (``bench/kernels.py --slot-scan``), so this says how much of a group's time the
    fixed part takes: ``len`` of it is the group's steps, its sum the clients' steps."""
    queue = sorted((i for i in range(len(steps)) if steps[i] > 0), key=lambda i: (-int(steps[i]), i))
    if not queue:
        return []
    width = max(1, min(int(slots), len(queue)))
    left = [int(steps[i]) for i in queue[:width]]
    waiting = [int(steps[i]) for i in queue[width:]]
    out: List[int] = []
    while left:
        out.append(len(left))
        left = [n - 1 for n in left]
        for j, n in enumerate(left):
            if n == 0 and waiting:
                left[j] = waiting.pop(0)
        left = [n for n in left if n > 0]
    return out


def all_outcomes(outcomes: List[Optional[PhaseOutcome]]) -> List[PhaseOutcome]:
    """The outcomes, every client's present."""
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(outcomes), "a client of the group has no outcome"
    return done

