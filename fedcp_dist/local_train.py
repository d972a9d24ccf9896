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
) -> tuple[float, int]:
    """Plain SGD (no momentum) over ``batches``; returns (Σ batch loss · batch size, samples seen).

    ``amp="bf16"`` runs ``loss_fn`` (the forward pass) under bf16 autocast; the backward pass
    and the update stay outside it (parameters and their updates stay float32).
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
