"""Split a labelled data set among federated clients.

Three schemes, all deterministic in a seed (every random draw goes through one
``np.random.default_rng(seed)``):

* ``dir``: per class, Dirichlet(beta) proportions over the clients, redrawn until every client
  holds at least ``least_samples`` samples (bounded: see :func:`partition_dir`);
* ``pat`` (pathological): every client sees at most ``classes_per_client`` classes;
* ``iid``: a random permutation cut into near-equal parts.

Each client's share is then split into its own train and test indices.  Everything is
vectorised so that 10,000 clients partition in well under a second per try.

Partitioning looks at the labels only; :func:`client_rows` then hands every client's samples to
the shard writer as index views of the one in-memory data set, which copies them a block at a
time, so writing never holds a second copy of the data set.
"""
from __future__ import annotations

import heapq
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from fedcp_dist.data.shards import Rows
from fedcp_dist.errors import UserError

PARTITION_KINDS = ("dir", "pat", "iid")
#: draws the Dirichlet partitioner always makes before it may judge the rule out of reach
PROBE_DRAWS = 20
#: redrawing stops once the estimated chance that the remaining draws meet the rule is below this
GIVE_UP_CHANCE = 0.01
#: while redrawing, a line on stderr says how far it is every this many seconds; the clock never
#: stops or fails drawing (that would make a seed's partition, or its error, depend on the
#: machine's speed and load)
PROGRESS_SECONDS = 10.0


def least_samples(batch_size: int, train_ratio: float, total: int, num_clients: int) -> int:
    """Fewest samples a client should hold: one train batch, capped at half the mean share."""
    return int(min(batch_size / (1 - train_ratio), total / num_clients / 2))


def _split_sizes(n: int, train_ratio: float) -> tuple[int, int]:
    """(n_train, n_test) of a client with ``n`` samples, as :func:`split_train_test` cuts them.

    Sizes follow scikit-learn's ``train_test_split``: n_test = ceil((1 - train_ratio) * n)
    (computed with a tiny tolerance so that e.g. 0.3 * 10 gives 3, not 4).
    """
    n_test = min(n, int(math.ceil(round((1 - train_ratio) * n, 9))))
    return n - n_test, n_test


def min_split_samples(train_ratio: float) -> int:
    """Fewest samples that :func:`split_train_test` cuts into >= 1 train and >= 1 test sample.

    2 for any ``train_ratio`` >= 0.5; more below (4 for 0.3).  A client with fewer samples would
    have nothing to train on or nothing to be evaluated on.
    """
    n = 2
    while _split_sizes(n, train_ratio)[0] < 1:
        n += 1
    return n


def _group_by_owner(indices: np.ndarray, owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Group ``indices`` by ``owner`` (client id per index), keeping their order within a client."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=num_clients)
    return np.split(indices[order], np.cumsum(counts)[:-1])


@dataclass
class DirDraws:
    """What :func:`partition_dir` did to meet its ``least`` rule."""

    least: int
    #: allocations drawn (1: the first one met the rule)
    draws: int
    #: why drawing stopped: "met" (the last draw met the rule), "max_tries" (no draw met it),
    #: "unlikely" (the draws so far showed the remaining ones would not meet it either)
    stop: str
    #: clients below ``least`` in the kept draw (0 when met)
    short_clients: int
    #: the kept draw's smallest client, before any top-up
    smallest_drawn: int
    #: samples moved from the largest clients to the short ones (0 when met)
    moved_samples: int


def partition_dir(labels: np.ndarray, num_clients: int, num_classes: int, beta: float,
                  least: int, rng: np.random.Generator, max_tries: int = 10000,
                  progress_every: float = PROGRESS_SECONDS) -> tuple[list[np.ndarray], DirDraws]:
    """Dirichlet label-skew partition; returns the sample indices of each client, and what it did.

    The whole allocation is redrawn until the smallest client holds ``least`` samples, as the
    reference protocol does.  With many clients that may never happen (over 1,000 MNIST clients,
    Dir(1.0) leaves a dozen clients short in every draw), so drawing is bounded:

    * at most ``max_tries`` draws;
    * after :data:`PROBE_DRAWS` draws, drawing stops when the remaining ones are unlikely to
      succeed: with m the mean number of short clients per draw so far, a draw meets the rule
      with probability about exp(-m) (short clients are rare, nearly independent events), so
      drawing stops once ``remaining · exp(-m)`` < :data:`GIVE_UP_CHANCE`;
    * every ``progress_every`` seconds of drawing a line on stderr gives the draws made, the bound
      and the best draw's short clients, naming ``--max-tries`` (lower it to top up sooner).

    When no draw met the rule, the draw that missed it by the fewest samples is kept and topped
    up: each short client receives the samples it lacks, taken at random from the clients that
    hold the most (see :func:`_top_up`).  All of this depends on the draws only, never on the
    clock, so a seed always gives the same partition or the same error.
    """
    labels = np.asarray(labels)
    total = len(labels)
    if least * num_clients > total:
        raise UserError(
            f"the dir partition cannot give each of {num_clients} clients {least} samples "
            f"(least_samples) from {total} samples; use at most {total // max(least, 1)} clients "
            f"(--num-clients)")
    cap = total / num_clients
    class_idx = [np.flatnonzero(labels == k) for k in range(num_classes)]
    alpha = np.full(num_clients, float(beta))
    clients = np.arange(num_clients)
    next_note = time.perf_counter() + progress_every
    best = None  # (deficit, permuted class indices, per-class counts, sizes) of the best draw
    short_sum, stop, draw = 0, "max_tries", 0
    for draw in range(1, max_tries + 1):
        sizes = np.zeros(num_clients, dtype=np.int64)
        perms, class_counts = [], []
        for idx_k in class_idx:
            idx_k = rng.permutation(idx_k)
            n_k = len(idx_k)
            drawn = rng.dirichlet(alpha)
            q = np.where(sizes < cap, drawn, 0.0)
            if not q.sum() > 0:  # every client is full: keep the draw as it was
                q = drawn
            q = q / q.sum()
            cuts = (np.cumsum(q) * n_k).astype(np.int64)[:-1]
            cuts = np.clip(cuts, 0, n_k)
            counts = np.diff(np.concatenate(([0], cuts, [n_k])))
            sizes += counts
            perms.append(idx_k)
            class_counts.append(counts)
        short = sizes < least
        deficit = int((least - sizes[short]).sum())
        if best is None or deficit < best[0]:
            best = (deficit, perms, class_counts, sizes)
        if deficit == 0:
            stop = "met"
            break
        short_sum += int(short.sum())
        remaining = max_tries - draw
        if draw >= PROBE_DRAWS and remaining * math.exp(-short_sum / draw) < GIVE_UP_CHANCE:
            stop = "unlikely"
            break
        if remaining and time.perf_counter() >= next_note:
            print(f"dir partition: {draw} of at most {max_tries} draws, none yet gives each of {num_clients} "
                  f"clients {least} samples (the best leaves {int((best[3] < least).sum())} short); "
                  f"still drawing (--max-tries {max_tries} bounds it; a lower one tops up the best draw sooner)",
                  file=sys.stderr, flush=True)
            next_note = time.perf_counter() + progress_every
    deficit, perms, class_counts, sizes = best
    report = DirDraws(least=least, draws=draw, stop=stop,
                      short_clients=int((sizes < least).sum()),
                      smallest_drawn=int(sizes.min()) if num_clients else 0,
                      moved_samples=deficit)
    if not perms:
        return [np.zeros(0, dtype=np.int64) for _ in range(num_clients)], report
    index = np.concatenate(perms)
    owner = np.concatenate([np.repeat(clients, counts) for counts in class_counts])
    if deficit:
        owner = _top_up(owner, sizes, least, rng)
    return _group_by_owner(index, owner, num_clients), report


def _top_up(owner: np.ndarray, sizes: np.ndarray, least: int,
            rng: np.random.Generator) -> np.ndarray:
    """Move samples so that every client holds ``least``; returns the new owner of each sample.

    ``owner[j]`` is the client of sample j and ``sizes`` its bincount (whose sum must be at least
    ``least · len(sizes)``).  The samples a short client lacks are taken one at a time from the
    client that holds the most at that moment (ties: the lower id), which moves as few samples
    as possible and only from the largest shares; which of a donor's samples move, and to which
    short client, is random.
    """
    num_clients = len(sizes)
    need = np.maximum(least - sizes, 0)
    give = np.zeros(num_clients, dtype=np.int64)
    heap = [(-int(s), c) for c, s in enumerate(sizes) if s > least]
    heapq.heapify(heap)
    for _ in range(int(need.sum())):
        neg, c = heapq.heappop(heap)
        give[c] += 1
        if -neg - 1 > least:
            heapq.heappush(heap, (neg + 1, c))
    order = rng.permutation(len(owner))
    grouped = order[np.argsort(owner[order], kind="stable")]  # by client, random within one
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rank = np.arange(len(owner)) - first[owner[grouped]]
    moved = rng.permutation(grouped[rank < give[owner[grouped]]])
    owner = owner.copy()
    owner[moved] = np.repeat(np.arange(num_clients), need)
    return owner


def partition_pat(labels: np.ndarray, num_clients: int, num_classes: int, classes_per_client: int,
                  balance: bool, least: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological partition: each client receives samples of at most ``classes_per_client`` classes.

    Classes are dealt in order to the first clients that still have class budget left, about
    ``ceil(N / C * classes_per_client)`` clients per class.  Unbalanced splits draw the size of
    each share (but the last) uniformly from [max(mean / 10, least / C), mean).
    """
    labels = np.asarray(labels)
    budget = np.full(num_clients, int(classes_per_client), dtype=np.int64)
    per_class = int(math.ceil(num_clients / num_classes * classes_per_client))
    pieces, owners = [], []
    for i in range(num_classes):
        candidates = np.flatnonzero(budget > 0)
        if len(candidates) == 0:
            raise UserError(
                f"the pat partition ran out of clients at class {i}: {num_clients} clients with "
                f"{classes_per_client} classes each cannot cover {num_classes} classes; use more "
                f"clients or a larger --classes-per-client")
        chosen = candidates[:per_class]
        m = len(chosen)
        idx_i = rng.permutation(np.flatnonzero(labels == i))
        n_i = len(idx_i)
        mean_share = n_i / m
        if balance or m == 1:
            head = np.full(m - 1, int(mean_share), dtype=np.int64)
        else:
            high = int(mean_share)
            low = min(int(math.ceil(max(mean_share / 10, least / num_classes))), high)
            if low >= high:
                head = np.full(m - 1, high, dtype=np.int64)
            else:
                head = rng.integers(low, high, size=m - 1, dtype=np.int64)
        counts = np.append(head, n_i - head.sum())
        pieces.append(idx_i)
        owners.append(np.repeat(chosen, counts))
        budget[chosen] -= 1
    if not pieces:
        return [np.zeros(0, dtype=np.int64) for _ in range(num_clients)]
    return _group_by_owner(np.concatenate(pieces), np.concatenate(owners), num_clients)


def partition_iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation of ``range(n)`` cut into ``num_clients`` near-equal parts."""
    return np.array_split(rng.permutation(n).astype(np.int64), num_clients)


def split_train_test(indices: np.ndarray, train_ratio: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one client's indices and cut them into (train, test) (see :func:`_split_sizes`)."""
    indices = rng.permutation(np.asarray(indices, dtype=np.int64))
    n_train = _split_sizes(len(indices), train_ratio)[0]
    return indices[:n_train], indices[n_train:]


@dataclass
class PartitionReport:
    """What :func:`partition_clients` did: for the command's output and the shard's record."""

    kind: str
    num_clients: int
    #: dir: the fewest samples every client must hold (``least_samples``, at least
    #: :func:`min_split_samples`); 0 for the other kinds
    least_samples: int
    #: the smallest client (train + test samples) and its split; the fewest train and test
    #: samples of any client
    smallest: int
    smallest_train: int
    smallest_test: int
    min_train: int
    min_test: int
    seconds: float
    #: dir only: what the redrawing did
    draws: DirDraws = None

    def summary(self) -> str:
        """One line for the partition's output."""
        smallest = (f"smallest client {self.smallest} samples ({self.smallest_train} train, "
                    f"{self.smallest_test} test)")
        d = self.draws
        if d is None:
            return f"{self.kind}: {smallest}"
        if d.stop == "met":
            return (f"dir: draw {d.draws} gave every client >= {d.least} samples (least_samples); "
                    f"{smallest}")
        why = ("--max-tries reached" if d.stop == "max_tries" else
               "the rest were judged unlikely to meet it")
        return (f"dir: none of {d.draws} draws gave every client >= {d.least} samples "
                f"(least_samples; {why}); the best left {d.short_clients} clients short "
                f"(smallest {d.smallest_drawn}), topped up with {d.moved_samples} samples from "
                f"the largest clients; {smallest}")

    def params(self) -> dict:
        """What the shard records of it (``partition_params``): deterministic facts only."""
        d = self.draws
        if d is None:
            return {}
        return {"least_samples": d.least, "draws": d.draws, "topped_up_clients": d.short_clients,
                "moved_samples": d.moved_samples}


@dataclass
class Partition:
    #: one ``(train_idx, test_idx)`` pair of int64 index arrays per client
    shares: list
    report: PartitionReport


def partition_clients(labels: np.ndarray, num_classes: int, kind: str, num_clients: int,
                      seed: int, beta: float = 0.1, classes_per_client: int = 2,
                      balance: bool = True, batch_size: int = 10, train_ratio: float = 0.75,
                      max_tries: int = 10000,
                      progress_every: float = PROGRESS_SECONDS) -> Partition:
    """Partition ``labels`` among ``num_clients`` clients and split each share into train/test.

    ``dir`` and ``iid`` give every client at least :func:`min_split_samples` samples (one train
    and one test sample), or stop with a :class:`UserError` naming ``--num-clients`` when the
    data set is too small for that; ``dir`` also enforces ``least_samples`` (bounded redraws,
    then a top-up: :func:`partition_dir`).
    """
    labels = np.asarray(labels)
    if kind not in PARTITION_KINDS:
        raise UserError(f"unknown partition '{kind}'; choose one of {', '.join(PARTITION_KINDS)}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise UserError(f"num_clients must be an integer >= 1, got {num_clients}")
    num_clients = int(num_clients)
    if not beta > 0:
        raise UserError(f"beta must be > 0, got {beta}")
    if not 0 < train_ratio < 1:
        raise UserError(f"train_ratio must be between 0 and 1 (exclusive), got {train_ratio}")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    if max_tries < 1:
        raise UserError(f"max_tries must be >= 1, got {max_tries}")
    if num_classes < 1:
        raise UserError(f"num_classes must be >= 1, got {num_classes}")
    if kind == "pat" and not 1 <= classes_per_client <= num_classes:
        raise UserError(f"classes_per_client must be between 1 and {num_classes}, "
                        f"got {classes_per_client}")
    if labels.ndim != 1:
        raise UserError(f"labels must be a 1-d array, got shape {labels.shape}")
    total = len(labels)
    if total < num_clients:
        raise UserError(f"cannot split {total} samples among {num_clients} clients: "
                        f"use at most {total} clients")
    if total and (labels.min() < 0 or labels.max() >= num_classes):
        raise UserError(f"labels must lie in [0, {num_classes}), found "
                        f"[{labels.min()}, {labels.max()}]")
    floor = min_split_samples(train_ratio)
    if kind != "pat" and total < floor * num_clients:
        raise UserError(f"{total} samples cannot give each of {num_clients} clients the {floor} "
                        f"samples that one train and one test sample need (train_ratio "
                        f"{train_ratio:g}): use at most {total // floor} clients (--num-clients)")

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    least = least_samples(batch_size, train_ratio, total, num_clients)
    draws = None
    if kind == "dir":
        shares, draws = partition_dir(labels, num_clients, num_classes, beta, max(least, floor),
                                      rng, max_tries, progress_every)
    elif kind == "pat":
        shares = partition_pat(labels, num_clients, num_classes, classes_per_client, balance,
                               least, rng)
    else:
        shares = partition_iid(total, num_clients, rng)
    pairs = [split_train_test(share, train_ratio, rng) for share in shares]
    n_train = np.array([len(tr) for tr, _ in pairs], dtype=np.int64)
    n_test = np.array([len(te) for _, te in pairs], dtype=np.int64)
    short = int(((n_train == 0) | (n_test == 0)).sum())
    if short:  # dir and iid give every client a train and a test sample (the floor above); pat deals whole shares
        per_class = int(math.ceil(num_clients / num_classes * classes_per_client))
        raise UserError(f"the pat partition leaves {short} of {num_clients} clients without a training or a test "
                        f"sample (each class's samples are dealt to about {per_class} clients, "
                        f"{total // num_classes} samples a class on average); use fewer clients (--num-clients) "
                        f"or a smaller --classes-per-client")
    i = int(np.argmin(n_train + n_test))
    report = PartitionReport(kind=kind, num_clients=num_clients,
                             least_samples=draws.least if draws else 0,
                             smallest=int(n_train[i] + n_test[i]), smallest_train=int(n_train[i]),
                             smallest_test=int(n_test[i]), min_train=int(n_train.min()),
                             min_test=int(n_test.min()), seconds=time.perf_counter() - start,
                             draws=draws)
    return Partition(shares=pairs, report=report)


def client_rows(x: np.ndarray, y: np.ndarray, shares, lengths: np.ndarray = None):
    """Yield each client's samples for :func:`~fedcp_dist.data.shards.write_shard`.

    ``shares`` are the ``(train_idx, test_idx)`` pairs of :func:`partition_clients`.  Samples are
    :class:`~fedcp_dist.data.shards.Rows` views of ``x``; labels (and, for text, the ``lengths``
    of the rows, appended as train_len, test_len) are small and gathered directly.
    """
    y = np.asarray(y)
    for train_idx, test_idx in shares:
        part = (Rows(x, train_idx), y[train_idx], Rows(x, test_idx), y[test_idx])
        if lengths is not None:
            part += (lengths[train_idx], lengths[test_idx])
        yield part
