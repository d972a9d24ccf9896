"""The shared local SGD loop: epochs of shuffled mini-batches drawn from resident tensors."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch


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


def sgd(
    params: Iterable[torch.nn.Parameter],
    batches: Iterable[torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    lr: float,
) -> tuple[float, int]:
    """Plain SGD (no momentum) over ``batches``; returns (Σ batch loss · batch size, samples seen)."""
    params = [p for p in params if p.requires_grad]
    loss_sum = None
    seen = 0
    for idx in batches:
        loss = loss_fn(idx)
        grads = torch.autograd.grad(loss, params, materialize_grads=True)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        b = int(idx.shape[0])
        seen += b
        contrib = loss.detach() * b
        loss_sum = contrib if loss_sum is None else loss_sum + contrib
    return (float(loss_sum) if loss_sum is not None else 0.0), seen
