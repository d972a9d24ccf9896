"""Room on disk for a run's checkpoints, checked before its first round.

A checkpoint that does not fit on out_dir's file system stops the run with the previous one intact
(:class:`~fedcp_dist.rundir.checkpoint.Checkpointer`), but only after every round since that one
was trained: a run of thousands of clients whose first checkpoint cannot fit would train its first
``checkpoint_every`` rounds for nothing. So the start-up estimates what the checkpoints will take
and compares it with the space the file system gives an unprivileged user (``statvfs``'s
``f_bavail``): a run whose first checkpoint cannot fit is refused in one line; one whose
checkpoints at their peak will not fit is told so at start, with a ``keep_checkpoints`` that fits;
any other says the figure beside its memory.

The estimate (:class:`Figures`, plain numbers, so it is tested with made-up sizes):

* **a client's part**: the bytes of its state (with its BatchNorm statistics and compression
  residual) and :data:`TENSOR_BYTES` per tensor for ``torch.save``'s records; a disk store's
  client files :data:`FILE_BYTES` more each, one file per client;
* **the clients with a state** after round t: every client at full participation, otherwise the
  expected number of distinct clients in t uniform cohorts of ρN: N (1 - (1 - ρ)^t);
* **the global part** (rank 0's ``global.pt``): the global state (a peer method's per-client banks
  included) and :data:`RECORD_BYTES` per round done for the metric records in its metadata;
* **links**: with ``client_state: disk`` an unchanged client's file is a hard link to the previous
  checkpoint's, so after the first written (or the one resumed from) a checkpoint adds the clients
  trained since, at most ρN a round; a checkpoint of the other stores holds every client's state;
* **the peak**: while the checkpoint after round t is written, the ``keep_checkpoints`` newest
  before it are still there; a disk store's own files, where they are on the same file system,
  hold every client with a state besides.

With ``checkpoint_every: 0`` (a checkpoint only on a preemption signal) the line says what one
after the last round would take and nothing is refused.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Tuple

from fedcp_dist.errors import UserError
from fedcp_dist.state.disk_store import DiskClientStore
from fedcp_dist.state.process_memory import client_state_size, state_bytes

#: bytes ``torch.save`` adds per tensor (its pickle record and zip entry, aligned; measured 250–350)
TENSOR_BYTES = 384
#: bytes a client file of a disk store adds besides its tensors (the zip's own records; measured 1.5 KiB)
FILE_BYTES = 2048
#: bytes of a round's metric record in a checkpoint's metadata (measured 640 for 20 clients)
RECORD_BYTES = 1024


@dataclass
class Figures:
    """What a run's checkpoints are made of (all ranks together), in bytes and counts."""

    clients: int  # N, the run's clients
    participation: float  # ρ: the expected fraction of clients a round trains
    client_bytes: int  # one client's part of a checkpoint (state, statistics, residual and records)
    global_bytes: int  # rank 0's part besides the metric records
    rounds: int
    start: int  # rounds done already (a resume)
    every: int  # checkpoint_every (0: only on a preemption signal)
    keep: int  # keep_checkpoints
    linked: bool = False  # a disk store: unchanged client files are links to the previous checkpoint's
    store_here: bool = False  # a disk store whose own files are on out_dir's file system

    def with_state(self, t: int) -> int:
        """Clients with a state after ``t`` rounds (expected, rounded up)."""
        if t <= 0 or self.clients == 0:
            return 0
        if self.participation >= 1.0:
            return self.clients
        return min(self.clients, math.ceil(self.clients * (1.0 - (1.0 - self.participation) ** t)))

    def trained_in(self, rounds: int) -> int:
        """Clients trained in ``rounds`` consecutive rounds at most (expected cohorts, rounded up)."""
        return min(self.clients, math.ceil(self.participation * self.clients) * max(0, rounds))

    def checkpoint_rounds(self) -> List[int]:
        """The rounds after which the run checkpoints (with ``every`` 0: the last, as a preemption's worst)."""
        if self.rounds <= self.start:
            return []
        if not self.every:
            return [self.rounds]
        out = list(range((self.start // self.every + 1) * self.every, self.rounds + 1, self.every))
        return out if out and out[-1] == self.rounds else out + [self.rounds]


@dataclass
class Checkpoint:
    """One checkpoint the run will write: after which round, its global part's bytes, its client
    files' (or part's) bytes, and of those the bytes no earlier checkpoint shares (links)."""

    round: int
    global_part: int
    clients: int
    unshared: int


def checkpoints(f: Figures) -> List[Checkpoint]:
    """Every checkpoint the run will write, in order."""
    out, before = [], f.start
    for i, t in enumerate(f.checkpoint_rounds()):
        whole = f.with_state(t)
        new = whole if not f.linked or (i == 0 and f.start == 0) else min(whole, f.trained_in(t - before))
        out.append(Checkpoint(t, f.global_bytes + RECORD_BYTES * t, whole * f.client_bytes, new * f.client_bytes))
        before = t
    return out


def _prefix(values) -> List[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _needs(f: Figures, sizes: List[Checkpoint]) -> List[int]:
    """:func:`need_at` of every checkpoint, by running sums (a run of 2,000 checkpoints keeping 1,000)."""
    g, c, u = (_prefix(getattr(x, name) for x in sizes) for name in ("global_part", "clients", "unshared"))
    out = []
    for j, cp in enumerate(sizes):
        lo = max(0, j - f.keep)
        files = c[j + 1] - c[lo]
        if f.linked:  # a file shared by links counts once: the newest checkpoint's, and the older ones a later replaced
            files = min(files, cp.clients + u[j + 1] - u[lo + 1])
        store = f.with_state(cp.round) * f.client_bytes if f.store_here else 0
        out.append(g[j + 1] - g[lo] + files + store)
    return out


def need_at(f: Figures, j: int, sizes: Optional[List[Checkpoint]] = None) -> int:
    """Bytes the run's checkpoints take on disk while its ``j``-th checkpoint (0-based) is written:
    it and the ``keep`` newest before it of this run (those of an earlier attempt are on disk
    already), and a disk store's own files where they share the file system."""
    sizes = sizes if sizes is not None else checkpoints(f)
    return _needs(f, sizes[: j + 1])[j]


def peak(f: Figures, sizes: Optional[List[Checkpoint]] = None) -> Tuple[int, int]:
    """(bytes, round) of the most the run's checkpoints take at once; (0, 0) without any."""
    sizes = sizes if sizes is not None else checkpoints(f)
    return max(zip(_needs(f, sizes), (c.round for c in sizes)), default=(0, 0))


def mib(n: float) -> str:
    """Bytes as KiB, MiB or GiB, to a tenth of a KiB or MiB or a hundredth of a GiB (a need and the room
    beside it seldom round to the same figure; a client's small state is not 0.0 MiB)."""
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_bytes(folder) -> Optional[int]:
    """The bytes an unprivileged user may still write on ``folder``'s file system (None where the
    file system cannot say: the check is then a figure only, never a refusal)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def same_file_system(a, b) -> bool:
    """Whether ``b`` (or its nearest folder that exists) is on ``a``'s file system."""
    b = Path(b).absolute()
    while not b.exists() and b != b.parent:
        b = b.parent
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def check(f: Figures, free: Optional[int], out_dir: str) -> str:
    """The line that says what the checkpoints take at their peak and what is free; a one-line
    :class:`UserError` when the first checkpoint cannot fit; the line is a note when the peak does not."""
    sizes = checkpoints(f)
    if not sizes:
        return ""
    where = f"the file system of out_dir {out_dir}"
    top, at = peak(f)
    if free is None:
        return f"checkpoints on disk: about {mib(top)} at the peak (after round {at}); the free space on {where} is unknown"
    if not f.every:
        return (f"checkpoints on disk: only on a preemption signal (checkpoint_every=0), about {mib(top)} after "
                f"round {at}; {mib(free)} free on {where}")
    first = need_at(f, 0, sizes)
    if first > free:
        what = f"about {f.with_state(sizes[0].round)} clients' states of {mib(f.client_bytes)} each"
        if f.store_here:
            what += " and as much again for client_state: disk's own files there"
        raise UserError(f"config key 'out_dir': the first checkpoint (after round {sizes[0].round}) needs about "
                        f"{mib(first)} ({what}, and the global state's {mib(f.global_bytes)}) but {mib(free)} "
                        f"are free on {where}: free space there or choose an out_dir on a larger disk")
    kept = f"{f.keep} kept + 1 being written"
    if top <= free:
        return f"checkpoints on disk: about {mib(top)} at the peak (after round {at}, {kept}); {mib(free)} free on {where}"
    # the most checkpoints kept that fit (the peak grows with keep): a bisection over 1 … keep - 1
    lo, hi = 0, f.keep - 1
    while lo < hi:
        k = (lo + hi + 1) // 2
        lo, hi = (k, hi) if peak(replace(f, keep=k), sizes)[0] <= free else (lo, k - 1)
    fits = lo or None
    advice = (f"keep_checkpoints={fits} fits" if fits else
              "not even keep_checkpoints=1 fits: free space there or choose an out_dir on a larger disk")
    return (f"note: the checkpoints will need about {mib(top)} at their peak (after round {at}, {kept}) but "
            f"{mib(free)} are free on {where}: the run stops at the first checkpoint that does not fit, the "
            f"previous one intact; {advice}")


def checkpoint_room(cfg, setup, algo, store, agg, compressor, start: int) -> str:
    """:func:`check` of the run's checkpoints (every rank's parts, on out_dir's file system: rank 0
    checks for all) against the room there, after ``start`` rounds done, its figures taken from the
    run's parts (the method's client state, the store, the upload's shapes); its line."""
    nbytes, tensors = client_state_size(algo, store, agg, compressor, int(setup.clients[0]) if len(setup.clients) else 0)
    disk = isinstance(store, DiskClientStore)
    client_bytes = nbytes + TENSOR_BYTES * tensors + (FILE_BYTES if disk else 0) if nbytes else 0
    gs = store.global_state
    rho = (sum(cfg.participation_range) / 2 if cfg.participation_range is not None else cfg.participation)
    f = Figures(clients=setup.num_clients, participation=min(1.0, float(rho)), client_bytes=client_bytes,
                global_bytes=state_bytes(gs) + TENSOR_BYTES * len(gs), rounds=cfg.rounds, start=start,
                every=cfg.checkpoint_every, keep=cfg.keep_checkpoints, linked=disk,
                store_here=disk and same_file_system(cfg.out_dir, store.dir))
    return check(f, free_bytes(cfg.out_dir), cfg.out_dir)
