"""The gradient-matching attack of DLG and iDLG: dummy images (and, for DLG, soft labels) whose
gradient matches an observed one, found with L-BFGS; iDLG reads the labels off the classification
layer's gradient first. What the server observes and how it computes a dummy's gradient is
:mod:`fedcp_dist.analysis.server_copy`; the threat model and the whole attack on a run:
:mod:`fedcp_dist.analysis.dlg`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from fedcp_dist.errors import UserError


GradFn = Callable[[torch.Tensor, torch.Tensor], dict]


# ----------------------------------------------------------------------------- the attack


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of −Σ_c target_c · log softmax(logits)_c (one-hot target: plain CE)."""
    return -(target * F.log_softmax(logits, dim=1)).sum(1).mean()


def infer_labels(head_grad: torch.Tensor, n: int) -> torch.Tensor:
    """Labels read off the classification layer's weight gradient (C, K): the n classes whose rows
    sum lowest. For one image this is iDLG's rule (the true class's row is the only negative one);
    for a batch it is exact when the batch's labels are distinct; beyond C images the classes repeat."""
    order = torch.argsort(head_grad.detach().double().sum(1))
    reps = -(-n // order.numel())
    return order.repeat(reps)[:n].clone()


@dataclass
class Reconstruction:
    images: torch.Tensor  # (n, C, H, W) in [0, 1]
    labels: torch.Tensor  # (n,) argmax of the dummy labels (or the inferred ones)
    loss: float  # the relative gradient distance reached
    restart: int


def reconstruct(grad_fn: GradFn, observed: dict, shape: tuple, num_classes: int, *, labels: Optional[torch.Tensor] = None,
                steps: int = 100, restarts: int = 1, seed: int = 0, on_step: Optional[Callable[[float], None]] = None
                ) -> Reconstruction:
    """Dummy images (and labels unless ``labels`` is given) whose gradient under ``grad_fn`` matches
    ``observed``: L-BFGS (strong-Wolfe line search) for ``steps`` iterations from each of
    ``restarts`` random starts; the start that ends with the smallest gradient distance wins (the
    attacker cannot see the true images, only that distance).

    ``grad_fn(x, y)`` takes images in [0, 1] (n, C, H, W) and label distributions (n, classes) and
    returns differentiable tensors keyed like ``observed``. ``on_step(loss)`` is called after every
    iteration (the progress bar).
    """
    device = next(iter(observed.values())).device
    target = {k: v.detach() for k, v in observed.items()}
    scale = sum(float((v.double() ** 2).sum()) for v in target.values())
    if not scale > 0:
        raise UserError("the upload carries no gradient (the client's update is zero): nothing to attack")
    best: Optional[Reconstruction] = None
    for r in range(restarts):
        gen = torch.Generator().manual_seed(int(seed) * 1009 + r)
        z = torch.randn(shape, generator=gen).to(device).requires_grad_(True)
        zy = torch.randn((shape[0], num_classes), generator=gen).to(device).requires_grad_(labels is None)
        fixed = None if labels is None else F.one_hot(labels.to(device), num_classes).to(z.dtype)
        variables = [z] if labels is not None else [z, zy]
        # one iteration per call (for the progress bar); max_eval leaves the line search its 25 evaluations
        opt = torch.optim.LBFGS(variables, lr=1.0, max_iter=1, max_eval=26, history_size=100, line_search_fn="strong_wolfe",
                                tolerance_grad=1e-12, tolerance_change=1e-14)

        def distance():
            y = fixed if fixed is not None else torch.softmax(zy, dim=1)
            grads = grad_fn(torch.sigmoid(z), y)
            return sum(((grads[k] - target[k]) ** 2).sum() for k in target) / scale

        def closure():
            opt.zero_grad()
            loss = distance()
            loss.backward()
            return loss

        current = (z.detach().clone(), zy.detach().clone())
        best_here, best_loss = current, math.inf
        for _ in range(steps):
            loss = float(opt.step(closure).detach())  # the distance at `current`, the iterate before this step
            if math.isfinite(loss) and loss < best_loss:
                best_here, best_loss = current, loss
            if not math.isfinite(loss) or not bool(torch.isfinite(z).all()):
                break  # the line search left the finite region: the best iterate so far is kept
            current = (z.detach().clone(), zy.detach().clone())
            if on_step is not None:
                on_step(loss)
        with torch.no_grad():
            z.copy_(current[0])
            zy.copy_(current[1])
        last = float(distance().detach())
        if math.isfinite(last) and last < best_loss:
            best_here, best_loss = current, last
        kept = best_here
        got_labels = labels.clone() if labels is not None else kept[1].argmax(1)
        cand = Reconstruction(torch.sigmoid(kept[0]).detach(), got_labels.cpu(), best_loss, r)
        if best is None or cand.loss < best.loss or not math.isfinite(best.loss):
            best = cand
    return best
