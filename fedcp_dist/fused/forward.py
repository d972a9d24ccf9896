"""Grouped forward passes: ``k`` clients' batches through one module, each with its own parameters.

The layers of :mod:`fedcp_dist.fused.slots`'s steps: parameters stacked along a leading slot dimension,
``Conv2d`` as one grouped channels-last convolution, ``Linear`` as ``baddbmm`` (taking its SGD step
inside the backward pass where it may, :class:`InBackwardSGD`), ``LayerNorm`` as a normalisation
and each slot's affine, parameter-free layers unchanged, a module with a ``forward_stacked(params,
x)`` method through it (its own grouped form: the LSTM, which vmap cannot run), anything else
through ``torch.vmap``. The
module docstring of :mod:`fedcp_dist.fused.slots` says why each layer runs as it does.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fedcp_dist.data.resident import channels_last

Tensor = torch.Tensor

_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_CHANNELWISE = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)



class Act:
    """An activation of ``k`` clients' batches of ``B`` samples, in one of two layouts.

    * client-major (``grouped=False``): (k, B, *sample_shape);
    * slot-channel (``grouped=True``): images as (B, k·C, H, W), channels-last in memory; what a
      grouped convolution reads and writes.
    """

    __slots__ = ("t", "k", "grouped")

    def __init__(self, t: Tensor, k: int, grouped: bool = False):
        self.t, self.k, self.grouped = t, k, grouped

    def client_major(self) -> Tensor:
        if not self.grouped:
            return self.t
        b, kc, h, w = self.t.shape
        return self.t.view(b, self.k, kc // self.k, h, w).transpose(0, 1)

    def slot_channel(self) -> Tensor:
        if self.grouped:
            return self.t
        k, b, c, h, w = self.t.shape
        return channels_last(self.t.transpose(0, 1).reshape(b, k * c, h, w))


def sub_params(params: Dict[str, Tensor], prefix: str) -> Dict[str, Tensor]:
    n = len(prefix)
    return {name[n:]: t for name, t in params.items() if name.startswith(prefix)}


def _per_slot(t: Tensor, k: int, ndim: int) -> Tensor:
    """A (k, *shape) parameter viewed to broadcast against a (k, B, ..., *shape) activation."""
    return t.view(k, *([1] * (ndim - t.dim())), *t.shape[1:])


def _conv(m: nn.Conv2d, p: Dict[str, Tensor], a: Act) -> Act:
    x = a.slot_channel()
    w = p["weight"]
    k = a.k
    w = w.reshape(k * w.shape[1], *w.shape[2:])
    bias = p["bias"].reshape(-1) if m.bias is not None else None
    y = F.conv2d(x, w, bias, m.stride, m.padding, m.dilation, k * m.groups)
    return Act(y, k, grouped=True)


class InBackwardSGD:
    """One fused step's SGD inside the backward pass: the learning rate, and the parameters whose
    step their grouped Linear layer's backward has taken (see :class:`_LinearSGD`)."""

    def __init__(self, lr: float, lrs: Optional[Dict[int, float]] = None):
        self.lr = lr
        self.lrs = lrs or {}  # {id(leaf): its own rate} where it differs from ``lr``
        self.done: set = set()

    def lr_of(self, t: Tensor) -> float:
        return self.lrs.get(id(t), self.lr)

    def claim(self, *tensors: Optional[Tensor]) -> bool:
        """True (and remembered) when none of ``tensors`` has been claimed in this step yet."""
        ids = [id(t) for t in tensors if t is not None]
        if any(i in self.done for i in ids):
            return False
        self.done.update(ids)
        return True


class _LinearSGD(torch.autograd.Function):
    """A grouped Linear, (k, N, in) → (k, N, out), whose backward also takes the SGD step.

    The weight's gradient Σ_n g_n x_nᵀ is added into the weight directly (``baddbmm_`` with
    α = −lr) once the input's gradient has been computed from the old weight, instead of being
    written to a gradient tensor that the update then reads back: for the large per-client
    matrices (the CNN's 1024 → 512 layer, FedCP's CPN) this halves the memory traffic of the
    backward pass plus update, which bounds these layers at B = 10. Returns no gradient for the
    weight and bias (their step is done); the weight must not be used anywhere else in the graph
    (autograd's version check would refuse it).
    """

    @staticmethod
    def forward(ctx, x3, w, b, lr):
        ctx.save_for_backward(x3, w)
        ctx.b, ctx.lr = b, lr
        if b is None:
            return torch.bmm(x3, w.transpose(1, 2))
        return torch.baddbmm(b.unsqueeze(1), x3, w.transpose(1, 2))

    @staticmethod
    def backward(ctx, g):
        x3, w = ctx.saved_tensors
        gx = torch.bmm(g, w.to(g.dtype)).to(x3.dtype) if ctx.needs_input_grad[0] else None
        with torch.no_grad():
            g32 = g.to(w.dtype)
            w.baddbmm_(g32.transpose(1, 2), x3.to(w.dtype), alpha=-ctx.lr)
            if ctx.b is not None:
                ctx.b.sub_(g32.sum(1), alpha=ctx.lr)
        return gx, None, None, None


def _linear(m: nn.Linear, p: Dict[str, Tensor], a: Act, sgd: Optional[InBackwardSGD]) -> Act:
    x = a.client_major()
    k = a.k
    x3 = x.reshape(k, -1, x.shape[-1])
    w, b = p["weight"], p.get("bias") if m.bias is not None else None
    trained = w.requires_grad and (b is None or b.requires_grad)
    if sgd is not None and trained and w.is_leaf and (b is None or b.is_leaf) and sgd.claim(w, b):
        y = _LinearSGD.apply(x3, w, b, sgd.lr_of(w))
    elif b is not None:
        y = torch.baddbmm(b.unsqueeze(1), x3, w.transpose(1, 2))
    else:
        y = torch.bmm(x3, w.transpose(1, 2))
    return Act(y.view(*x.shape[:-1], y.shape[-1]), k)


def _layer_norm(m: nn.LayerNorm, p: Dict[str, Tensor], a: Act) -> Act:
    x = a.client_major()
    y = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
    if "weight" in p:
        y = y * _per_slot(p["weight"], a.k, y.dim())
    if "bias" in p:
        y = y + _per_slot(p["bias"], a.k, y.dim())
    return Act(y, a.k)


def _channelwise(m: nn.Module, a: Act) -> Act:
    if a.grouped:
        return Act(m(a.t), a.k, grouped=True)
    x = a.t
    y = m(x.reshape(-1, *x.shape[2:]))
    return Act(y.view(*x.shape[:2], *y.shape[1:]), a.k)


#: functional_call swaps a module's parameters in place while it runs: fused workers (threads)
#: sharing a module take turns (the graph it records keeps the tensors, so the backward needs no lock)
_FUNCTIONAL_CALL = threading.Lock()


def _vmapped(m: nn.Module, p: Dict[str, Tensor], a: Act) -> Act:
    def one(params, x):
        return functional_call(m, params, (x,))

    with _FUNCTIONAL_CALL:
        return Act(vmap(one)(p, a.client_major()), a.k)


def grouped_forward(module: nn.Module, params: Dict[str, Tensor], x, k: int,
                    sgd: Optional[InBackwardSGD] = None) -> Tensor:
    """``module`` applied to each slot's batch with that slot's parameters.

    ``params``: {name: (k, *shape)} for the module's parameters (names as ``named_parameters``);
    ``x``: a (k, B, ...) tensor or an :class:`Act`; ``sgd``: grouped Linear layers of trained
    leaves take their SGD step in the backward pass. Returns the client-major (k, B, ...) output.
    """
    a = x if isinstance(x, Act) else Act(x, k)
    return _run(module, params, a, sgd).client_major()


def _run(m: nn.Module, p: Dict[str, Tensor], a: Act, sgd: Optional[InBackwardSGD]) -> Act:
    stacked = getattr(m, "forward_stacked", None)  # a module that carries its own grouped form (models/lstm.py)
    if stacked is not None:
        return Act(stacked(p, a.client_major()), a.k)
    if type(m) is nn.Sequential:
        children = list(m.named_children())
        i = 0
        while i < len(children):
            name, child = children[i]
            if type(child) is nn.ReLU and i + 1 < len(children) and type(children[i + 1][1]) is nn.MaxPool2d:
                # max-pooling and ReLU commute exactly (ReLU is monotonic): pooling first runs the
                # ReLU and its backward on a quarter of the elements
                a = _channelwise(children[i + 1][1], a)
                a = Act(torch.relu(a.t), a.k, a.grouped)
                i += 2
                continue
            a = _run(child, sub_params(p, f"{name}."), a, sgd)
            i += 1
        return a
    if type(m) is nn.Conv2d and m.padding_mode == "zeros":
        return _conv(m, p, a)
    if type(m) is nn.Linear:
        return _linear(m, p, a, sgd)
    if type(m) is nn.LayerNorm:
        return _layer_norm(m, p, a)
    if type(m) in _ELEMENTWISE:
        return Act(m(a.t), a.k, a.grouped)
    if type(m) in _CHANNELWISE:
        return _channelwise(m, a)
    if type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
        x = a.client_major()
        return Act(x.reshape(*x.shape[:2], -1), a.k)
    return _vmapped(m, p, a)
