"""Client → rank placement, cohort sampling and derived random streams.

Everything here is a pure function of (seed, round, client) and the shard's metadata, so every
rank computes the same answer and results do not depend on the world size.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

import numpy as np

# stream tags: keep the streams of different purposes apart
STREAM_COHORT = 1
STREAM_TRAIN = 2
STREAM_EVAL = 3
STREAM_INIT = 4
STREAM_PROBE = 5  # the probes' own draws (Gumbel noise of the losses before/after with cpn_eval_gumbel)
STREAM_SUBSET = 6  # the draw of a run's client subset (data.clients)

#: how a drop-out round's participants are counted (``participation_draw``)
PARTICIPATION_DRAWS = ("rho", "count")


def stream_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for the random stream named by (seed, *keys)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, *[int(k) for k in keys]]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def client_subset(clients, seed: int, num_clients: int) -> np.ndarray:
    """The shard's ids of the clients a run uses (``data.clients``), sorted; the same on every rank.

    ``None``: all ``num_clients``. An int K: K clients drawn without replacement from a stream of
    the run seed of its own (so the subset does not depend on the world size or on anything else
    the seed drives). A list: those clients.
    """
    if clients is None:
        return np.arange(num_clients, dtype=np.int64)
    if isinstance(clients, list):
        return np.sort(np.asarray(clients, dtype=np.int64))
    rng = np.random.default_rng(stream_seed(seed, STREAM_SUBSET))
    return np.sort(rng.choice(num_clients, size=int(clients), replace=False)).astype(np.int64)


def place_clients(train_counts: Sequence[int], world_size: int) -> np.ndarray:
    """Owner rank of every client: largest train-sample count first, to the least-loaded rank.

    Ties (equal counts, equal loads) are broken by client id and rank, so the answer is the same
    on every rank.
    """
    counts = np.asarray(train_counts, dtype=np.int64)
    owner = np.empty(len(counts), dtype=np.int64)
    order = sorted(range(len(counts)), key=lambda c: (-int(counts[c]), c))
    heap = [(0, r) for r in range(world_size)]
    for c in order:
        load, r = heapq.heappop(heap)
        owner[c] = r
        heapq.heappush(heap, (load + int(counts[c]), r))
    return owner


def cohort_size(rho: float, num_clients: int) -> int:
    return max(1, min(num_clients, int(math.floor(rho * num_clients + 1e-9))))


def sample_cohort(
    seed: int,
    round_idx: int,
    num_clients: int,
    participation: float,
    participation_range: Optional[Sequence[float]] = None,
    draw: str = "rho",
) -> np.ndarray:
    """The sorted client ids that train in round ``round_idx`` (same on every rank).

    With ``participation_range = [a, b]`` each round draws its cohort size: ``draw="rho"`` takes
    ρ uniformly from [a, b] and ⌊ρN⌋ clients (ρ = b exactly has probability 0, so N is never
    reached when b = 1); ``draw="count"`` takes the count uniformly from the integers
    {⌊aN⌋ … ⌊bN⌋} (at least 1), as the reference library draws its participants, so b = 1
    reaches all N clients.
    """
    rng = np.random.default_rng(stream_seed(seed, STREAM_COHORT, round_idx))
    m = round_cohort_size(rng, num_clients, participation, participation_range, draw)
    return np.sort(rng.choice(num_clients, size=m, replace=False))


def round_cohort_size(rng: np.random.Generator, num_clients: int, participation: float,
                      participation_range: Optional[Sequence[float]] = None, draw: str = "rho") -> int:
    """A round's cohort size, drawn from the round's cohort stream ``rng`` (see :func:`sample_cohort`);
    without ``participation_range`` nothing is drawn."""
    if participation_range is None:
        return cohort_size(participation, num_clients)
    if draw == "count":
        low, high = (cohort_size(float(r), num_clients) for r in participation_range)
        return int(rng.integers(low, high + 1))
    return cohort_size(float(rng.uniform(*participation_range)), num_clients)
