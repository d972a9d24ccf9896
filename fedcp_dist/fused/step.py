"""The fused step: a :class:`~fedcp_dist.local_train.StepOps` for ``k`` clients at once.

A method's loss is written once (a :class:`~fedcp_dist.local_train.Phase`) with the operations of
:class:`~fedcp_dist.local_train.StepOps`; the sequential path runs it on one client's (B, ...) batch
(:class:`~fedcp_dist.local_train.Step`), the fused path on :class:`FusedStep`, whose operations take
(k, B, ...) tensors and return (k,) per-client means over each client's real rows.

How the group is computed
    Layers with per-client parameters run as grouped operations on the stacked parameters
    (:mod:`fedcp_dist.fused.forward`): ``Conv2d`` as one convolution with ``groups = S·groups`` over
    a channels-last (batch, slot·channel, H, W) tensor, ``Linear`` as ``baddbmm``, ``LayerNorm`` as
    a plain normalisation followed by each slot's affine; parameter-free per-channel or elementwise
    layers (pooling, activations) run unchanged on either layout. Any other module runs through
    ``torch.vmap`` over ``torch.func.functional_call`` (correct for any module whose forward treats
    samples independently). Grouped channels-last convolutions are used instead of vmap's
    convolution rule, which computes the same grouped convolution in NCHW with a layout copy per
    call; channels-last also makes pooling faster (docs/performance.md has the measurements).

The SGD step
    ``w ← w − lr·∇w`` per client, as in :func:`~fedcp_dist.local_train.sgd`. The grouped Linear
    layers take their step inside the backward pass (:class:`~fedcp_dist.fused.forward.InBackwardSGD`):
    at B = 10 their large per-client matrices are bound by memory traffic, not arithmetic, and
    adding the gradient straight into the weight saves writing and re-reading a gradient tensor.
    All other parameters get their gradient from the backward pass and step after it
    (:func:`fedcp_dist.fused.slots.train_fused`). A loss that reads trained parameters itself (a
    proximal term: ``Phase.penalised``) gets plain gradients for every parameter instead, since a
    weight stepped inside the backward pass cannot also be read elsewhere in the graph.

Not fused
    Modules with floating-point buffers or batch-dependent layers (BatchNorm, dropout) are refused
    (:func:`~fedcp_dist.local_train.unsupported_reason`); the algorithms then fall back to the
    sequential loop.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

import torch
from torch import nn

from fedcp_dist.fused.forward import InBackwardSGD, autocast_dtype, grouped_forward, sub_params
from fedcp_dist.local_train import Bandwidths, full_precision, resolve
from fedcp_dist.losses import MMD_BANDWIDTHS, at_least_fp32, grouped_mmd2, masked_cross_entropy, masked_mean

Tensor = torch.Tensor


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


#: {model: whether it computes head(features(x))}, answered once per model
_SPLIT_CACHE: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


class FusedStep:
    """The :class:`~fedcp_dist.local_train.StepOps` operations for ``k`` clients' padded batches.

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

    def _forward(self, module: nn.Module, params: Dict[str, Tensor], x: Tensor, k: int,
                 sgd: Optional[InBackwardSGD]) -> Tensor:
        split = _SPLIT_CACHE.get(module)
        if split is None and type(module) is not nn.Sequential:
            split = computes_head_of_features(module, self.x[0, :1])
            _SPLIT_CACHE[module] = split
        features, head = getattr(module, "features", None), getattr(module, "head", None)
        if split and isinstance(features, nn.Module) and isinstance(head, nn.Module):
            # a model computing head(features(x)): each part with the grouped layers
            h = grouped_forward(features, sub_params(params, "features."), x, k, sgd)
            return grouped_forward(head, sub_params(params, "head."), h, k, sgd)
        return grouped_forward(module, params, x, k, sgd)

    def run(self, name: str, x: Tensor, *, grad: bool = True, batch_stats: bool = False) -> Tensor:
        module, prefix = resolve(self.modules, name)
        params = {n: self.views[prefix + n] for n, _ in module.named_parameters()}
        if grad:
            return self._forward(module, params, x, self.k, self.sgd)
        with torch.no_grad():
            return self._forward(module, params, x, self.k, None)

    def shared(self, module: nn.Module, x: Tensor, *, grad: bool = True, batch_stats: bool = False) -> Tensor:
        k, b = x.shape[:2]
        if not any(isinstance(m, nn.Conv2d) for m in module.modules()):
            y = module(x.reshape(k * b, *x.shape[2:]))
            return y.view(k, b, *y.shape[1:])
        # convolutions: all k·B samples as one slot of the grouped (channels-last) layers; under
        # autocast a copy in its dtype, made once for the group (a shared module does not change)
        low = autocast_dtype(x.device)
        key = module if low is None else (module, low)
        if key not in self._shared_params:
            params = stack_once(dict(module.named_parameters()))
            self._shared_params[key] = params if low is None else {n: t.to(low) for n, t in params.items()}
        with contextlib.nullcontext() if grad else torch.no_grad():
            y = grouped_forward(module, self._shared_params[key], x.reshape(1, k * b, *x.shape[2:]), 1)
        return y.view(k, b, *y.shape[2:])

    def value(self, name: str) -> Tensor:
        t = self.views[name]
        return t.view(t.shape[0], 1, *t.shape[1:])

    def proximal(self, anchor_prefix: str, prefix: str = "") -> Tensor:
        module = self.modules[prefix]
        total: Tensor | float = 0.0
        for n, _ in module.named_parameters():
            d = self.views[prefix + n] - self.views[anchor_prefix + n]
            total = total + (d * d).flatten(1).sum(1)
        assert isinstance(total, Tensor), "a proximal term over a module without parameters"
        return total

    def cross_entropy(self, logits: Tensor, y: Optional[Tensor] = None) -> Tensor:
        b = self.batch
        return masked_cross_entropy(logits, b.y if y is None else y, b.mask, b.count)

    def mean(self, per_sample: Tensor) -> Tensor:
        return masked_mean(per_sample, self.batch.mask, self.batch.count)

    def mmd2(self, a: Tensor, b: Tensor, bandwidths: Bandwidths = MMD_BANDWIDTHS) -> Tensor:
        with full_precision(a.device):
            return grouped_mmd2(at_least_fp32(a), at_least_fp32(b), self.batch.mask, self.batch.count, bandwidths)

    def gumbel_like(self, logits: Tensor) -> Tensor:
        # each client's noise from its own stream, the same draws as alone; padding: −log 1 = 0
        e = torch.empty_like(logits)
        for j, (n, g) in enumerate(zip(self.batch.sizes, self.batch.generators)):
            e[j, :n].exponential_(generator=g)
            if n < e.shape[1]:
                e[j, n:].fill_(1.0)
        return e.log_().neg_()


def stacked_like(t: Tensor, slots: int) -> Tensor:
    """An uninitialised tensor of shape (slots, *t.shape) (each slot is written before it is read);
    4-d parameters (convolution weights) channels-last."""
    if t.dim() == 4:
        o, i, h, w = t.shape
        return torch.empty((slots, o, h, w, i), dtype=t.dtype, device=t.device).permute(0, 1, 4, 2, 3)
    return torch.empty((slots, *t.shape), dtype=t.dtype, device=t.device)


def stack_once(params: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Shared parameters as one slot, (1, *shape), in the stacked layout (for a grouped forward
    of a shared module over all slots' samples as one batch)."""
    out = {}
    with torch.no_grad():
        for n, t in params.items():
            out[n] = stacked_like(t, 1)
            out[n][0].copy_(t)
    return out


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
