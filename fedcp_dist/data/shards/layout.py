"""The shard format's names and numbers, what describes a shard (:class:`ShardInfo`), the rows
view a writer is handed (:class:`Rows`) and the cheap layout digest; the format itself is described
in :mod:`fedcp_dist.data.shards`."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

#: the version written: one array per split, per-client offsets
FORMAT_VERSION = 3
#: the group-per-client versions, still read: images, and images or text
IMAGE_FORMAT_VERSION = 1
TEXT_FORMAT_VERSION = 2
READABLE_VERSIONS = (IMAGE_FORMAT_VERSION, TEXT_FORMAT_VERSION, FORMAT_VERSION)
KIND = "image"
TEXT_KIND = "text"
TABLE_KIND = "table"
KINDS = (KIND, TEXT_KIND, TABLE_KIND)
#: the group-per-client version that holds each kind
GROUP_VERSIONS = {KIND: IMAGE_FORMAT_VERSION, TEXT_KIND: TEXT_FORMAT_VERSION}
CHUNK_SAMPLES = 256
#: samples copied per write and per read: a whole number of chunks, so no chunk is compressed
#: twice, and the chunk length of the label and length arrays
WRITE_SAMPLES = CHUNK_SAMPLES * 16
SPLITS = ("train_x", "train_y", "test_x", "test_y")
TEXT_SPLITS = SPLITS + ("train_len", "test_len")
#: the largest attribute versions 1 and 2 write (HDF5 refuses object-header messages over 64 KiB)
ATTRIBUTE_BYTES = 65_000

_REQUIRED_ATTRS = ("kind", "source", "num_classes", "num_clients", "input_shape", "mean", "std",
                   "partition", "partition_params", "seed")
#: the attribute holding a shard's content fingerprint (absent from shards written before it)
FINGERPRINT = "fingerprint"
#: the attribute holding each array's digest as written, JSON (absent from shards written before
#: it; :mod:`fedcp_dist.data.shards.verify`)
ARRAY_DIGESTS = "array_digests"
#: attributes of versions 1 and 2 only (datasets in version 3)
_COUNT_ATTRS = ("train_counts", "test_counts", "train_label_counts", "test_label_counts")


@dataclass
class ShardInfo:
    """The attributes of a shard file and its per-client counts."""

    path: str
    format_version: int
    kind: str
    source: str
    num_classes: int
    num_clients: int
    input_shape: tuple
    mean: tuple
    std: tuple
    partition: str
    partition_params: dict
    seed: int
    train_counts: np.ndarray
    test_counts: np.ndarray
    #: (N, num_classes) per split; None when read without them (``read_info(label_counts=False)``)
    train_label_counts: Optional[np.ndarray]
    test_label_counts: Optional[np.ndarray]
    #: number of token ids of a text shard (its vocabulary's length); 0 for images
    vocab_size: int = 0
    #: the content fingerprint written with the shard ("sha256:..."); "" for a shard written before
    #: fingerprints (see the module's docstring)
    fingerprint: str = ""
    #: each array's digest as written ({} for a shard written before them; see
    #: :mod:`fedcp_dist.data.shards.verify`)
    array_digests: dict = field(default_factory=dict)


class Rows:
    """The rows ``index`` of the array ``base``, copied out a block at a time when written.

    Lets a caller hand :func:`write_shard` every client's samples without first gathering a
    client's (possibly large) share into a new array: at most :data:`WRITE_SAMPLES` rows are
    copied at once.
    """

    def __init__(self, base: np.ndarray, index):
        self.base = base
        self.index = np.asarray(index, dtype=np.int64)
        if self.index.ndim != 1:
            raise ValueError(f"Rows needs a 1-d index, got shape {self.index.shape}")

    @property
    def shape(self) -> tuple:
        return (len(self.index),) + tuple(self.base.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return self.base.ndim

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item) -> np.ndarray:
        return self.base[self.index[item]]


def normalisation_problem(kind: str, input_shape, mean, std) -> str:
    """What is wrong with a shard's ``mean`` / ``std`` ("" when nothing): an image shard holds one
    value of each per channel (input_shape[0]), a table shard one per feature, each finite and the
    std > 0 (the inputs are divided by it); a text shard's are not read."""
    if kind == TEXT_KIND:
        return ""
    shape = tuple(int(d) for d in input_shape)
    what, n = ("channel", shape[0]) if kind != TABLE_KIND and len(shape) == 3 else ("feature", shape[0] if shape else 0)
    for name, values in (("mean", mean), ("std", std)):
        v = np.asarray(values, dtype=np.float64).ravel()
        if v.size != n:
            return f"'{name}' holds {v.size} value(s) for {n} {what}(s): one per {what}"
        if not np.isfinite(v).all():
            return f"'{name}' holds {v[~np.isfinite(v)][0]}: every value must be finite"
        if name == "std" and (v <= 0).any():
            return f"'std' holds {v[v <= 0][0]}: every value must be > 0 (the inputs are divided by it)"
    return ""


def training_attributes(kind: str, num_classes: int, input_shape, mean, std, vocab, columns) -> dict:
    """The attributes that shape training, as the content fingerprint and digests hash them."""
    return {"kind": kind, "num_classes": int(num_classes), "input_shape": [int(d) for d in input_shape],
            "mean": [float(v) for v in np.asarray(mean, dtype=np.float64).ravel()],
            "std": [float(v) for v in np.asarray(std, dtype=np.float64).ravel()],
            "vocab": None if vocab is None else [str(t) for t in vocab],
            "columns": None if columns is None else [str(c) for c in columns]}


def layout_hash(info: "ShardInfo"):
    """The SHA-256 of :func:`layout_digest` fed its attributes and per-client sample counts (the
    per-class counts follow, train's then test's, row by row)."""
    h = hashlib.sha256()
    meta = {"kind": info.kind, "num_classes": info.num_classes, "num_clients": info.num_clients,
            "input_shape": list(info.input_shape), "mean": list(info.mean), "std": list(info.std),
            "vocab_size": info.vocab_size}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for key in ("train_counts", "test_counts"):
        h.update(np.ascontiguousarray(getattr(info, key), dtype=np.int64).tobytes())
    return h


def layout_digest(info: "ShardInfo") -> str:
    """A digest of a shard's attributes that shape training and its per-client counts (cheap: no
    sample is read). Stands in for :attr:`ShardInfo.fingerprint` on shards written without one."""
    h = layout_hash(info)
    for key in ("train_label_counts", "test_label_counts"):
        h.update(np.ascontiguousarray(getattr(info, key), dtype=np.int64).tobytes())
    return f"sha256:{h.hexdigest()}"
