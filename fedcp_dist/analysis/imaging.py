"""Image-quality scores of a reconstruction: PSNR and SSIM on pixels in [0, 1].

SSIM is written here rather than taken from scikit-image: it is two dozen lines of Gaussian-window
statistics, and scikit-image would bring SciPy's image stack and several more packages for one
function. The definition is Wang et al. (2004): an 11×11 Gaussian window with σ = 1.5, K1 = 0.01,
K2 = 0.03, data range 1, population (co)variances, averaged over the positions where the whole
window fits, channels averaged. It is the same as scikit-image's
``structural_similarity(a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
data_range=1)`` (``tests/test_analysis.py`` compares the two where scikit-image is installed).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

#: PSNR reported for two identical images (the MSE is 0, the ratio unbounded)
PSNR_IDENTICAL = 100.0
SSIM_SIGMA = 1.5
SSIM_RADIUS = 5  # an 11×11 window: scikit-image's truncate=3.5 at σ = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio of two images of one shape, in dB: 10·log10(peak² / MSE).

    Higher means closer; a reconstruction attack that gets lower PSNR leaked less.
    """
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ, {tuple(a.shape)} and {tuple(b.shape)}")
    mse = float(((a.double() - b.double()) ** 2).mean())
    if mse == 0.0:
        return PSNR_IDENTICAL
    return 10.0 * math.log10(peak * peak / mse)


def _gaussian_window(radius: int = SSIM_RADIUS, sigma: float = SSIM_SIGMA) -> torch.Tensor:
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    g = torch.exp(-(t * t) / (2 * sigma * sigma))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> float:
    """Structural similarity of two images (C, H, W) or (H, W), 1 for identical images.

    Images smaller than the 11×11 window use a window cut to the smaller side (odd length).
    """
    if a.shape != b.shape:
        raise ValueError(f"ssim: shapes differ, {tuple(a.shape)} and {tuple(b.shape)}")
    x = a.double().reshape(-1, 1, *a.shape[-2:])
    y = b.double().reshape(-1, 1, *b.shape[-2:])
    side = min(x.shape[-2:])
    radius = min(SSIM_RADIUS, (side - 1) // 2)
    w = _gaussian_window(radius)[None, None]

    def mean(t):
        return F.conv2d(t, w)

    mx, my = mean(x), mean(y)
    vx = mean(x * x) - mx * mx
    vy = mean(y * y) - my * my
    cxy = mean(x * y) - mx * my
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())


def match_images(truth: torch.Tensor, guess: torch.Tensor) -> list[int]:
    """The order of ``guess`` that pairs each true image with a reconstruction, best PSNR in sum.

    A gradient does not say in which order a batch's images came, so the reconstructions of a batch
    are paired with the true images by an optimal assignment (Hungarian) on PSNR; ``result[i]`` is
    the reconstruction paired with ``truth[i]``.
    """
    n = truth.shape[0]
    if n == 1:
        return [0]
    from scipy.optimize import linear_sum_assignment  # SciPy comes with scikit-learn

    cost = np.array([[-psnr(truth[i], guess[j]) for j in range(n)] for i in range(n)])
    rows, cols = linear_sum_assignment(cost)
    order = [0] * n
    for r, c in zip(rows, cols):
        order[r] = int(c)
    return order
