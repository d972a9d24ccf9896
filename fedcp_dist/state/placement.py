"""Client → rank placement, cohort sampling and derived random streams.

Everything here is a pure function of (seed, round, client) and the shard's metadata, so every
rank computes the same answer and results do not depend on the world size.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

import numpy as np

from fedcp_dist.local_train import num_batches
from fedcp_dist.state.keys import cohort_size

# stream tags: keep the streams of different purposes apart
STREAM_COHORT = 1
STREAM_TRAIN = 2
STREAM_EVAL = 3
STREAM_INIT = 4
STREAM_PROBE = 5  # the probes' own draws (Gumbel noise of the losses before/after with cpn_eval_gumbel)
STREAM_SUBSET = 6  # the draw of a run's client subset (data.clients)
STREAM_DP_NOISE = 7  # dp=central: the Gaussian noise on a round's sum of clipped uploads
STREAM_DP_COUNT = 8  # dp_clip=adaptive: the noise on a round's count of unclipped uploads
STREAM_EVAL_SAMPLE = 9  # the draw of the clients a run evaluates (eval_clients)


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


def eval_sample(seed: int, num_clients: int, eval_clients: int) -> np.ndarray:
    """The run's clients that every evaluation evaluates (``eval_clients``), sorted: all
    ``num_clients`` when ``eval_clients`` is 0 or not below it, else that many drawn without
    replacement, once, from a stream of the run seed of its own: the same sample on every rank,
    every world size and on resume, whatever else the seed drives."""
    if not eval_clients or eval_clients >= num_clients:
        return np.arange(num_clients, dtype=np.int64)
    rng = np.random.default_rng(stream_seed(seed, STREAM_EVAL_SAMPLE))
    return np.sort(rng.choice(num_clients, size=int(eval_clients), replace=False)).astype(np.int64)


def place_clients(train_counts: Sequence[int], world_size: int) -> np.ndarray:
    """Owner rank of every client: largest weight first, to the least-loaded rank (the
    longest-processing-time greedy rule). The weights are the train-sample counts or the local
    step counts (:func:`placement_weights`).

    Ties (equal weights, equal loads) are broken by client id and rank, so the answer is a
    function of the weights and the world size alone: the same on every rank.
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


def form_groups(steps: Sequence[int], size: int) -> list:
    """The run's fused groups (:mod:`fedcp_dist.fused.groups`): ⌈N / size⌉ groups of at most ``size``
    clients, dealt so that they weigh alike: the clients in order of their local steps, largest
    first (ties: the lower id first), each to the group of fewest steps so far that has room (ties:
    the lower group). Each group sorted by id. A function of the step counts and ``size`` alone,
    so the groups are the same on every rank and every world size; groups of equal weight let
    whole groups share out evenly over ranks."""
    n, size = len(steps), max(1, int(size))
    order = sorted(range(n), key=lambda c: (-int(steps[c]), c))
    members = [[] for _ in range(math.ceil(n / size))]
    heap = [(0, g) for g in range(len(members))]  # (steps so far, group) of the groups with room
    for c in order:
        load, g = heapq.heappop(heap)
        members[g].append(c)
        if len(members[g]) < size:
            heapq.heappush(heap, (load + int(steps[c]), g))
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def place_groups(weights: Sequence[int], groups: Sequence[np.ndarray], world_size: int) -> np.ndarray:
    """Owner rank of every client when whole ``groups`` are placed: each group weighs the sum of
    its clients' ``weights`` and goes where :func:`place_clients` puts it."""
    w = np.asarray(weights, dtype=np.int64)
    group_owner = place_clients([int(w[g].sum()) for g in groups], world_size)
    owner = np.empty(len(w), dtype=np.int64)
    for g, r in zip(groups, group_owner):
        owner[g] = r
    return owner


def client_steps(train_counts: Sequence[int], batch_size: int, epochs: int, drop_last: bool) -> np.ndarray:
    """Local SGD steps of every client in a round: its batches per epoch × ``epochs`` (as
    :func:`~fedcp_dist.local_train.num_batches` counts them)."""
    return np.asarray([num_batches(int(n), int(batch_size), int(epochs), bool(drop_last)) for n in train_counts],
                      dtype=np.int64)


def placement_rule(placement: str, fused) -> str:
    """``samples`` or ``steps``: what the clients are weighted by. ``auto`` weighs them by their
    steps wherever training may run fused (``fused`` auto or true: a fused rank's time follows its
    clients' steps, not their samples) and by their samples with ``fused=false``, as every run did
    before (its results, which depend on the placement through the order of the sums, stay as
    recorded)."""
    if placement != "auto":
        return placement
    return "samples" if fused is False else "steps"


def placement_weights(rule: str, train_counts: Sequence[int], batch_size: int, epochs: int,
                      drop_last: bool) -> np.ndarray:
    """The weight of every client under ``rule`` (``samples`` or ``steps``)."""
    if rule == "steps":
        return client_steps(train_counts, batch_size, epochs, drop_last)
    return np.asarray(train_counts, dtype=np.int64)


def steps_per_rank(steps: Sequence[int], owner: Sequence[int], world_size: int) -> np.ndarray:
    """Every rank's total local steps when all its clients train (int64, (world_size,))."""
    return np.bincount(np.asarray(owner, dtype=np.int64), weights=np.asarray(steps, dtype=np.float64),
                       minlength=world_size).round().astype(np.int64)


def imbalance(per_rank: Sequence[int]) -> float:
    """max / mean of the ranks' loads (1.0: balanced; also 1.0 when no rank has any)."""
    loads = np.asarray(per_rank, dtype=np.float64)
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max()) / mean if mean > 0 else 1.0


#: a Poisson cohort larger than :func:`poisson_cohort_bound` has at most this chance in a round
POISSON_TAIL = 1e-20


def poisson_cohort_bound(num_clients: int, rate: float, tail: float = POISSON_TAIL) -> int:
    """A size that a Poisson cohort (each of N clients joins with probability q on its own) exceeds
    with probability at most ``tail`` in a round: μ + t for μ = qN and t from Bernstein's inequality,
    P(X − μ ≥ t) ≤ exp(−t² / (2(σ² + t/3))) with σ² = qN(1 − q) ≤ μ, solved for t at
    ln(1/tail) = a: t = a/3 + √(a²/9 + 2aμ). 50 expected of 10⁵ clients: 135 (N was charged)."""
    if rate >= 1 or num_clients <= 0:
        return num_clients
    mu, a = rate * num_clients, math.log(1.0 / tail)
    return min(num_clients, math.ceil(mu + a / 3 + math.sqrt(a * a / 9 + 2 * a * mu)))


def max_cohort_size(num_clients: int, participation: float,
                    participation_range: Optional[Sequence[float]] = None, sampling: str = "fixed") -> int:
    """The largest cohort a round draws (:func:`sample_cohort`, and feature-difference selection's
    draw of the same size), which the all-reduce's per-client rows, the probes and the memory
    pre-flight are sized by: ⌊ρN⌋, or with ``participation_range`` [a, b] ⌊bN⌋ (either draw); with
    ``sampling="poisson"`` any cohort up to N may be drawn, and the size is
    :func:`poisson_cohort_bound` (a larger one: a one-line failure, with a chance of 10⁻²⁰ a round)."""
    if sampling == "poisson":
        return poisson_cohort_bound(num_clients, float(participation))
    rho = float(participation_range[1]) if participation_range is not None else float(participation)
    return cohort_size(rho, num_clients)


def partial_participation(cfg) -> bool:
    """Whether some round's cohort may leave clients out (ρ < 1, or a range of cohort sizes)."""
    return cfg.participation < 1 or cfg.participation_range is not None


def sample_cohort(
    seed: int,
    round_idx: int,
    num_clients: int,
    participation: float,
    participation_range: Optional[Sequence[float]] = None,
    draw: str = "rho",
    sampling: str = "fixed",
) -> np.ndarray:
    """The sorted client ids that train in round ``round_idx`` (same on every rank).

    ``sampling="fixed"``: ⌊ρN⌋ clients (at least one) drawn uniformly without replacement.
    ``sampling="poisson"``: each client joins with probability ρ on its own (one uniform draw per
    client from the round's stream), so the cohort's size varies and may be 0.

    With ``participation_range = [a, b]`` (fixed sampling) each round draws its cohort size:
    ``draw="rho"`` takes ρ uniformly from [a, b] and ⌊ρN⌋ clients (ρ = b exactly has probability 0,
    so N is never reached when b = 1); ``draw="count"`` takes the count uniformly from the integers
    {⌊aN⌋ … ⌊bN⌋} (at least 1), as the reference library draws its participants, so b = 1
    reaches all N clients.
    """
    rng = np.random.default_rng(stream_seed(seed, STREAM_COHORT, round_idx))
    if sampling == "poisson":
        return np.flatnonzero(rng.random(num_clients) < participation).astype(np.int64)
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
