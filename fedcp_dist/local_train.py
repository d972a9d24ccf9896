"""Local training: the shared SGD loop over resident tensors, and how a method declares its objective.

A method whose local training is SGD on a loss declares it once as :class:`Phase` s: the loss is
written with the operations of :class:`StepOps`, the contract of a step (run a client's module,
apply a shared one, read a per-client constant, cross-entropy, MMD², Gumbel noise, a proximal term,
a tally). Two steps implement it: :class:`Step`, one client's (B, ...) batch on the working modules,
which the sequential path (:func:`train_sequential`) computes; and
:class:`~fedcp_dist.fused.step.FusedStep`, a group of clients' (k, B, ...) batches on stacked values
(:mod:`fedcp_dist.fused`). ``tests/test_types.py`` has a type checker hold both to the protocol.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Protocol, Sequence, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.losses import MMD_BANDWIDTHS, at_least_fp32, mmd2
from fedcp_dist.models import forward_batch_stats
from fedcp_dist.models.batchnorm import one_value_batches


def num_batches(n: int, batch_size: int, epochs: int, drop_last: bool) -> int:
    """How many batches :func:`batch_indices` yields for these arguments."""
    if n == 0:
        return 0
    stop = n - n % batch_size if (drop_last and n >= batch_size) else n
    return epochs * -(-stop // batch_size)


def batch_indices(n: int, batch_size: int, epochs: int, drop_last: bool, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled index batches for ``epochs`` passes over ``n`` samples.

    The order comes only from ``generator`` (seeded by (seed, round, client)). With ``drop_last``
    a last incomplete batch is dropped, except when the client holds fewer samples than one
    batch: then it trains on that one short batch.
    """
    if n == 0:
        return
    stop = n - n % batch_size if (drop_last and n >= batch_size) else n
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator, device=generator.device)
        for start in range(0, stop, batch_size):
            yield perm[start : start + batch_size]


_amp_cpu_noted = False


def cpu_has_native_bf16() -> bool:
    """True when oneDNN runs bf16 matrix products natively on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def amp_autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for ``amp`` on ``device``: bf16 autocast, or nothing for ``"none"``.

    Under it convolutions and matrix products take bf16 inputs and accumulate in float32 (on CUDA
    and on CPUs alike), so a CPU run shows the accuracy effect a GPU run would have. On a CPU
    without native bf16 matrix units (no AVX512-BF16/AMX) the products are emulated and slower
    than float32; a one-time notice says so.
    """
    global _amp_cpu_noted
    if amp != "bf16":
        return contextlib.nullcontext()
    if device.type == "cpu" and not _amp_cpu_noted:
        _amp_cpu_noted = True
        if not cpu_has_native_bf16():
            print("fedcp_dist: amp=bf16 on a CPU without native bf16 units: the numerics of bf16 "
                  "autocast, but slower than float32 here", flush=True)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast switched off (for sums that bf16 would ruin, such as MMD distances)."""
    return torch.autocast(device.type, enabled=False)


def sgd(
    params: Iterable[torch.nn.Parameter],
    batches: Iterable[torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    lr: float,
    amp: str = "none",
    lrs: Optional[list] = None,
) -> tuple[float, int]:
    """Plain SGD (no momentum) over ``batches``; returns (Σ batch loss · batch size, samples seen).

    ``amp="bf16"`` runs ``loss_fn`` (the forward pass) under bf16 autocast; the backward pass
    and the update stay outside it (parameters and their updates stay float32). ``lrs``: one
    learning rate per parameter of ``params`` instead of ``lr`` for all.
    """
    params = list(params)
    if lrs is not None:
        lrs = [r for p, r in zip(params, lrs) if p.requires_grad]
    params = [p for p in params if p.requires_grad]
    leaves = cast(List[torch.Tensor], params)
    groups = None if lrs is None else {r: [i for i, q in enumerate(lrs) if q == r] for r in lrs}
    autocast = amp_autocast(amp, params[0].device) if params and amp != "none" else contextlib.nullcontext()
    loss_sum = None
    seen = 0
    for idx in batches:
        with autocast:
            loss = loss_fn(idx)
        grads = torch.autograd.grad(loss, params, materialize_grads=True)
        with torch.no_grad():
            if groups is None:
                torch._foreach_add_(leaves, grads, alpha=-lr)
            else:
                for r, ix in groups.items():
                    torch._foreach_add_([leaves[i] for i in ix], [grads[i] for i in ix], alpha=-r)
        b = int(idx.shape[0])
        seen += b
        contrib = loss.detach().float() * b
        loss_sum = contrib if loss_sum is None else loss_sum + contrib
    return (float(loss_sum) if loss_sum is not None else 0.0), seen


# ----------------------------------------------------------------------------------------------
# a method's local objective, written once: phases and the step it is computed on


#: the bandwidths of an MMD² kernel: the widths a of Σ_a exp(−d/2a), or "median" (the median heuristic)
Bandwidths = Union[Sequence[float], str]


class StepOps(Protocol):
    """What a :class:`Phase`'s loss may do with the step it is computed on: the contract both steps
    implement, :class:`Step` (one client's batch, tensors (B, ...), scalar losses) and
    :class:`~fedcp_dist.fused.step.FusedStep` (``k`` clients' padded batches, tensors (k, B, ...),
    (k,) per-client losses). A loss written with these operations only, counting dimensions from
    the end, runs on both."""

    #: the batch's inputs and labels
    x: torch.Tensor
    y: torch.Tensor
    #: {name: sum} of what the loss tallies (None: tallying is off this step)
    tallies: Optional[dict]

    def tally(self, name: str, per_sample: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        """Add the batch's sum over its samples of a per-sample quantity to the tally ``name``."""
        ...

    def run(self, name: str, x: torch.Tensor, *, grad: bool = True, batch_stats: bool = False) -> torch.Tensor:
        """The client's own module ``name`` (registered in the phase's ``modules``) applied to ``x``."""
        ...

    def shared(self, module: nn.Module, x: torch.Tensor, *, grad: bool = True, batch_stats: bool = False) -> torch.Tensor:
        """A module with the same parameters for every client applied to ``x``."""
        ...

    def value(self, name: str) -> torch.Tensor:
        """A per-client constant, broadcastable over the batch."""
        ...

    def proximal(self, anchor_prefix: str, prefix: str = "") -> torch.Tensor:
        """Σ ‖p − a‖² over the parameters of the module under ``prefix`` against their anchors."""
        ...

    def cross_entropy(self, logits: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The mean cross-entropy over the batch's real samples."""
        ...

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The mean over the batch's real samples of a per-sample quantity."""
        ...

    def mmd2(self, a: torch.Tensor, b: torch.Tensor, bandwidths: Bandwidths = MMD_BANDWIDTHS) -> torch.Tensor:
        """Biased MMD² between the rows of ``a`` and ``b``, in full precision."""
        ...

    def gumbel_like(self, logits: torch.Tensor) -> torch.Tensor:
        """Gumbel(0, 1) noise shaped like ``logits``, from each client's own stream."""
        ...


@dataclass(frozen=True)
class Phase:
    """A stretch of local SGD on one loss, declared once by a method (the same for every client).

    * ``loss(step)`` — the mean loss of the step's batch: a scalar on the sequential path, one
      value per client of a fused group; written with the :class:`StepOps` operations only, so the
      same code serves both paths;
    * ``modules`` — the working modules whose values are per client, by key prefix: a module
      registered under ``"head."`` holds the values ``head.<parameter name>`` (parameters and
      floating buffers, as :func:`~fedcp_dist.algorithms.base.module_state` names them);
    * ``trainable`` — the parameter names that SGD moves (the others are constants);
    * ``shared`` — modules the loss applies identically to every client (``step.shared``), listed
      so that the fused path can check them;
    * ``penalised`` — the loss reads trained parameters directly (``step.proximal``);
    * ``tallied`` — what the loss tallies in every round, not only when probed (e.g. FedCP's Σ h
      for ``selection_vector=features``): tallying is then on for the phase, on either path.
    """

    name: str
    loss: Callable[[StepOps], torch.Tensor]
    modules: Mapping[str, nn.Module]
    trainable: tuple
    epochs: int
    shared: tuple = ()
    penalised: bool = False
    tallied: tuple = ()


@dataclass
class ClientPhase:
    """One client's part of a phase: its starting values (every name the loss reads) and the
    training rows it uses (None: all of them)."""

    start: Dict[str, torch.Tensor]
    index: Optional[torch.Tensor] = None
    #: anything the method's ``finish`` needs besides the trained values (handed to the outcome)
    info: dict = field(default_factory=dict)


@dataclass
class PhaseOutcome:
    values: Dict[str, torch.Tensor]  # the client's values after the phase (modules' and constants)
    loss_sum: float  # Σ over steps of the mean batch loss · real batch size
    samples: int
    info: dict = field(default_factory=dict)  # the ClientPhase's info
    #: {name: Σ over the samples seen} of what the loss tallied (``Step.tally``), with tallying on
    tallies: dict = field(default_factory=dict)


def resolve(modules: Mapping[str, nn.Module], name: str) -> tuple[nn.Module, str]:
    """(module, key prefix of its values) for a dotted ``name`` under the registered prefixes:
    with ``{"": model}``, ``"features"`` is ``model.features`` with values ``features.*``."""
    best = None
    for prefix in modules:
        if f"{name}.".startswith(prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    if best is None:
        raise KeyError(f"no module registered for {name!r}")
    rest = f"{name}."[len(best):].rstrip(".")
    module = modules[best].get_submodule(rest) if rest else modules[best]
    return module, (f"{name}." if name else "")


class Step:
    """One client's batch on the sequential path: :class:`StepOps` on (B, ...) tensors.

    The fused path's step (:class:`fedcp_dist.fused.step.FusedStep`) offers the same operations on
    (k, B, ...) tensors, so a loss written with them (and with dimensions counted from the end)
    runs on both.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, modules: Mapping[str, nn.Module],
                 values: Mapping[str, torch.Tensor], generator: torch.Generator, tallies: Optional[dict] = None):
        self.x, self.y = x, y
        self.modules, self.values, self.generator = modules, values, generator
        self.tallies = tallies

    def tally(self, name: str, per_sample: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        """Add the batch's sum of a (B,) or (B, D) per-sample quantity, in ``dtype``, to the client's
        tally ``name`` (detached: it changes nothing in training); nothing happens unless tallying
        is on (the round is probed, or the phase names it in ``tallied``)."""
        if self.tallies is not None:
            v = per_sample.detach().sum(dim=0, dtype=dtype)
            self.tallies[name] = v if name not in self.tallies else self.tallies[name] + v

    def run(self, name: str, x: torch.Tensor, *, grad: bool = True, batch_stats: bool = False) -> torch.Tensor:
        """The client's module ``name`` (e.g. ``"features"``, ``"cpn.net"``, ``""``) applied to ``x``."""
        module, _ = resolve(self.modules, name)
        return self.shared(module, x, grad=grad, batch_stats=batch_stats)

    def shared(self, module: nn.Module, x: torch.Tensor, *, grad: bool = True, batch_stats: bool = False) -> torch.Tensor:
        """A module with the same parameters for every client applied to ``x``; ``grad=False``:
        no graph; ``batch_stats``: BatchNorm normalises by the batch's own statistics and leaves
        its running statistics as they were."""
        if grad:
            return module(x)
        with torch.no_grad():
            if batch_stats:
                return forward_batch_stats(module, x)
            return module(x)

    def value(self, name: str) -> torch.Tensor:
        """A per-client constant (e.g. FedCP's client vector), broadcastable over the batch."""
        return self.values[name]

    def proximal(self, anchor_prefix: str, prefix: str = "") -> torch.Tensor:
        """Σ ‖p − a‖² over the parameters p of the module registered under ``prefix``, each against
        the constant ``anchor_prefix + name``."""
        module = self.modules[prefix]
        return cast(torch.Tensor, sum(((p - self.values[anchor_prefix + n]) ** 2).sum() for n, p in module.named_parameters()))

    def cross_entropy(self, logits: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.cross_entropy(logits, self.y if y is None else y)

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The mean over the batch of a (B,) tensor."""
        return per_sample.mean()

    def mmd2(self, a: torch.Tensor, b: torch.Tensor, bandwidths: Bandwidths = MMD_BANDWIDTHS) -> torch.Tensor:
        """Biased MMD² between the rows of ``a`` and ``b``, in full precision (bf16 would cancel
        the distances away)."""
        with full_precision(a.device):
            return mmd2(at_least_fp32(a), at_least_fp32(b), bandwidths)

    def gumbel_like(self, logits: torch.Tensor) -> torch.Tensor:
        """Gumbel(0, 1) noise shaped like ``logits``, as −log Exp(1), from the client's stream."""
        return torch.empty_like(logits).exponential_(generator=self.generator).log_().neg_()


def module_state(prefix: str, module: nn.Module) -> Dict[str, torch.Tensor]:
    """Detached copies of a module's parameters and floating buffers, keys prefixed."""
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_floating_point():
            out[f"{prefix}{name}"] = t.detach().clone()
    return out


@torch.no_grad()
def load_module(module: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Copy ``state[prefix + name]`` into a module's parameters and floating buffers in place."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_floating_point():
            t.copy_(state[f"{prefix}{name}"])


def unsupported_reason(*modules: nn.Module) -> Optional[str]:
    """Why these modules cannot be trained fused (:mod:`fedcp_dist.fused`; None: they can).

    Refused: floating-point buffers (BatchNorm's running statistics would have to be stacked and
    updated per client), batch statistics and dropout (a padded or merged batch would change them).
    """
    for module in modules:
        for m in module.modules():
            if isinstance(m, (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)):
                return f"{type(m).__name__} layers are not fused"
            if isinstance(m, nn.MaxPool2d) and m.return_indices:
                return "MaxPool2d(return_indices=True) is not fused"
        for name, b in module.named_buffers():
            if b.is_floating_point():
                return f"floating-point buffer {name!r} is not fused"
    return None


def module_keys(phase: Phase) -> set:
    """The value names held by the phase's modules (parameters and floating buffers)."""
    keys = set()
    for prefix, m in phase.modules.items():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_floating_point():
                keys.add(prefix + name)
    return keys


def trained_named_parameters(phase: Phase) -> list:
    """[(value name, parameter)] that SGD moves in ``phase``."""
    return [(prefix + n, p) for prefix, m in phase.modules.items() for n, p in m.named_parameters()
            if prefix + n in phase.trainable]


def lr_of(name: str, lr: float, param_lr: Optional[Mapping[str, float]]) -> float:
    """The learning rate of the value ``name``: the first ``param_lr`` prefix it starts with, else ``lr``."""
    for prefix, r in (param_lr or {}).items():
        if name.startswith(prefix):
            return r
    return lr


def train_sequential(phase: Phase, client: ClientPhase, data, generator: torch.Generator, *, batch_size: int,
                     drop_last: bool, lr: float, amp: str = "none", tally: bool = False,
                     param_lr: Optional[Mapping[str, float]] = None) -> PhaseOutcome:
    """One client's phase on the working modules: load its values, SGD over its batches, read them back.
    ``tally``: collect what the loss tallies (``Step.tally``) into the outcome's ``tallies`` (on
    anyway for the phase's ``tallied``);
    ``param_lr``: {value-name prefix: learning rate} for the values it names (others: ``lr``)."""
    names = module_keys(phase)
    for prefix, m in phase.modules.items():
        one_value_batches(m)  # a method's own BatchNorms (FedCP's CPN) take a batch of one as the model's do
        load_module(m, client.start, prefix)
        if any(prefix + n in phase.trainable for n, _ in m.named_parameters()):
            m.train()
    constants = {k: v for k, v in client.start.items() if k not in names}
    index = client.index
    tallies: Optional[dict] = {} if tally or phase.tallied else None

    def loss_fn(idx):
        x, y = data.train_batch(idx if index is None else index[idx])
        return phase.loss(Step(x, y, phase.modules, constants, generator, tallies))

    n = data.n_train if index is None else int(index.numel())
    batches = batch_indices(n, batch_size, phase.epochs, drop_last, generator)
    named = trained_named_parameters(phase)
    lrs = None if param_lr is None else [lr_of(n, lr, param_lr) for n, _ in named]
    loss_sum, seen = sgd([p for _, p in named], batches, loss_fn, lr, amp=amp, lrs=lrs)
    values = dict(constants)
    for prefix, m in phase.modules.items():
        values.update(module_state(prefix, m))
    return PhaseOutcome(values, loss_sum, seen, client.info, finished_tallies(tallies or {}, tally, phase))


def finished_tallies(sums: Mapping[str, torch.Tensor], probed: bool, phase: Phase) -> dict:
    """A client's tallies for its outcome: every one when the round is probed, else only the
    phase's ``tallied`` (a loss may tally probe quantities whenever tallying is on); a float for a
    scalar tally, the tensor for a vector one."""
    return {k: float(v) if v.dim() == 0 else v.clone() for k, v in sums.items() if probed or k in phase.tallied}
