"""The partitioned-data file: one HDF5 file holding every client's train and test samples.

Format version 3, the one written (no pickled objects anywhere)::

    /                     attributes: format_version (3), kind, source, num_classes, num_clients,
                          input_shape, mean, std, partition, partition_params (JSON), seed,
                          fingerprint and, for text, vocab_size
    /train_x              every client's training samples, client 0's first: images uint8
                          (n, C, H, W), text int32 token ids (n, max_len); chunks of 256 samples,
                          gzip 4 + shuffle
    /train_y              int64 (n,)
    /train_len            text only: int32 (n,) real (non-padding) tokens per row
    /train_offsets        int64 (N + 1,): client i's training rows are [off[i], off[i + 1])
    /train_label_counts   int64 (N, num_classes): each client's training samples per class
    /test_x, /test_y, /test_len, /test_offsets, /test_label_counts: the same for the test split
    /vocab                text only: UTF-8 strings, the tokens in id order (0 = padding)

Nothing whose size grows with the number of clients N is an attribute: HDF5 keeps attributes in
the object header, whose messages hold at most 64 KiB, which is what kept versions 1 and 2 (with
the per-client counts among the attributes) from being written for more than about 800 clients
of 10 classes.  One array per split instead of a group per client also keeps the file small and
writing and loading fast at thousands of clients: each group costs four chunked datasets, each
with its own header and chunk index.

Versions 1 and 2 put one group per client (still read, and written with ``format_version=1`` or
``2`` for older readers, up to the attribute limit)::

    /                       the attributes above plus train_counts, test_counts (int64 (N,)),
                            train_label_counts, test_label_counts (int64 (N, num_classes))
    /clients/{i}/train_x    client i's rows of /train_x above; likewise train_y, test_x, test_y
                            and, for text, train_len, test_len
    /vocab                  text only

Tables (``kind`` "table", version 3 only: users' CSV files, :mod:`fedcp_dist.data.owndata`)
keep raw float32 feature rows ``(n, F)`` in ``/train_x`` and ``/test_x``, ``input_shape`` = [F],
``mean`` / ``std`` the per-feature statistics of the training rows (the engine standardises every
batch with them) and the feature names in ``/columns`` (UTF-8 strings).

Version 1 is the image layout (``kind`` "image"); version 2 adds ``kind`` "text" (``input_shape``
= [max_len], empty ``mean`` / ``std``, the ``vocab_size`` attribute, the ``*_len`` datasets and
``/vocab``).  Every version keeps ``format_version`` where version 1 had it, so a reader refuses
a version it does not know by that number, with a clear message, instead of misreading it: a
version-1 reader refuses text shards, readers of versions 1 and 2 refuse version 3.  This
reader reads all three.

``fingerprint`` (every version, as written now; shards written before it have none) is
``sha256:`` and the hex SHA-256 of what a run reads from the file: every client's arrays in
client order (each array's name, dtype, shape and bytes) and the attributes that shape
training (kind, num_classes, input_shape, mean, std, the vocabulary, the feature names). Two
shards with the same fingerprint train alike; a shard partitioned again at the same path gets
another. A run records it in its checkpoints and refuses to resume onto other data
(:mod:`fedcp_dist.checkpoint`).  :func:`layout_digest` is the cheap stand-in for a shard without
one: the attributes and per-client counts, which a re-partition almost always changes.

Files are written atomically (temporary file in the same directory, then ``os.replace``), so
a reader never sees a half-written shard and an existing file survives a failed write.  Writing
and loading go a block of :data:`WRITE_SAMPLES` rows at a time, so memory stays at the data
handed in (or loaded) plus a block or two.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterable

import h5py
import numpy as np

from fedcp_dist.errors import UserError
from fedcp_dist.fileio import atomic_path

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
#: clients up to which :func:`describe_lines` prints one row per client (more: a summary)
DESCRIBE_ROWS = 50
#: the smallest clients the summary shows
DESCRIBE_SMALLEST = 5
#: the attribute holding a shard's content fingerprint (absent from shards written before it)
FINGERPRINT = "fingerprint"
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
    train_label_counts: np.ndarray
    test_label_counts: np.ndarray
    #: number of token ids of a text shard (its vocabulary's length); 0 for images
    vocab_size: int = 0
    #: the content fingerprint written with the shard ("sha256:..."); "" for a shard written before
    #: fingerprints (see the module's docstring)
    fingerprint: str = ""


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


class _Fingerprint:
    """The running SHA-256 of a shard's content as it is written (see the module's docstring)."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, name: str, x) -> None:
        """One client's array (an array or :class:`Rows`), read a block of rows at a time."""
        self.h.update(f"{name}|{np.dtype(x.dtype).str}|{tuple(x.shape)}|".encode())
        for start in range(0, len(x), WRITE_SAMPLES):
            self.h.update(np.ascontiguousarray(x[start:start + WRITE_SAMPLES]).tobytes())

    def finish(self, meta: dict) -> str:
        self.h.update(json.dumps(meta, sort_keys=True).encode())
        return f"sha256:{self.h.hexdigest()}"


def layout_digest(info: "ShardInfo") -> str:
    """A digest of a shard's attributes that shape training and its per-client counts (cheap: no
    sample is read). Stands in for :attr:`ShardInfo.fingerprint` on shards written without one."""
    h = hashlib.sha256()
    meta = {"kind": info.kind, "num_classes": info.num_classes, "num_clients": info.num_clients,
            "input_shape": list(info.input_shape), "mean": list(info.mean), "std": list(info.std),
            "vocab_size": info.vocab_size}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for key in ("train_counts", "test_counts", "train_label_counts", "test_label_counts"):
        h.update(np.ascontiguousarray(getattr(info, key), dtype=np.int64).tobytes())
    return f"sha256:{h.hexdigest()}"


def _write_x(group: h5py.Group, name: str, x) -> None:
    """Write samples ``x`` (an array or :class:`Rows`) as a chunked, compressed dataset."""
    n = len(x)
    shape = (n,) + tuple(x.shape[1:])
    if n == 0:
        group.create_dataset(name, shape=shape, dtype=x.dtype)
        return
    chunk = (min(CHUNK_SAMPLES, n),) + shape[1:]
    ds = group.create_dataset(name, shape=shape, dtype=x.dtype, chunks=chunk, compression="gzip",
                              compression_opts=4, shuffle=True)
    for start in range(0, n, WRITE_SAMPLES):
        ds[start:start + WRITE_SAMPLES] = np.ascontiguousarray(x[start:start + WRITE_SAMPLES])


def _samples(x):
    return x if isinstance(x, Rows) else np.asarray(x)


def _check_labels(i: int, name: str, y, n: int, num_classes: int) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != n:
        raise ValueError(f"client {i}: {name} has shape {y.shape}, expected ({n},)")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"client {i}: {name} must be integer, got {y.dtype}")
    y = y.astype(np.int64)
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"client {i}: labels must lie in [0, {num_classes})")
    return y


class _IdRange:
    """Checks that token ids lie in [0, vocab_size), each distinct base array only once."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.seen: set = set()

    def check(self, i: int, name: str, x) -> None:
        arr = x.base if isinstance(x, Rows) else x
        if isinstance(x, Rows):
            if id(arr) in self.seen:
                return
            self.seen.add(id(arr))
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"client {i}: {name} holds token ids outside [0, {self.vocab_size})")


def _check_client(i: int, arrays, input_shape: tuple, num_classes: int, kind: str = KIND,
                  ids: _IdRange = None):
    expected = 6 if kind == TEXT_KIND else 4
    if len(arrays) != expected:
        names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
        raise ValueError(f"client {i}: expected ({', '.join(names)}), got {len(arrays)} items")
    out = []
    for split in (0, 2):
        name = SPLITS[split]
        x = _samples(arrays[split])
        if kind == TABLE_KIND:
            if x.dtype != np.float32:
                raise ValueError(f"client {i}: {name} (feature rows) must be float32, got {x.dtype}")
            if x.ndim != 2 or x.shape[1:] != input_shape:
                raise ValueError(f"client {i}: {name} has shape {x.shape}, "
                                 f"expected (n, {input_shape[0]})")
        elif kind == KIND:
            if x.dtype != np.uint8:
                raise ValueError(f"client {i}: {name} must be uint8, got {x.dtype}")
            if x.shape[1:] != input_shape or x.ndim != 4:
                raise ValueError(f"client {i}: {name} has shape {x.shape}, "
                                 f"expected (n, {', '.join(map(str, input_shape))})")
        else:
            if x.dtype != np.int32:
                raise ValueError(f"client {i}: {name} (token ids) must be int32, got {x.dtype}")
            if x.ndim != 2 or x.shape[1:] != input_shape:
                raise ValueError(f"client {i}: {name} has shape {x.shape}, "
                                 f"expected (n, {input_shape[0]})")
            ids.check(i, name, x)
        y = _check_labels(i, SPLITS[split + 1], arrays[split + 1], len(x), num_classes)
        out += [x if isinstance(x, Rows) else np.ascontiguousarray(x), y]
    if kind == TEXT_KIND:
        max_len = input_shape[0]
        for split, name in ((4, "train_len"), (5, "test_len")):
            lengths = np.asarray(arrays[split])
            n = len(out[2 * (split - 4)])  # rows of train_x, then of test_x
            if lengths.shape != (n,) or (n and not np.issubdtype(lengths.dtype, np.integer)):
                raise ValueError(f"client {i}: {name} must be {n} integers, got {lengths.dtype} "
                                 f"of shape {lengths.shape}")
            if n and (lengths.min() < 0 or lengths.max() > max_len):
                raise ValueError(f"client {i}: {name} must lie in [0, {max_len}]")
            out.append(lengths.astype(np.int32))
    return out


class _Counts:
    """Each client's train and test sample counts and per-class counts, as they are written."""

    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.train, self.test, self.train_labels, self.test_labels = [], [], [], []

    def add(self, train_y: np.ndarray, test_y: np.ndarray) -> None:
        self.train.append(len(train_y))
        self.test.append(len(test_y))
        self.train_labels.append(np.bincount(train_y, minlength=self.num_classes))
        self.test_labels.append(np.bincount(test_y, minlength=self.num_classes))

    def __len__(self) -> int:
        return len(self.train)

    def arrays(self) -> dict[str, np.ndarray]:
        """``train_counts``, ``test_counts`` (N,) and ``*_label_counts`` (N, C), all int64."""
        return {"train_counts": np.asarray(self.train, dtype=np.int64),
                "test_counts": np.asarray(self.test, dtype=np.int64),
                "train_label_counts": np.stack(self.train_labels).astype(np.int64),
                "test_label_counts": np.stack(self.test_labels).astype(np.int64)}


class _Appender:
    """A growing dataset written a block of :data:`WRITE_SAMPLES` rows at a time.

    Rows are gathered in one block-sized buffer and written when it is full (and at
    :meth:`close`), so every chunk is compressed once however small the clients are.
    """

    def __init__(self, f: h5py.File, name: str, dtype, row_shape: tuple, chunk_rows: int):
        self.ds = f.create_dataset(name, shape=(0,) + row_shape, maxshape=(None,) + row_shape,
                                   dtype=dtype, chunks=(chunk_rows,) + row_shape,
                                   compression="gzip", compression_opts=4, shuffle=True)
        self.buf = np.empty((WRITE_SAMPLES,) + row_shape, dtype=dtype)
        self.fill = 0

    def append(self, x) -> None:
        """Append the rows of ``x`` (an array or :class:`Rows`)."""
        done = 0
        while done < len(x):
            k = min(len(x) - done, WRITE_SAMPLES - self.fill)
            target = self.buf[self.fill:self.fill + k]
            if isinstance(x, Rows):  # gather straight into the buffer
                np.take(x.base, x.index[done:done + k], axis=0, out=target)
            else:
                target[...] = x[done:done + k]
            self.fill += k
            done += k
            if self.fill == WRITE_SAMPLES:
                self.close()

    def close(self) -> None:
        """Write what the buffer holds."""
        if self.fill:
            rows = self.ds.shape[0]
            self.ds.resize(rows + self.fill, axis=0)
            self.ds[rows:rows + self.fill] = self.buf[:self.fill]
            self.fill = 0


class _SplitWriter:
    """Version 3: every client's rows appended to one dataset per split and array."""

    def __init__(self, f: h5py.File, kind: str, input_shape: tuple):
        self.f = f
        self.names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
        x_dtype = {KIND: np.uint8, TEXT_KIND: np.int32, TABLE_KIND: np.float32}[kind]
        self.columns = {}
        for name in self.names:
            if name.endswith("_x"):
                self.columns[name] = _Appender(f, name, x_dtype, input_shape, CHUNK_SAMPLES)
            else:
                dtype = np.int64 if name.endswith("_y") else np.int32
                self.columns[name] = _Appender(f, name, dtype, (), WRITE_SAMPLES)

    def add(self, i: int, checked: list) -> None:
        for name, arr in zip(self.names, checked):
            self.columns[name].append(arr)

    def finish(self, counts: _Counts) -> None:
        for column in self.columns.values():
            column.close()
        arrays = counts.arrays()
        for split in ("train", "test"):
            sizes = arrays[f"{split}_counts"]
            offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
            self.f.create_dataset(f"{split}_offsets", data=offsets)
            self.f.create_dataset(f"{split}_label_counts", data=arrays[f"{split}_label_counts"],
                                  chunks=True, compression="gzip", compression_opts=4,
                                  shuffle=True)


class _GroupWriter:
    """Versions 1 and 2: a group per client, the counts among the root attributes."""

    def __init__(self, f: h5py.File, kind: str, version: int):
        self.f, self.version = f, version
        self.names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
        self.root = f.create_group("clients")

    def add(self, i: int, checked: list) -> None:
        g = self.root.create_group(str(i))
        for name, arr in zip(self.names, checked):
            if name.endswith("_x"):
                _write_x(g, name, arr)
            else:
                g.create_dataset(name, data=arr)

    def finish(self, counts: _Counts) -> None:
        arrays = counts.arrays()
        largest = max(a.nbytes for a in arrays.values())
        if largest > ATTRIBUTE_BYTES:
            raise ValueError(
                f"format_version {self.version} keeps the per-client counts in attributes, which "
                f"HDF5 limits to 64 KiB: {len(counts)} clients of {counts.num_classes} classes "
                f"need {largest} bytes; write format_version {FORMAT_VERSION}")
        for key, value in arrays.items():
            self.f.attrs[key] = value


def write_shard(path, clients: Iterable, *, source: str, num_classes: int, input_shape,
                mean, std, partition: str, partition_params: dict, seed: int,
                kind: str = KIND, vocab=None, format_version: int = FORMAT_VERSION,
                columns=None) -> None:
    """Write ``clients`` to ``path``.

    Images: each client is ``(train_x, train_y, test_x, test_y)``.  Text (``kind="text"``, with
    ``vocab`` the tokens in id order): ``(train_x, train_y, test_x, test_y, train_len,
    test_len)``.  Any ``*_x`` may be a :class:`Rows` view, copied a block at a time.
    ``format_version`` is :data:`FORMAT_VERSION`, or the group-per-client version of the kind
    (1 for images, 2 for text) for readers that know no other.  Tables (``kind="table"``,
    version 3 only): float32 feature rows, ``mean`` / ``std`` one value per feature, ``columns``
    the feature names.

    The file appears at ``path`` only once it is complete; on any failure the temporary file is
    removed and whatever was at ``path`` before is left as it was.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if format_version not in (FORMAT_VERSION, GROUP_VERSIONS.get(kind, FORMAT_VERSION)):
        raise ValueError(f"a {kind} shard is written as format_version {FORMAT_VERSION} or "
                         f"{GROUP_VERSIONS[kind]}, not {format_version!r}")
    if kind == TABLE_KIND:
        if len(tuple(input_shape)) != 1 or len(mean) != input_shape[0] or len(std) != input_shape[0]:
            raise ValueError(f"a table shard's input_shape is (features,) with one mean and std "
                             f"per feature, got {tuple(input_shape)}, {len(mean)}, {len(std)}")
        if columns is not None and len(columns) != input_shape[0]:
            raise ValueError(f"{len(columns)} column names for {input_shape[0]} features")
    elif columns is not None:
        raise ValueError("only a table shard has feature column names")
    if kind == TEXT_KIND:
        if vocab is None or len(vocab) < 2:
            raise ValueError("a text shard needs its vocabulary (at least <pad> and <unk>)")
        vocab = [str(token) for token in vocab]
    elif vocab is not None:
        raise ValueError("an image shard has no vocabulary")
    path = os.fspath(path)
    input_shape = tuple(int(d) for d in input_shape)
    if kind == TEXT_KIND and len(input_shape) != 1:
        raise ValueError(f"a text shard's input_shape is (max_len,), got {input_shape}")
    num_classes = int(num_classes)
    ids = _IdRange(len(vocab)) if kind == TEXT_KIND else None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        if format_version == FORMAT_VERSION:
            body = _SplitWriter(f, kind, input_shape)
        else:
            body = _GroupWriter(f, kind, format_version)
        counts = _Counts(num_classes)
        fingerprint = _Fingerprint()
        for i, arrays in enumerate(clients):
            checked = _check_client(i, arrays, input_shape, num_classes, kind, ids)
            body.add(i, checked)
            counts.add(checked[1], checked[3])
            for name, arr in zip(body.names, checked):
                fingerprint.add(name, arr)
        if len(counts) == 0:
            raise ValueError("write_shard needs at least one client")
        a = f.attrs
        a["format_version"] = np.int64(format_version)
        if kind == TEXT_KIND:
            a["vocab_size"] = np.int64(len(vocab))
            f.create_dataset("vocab", data=vocab, dtype=h5py.string_dtype("utf-8"))
        if columns is not None:
            f.create_dataset("columns", data=[str(c) for c in columns],
                             dtype=h5py.string_dtype("utf-8"))
        a["kind"] = kind
        a["source"] = str(source)
        a["num_classes"] = np.int64(num_classes)
        a["num_clients"] = np.int64(len(counts))
        a["input_shape"] = np.asarray(input_shape, dtype=np.int64)
        a["mean"] = np.asarray(mean, dtype=np.float64)
        a["std"] = np.asarray(std, dtype=np.float64)
        a["partition"] = str(partition)
        a["partition_params"] = json.dumps(partition_params, sort_keys=True)
        a["seed"] = np.int64(seed)
        a[FINGERPRINT] = fingerprint.finish({
            "kind": kind, "num_classes": num_classes, "input_shape": list(input_shape),
            "mean": [float(v) for v in np.asarray(mean, dtype=np.float64).ravel()],
            "std": [float(v) for v in np.asarray(std, dtype=np.float64).ravel()],
            "vocab": vocab, "columns": None if columns is None else [str(c) for c in columns]})
        body.finish(counts)
        f.flush()


def _open(path) -> h5py.File:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserError(f"shard file {path} does not exist")
    if os.path.isdir(path):
        raise UserError(f"shard file {path} is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise UserError(f"shard file {path} is not a readable HDF5 file "
                        f"(truncated or corrupt?): {' '.join(str(exc).split())}") from None


def _check_version(f: h5py.File, path) -> int:
    if "format_version" not in f.attrs:
        raise UserError(f"shard file {path} lacks the attribute 'format_version' "
                        f"(not a fedcp-dist shard?)")
    version = int(f.attrs["format_version"])
    if version not in READABLE_VERSIONS:
        raise UserError(f"shard file {path} has format_version {version}, this version of "
                        f"fedcp-dist reads format_version {IMAGE_FORMAT_VERSION} (images), "
                        f"{TEXT_FORMAT_VERSION} (images or text) and {FORMAT_VERSION} (images or "
                        f"text, one array per split); re-create it with fedcp-partition")
    return version


def _as_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _check_kind(path, kind: str, version: int) -> None:
    if kind not in KINDS:
        raise UserError(f"shard file {path} has kind '{kind}', expected one of "
                        f"{', '.join(repr(k) for k in KINDS)}")
    if kind == TEXT_KIND and version < TEXT_FORMAT_VERSION:
        raise UserError(f"shard file {path} has kind 'text' but format_version {version}; text "
                        f"shards are format_version {TEXT_FORMAT_VERSION}")
    if kind == TABLE_KIND and version < FORMAT_VERSION:
        raise UserError(f"shard file {path} has kind 'table' but format_version {version}; table "
                        f"shards are format_version {FORMAT_VERSION}")


def _offsets(f: h5py.File, path, split: str, num_clients: int, names) -> np.ndarray:
    """The checked ``{split}_offsets`` of a version-3 shard: (N + 1,), from 0, non-decreasing,
    ending at the length of each of the split's datasets among ``names``."""
    key = f"{split}_offsets"
    if key not in f or not isinstance(f[key], h5py.Dataset):
        raise UserError(f"shard file {path} lacks the dataset '{key}'")
    offsets = np.asarray(f[key][()])
    if offsets.shape != (num_clients + 1,) or not np.issubdtype(offsets.dtype, np.integer):
        raise UserError(f"shard file {path}: dataset '{key}' is {offsets.dtype} of shape "
                        f"{offsets.shape}, expected ({num_clients + 1},) integers")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise UserError(f"shard file {path}: dataset '{key}' must start at 0 and never decrease")
    for name in names:
        if not name.startswith(split):
            continue
        if name not in f or not isinstance(f[name], h5py.Dataset):
            raise UserError(f"shard file {path} lacks the dataset '{name}'")
        if f[name].ndim < 1 or f[name].shape[0] != offsets[-1]:
            raise UserError(f"shard file {path}: dataset '{name}' has {f[name].shape[:1]} rows "
                            f"but '{key}' ends at {offsets[-1]} (truncated or corrupt?)")
    return offsets


def _split_counts(f: h5py.File, path, num_clients: int, num_classes: int, kind: str) -> dict:
    """The per-client counts of a version-3 shard (ShardInfo's fields), checked together."""
    names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
    out = {}
    for split in ("train", "test"):
        counts = np.diff(_offsets(f, path, split, num_clients, names))
        key = f"{split}_label_counts"
        if key not in f or not isinstance(f[key], h5py.Dataset):
            raise UserError(f"shard file {path} lacks the dataset '{key}'")
        labels = np.asarray(f[key][()], dtype=np.int64)
        if labels.shape != (num_clients, num_classes):
            raise UserError(f"shard file {path}: dataset '{key}' has shape {labels.shape}, "
                            f"expected ({num_clients}, {num_classes})")
        if not np.array_equal(labels.sum(axis=1), counts):
            raise UserError(f"shard file {path}: dataset '{key}' does not add up to the client "
                            f"sizes of '{split}_offsets' (corrupt file?)")
        out[f"{split}_counts"], out[key] = counts, labels
    return out


def read_info(path) -> ShardInfo:
    """Read and check the attributes (and, from version 3 on, the per-client counts) of the
    shard at ``path``."""
    f = _open(path)
    try:
        with f:
            version = _check_version(f, path)
            attrs = f.attrs
            required = _REQUIRED_ATTRS + (_COUNT_ATTRS if version < FORMAT_VERSION else ())
            for key in required:
                if key not in attrs:
                    raise UserError(f"shard file {path} lacks the attribute '{key}'")
            kind = _as_str(attrs["kind"])
            _check_kind(path, kind, version)
            vocab_size, vocab_len = 0, None
            if kind == TEXT_KIND:
                if "vocab_size" not in attrs:
                    raise UserError(f"shard file {path} lacks the attribute 'vocab_size'")
                vocab_size = int(attrs["vocab_size"])
                if "vocab" not in f or not isinstance(f["vocab"], h5py.Dataset):
                    raise UserError(f"shard file {path} lacks the dataset 'vocab'")
                if f["vocab"].ndim != 1:
                    raise UserError(f"shard file {path}: dataset 'vocab' has shape "
                                    f"{f['vocab'].shape}, expected ({vocab_size},)")
                vocab_len = len(f["vocab"])
            try:
                params = json.loads(_as_str(attrs["partition_params"]))
            except ValueError:
                raise UserError(f"shard file {path}: attribute 'partition_params' "
                                f"is not valid JSON") from None
            n, c = int(attrs["num_clients"]), int(attrs["num_classes"])
            if version >= FORMAT_VERSION:
                counts = _split_counts(f, path, n, c, kind)
            else:
                counts = {key: np.asarray(attrs[key], dtype=np.int64) for key in _COUNT_ATTRS}
                for key in ("train_counts", "test_counts"):
                    counts[key] = counts[key].reshape(-1)
            info = ShardInfo(
                path=os.fspath(path),
                format_version=version,
                kind=kind,
                source=_as_str(attrs["source"]),
                num_classes=c,
                num_clients=n,
                input_shape=tuple(int(d) for d in np.atleast_1d(attrs["input_shape"])),
                mean=tuple(float(v) for v in np.atleast_1d(attrs["mean"])),
                std=tuple(float(v) for v in np.atleast_1d(attrs["std"])),
                partition=_as_str(attrs["partition"]),
                partition_params=params,
                seed=int(attrs["seed"]),
                vocab_size=vocab_size,
                fingerprint=_as_str(attrs[FINGERPRINT]) if FINGERPRINT in attrs else "",
                **counts,
            )
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"shard file {path} could not be read (truncated or corrupt?): "
                        f"{' '.join(str(exc).split())}") from None
    for key in ("train_counts", "test_counts"):
        if getattr(info, key).shape != (n,):
            raise UserError(f"shard file {path}: attribute '{key}' has shape "
                            f"{getattr(info, key).shape}, expected ({n},)")
    for key in ("train_label_counts", "test_label_counts"):
        if getattr(info, key).shape != (n, c):
            raise UserError(f"shard file {path}: attribute '{key}' has shape "
                            f"{getattr(info, key).shape}, expected ({n}, {c})")
    if kind == TEXT_KIND:
        if len(info.input_shape) != 1 or info.input_shape[0] < 1:
            raise UserError(f"shard file {path}: a text shard's 'input_shape' must be "
                            f"[max_len] with max_len >= 1, found {list(info.input_shape)}")
        if vocab_size < 2:
            raise UserError(f"shard file {path}: attribute 'vocab_size' is {vocab_size}, a "
                            f"vocabulary holds at least <pad> and <unk>")
        if vocab_len != vocab_size:
            raise UserError(f"shard file {path}: dataset 'vocab' holds {vocab_len} tokens but "
                            f"attribute 'vocab_size' is {vocab_size}")
    elif kind == TABLE_KIND:
        f_dim = info.input_shape[0] if len(info.input_shape) == 1 else -1
        if f_dim < 1 or len(info.mean) != f_dim or len(info.std) != f_dim:
            raise UserError(f"shard file {path}: a table shard's 'input_shape' must be [features] "
                            f"with one 'mean' and 'std' per feature, found "
                            f"{list(info.input_shape)}, {len(info.mean)} and {len(info.std)}")
        if min(info.std) <= 0:
            raise UserError(f"shard file {path}: attribute 'std' must be > 0 for every feature")
    elif len(info.input_shape) != 3:
        raise UserError(f"shard file {path}: an image shard's 'input_shape' must be [C, H, W], "
                        f"found {list(info.input_shape)}")
    return info


def _compact_labels(labels) -> str:
    """Render sorted ints compactly: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    labels = [int(v) for v in labels]
    parts, i = [], 0
    while i < len(labels):
        j = i
        while j + 1 < len(labels) and labels[j + 1] == labels[j] + 1:
            j += 1
        parts.append(str(labels[i]) if i == j else f"{labels[i]}-{labels[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def describe_lines(info: ShardInfo, all_clients: bool = False) -> list[str]:
    """The text of ``fedcp-partition --describe``: the shard's attributes, then its clients.

    Up to :data:`DESCRIBE_ROWS` clients (or with ``all_clients``) one row per client: train and
    test samples and the classes present.  Beyond that, so that 10,000 clients do not print
    10,000 lines: percentiles of those figures over the clients, the number of clients without
    train or test samples, and the rows of the :data:`DESCRIBE_SMALLEST` smallest clients.  Both
    end with the total row.
    """
    lines = [f"file:             {info.path}",
             f"format_version:   {info.format_version}",
             f"source:           {info.source} ({info.kind}, input {info.input_shape}, "
             f"{info.num_classes} classes)"]
    if info.kind == TEXT_KIND:
        lines.append(f"vocabulary:       {info.vocab_size} token ids (0 = padding, 1 = unknown)")
    elif info.kind == TABLE_KIND:
        shown = ", ".join(f"{m:.4g}/{s:.4g}" for m, s in zip(info.mean[:4], info.std[:4]))
        more = ", ..." if len(info.mean) > 4 else ""
        lines.append(f"standardised:     per feature, train-row mean/std {shown}{more}")
    else:
        lines.append(f"mean / std:       {info.mean} / {info.std}")
    lines += [f"partition:        {info.partition} "
              f"{json.dumps(info.partition_params, sort_keys=True)}",
              f"seed:             {info.seed}",
              f"fingerprint:      {info.fingerprint or 'none (written before shards had one)'}",
              f"clients:          {info.num_clients}",
              ""]
    label_counts = info.train_label_counts + info.test_label_counts
    header = f"{'client':>7} {'train':>8} {'test':>8} {'classes':>7}  labels"

    def row(i: int) -> str:
        present = np.flatnonzero(label_counts[i])
        return (f"{i:>7} {int(info.train_counts[i]):>8} {int(info.test_counts[i]):>8} "
                f"{len(present):>7}  {_compact_labels(present)}")

    if all_clients or info.num_clients <= DESCRIBE_ROWS:
        lines += [header] + [row(i) for i in range(info.num_clients)]
    else:
        sizes = info.train_counts + info.test_counts
        quantiles = (0, 5, 25, 50, 75, 95, 100)
        names = ("min", "5%", "25%", "median", "75%", "95%", "max")
        lines.append(f"{'per client':<10}" + "".join(f"{q:>8}" for q in names) + f"{'mean':>10}")
        for name, values in (("train", info.train_counts), ("test", info.test_counts),
                             ("samples", sizes), ("classes", (label_counts > 0).sum(axis=1))):
            q = np.percentile(values, quantiles, method="lower")
            lines.append(f"{name:<10}" + "".join(f"{int(v):>8}" for v in q)
                         + f"{float(np.mean(values)):>10.2f}")
        lines += [f"clients without train samples: {int((info.train_counts == 0).sum())}, "
                  f"without test samples: {int((info.test_counts == 0).sum())}",
                  "",
                  f"the {DESCRIBE_SMALLEST} smallest of {info.num_clients} clients "
                  f"(every client: --describe FILE --all)",
                  header]
        smallest = np.argsort(sizes, kind="stable")[:DESCRIBE_SMALLEST]
        lines += [row(int(i)) for i in smallest]
    present = np.flatnonzero(label_counts.sum(axis=0))
    lines.append(f"{'total':>7} {int(info.train_counts.sum()):>8} "
                 f"{int(info.test_counts.sum()):>8} {len(present):>7}  "
                 f"{_compact_labels(present)}")
    return lines


def read_vocab(path) -> list[str]:
    """The vocabulary of the text shard at ``path``: its tokens in id order."""
    info = read_info(path)
    if info.kind != TEXT_KIND:
        raise UserError(f"shard file {path} holds images, not text: it has no vocabulary")
    f = _open(path)
    try:
        with f:
            return [str(token) for token in f["vocab"].asstr()[()]]
    except (OSError, RuntimeError, KeyError, UnicodeDecodeError) as exc:
        raise UserError(f"shard file {path}: could not read the vocabulary (corrupt file?): "
                        f"{' '.join(str(exc).split())}") from None


def _check_text_arrays(path, cid: int, arrays: dict, max_len: int, vocab_size: int) -> None:
    for split in ("train", "test"):
        x, lengths = arrays[f"{split}_x"], arrays[f"{split}_len"]
        if x.ndim != 2 or x.shape[1] != max_len or not np.issubdtype(x.dtype, np.integer):
            raise UserError(f"shard file {path}: client {cid} '{split}_x' is {x.dtype} of shape "
                            f"{x.shape}, expected integer token ids of shape (n, {max_len})")
        if lengths.shape != (len(x),) or not np.issubdtype(lengths.dtype, np.integer):
            raise UserError(f"shard file {path}: client {cid} '{split}_len' is {lengths.dtype} "
                            f"of shape {lengths.shape}, expected ({len(x)},) integers")
        if x.size and (x.min() < 0 or x.max() >= vocab_size):
            raise UserError(f"shard file {path}: client {cid} '{split}_x' holds token ids "
                            f"outside [0, {vocab_size})")
        if lengths.size and (lengths.min() < 0 or lengths.max() > max_len):
            raise UserError(f"shard file {path}: client {cid} '{split}_len' holds lengths "
                            f"outside [0, {max_len}]")


def _row_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows [starts[k], starts[k] + lengths[k]) of every k, concatenated."""
    before = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _gather_rows(ds: h5py.Dataset, rows: np.ndarray) -> np.ndarray:
    """``ds[rows]`` for sorted ``rows``, read a block of :data:`WRITE_SAMPLES` rows at a time.

    Blocks are whole chunks, so each chunk is decompressed at most once whatever the chunk cache
    holds, and only blocks that hold a wanted row are read.
    """
    out = np.empty((len(rows),) + ds.shape[1:], dtype=ds.dtype)
    if not len(rows):
        return out
    cuts = np.flatnonzero(np.diff(rows // WRITE_SAMPLES)) + 1
    for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(rows)]))):
        first, last = int(rows[lo]), int(rows[hi - 1])
        if last - first + 1 == hi - lo:  # contiguous rows: read straight into place
            ds.read_direct(out, np.s_[first:last + 1], np.s_[lo:hi])
        else:
            out[lo:hi] = ds[first:last + 1][rows[lo:hi] - first]
    return out


def _load_split_rows(f: h5py.File, path, ids: list[int], names, num_clients: int) -> dict:
    """Version 3: each client's rows of every dataset in ``names`` (views of one array each)."""
    order = np.unique(np.asarray(ids, dtype=np.int64))
    out: dict[int, dict[str, np.ndarray]] = {int(c): {} for c in order}
    for split in ("train", "test"):
        offsets = _offsets(f, path, split, num_clients, names)
        lengths = offsets[order + 1] - offsets[order]
        rows = _row_ranges(offsets[order], lengths)
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        for name in names:
            if name.startswith(split):
                data = _gather_rows(f[name], rows)
                for k, cid in enumerate(order):
                    out[int(cid)][name] = data[bounds[k]:bounds[k + 1]]
    return out


def _load_groups(f: h5py.File, path, ids: list[int], names, num_clients: int) -> dict:
    """Versions 1 and 2: each client's datasets from its group."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for cid in ids:
        key = f"clients/{cid}"
        if key not in f:
            raise UserError(f"shard file {path} has no client {cid} "
                            f"(it holds {num_clients} clients)")
        group = f[key]
        arrays = {}
        for name in names:
            if name not in group:
                raise UserError(f"shard file {path}: client {cid} lacks dataset '{name}'")
            arrays[name] = group[name][()]
        out[cid] = arrays
    return out


def load_clients(path, client_ids) -> dict[int, dict[str, np.ndarray]]:
    """Read the arrays of the given clients, opening the file once.

    Returns ``{client_id: {"train_x", "train_y", "test_x", "test_y"}}``; text shards add
    ``"train_len"`` and ``"test_len"``.  Memory: the clients' arrays plus one block of rows.
    """
    f = _open(path)
    try:
        with f:
            version = _check_version(f, path)
            num_clients = int(f.attrs.get("num_clients", -1))
            kind = _as_str(f.attrs.get("kind", KIND))
            _check_kind(path, kind, version)
            names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
            if kind == TEXT_KIND:
                for key in ("vocab_size", "input_shape"):
                    if key not in f.attrs:
                        raise UserError(f"shard file {path} lacks the attribute '{key}'")
                vocab_size = int(f.attrs["vocab_size"])
                max_len = int(np.atleast_1d(f.attrs["input_shape"])[0])
            ids = [int(cid) for cid in client_ids]
            if version >= FORMAT_VERSION:
                if "num_clients" not in f.attrs:
                    raise UserError(f"shard file {path} lacks the attribute 'num_clients'")
                for cid in ids:
                    if not 0 <= cid < num_clients:
                        raise UserError(f"shard file {path} has no client {cid} "
                                        f"(it holds {num_clients} clients)")
                out = _load_split_rows(f, path, ids, names, num_clients)
            else:
                out = _load_groups(f, path, ids, names, num_clients)
            for cid, arrays in out.items():
                if len(arrays["train_x"]) != len(arrays["train_y"]) or \
                        len(arrays["test_x"]) != len(arrays["test_y"]):
                    raise UserError(f"shard file {path}: client {cid} has samples and labels "
                                    f"of different lengths")
                if kind == TEXT_KIND:
                    _check_text_arrays(path, cid, arrays, max_len, vocab_size)
    except (OSError, RuntimeError, KeyError) as exc:
        raise UserError(f"shard file {path}: could not read client data (corrupt file?): "
                        f"{' '.join(str(exc).split())}") from None
    return out
