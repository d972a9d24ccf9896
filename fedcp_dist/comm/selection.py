"""Feature-difference client selection: prefer the clients whose features differ most.

With participation ρ < 1 and ``client_selection=feature_difference`` the round's cohort (as many
clients as uniform sampling takes, see :func:`fedcp_dist.state.placement.cohort_size`) is drawn without
replacement with first-draw probabilities

    w_i = |D_i| · (1 − cos(v_i, v̄)),      v̄ = (1/N) Σ_j v_j,
    p_i = max(w_i / Σ_j w_j, p_min) / Z    (Z makes them sum to 1),

v_i the client vector the method keeps (FedCP: the column sums of the personal head's weight;
a client that has not trained yet has its initial vector), |D_i| its training samples and
p_min = ``selection_min_prob``. With ``selection_vector=features`` v_i is instead the mean of the
client's features h over every sample of its last local training (FedCP keeps it in the client's
state as ``fmean``; zero before the client has trained): with cross-entropy and SGD a linear head's
column sums never change, so FedCP's own v_i tells trained clients apart from untrained ones only.
cos is 0 where a vector is zero; a weight below 0 (rounding) is 0; if every weight is 0 (all
vectors parallel, as before anyone trained) w_i = |D_i|, and if those are all 0 too, every client
weighs the same.

The draw is a function of (seed, round, the vectors, the sizes) only: the engine gathers the N × K
vectors in one collective, and every rank computes the same probabilities in float64 and draws
from the round's cohort stream, so every rank draws the same cohort whatever the world size. The
vectors are part of the clients' checkpointed states, so a resumed run draws the same cohorts.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from fedcp_dist.state.placement import STREAM_COHORT, round_cohort_size, sample_cohort, stream_seed


def selection_weights(sizes: Sequence[float], vectors) -> np.ndarray:
    """w_i = |D_i| · (1 − cos(v_i, v̄)) in float64 (before the fall-backs)."""
    v = np.asarray(vectors, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    mean = v.mean(axis=0)
    norms = np.linalg.norm(v, axis=1) * np.linalg.norm(mean)
    dots = v @ mean
    cos = np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
    return np.maximum(n * (1.0 - cos), 0.0)


def selection_probabilities(sizes: Sequence[float], vectors, min_prob: float) -> np.ndarray:
    """Every client's first-draw probability p_i (sums to 1)."""
    w = selection_weights(sizes, vectors)
    if not w.sum() > 0:
        w = np.maximum(np.asarray(sizes, dtype=np.float64), 0.0)
    if not w.sum() > 0:
        w = np.ones_like(w)
    p = np.maximum(w / w.sum(), float(min_prob))
    return p / p.sum()


def sample_cohort_weighted(seed: int, round_idx: int, probs: np.ndarray, participation: float,
                           participation_range: Optional[Sequence[float]] = None, draw: str = "rho") -> np.ndarray:
    """The sorted cohort of round ``round_idx``, drawn without replacement with ``probs``.

    The round's cohort size (with ``participation_range``: drawn as ``draw`` says) is that of
    uniform sampling.
    """
    rng = np.random.default_rng(stream_seed(seed, STREAM_COHORT, round_idx))
    m = round_cohort_size(rng, len(probs), participation, participation_range, draw)
    return np.sort(rng.choice(len(probs), size=m, replace=False, p=probs))


def gather_client_vectors(rt, algo, store, owned, num_clients: int) -> np.ndarray:
    """Every client's vector v_i (N × K, float32, on the host), the same on every rank: each rank
    writes its own clients' rows (an untrained client's initial vector) and one all-reduce adds
    them, each row having a single non-zero contributor (so the sum is exact)."""
    buf = torch.zeros(num_clients, algo.client_vector_dim, dtype=torch.float32, device=rt.device)
    for c in owned:
        buf[c] = algo.client_vector(store.peek(c))
    return rt.all_reduce_sum_(buf).cpu().numpy()


def draw_cohort(cfg, t: int, train_counts, vectors):
    """Round t's sorted cohort: uniform, or with ``client_selection: feature_difference`` and
    ρ < 1 drawn by feature difference from ``vectors()`` (called only then: it is a collective)."""
    if cfg.client_selection != "feature_difference" or (cfg.participation >= 1 and cfg.participation_range is None):
        return sample_cohort(cfg.seed, t, len(train_counts), cfg.participation, cfg.participation_range,
                             cfg.participation_draw, cfg.participation_sampling)
    probs = selection_probabilities(train_counts, vectors(), cfg.selection_min_prob)
    return sample_cohort_weighted(cfg.seed, t, probs, cfg.participation, cfg.participation_range, cfg.participation_draw)


def selection_counts(cohorts, num_clients: int) -> list:
    """Rounds each client trained in, from the rounds' cohorts (each a list of client ids)."""
    counts = [0] * num_clients
    for cohort in cohorts:
        for c in cohort:
            counts[int(c)] += 1
    return counts
