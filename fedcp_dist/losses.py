"""Loss terms shared by the methods, for one batch and for a group of padded batches.

The plain forms take a batch of ``B`` rows; the grouped forms take ``k`` clients' batches stacked
as (k, B, ...) with a (k, B) 0/1 mask of the real rows and their (k,) count, and return one value
per client computed over its real rows only (padded rows get no gradient).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: the reference's Gaussian kernels: Σ_a exp(−d / (2a)) over these a, d the squared distance
MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)


def _sq_dists(a: Tensor, b: Tensor, a_sq: Tensor, b_sq: Tensor) -> Tensor:
    return (a_sq[:, None] + b_sq[None, :] - 2.0 * (a @ b.T)).clamp_min(0.0)


#: ``bandwidths`` value that asks for the median heuristic: one Gaussian kernel with 2σ² = 2·median
#: squared distance between distinct rows of the pooled batch (x and y together), detached
MEDIAN = "median"


def median_sq_dist(x: Tensor, y: Tensor) -> Tensor:
    """The (lower) median of ‖z_i − z_j‖² over ordered pairs i ≠ j of the pooled rows z = [x; y],
    detached: σ² of the median heuristic (σ = the median pairwise distance)."""
    with torch.no_grad():
        z = torch.cat([x, y])
        z_sq = (z * z).sum(1)
        d = _sq_dists(z, z, z_sq, z_sq)
        off = ~torch.eye(z.shape[0], dtype=torch.bool, device=z.device)
        return d[off].median() if z.shape[0] > 1 else d.new_ones(())


def grouped_median_sq_dist(x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """:func:`median_sq_dist` for each of k padded batches, over the real rows only: (k,)."""
    with torch.no_grad():
        z = torch.cat([x, y], dim=1)
        m = torch.cat([mask, mask], dim=1) > 0
        z_sq = (z * z).sum(2)
        d = (z_sq[:, :, None] + z_sq[:, None, :] - 2.0 * torch.bmm(z, z.transpose(1, 2))).clamp_min(0.0)
        n = z.shape[1]
        valid = m[:, :, None] & m[:, None, :] & ~torch.eye(n, dtype=torch.bool, device=z.device)
        med = torch.where(valid, d, torch.full_like(d, float("nan"))).flatten(1).nanmedian(dim=1).values
        return torch.nan_to_num(med, nan=1.0)  # a slot with one real row: no pair, any σ gives MMD² = 0


def _widths(bandwidths, x: Tensor, y: Tensor, median):
    """The bandwidth list with the median heuristic resolved (``median(x, y)``, σ² clamped away from 0)."""
    if isinstance(bandwidths, str):
        if bandwidths != MEDIAN:
            raise ValueError(f"unknown bandwidth rule {bandwidths!r}")
        return (median(x, y).clamp_min(1e-12),)
    return bandwidths


def mmd2(x: Tensor, y: Tensor, bandwidths: Union[Sequence[float], str] = MMD_BANDWIDTHS) -> Tensor:
    """Biased MMD² between the rows of ``x`` and ``y`` (all pairs, diagonal included).

    Kernel: Σ_a exp(−d / (2a)) over the bandwidths a, d the squared Euclidean distance; a single
    a = σ² is the RBF kernel exp(−d / (2σ²)); ``bandwidths="median"``: a = :func:`median_sq_dist`.
    """
    bandwidths = _widths(bandwidths, x, y, median_sq_dist)
    x_sq, y_sq = (x * x).sum(1), (y * y).sum(1)
    dxx, dyy, dxy = _sq_dists(x, x, x_sq, x_sq), _sq_dists(y, y, y_sq, y_sq), _sq_dists(x, y, x_sq, y_sq)
    k = 0.0
    for a in bandwidths:
        c = -0.5 / a
        k = k + (dxx * c).exp().mean() + (dyy * c).exp().mean() - 2.0 * (dxy * c).exp().mean()
    return k


def grouped_mmd2(x: Tensor, y: Tensor, mask: Tensor, count: Tensor,
                 bandwidths: Union[Sequence[float], str] = MMD_BANDWIDTHS) -> Tensor:
    """:func:`mmd2` for each of k padded batches at once: x, y (k, B, K); mask (k, B) marks the
    real rows and count (k,) their number. Returns (k,) MMD² over the real rows only. A bandwidth
    may be a (k,) tensor (one per batch: the median heuristic, ``bandwidths="median"``)."""
    bandwidths = _widths(bandwidths, x, y, lambda a, b: grouped_median_sq_dist(a, b, mask))
    x_sq, y_sq = (x * x).sum(2), (y * y).sum(2)

    def sq_dists(a, b, a_sq, b_sq):
        return (a_sq[:, :, None] + b_sq[:, None, :] - 2.0 * torch.bmm(a, b.transpose(1, 2))).clamp_min(0.0)

    dxx, dyy, dxy = sq_dists(x, x, x_sq, x_sq), sq_dists(y, y, y_sq, y_sq), sq_dists(x, y, x_sq, y_sq)
    pairs = mask[:, :, None] * mask[:, None, :]
    n2 = count * count

    def mean(t):
        return (t * pairs).sum((1, 2)) / n2

    k = 0.0
    for a in bandwidths:
        c = -0.5 / a
        if isinstance(c, Tensor) and c.dim() == 1:
            c = c[:, None, None]
        k = k + mean((dxx * c).exp()) + mean((dyy * c).exp()) - 2.0 * mean((dxy * c).exp())
    return k


def at_least_fp32(t: Tensor) -> Tensor:
    """``t`` in float32, or as it is if wider (bf16 activations under autocast are widened)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def masked_mean(values: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    """(k,) means over each slot's real samples of a (k, B) tensor."""
    return (values * mask).sum(1) / count


def masked_cross_entropy(logits: Tensor, y: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    """(k,) mean cross-entropy over each slot's real samples; logits (k, B, C), y (k, B)."""
    k, b = y.shape
    ce = F.cross_entropy(logits.reshape(k * b, -1), y.reshape(-1), reduction="none").view(k, b)
    return masked_mean(ce, mask, count)
