"""Fused multi-client local training: several clients' SGD steps in one forward/backward.

A rank trains its participants one after another with batches of ``B`` = 10 samples, far too few
to keep a CPU's or a GPU's arithmetic units busy. Here the parameters of up to ``S`` clients are
stacked along a leading dimension (one *slot* per client) and every step runs the forward and
backward pass of all active slots at once; each client still draws its own batches from its own
generator, takes its own SGD step and gets exactly the result it would get alone (up to float
rounding).

How the group is computed
    A method's loss is written once (a :class:`~fedcp_dist.local_train.Phase`); here it runs on a
    :class:`FusedStep`, whose operations take (k, B, ...) tensors. Layers with per-client
    parameters run as grouped operations on the stacked parameters: ``Conv2d`` as one convolution
    with ``groups = S·groups`` over a channels-last (batch, slot·channel, H, W) tensor, ``Linear``
    as ``baddbmm``, ``LayerNorm`` as a plain normalisation followed by each slot's affine;
    parameter-free per-channel or elementwise layers (pooling, activations) run unchanged on either
    layout. Any other module runs through ``torch.vmap`` over ``torch.func.functional_call``
    (correct for any module whose forward treats samples independently). Grouped channels-last
    convolutions are used instead of vmap's convolution rule, which computes the same grouped
    convolution in NCHW with a layout copy per call; channels-last also makes pooling faster
    (docs/performance.md has the measurements).

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

The SGD step
    ``w ← w − lr·∇w`` per client, as in :func:`~fedcp_dist.local_train.sgd`. The grouped Linear
    layers take their step inside the backward pass
    (:class:`~fedcp_dist.fused.forward._LinearSGD`): at B = 10 their large per-client matrices are
    bound by memory traffic, not arithmetic, and adding the gradient straight into the weight
    saves writing and re-reading a gradient tensor. All other
    parameters get their gradient from the backward pass and step after it. A loss that reads
    trained parameters itself (a proximal term: ``Phase.penalised``) gets plain gradients for
    every parameter instead, since a weight stepped inside the backward pass cannot also be read
    elsewhere in the graph.

Randomness
    Each client's batch indices come from :func:`~fedcp_dist.local_train.batch_indices` on its own
    generator, advanced one batch per step exactly as the sequential loop advances it, and noise
    inside a step (FedCP's Gumbel noise) is drawn per client from its generator after that step's
    batch, so every generator is consumed in the same order as in the sequential path.

Not fused
    Modules with floating-point buffers or batch-dependent layers (BatchNorm, dropout) are
    refused (:func:`~fedcp_dist.local_train.unsupported_reason`); the algorithms then fall back to
    the sequential loop.

The layers' grouped forms: :mod:`fedcp_dist.fused.forward`; memory and the caps on slots:
:mod:`fedcp_dist.fused.memory`; which clients form a group, and how a rank's groups are trained
side by side: :mod:`fedcp_dist.fused.groups`.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from fedcp_dist.fused.forward import InBackwardSGD, grouped_forward, sub_params
from fedcp_dist.local_train import (Phase, PhaseOutcome, batch_indices, finished_tallies, full_precision, lr_of, num_batches,
                                     resolve)
from fedcp_dist.losses import MMD_BANDWIDTHS, at_least_fp32, grouped_mmd2, masked_cross_entropy, masked_mean
from fedcp_dist.options import Component, Option, at_least, auto_or, boolean_or_auto, described

Tensor = torch.Tensor

# ----------------------------------------------------------------------------------------------
# the step a phase's loss is computed on, for a group of clients


@dataclass
class Batch:
    """One fused step's inputs for the ``k`` active slots."""

    x: Tensor  # (k, B, ...) inputs, rows past a slot's count repeat its first sample
    y: Tensor  # (k, B)
    mask: Tensor  # (k, B) float: 1 for real samples, 0 for padding
    count: Tensor  # (k,) float: real samples per slot
    sizes: List[int]  # real samples per slot
    generators: List[torch.Generator]  # each slot's client generator, to draw in-step noise from
    k: int


_SPLIT_CACHE: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


class FusedStep:
    """The :class:`~fedcp_dist.local_train.Step` operations for ``k`` clients' padded batches.

    Activations are client-major (k, B, ...); per-client values are the stacked ``views``
    (k, *shape); losses come back as (k,) per-client means over the real rows.
    """

    def __init__(self, views: Dict[str, Tensor], batch: Batch, modules: Mapping[str, nn.Module],
                 sgd: Optional[InBackwardSGD], shared_params: dict, tallies: Optional[dict] = None):
        self.views, self.batch, self.modules, self.sgd = views, batch, modules, sgd
        self.x, self.y, self.k = batch.x, batch.y, batch.k
        self._shared_params = shared_params
        self.tallies = tallies

    def tally(self, name: str, per_sample: Tensor, dtype: torch.dtype = torch.float32) -> None:
        """Each slot's sum over its real rows of a (k, B) or (k, B, D) per-sample quantity, in
        ``dtype``, as ``tallies[name]`` (k,) or (k, D)."""
        if self.tallies is not None:
            v = per_sample.detach().to(dtype)
            mask = self.batch.mask.view(*self.batch.mask.shape, *([1] * (v.dim() - 2)))
            self.tallies[name] = (v * mask).sum(1)

    def _forward(self, module: nn.Module, params: Dict[str, Tensor], x, k: int, sgd) -> Tensor:
        split = _SPLIT_CACHE.get(module)
        if split is None and type(module) is not nn.Sequential:
            split = computes_head_of_features(module, self.x[0, :1])
            _SPLIT_CACHE[module] = split
        if split:  # a model computing head(features(x)): each part with the grouped layers
            h = grouped_forward(module.features, sub_params(params, "features."), x, k, sgd)
            return grouped_forward(module.head, sub_params(params, "head."), h, k, sgd)
        return grouped_forward(module, params, x, k, sgd)

    def run(self, name: str, x, *, grad: bool = True, batch_stats: bool = False) -> Tensor:
        module, prefix = resolve(self.modules, name)
        params = {n: self.views[prefix + n] for n, _ in module.named_parameters()}
        if grad:
            return self._forward(module, params, x, self.k, self.sgd)
        with torch.no_grad():
            return self._forward(module, params, x, self.k, None)

    def shared(self, module: nn.Module, x, *, grad: bool = True, batch_stats: bool = False) -> Tensor:
        k, b = x.shape[:2]
        if not any(isinstance(m, nn.Conv2d) for m in module.modules()):
            y = module(x.reshape(k * b, *x.shape[2:]))
            return y.view(k, b, *y.shape[1:])
        # convolutions: all k·B samples as one slot of the grouped (channels-last) layers
        if module not in self._shared_params:
            self._shared_params[module] = stack_once(dict(module.named_parameters()))
        with contextlib.nullcontext() if grad else torch.no_grad():
            y = grouped_forward(module, self._shared_params[module], x.reshape(1, k * b, *x.shape[2:]), 1)
        return y.view(k, b, *y.shape[2:])

    def value(self, name: str) -> Tensor:
        t = self.views[name]
        return t.view(t.shape[0], 1, *t.shape[1:])

    def proximal(self, anchor_prefix: str, prefix: str = "") -> Tensor:
        module = self.modules[prefix]
        total = 0.0
        for n, _ in module.named_parameters():
            d = self.views[prefix + n] - self.views[anchor_prefix + n]
            total = total + (d * d).flatten(1).sum(1)
        return total

    def cross_entropy(self, logits: Tensor, y: Optional[Tensor] = None) -> Tensor:
        b = self.batch
        return masked_cross_entropy(logits, b.y if y is None else y, b.mask, b.count)

    def mean(self, per_sample: Tensor) -> Tensor:
        return masked_mean(per_sample, self.batch.mask, self.batch.count)

    def mmd2(self, a: Tensor, b: Tensor, bandwidths=MMD_BANDWIDTHS) -> Tensor:
        with full_precision(a.device):
            return grouped_mmd2(at_least_fp32(a), at_least_fp32(b), self.batch.mask, self.batch.count, bandwidths)

    def gumbel_like(self, logits: Tensor) -> Tensor:
        # each client's noise from its own stream, the same draws as alone; padding: −log 1 = 0
        e = torch.ones_like(logits)
        for j, (n, g) in enumerate(zip(self.batch.sizes, self.batch.generators)):
            e[j, :n].exponential_(generator=g)
        return e.log_().neg_()


# ----------------------------------------------------------------------------------------------
# the slot trainer


@dataclass
class ClientRun:
    """One client of a fused group: its data, generator, starting values and training rows."""

    data: object  # ClientData
    generator: torch.Generator
    start: Dict[str, Tensor]  # {name: per-client tensor} for every stacked name
    index: Optional[Tensor] = None  # the training rows it uses (None: all)

    @property
    def n(self) -> int:
        return self.data.n_train if self.index is None else int(self.index.numel())


class _Active:
    __slots__ = ("index", "batches", "left", "seen")

    def __init__(self, index: int, batches, left: int):
        self.index, self.batches, self.left, self.seen = index, batches, left, 0


def _stacked_like(t: Tensor, slots: int) -> Tensor:
    """Zeros of shape (slots, *t.shape); 4-d parameters (convolution weights) channels-last."""
    if t.dim() == 4:
        o, i, h, w = t.shape
        return torch.zeros((slots, o, h, w, i), dtype=t.dtype, device=t.device).permute(0, 1, 4, 2, 3)
    return torch.zeros((slots, *t.shape), dtype=t.dtype, device=t.device)


def stack_once(params: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Shared parameters as one slot, (1, *shape), in the stacked layout (for a grouped forward
    of a shared module over all slots' samples as one batch)."""
    out = {}
    with torch.no_grad():
        for n, t in params.items():
            out[n] = _stacked_like(t, 1)
            out[n][0].copy_(t)
    return out


def batch_rows(batch_size: int, train_counts) -> int:
    """Rows of a fused step's padded batch: ``batch_size``, or the largest of ``train_counts`` when
    that is smaller (no batch is longer than its client's samples), at least 1."""
    return max(1, min(int(batch_size), max((int(n) for n in train_counts), default=1)))


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
    outcomes: List[Optional[PhaseOutcome]] = [None] * len(clients)
    steps = [num_batches(c.n, batch_size, phase.epochs, drop_last) for c in clients]
    for i, c in enumerate(clients):
        if steps[i] == 0:
            outcomes[i] = PhaseOutcome({n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in c.start.items()}, 0.0, 0)
    queue = sorted((i for i in range(len(clients)) if steps[i] > 0), key=lambda i: (-steps[i], i))
    if not queue:
        return outcomes  # type: ignore[return-value]
    slots = max(1, min(int(slots), len(queue)))
    # rows of a step: no batch is longer than the largest client's samples (batch_size may be far larger)
    rows = batch_rows(batch_size, [c.n for c in clients])
    first = clients[queue[0]].start
    stacked = {n: _stacked_like(first[n], slots) for n in names}
    loss_acc = torch.zeros(slots, dtype=torch.float32, device=first[names[0]].device)
    tally_acc: Dict[str, Tensor] = {}  # {name: (slots,)} with tally on
    active: List[Optional[_Active]] = []
    shared_params: dict = {}

    @torch.no_grad()
    def load(slot: int, i: int) -> _Active:
        for n in names:
            stacked[n][slot].copy_(clients[i].start[n])
        loss_acc[slot] = 0.0
        for acc in tally_acc.values():
            acc[slot] = 0.0
        c = clients[i]
        return _Active(i, batch_indices(c.n, batch_size, phase.epochs, drop_last, c.generator), steps[i])

    @torch.no_grad()
    def move(src: int, dst: int) -> None:
        for n in names:
            stacked[n][dst].copy_(stacked[n][src])
        loss_acc[dst] = loss_acc[src]
        for acc in tally_acc.values():
            acc[dst] = acc[src]

    while len(active) < slots:
        active.append(load(len(active), queue.pop(0)))

    while active:
        k = len(active)
        xs, ys, sizes = [], [], []
        for a in active:
            idx = next(a.batches)  # the epoch's permutation is drawn here, as in the sequential loop
            b = int(idx.shape[0])
            if b < rows:
                idx = torch.cat([idx, idx[:1].expand(rows - b)])
            c = clients[a.index]
            x, y = c.data.train_batch(idx if c.index is None else c.index[idx])
            xs.append(x)
            ys.append(y)
            sizes.append(b)
        x, y = torch.stack(xs), torch.stack(ys)
        count = torch.tensor(sizes, dtype=torch.float32, device=x.device)
        if min(sizes) == rows:
            mask = torch.ones(k, rows, dtype=torch.float32, device=x.device)
        else:
            mask = (torch.arange(rows, device=x.device)[None, :] < count[:, None]).to(torch.float32)
        gens = [clients[a.index].generator for a in active]
        batch = Batch(x, y, mask, count, sizes, gens, k)

        views = {n: stacked[n][:k] for n in names}
        leaves = []
        for n in trainable:
            views[n] = views[n].detach().requires_grad_(True)
            leaves.append(views[n])
        rates = None if param_lr is None else {id(views[n]): lr_of(n, lr, param_lr) for n in trainable}
        sgd = None if phase.penalised else InBackwardSGD(lr, rates)
        step_tallies = {} if tally or phase.tallied else None
        with autocast():
            losses = phase.loss(FusedStep(views, batch, phase.modules, sgd, shared_params, step_tallies))
        # the backward pass takes the grouped Linear layers' steps itself; the rest step here
        if losses.requires_grad:
            losses.sum().backward()
        done = sgd.done if sgd is not None else ()
        rest = [t for t in leaves if id(t) not in done and t.grad is not None]
        with torch.no_grad():
            if rest and rates is None:
                torch._foreach_add_(rest, [t.grad for t in rest], alpha=-lr)
            elif rest:
                for r in sorted(set(rates[id(t)] for t in rest)):
                    group = [t for t in rest if rates[id(t)] == r]
                    torch._foreach_add_(group, [t.grad for t in group], alpha=-r)
            loss_acc[:k] += losses.detach().float() * count
            for name, v in (step_tallies or {}).items():
                if name not in tally_acc:
                    tally_acc[name] = torch.zeros((slots, *v.shape[1:]), dtype=v.dtype, device=v.device)
                tally_acc[name][:k] += v

        # finished clients leave; waiting ones take their slots; the rest close up to a prefix
        finished = False
        for j, a in enumerate(active):
            a.left -= 1
            a.seen += sizes[j]
            if a.left == 0:
                finished = True
                values = {n: stacked[n][j].clone(memory_format=torch.contiguous_format) for n in names}
                outcomes[a.index] = PhaseOutcome(values, float(loss_acc[j]), a.seen,
                                                 tallies=finished_tallies({n: acc[j] for n, acc in tally_acc.items()}, tally, phase))
                active[j] = load(j, queue.pop(0)) if queue else None
        if finished:
            j = 0
            while j < len(active):
                if active[j] is None:
                    while active and active[-1] is None:
                        active.pop()
                    if j < len(active):
                        move(len(active) - 1, j)
                        active[j] = active.pop()
                j += 1
    return outcomes  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# several fused groups side by side on a CPU rank's threads


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
    import concurrent.futures

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


# ----------------------------------------------------------------------------------------------
# helpers the algorithms share


def probe_input(datas: Sequence) -> Optional[Tensor]:
    """One training sample (a batch of 1) of the first client that holds any, else None."""
    for d in datas:
        if d.n_train > 0:
            return d.train_batch(torch.zeros(1, dtype=torch.long, device=d.train_y.device))[0]
    return None


@torch.no_grad()
def computes_head_of_features(model: nn.Module, x: Tensor) -> bool:
    """True when ``model(x)`` is exactly ``model.head(model.features(x))`` on the probe ``x``.

    Then a fused step may run the two parts separately (each with the grouped layers); otherwise
    the whole model runs through vmap.
    """
    features, head = getattr(model, "features", None), getattr(model, "head", None)
    if not isinstance(features, nn.Module) or not isinstance(head, nn.Module):
        return False
    xx = torch.cat([x, x])
    return torch.equal(model(xx), head(features(xx)))


def param_count(*modules: nn.Module, trainable: Optional[bool] = None) -> int:
    return sum(p.numel() for m in modules for p in m.parameters() if trainable is None or p.requires_grad == trainable)


class Fusing(Component):
    """Fused training: a group of a rank's clients trained at once as stacked parameters."""

    options = (
        Option("fused", "auto", "train a group of a rank's clients at once (stacked parameters, one forward/backward): "
               "auto where the method and model can (else one by one) | true (the same; the start line says when it "
               "cannot) | false", boolean_or_auto, kind=Union[bool, str]),
        Option("fused_group", 0, "clients per fused group (groups are fixed for the run and placed whole on ranks); "
               "0 (auto): about the device kind's slot cap (8 on a CPU, 256 on a GPU) × ⌈1 / participation⌉ clients, in a "
               "power-of-two number of equal groups, on a GPU at least 8 (a node's GPUs; 20 clients on a CPU: 4 groups of "
               "5, on a GPU: 7 of at most 3)", at_least(0)),
        Option("fused_join", "auto", "a rank trains the round's participants of all its fused groups as one set of "
               "slots: auto (on a GPU, whose kernels give a slot the same bits whatever the slots beside it; not on a "
               "CPU, where they differ in the last bits, so each group trains alone) | true | false",
               boolean_or_auto, kind=Union[bool, str]),
        Option("fused_workers", "auto", "fused groups trained side by side on a CPU rank, one thread each: auto (one "
               "per thread of the rank) | N (1: one group at a time over all the rank's threads)", auto_or(described(">= 1", lambda v: None if isinstance(v, int)
                                                              and not isinstance(v, bool) and v >= 1
                                                              else f"must be auto or an integer >= 1, got {v!r}")),
               kind=Union[int, str]),
    )
