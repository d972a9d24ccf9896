"""A shard verified by its content: every array hashed a block at a time (:func:`content_digest`),
checked against the digests written with the shard (:func:`verify_shard`), the result kept beside
the file for the next run that opens the same file (:func:`cached_digest`).

What is hashed, in one pass over the file, reading :data:`WRITE_SAMPLES` rows of each dataset at a
time (whole chunks, each decompressed once):

* per array (``train_x``, ``train_y``, ``test_x``, ``test_y``, ``train_len``/``test_len`` of text,
  ``train_offsets``, ``test_offsets``) the SHA-256 of its name, dtype, shape and bytes (version 1
  and 2 shards: every client's rows in client order, the offsets from the counts), and of the
  attributes that shape training (``attributes``: kind, classes, input shape, mean/std, the
  vocabulary, the feature names): :attr:`ShardDigest.arrays`, which name what differs between two
  shards;
* the shard's ``fingerprint`` as :mod:`fedcp_dist.data.shards.write` computes it (each client's
  arrays in client order, then those attributes): :attr:`ShardDigest.fingerprint`.

The same pass checks what a run would otherwise trip over later (each a one-line
:class:`UserError` naming the split, the client and the value): labels outside ``[0,
num_classes)``, per-class counts (``{split}_label_counts``) that the labels do not add up to (said
after the digests: :attr:`ShardDigest.problem`) and non-finite feature values of a table; dtypes are checked when the shard is read
(:func:`fedcp_dist.data.shards.read_info`).

A shard written since array digests exist carries them (root attribute ``array_digests``); one
written before carries at least its ``fingerprint``. Either is compared with what the file holds
now, so a shard edited in place or damaged after it was written is refused by name.

On MNIST-sized data the pass costs about a second per 100 MB of samples, most of it gzip; so that a
re-read is free, a digest that took :data:`CACHE_SECONDS` or more is kept in ``<shard>.digest.json``
beside the shard, keyed by the file's identity (device, inode, size, modification time in ns): any
write to the shard, or a copy of it (another inode), computes it again. A folder that cannot be
written keeps no cache (the digest is computed each time).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import h5py
import numpy as np

from fedcp_dist.data.shards.layout import (FORMAT_VERSION, SPLITS, TABLE_KIND, TEXT_KIND, TEXT_SPLITS,
                                           WRITE_SAMPLES, ShardInfo, training_attributes)
from fedcp_dist.errors import UserError
from fedcp_dist.fileio import atomic_write_bytes

#: the version of what the cache file holds (a digest computed another way is not read back)
DIGEST_VERSION = 1
#: the cache file beside a shard: ``<shard>`` + this
CACHE_SUFFIX = ".digest.json"
#: digests that took this many seconds or more are cached
CACHE_SECONDS = 1.0
#: the key of the training attributes among :attr:`ShardDigest.arrays`
ATTRIBUTES = "attributes"
#: what each array holds, as a refusal names it
WHAT = {"train_x": "training samples", "test_x": "test samples", "train_y": "training labels",
        "test_y": "test labels", "train_len": "training text lengths", "test_len": "test text lengths",
        "train_offsets": "clients' training rows", "test_offsets": "clients' test rows",
        ATTRIBUTES: "attributes (classes, input shape, mean/std, vocabulary)"}


class ArrayHash:
    """The digest of one array fed a block of rows at a time: SHA-256 of its name, dtype, shape and
    the SHA-256 of its bytes (so the shape may be known only at the end)."""

    def __init__(self, name: str):
        self.name, self.h, self.dtype, self.rows, self.row_shape = name, hashlib.sha256(), None, 0, ()

    def add(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows)
        if self.dtype is None:
            self.dtype, self.row_shape = np.dtype(rows.dtype).str, tuple(int(d) for d in rows.shape[1:])
        self.rows += len(rows)
        self.h.update(rows)

    def hexdigest(self, dtype=None, row_shape=None) -> str:
        """``sha256:…``; ``dtype`` / ``row_shape``: the array's, where no row was added."""
        dtype = self.dtype or np.dtype(dtype).str
        shape = (self.rows,) + (self.row_shape if self.dtype else tuple(int(d) for d in (row_shape or ())))
        head = f"{self.name}|{dtype}|{shape}|{self.h.hexdigest()}"
        return f"sha256:{hashlib.sha256(head.encode()).hexdigest()}"


def offsets_digest(name: str, counts) -> str:
    h = ArrayHash(name)
    h.add(np.concatenate(([0], np.cumsum(np.asarray(counts, dtype=np.int64)))).astype(np.int64))
    return h.hexdigest()


def attributes_digest(meta: dict) -> str:
    """The digest of the training attributes (the dict the writer's fingerprint ends with)."""
    return f"sha256:{hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()}"


@dataclass
class ShardDigest:
    """What :func:`content_digest` found: the shard's fingerprint as its writer computes it, and one
    digest per array (see the module's docstring)."""

    fingerprint: str
    arrays: dict
    seconds: float = 0.0
    #: read back from the cache file (no array was read)
    cached: bool = False
    #: where the digest was cached ("" when it was not)
    cache: str = field(default="")
    #: what the pass found wrong beside the digests (per-class counts the labels do not add up to)
    problem: str = ""

    def differing(self, other: dict) -> list:
        """The arrays whose digests differ from ``other``'s (one of them lacking an array counts)."""
        return [k for k in sorted(set(self.arrays) | set(other)) if self.arrays.get(k) != other.get(k)]


def describe_differences(names) -> str:
    """``train_y (training labels), test_y (test labels)``."""
    return ", ".join(f"{n} ({WHAT.get(n, n)})" for n in names)


class _Cursor:
    """Rows of one dataset read in order, a block of :data:`WRITE_SAMPLES` rows at a time."""

    def __init__(self, ds: h5py.Dataset):
        self.ds, self.pos, self.block, self.start = ds, 0, None, 0

    def take(self, n: int):
        """The next ``n`` rows, as views of at most a few blocks."""
        while n > 0:
            if self.block is None or self.pos >= self.start + len(self.block):
                self.start = self.pos
                self.block = self.ds[self.pos:min(self.pos + WRITE_SAMPLES, self.ds.shape[0])]
                if not len(self.block):
                    raise UserError(f"shard file {self.ds.file.filename}: dataset '{self.ds.name[1:]}' ends before its "
                                    f"offsets do (truncated or corrupt?)")
            lo = self.pos - self.start
            piece = self.block[lo:lo + n]
            self.pos += len(piece)
            n -= len(piece)
            yield piece


def labels_in_range(path, split: str, y: np.ndarray, offsets, num_classes: int, first_client: int = 0,
                    clients=None) -> None:
    """Refuse a label of ``y`` (the rows ``offsets`` divide among clients ``first_client``, … or
    among ``clients``) outside [0, num_classes), naming the first one's client, row and value."""
    bad = np.flatnonzero((y < 0) | (y >= num_classes)) if len(y) else ()
    if len(bad):
        row = int(bad[0])
        k = int(np.searchsorted(offsets, row, side="right") - 1)
        client = int(clients[k]) if clients is not None else first_client + k
        raise UserError(f"shard file {path}: client {client}'s {split}_y holds label {int(y[row])} (its row "
                        f"{row - int(offsets[k])}), outside [0, {num_classes}) of the shard's num_classes; "
                        f"{len(bad)} such label(s) there (edited or damaged?)")


#: clients whose per-class counts :func:`label_counts_match` compares at a time
COUNT_BLOCK = 1 << 16


def label_counts_problem(path, split: str, y: np.ndarray, offsets, ds) -> str:
    """What is wrong with the per-class counts ``ds`` (``{split}_label_counts``, (N, num_classes),
    its shape checked when the shard was read) if they are not what the labels ``y`` divided by
    ``offsets`` hold, naming the first client that differs ("" when they are); a block of
    :data:`COUNT_BLOCK` clients at a time."""
    n, c = (int(d) for d in ds.shape)
    for start in range(0, n, COUNT_BLOCK):
        stop = min(start + COUNT_BLOCK, n)
        lo, hi = int(offsets[start]), int(offsets[stop])
        owner = np.repeat(np.arange(stop - start, dtype=np.int64), np.diff(offsets[start:stop + 1]))
        held = np.bincount(owner * c + y[lo:hi].astype(np.int64), minlength=(stop - start) * c).reshape(-1, c)
        written = np.asarray(ds[start:stop], dtype=np.int64)
        if not np.array_equal(written.sum(axis=1), np.diff(offsets[start:stop + 1])):  # as read_info says it
            return (f"shard file {path}: dataset '{split}_label_counts' does not add up to the client sizes "
                    f"of '{split}_offsets' (corrupt file?)")
        differ = np.flatnonzero((held != written).any(axis=1))
        if len(differ):
            k = int(differ[0])
            return (f"shard file {path}: dataset '{split}_label_counts' says client {start + k} holds "
                    f"{written[k].tolist()} samples per class, its {split}_y holds {held[k].tolist()}; "
                    f"{len(differ)} such client(s) in rows {start}-{stop - 1} (edited or damaged?)")
    return ""


def finite_rows(path, name: str, client: int, row0: int, rows: np.ndarray) -> None:
    """Refuse a non-finite value among a table's feature ``rows`` (client ``client``'s, from its row
    ``row0``), naming the first one's row, feature and value."""
    finite = np.isfinite(rows)
    if not finite.all():
        r, col = (int(v) for v in np.argwhere(~finite)[0][:2])
        raise UserError(f"shard file {path}: client {client}'s {name} holds {rows[r, col]} (its row {row0 + r}, "
                        f"feature {col}); a table's features must be finite numbers")


def _meta(f: h5py.File, info: ShardInfo) -> dict:
    vocab = [str(t) for t in f["vocab"].asstr()[()]] if info.kind == TEXT_KIND else None
    columns = [str(c) for c in f["columns"].asstr()[()]] if "columns" in f else None
    return training_attributes(info.kind, info.num_classes, info.input_shape, info.mean, info.std, vocab, columns)


def content_digest(info: ShardInfo) -> ShardDigest:
    """Hash the shard ``info`` describes (read by :func:`~fedcp_dist.data.shards.read_info`) in one
    pass, checking its labels and a table's values on the way (see the module's docstring)."""
    path, t0 = info.path, time.perf_counter()
    names = TEXT_SPLITS if info.kind == TEXT_KIND else SPLITS
    counts = {"train": info.train_counts, "test": info.test_counts}
    per_array = {n: ArrayHash(n) for n in names}
    fp = hashlib.sha256()
    problem = ""  # said by verify_shard after the digests, which name an edited array better
    try:
        with h5py.File(path, "r") as f:
            offsets = {s: np.concatenate(([0], np.cumsum(counts[s]))).astype(np.int64) for s in counts}
            if info.format_version >= FORMAT_VERSION:
                for split in counts:
                    y = np.asarray(f[f"{split}_y"][()])
                    labels_in_range(path, split, y, offsets[split], info.num_classes)
                    problem = problem or label_counts_problem(path, split, y, offsets[split],
                                                              f[f"{split}_label_counts"])
                cursors = {n: _Cursor(f[n]) for n in names}
                kinds = {n: (np.dtype(f[n].dtype).str, tuple(int(d) for d in f[n].shape[1:])) for n in names}
                clients = ((c, cursors, kinds) for c in range(info.num_clients))
            else:  # a group per client (at most a few hundred: HDF5's attribute limit)
                clients = ((c, g, {n: (np.dtype(g[n].dtype).str, tuple(int(d) for d in g[n].shape[1:])) for n in names})
                           for c, g in ((c, f[f"clients/{c}"]) for c in range(info.num_clients)))
            for c, source, kinds in clients:
                for name in names:
                    split = name[:-2] if name.endswith(("_x", "_y")) else name[:-4]
                    n = int(counts[split][c])
                    dtype, row_shape = kinds[name]
                    fp.update(f"{name}|{dtype}|{(n,) + row_shape}|".encode())
                    pieces = source[name].take(n) if info.format_version >= FORMAT_VERSION else [source[name][()]]
                    row = 0
                    for piece in pieces:
                        if info.format_version < FORMAT_VERSION and name.endswith("_y"):
                            labels_in_range(path, split, piece, [0, len(piece)], info.num_classes, c)
                        if info.kind == TABLE_KIND and name.endswith("_x"):
                            finite_rows(path, name, c, row, piece)
                        row += len(piece)
                        fp.update(np.ascontiguousarray(piece))
                        per_array[name].add(piece)
            meta = _meta(f, info)
            arrays = {n: h.hexdigest(f[n].dtype if n in f else None, f[n].shape[1:] if n in f else None)
                      for n, h in per_array.items()}
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise UserError(f"shard file {path} could not be read whole (truncated or corrupt?): "
                        f"{' '.join(str(exc).split())}") from None
    for split in counts:
        arrays[f"{split}_offsets"] = offsets_digest(f"{split}_offsets", counts[split])
    arrays[ATTRIBUTES] = attributes_digest(meta)
    fp.update(json.dumps(meta, sort_keys=True).encode())
    return ShardDigest(f"sha256:{fp.hexdigest()}", arrays, time.perf_counter() - t0, problem=problem)


# ----------------------------------------------------------------------------- the cache beside the shard


def _identity(path) -> dict:
    st = os.stat(path)
    return {"dev": st.st_dev, "inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_path(path) -> str:
    return os.fspath(path) + CACHE_SUFFIX


def _read_cache(path) -> Optional[ShardDigest]:
    try:
        with open(cache_path(path), encoding="utf-8") as f:
            data = json.load(f)
        if data.get("version") == DIGEST_VERSION and data.get("identity") == _identity(path):
            return ShardDigest(str(data["fingerprint"]), dict(data["arrays"]), cached=True, cache=cache_path(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def cached_digest(info: ShardInfo, cache_seconds: float = CACHE_SECONDS) -> ShardDigest:
    """:func:`content_digest`, read from the cache file when the shard is the very file it was
    computed on, and kept there when computing it took ``cache_seconds`` or more."""
    digest = _read_cache(info.path)
    if digest is not None:
        return digest
    before = _identity(info.path)
    digest = content_digest(info)
    if not digest.problem and digest.seconds >= cache_seconds and _identity(info.path) == before:  # not written to meanwhile
        record = {"version": DIGEST_VERSION, "shard": os.path.basename(info.path), "identity": before,
                  "fingerprint": digest.fingerprint, "arrays": digest.arrays}
        try:
            atomic_write_bytes(cache_path(info.path), (json.dumps(record, indent=1) + "\n").encode("utf-8"))
            digest.cache = cache_path(info.path)
        except OSError:  # a folder we may not write to: no cache
            pass
    return digest


def verify_shard(info: ShardInfo, cache_seconds: float = CACHE_SECONDS) -> ShardDigest:
    """The shard's content digest (:func:`cached_digest`), checked against the digests written with
    it: a shard whose content is not what was written (edited in place, damaged) is a one-line
    UserError naming the arrays that differ (the fingerprint alone, for a shard written before
    array digests)."""
    digest = cached_digest(info, cache_seconds)
    how = "re-create it with fedcp-partition (or write it with fedcp_dist.data.shards.write_shard)"
    if info.array_digests:
        differ = digest.differing(info.array_digests)
        if differ:
            raise UserError(f"shard file {info.path} does not hold what it was written with: its "
                            f"{describe_differences(differ)} differ from the digests written with it (edited in "
                            f"place or damaged?); {how}")
    elif info.fingerprint and info.fingerprint != digest.fingerprint:
        raise UserError(f"shard file {info.path} does not hold what it was written with: its content's fingerprint is "
                        f"{digest.fingerprint[:19]}..., the one written with it {info.fingerprint[:19]}... (edited in "
                        f"place or damaged?); {how}")
    if digest.problem:
        raise UserError(digest.problem)
    return digest
