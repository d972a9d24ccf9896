"""The shared local SGD loop: epochs of shuffled mini-batches drawn from resident tensors."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch


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


def amp_autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for ``amp`` on ``device``: bf16 on CUDA, nothing otherwise.

    ``amp="bf16"`` on a CPU is ignored (training and evaluation stay float32) with a one-time
    notice: CPUs without native bf16 matrix units (no AVX512-BF16/AMX, as on the machines this
    project is tested on) run bf16 matrix products slower than float32, and the gain on a GPU
    comes from its bf16 tensor cores.
    """
    global _amp_cpu_noted
    if amp == "bf16":
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if not _amp_cpu_noted:
            _amp_cpu_noted = True
            print("fedcp_dist: amp=bf16 applies on CUDA devices only; training on the CPU stays float32", flush=True)
    return contextlib.nullcontext()


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast switched off (for sums that bf16 would ruin, such as MMD distances)."""
    return torch.autocast(device.type, enabled=False)


def sgd(
    params: Iterable[torch.nn.Parameter],
    batches: Iterable[torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    lr: float,
    amp: str = "none",
) -> tuple[float, int]:
    """Plain SGD (no momentum) over ``batches``; returns (Σ batch loss · batch size, samples seen).

    ``amp="bf16"`` runs ``loss_fn`` (the forward pass) under bf16 autocast on CUDA; the backward
    pass and the update stay outside it.
    """
    params = [p for p in params if p.requires_grad]
    autocast = amp_autocast(amp, params[0].device) if params and amp != "none" else contextlib.nullcontext()
    loss_sum = None
    seen = 0
    for idx in batches:
        with autocast:
            loss = loss_fn(idx)
        grads = torch.autograd.grad(loss, params, materialize_grads=True)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        b = int(idx.shape[0])
        seen += b
        contrib = loss.detach().float() * b
        loss_sum = contrib if loss_sum is None else loss_sum + contrib
    return (float(loss_sum) if loss_sum is not None else 0.0), seen
