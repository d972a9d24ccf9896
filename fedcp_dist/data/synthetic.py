"""Synthetic(α, β): the benchmark of Li et al., "Federated Optimization in Heterogeneous Networks"
(FedProx, MLSys 2020, §5.1), generated client by client and streamed into a shard.

Client k (of any number, up to millions) has its own model and its own input distribution::

    u_k ~ N(0, α²)      W_k ∈ R^{10×60}, b_k ∈ R^10, every entry ~ N(u_k, 1)
    B_k ~ N(0, β²)      v_k ∈ R^60, every entry ~ N(B_k, 1)
    x ~ N(v_k, Σ),  Σ = diag(j^-1.2), j = 1 … 60
    y = argmax(softmax(W_k x + b_k)) = argmax(W_k x + b_k)

The paper writes N(0, α) and N(0, β); its authors' generator (``data/synthetic_*/
generate_synthetic.py`` of github.com/litian96/FedProx) draws ``np.random.normal(0, alpha)``, i.e.
with standard deviation α, and so does this module (the two readings agree for α = β = 1 and 0).
The same generator gives W_k and b_k one mean u_k, and Synthetic-IID (``iid``; ``generate_iid.py``)
one W, b ~ N(0, 1) for every client and v_k = 0.

Client sizes follow that generator's power law: n_k = floor(L_k) + 50, L_k ~ lognormal(4, 2)
(the log of L_k is N(4, 2²)); ``min_samples`` replaces the 50, ``max_samples`` (None: no cap)
caps n_k, so that a million clients fit on a disk (the uncapped law averages about 450 samples a
client). Each client's samples are cut into train and test as every source's are
(``train_ratio``, n_test = ceil((1 − train_ratio)·n)); the FedProx files were cut 90/10.

Determinism: client k's draws come from its own generator, PCG64 seeded with
``SeedSequence(seed, spawn_key=(0, k))``, in a fixed order (size, then u_k, B_k, v_k, W_k, b_k,
then x block by block); Synthetic-IID's shared W, b come from ``SeedSequence(seed,
spawn_key=(1,))``. Client k's data is therefore a function of (seed, k) alone: the first 10
clients of N = 20 are the clients of N = 10. Labels are computed from x as stored (float32), so
y = argmax(W_k x + b_k) holds for the file's own rows.

Memory: one client at a time is generated (its rows in blocks of :data:`ROW_BLOCK`) and handed to
the shard writer, which appends a block of rows at a time; what is held is the largest client
plus the writer's buffers, and of all the clients only their sample counts (docs/performance.md
has the figures for 10^4 to 10^6 clients).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from fedcp_dist.data.common import progress
from fedcp_dist.errors import UserError

DIMENSION = 60
NUM_CLASSES = 10
#: lognormal(mean, sigma) of the client sizes, as the FedProx generator draws them
SIZE_MEAN, SIZE_SIGMA = 4.0, 2.0
MIN_SAMPLES = 50
#: Σ's diagonal, j^-1.2 for j = 1 … 60, and its square root (the scale of each feature's noise)
COV_DIAG = np.arange(1, DIMENSION + 1, dtype=np.float64) ** -1.2
_SCALE = np.sqrt(COV_DIAG)
#: rows generated at once
ROW_BLOCK = 4096
#: the most clients and the largest smallest client a shard is generated with: beyond them the
#: writer's per-client counts (about 60 bytes a client) or one client held whole while it is
#: generated (248 bytes a sample) outgrow any machine, and 10**13 clients ran for a million hours
#: before the memory ran out (the docs measure up to 10**6 clients)
MAX_CLIENTS = 10**8
MAX_MIN_SAMPLES = 10**7


@dataclass(frozen=True)
class SyntheticSpec:
    """What to generate (see the module's docstring)."""

    alpha: float
    beta: float
    num_clients: int
    seed: int = 1
    iid: bool = False
    train_ratio: float = 0.75
    min_samples: int = MIN_SAMPLES
    max_samples: Optional[int] = None

    def check(self) -> None:
        """One-line errors naming the option as the command line spells it."""
        from fedcp_dist.data.partition import min_split_samples

        for name, value in (("--synthetic-alpha", self.alpha), ("--synthetic-beta", self.beta)):
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"{name} must be a finite number >= 0, got {value}")
        if self.num_clients < 1:
            raise UserError(f"--num-clients must be >= 1, got {self.num_clients}")
        if self.num_clients > MAX_CLIENTS:
            raise UserError(f"--num-clients must be at most {MAX_CLIENTS:,} with --source synthetic (the writer keeps "
                            f"about 60 bytes a client in memory, and each client holds at least "
                            f"--synthetic-min-samples samples of 240 bytes), got {self.num_clients:,}")
        if not 0 < self.train_ratio < 1:
            raise UserError(f"--train-ratio must be between 0 and 1 (exclusive), got {self.train_ratio}")
        least = min_split_samples(self.train_ratio)
        if self.min_samples < least:
            raise UserError(f"--synthetic-min-samples must be >= {least} (one train and one test sample at "
                            f"--train-ratio {self.train_ratio:g}), got {self.min_samples}")
        if self.min_samples > MAX_MIN_SAMPLES:
            raise UserError(f"--synthetic-min-samples must be at most {MAX_MIN_SAMPLES:,} (a client is generated "
                            f"whole in memory, 248 bytes a sample), got {self.min_samples:,}")
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise UserError(f"--synthetic-max-samples ({self.max_samples}) must be >= --synthetic-min-samples "
                            f"({self.min_samples})")

    def params(self) -> dict:
        """What the shard records in ``partition_params``."""
        return {"alpha": self.alpha, "beta": self.beta, "iid": self.iid, "dimension": DIMENSION,
                "train_ratio": self.train_ratio, "min_samples": self.min_samples, "max_samples": self.max_samples,
                "sizes": f"min(floor(lognormal({SIZE_MEAN:g}, {SIZE_SIGMA:g})) + min_samples, max_samples)",
                "streams": "client k: PCG64(SeedSequence(seed, spawn_key=(0, k)))"}


@dataclass
class ClientModel:
    """Client k's draws before its samples: its size n, W (10, 60), b (10,), v (60,)."""

    n: int
    W: np.ndarray
    b: np.ndarray
    v: np.ndarray


def client_generator(seed: int, k: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0, k)))


def shared_model(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic-IID's W (10, 60) and b (10,), the same for every client."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
    return rng.normal(0.0, 1.0, (NUM_CLASSES, DIMENSION)), rng.normal(0.0, 1.0, NUM_CLASSES)


def client_size(rng: np.random.Generator, spec: SyntheticSpec) -> int:
    n = int(rng.lognormal(SIZE_MEAN, SIZE_SIGMA)) + spec.min_samples
    return n if spec.max_samples is None else min(n, spec.max_samples)


def client_model(spec: SyntheticSpec, k: int, shared=None) -> tuple[ClientModel, np.random.Generator]:
    """Client k's size and model, and its generator (positioned to draw its samples next)."""
    rng = client_generator(spec.seed, k)
    n = client_size(rng, spec)
    if spec.iid:
        W, b = shared if shared is not None else shared_model(spec.seed)
        return ClientModel(n, W, b, np.zeros(DIMENSION)), rng
    u = rng.normal(0.0, spec.alpha)
    B = rng.normal(0.0, spec.beta)
    v = rng.normal(B, 1.0, DIMENSION)
    W = rng.normal(u, 1.0, (NUM_CLASSES, DIMENSION))
    b = rng.normal(u, 1.0, NUM_CLASSES)
    return ClientModel(n, W, b, v), rng


def client_samples(spec: SyntheticSpec, k: int, shared=None) -> tuple[np.ndarray, np.ndarray]:
    """Client k's samples: x float32 (n, 60), y int64 (n,)."""
    model, rng = client_model(spec, k, shared)
    x = np.empty((model.n, DIMENSION), dtype=np.float32)
    y = np.empty(model.n, dtype=np.int64)
    for start in range(0, model.n, ROW_BLOCK):
        rows = min(ROW_BLOCK, model.n - start)
        with np.errstate(over="ignore", invalid="ignore"):
            block = (model.v + rng.standard_normal((rows, DIMENSION)) * _SCALE).astype(np.float32)
            logits = block.astype(np.float64) @ model.W.T + model.b
        if not (np.isfinite(block).all() and np.isfinite(logits).all()):
            raise UserError(f"--synthetic-alpha {spec.alpha:g} and --synthetic-beta {spec.beta:g} make client {k}'s "
                            f"{'features' if not np.isfinite(block).all() else 'logits'} overflow (past float32's "
                            f"3.4e38 or float64's 1.8e308); the benchmark's values are 0 to about 1")
        x[start:start + rows] = block
        y[start:start + rows] = np.argmax(logits, axis=1)
    return x, y


def synthetic_clients(spec: SyntheticSpec) -> Iterator[tuple]:
    """Each client's (train_x, train_y, test_x, test_y), one client at a time."""
    from fedcp_dist.data.partition import _split_sizes

    shared = shared_model(spec.seed) if spec.iid else None
    for k in range(spec.num_clients):
        x, y = client_samples(spec, k, shared)
        n_train = _split_sizes(len(y), spec.train_ratio)[0]
        yield x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def write_synthetic_shard(spec: SyntheticSpec, out, say, replace: bool = True) -> None:
    """Generate ``spec``'s clients into the shard ``out``, one client at a time (``replace``: see
    :func:`~fedcp_dist.data.shards.write_shard`)."""
    from fedcp_dist.data.shards import write_shard

    spec.check()
    name = "Synthetic-IID" if spec.iid else f"Synthetic({spec.alpha:g}, {spec.beta:g})"
    cap = "" if spec.max_samples is None else f", at most {spec.max_samples}"
    say(f"generating {name}: {spec.num_clients} clients, seed {spec.seed}, sizes floor(lognormal"
        f"({SIZE_MEAN:g}, {SIZE_SIGMA:g})) + {spec.min_samples}{cap}, {spec.train_ratio:g} train split")
    write_shard(out, progress(synthetic_clients(spec), total=spec.num_clients, desc="writing clients",
                         unit="client"), source="synthetic",
                num_classes=NUM_CLASSES, input_shape=(DIMENSION,), mean=(0.0,) * DIMENSION, std=(1.0,) * DIMENSION,
                partition="synthetic", partition_params=spec.params(), seed=spec.seed, kind="table",
                columns=[f"x{j}" for j in range(DIMENSION)], replace=replace)
