"""The partitioned-data file: one HDF5 file holding every client's train and test samples.

Layout (no pickled objects anywhere)::

    /                       attributes: format_version, kind, source, num_classes, num_clients,
                            input_shape, mean, std, partition, partition_params (JSON), seed,
                            train_counts, test_counts, train_label_counts, test_label_counts
                            and, for text, vocab_size
    /clients/{i}/train_x    images: uint8 (n, C, H, W); text: int32 token ids (n, max_len);
                            chunked by whole samples, gzip 4 + shuffle
    /clients/{i}/train_y    int64 (n,)
    /clients/{i}/test_x     as train_x, (m, ...)
    /clients/{i}/test_y     int64 (m,)
    /clients/{i}/train_len  text only: int32 (n,) real (non-padding) tokens per row
    /clients/{i}/test_len   text only: int32 (m,)
    /vocab                  text only: UTF-8 strings, the tokens in id order (0 = padding)

Versions: ``format_version`` 1 is the image layout (``kind`` "image"); image shards are still
written as version 1, byte for byte as before, so older readers keep reading them.  Version 2
adds ``kind`` "text" (``input_shape`` = [max_len], empty ``mean`` / ``std``, the ``vocab_size``
attribute, the ``*_len`` datasets and ``/vocab``); text shards are written as version 2, which a
version-1 reader refuses with a clear message instead of misreading.  This reader reads both.

Files are written atomically (temporary file in the same directory, then ``os.replace``), so
a reader never sees a half-written shard and an existing file survives a failed write.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable

import h5py
import numpy as np

from fedcp_dist.errors import UserError

#: version written for image shards (and the oldest one read)
FORMAT_VERSION = 1
#: version written for text shards
TEXT_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, TEXT_FORMAT_VERSION)
KIND = "image"
TEXT_KIND = "text"
KINDS = (KIND, TEXT_KIND)
CHUNK_SAMPLES = 256
#: samples copied per write: a whole number of chunks, so no chunk is compressed twice
WRITE_SAMPLES = CHUNK_SAMPLES * 16
SPLITS = ("train_x", "train_y", "test_x", "test_y")
TEXT_SPLITS = SPLITS + ("train_len", "test_len")

_REQUIRED_ATTRS = ("kind", "source", "num_classes", "num_clients", "input_shape", "mean", "std",
                   "partition", "partition_params", "seed", "train_counts", "test_counts",
                   "train_label_counts", "test_label_counts")


@dataclass
class ShardInfo:
    """The attributes of a shard file."""

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
    expected = 4 if kind == KIND else 6
    if len(arrays) != expected:
        names = SPLITS if kind == KIND else TEXT_SPLITS
        raise ValueError(f"client {i}: expected ({', '.join(names)}), got {len(arrays)} items")
    out = []
    for split in (0, 2):
        name = SPLITS[split]
        x = _samples(arrays[split])
        if kind == KIND:
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


def write_shard(path, clients: Iterable, *, source: str, num_classes: int, input_shape,
                mean, std, partition: str, partition_params: dict, seed: int,
                kind: str = KIND, vocab=None) -> None:
    """Write ``clients`` to ``path``.

    Images: each client is ``(train_x, train_y, test_x, test_y)``.  Text (``kind="text"``, with
    ``vocab`` the tokens in id order): ``(train_x, train_y, test_x, test_y, train_len,
    test_len)``.  Any ``*_x`` may be a :class:`Rows` view, copied a block at a time.

    The file appears at ``path`` only once it is complete; on any failure the temporary file is
    removed and whatever was at ``path`` before is left as it was.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == TEXT_KIND:
        if vocab is None or len(vocab) < 2:
            raise ValueError("a text shard needs its vocabulary (at least <pad> and <unk>)")
        vocab = [str(token) for token in vocab]
    elif vocab is not None:
        raise ValueError("an image shard has no vocabulary")
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    input_shape = tuple(int(d) for d in input_shape)
    if kind == TEXT_KIND and len(input_shape) != 1:
        raise ValueError(f"a text shard's input_shape is (max_len,), got {input_shape}")
    num_classes = int(num_classes)
    ids = _IdRange(len(vocab)) if kind == TEXT_KIND else None
    try:
        with h5py.File(tmp, "w") as f:
            root = f.create_group("clients")
            train_counts, test_counts, train_labels, test_labels = [], [], [], []
            for i, arrays in enumerate(clients):
                checked = _check_client(i, arrays, input_shape, num_classes, kind, ids)
                train_x, train_y, test_x, test_y = checked[:4]
                g = root.create_group(str(i))
                _write_x(g, "train_x", train_x)
                g.create_dataset("train_y", data=train_y)
                _write_x(g, "test_x", test_x)
                g.create_dataset("test_y", data=test_y)
                if kind == TEXT_KIND:
                    g.create_dataset("train_len", data=checked[4])
                    g.create_dataset("test_len", data=checked[5])
                train_counts.append(len(train_y))
                test_counts.append(len(test_y))
                train_labels.append(np.bincount(train_y, minlength=num_classes))
                test_labels.append(np.bincount(test_y, minlength=num_classes))
            n = len(train_counts)
            if n == 0:
                raise ValueError("write_shard needs at least one client")
            a = f.attrs
            if kind == TEXT_KIND:
                a["format_version"] = np.int64(TEXT_FORMAT_VERSION)
                a["vocab_size"] = np.int64(len(vocab))
                f.create_dataset("vocab", data=vocab, dtype=h5py.string_dtype("utf-8"))
            else:
                a["format_version"] = np.int64(FORMAT_VERSION)
            a["kind"] = kind
            a["source"] = str(source)
            a["num_classes"] = np.int64(num_classes)
            a["num_clients"] = np.int64(n)
            a["input_shape"] = np.asarray(input_shape, dtype=np.int64)
            a["mean"] = np.asarray(mean, dtype=np.float64)
            a["std"] = np.asarray(std, dtype=np.float64)
            a["partition"] = str(partition)
            a["partition_params"] = json.dumps(partition_params, sort_keys=True)
            a["seed"] = np.int64(seed)
            a["train_counts"] = np.asarray(train_counts, dtype=np.int64)
            a["test_counts"] = np.asarray(test_counts, dtype=np.int64)
            a["train_label_counts"] = np.stack(train_labels).astype(np.int64)
            a["test_label_counts"] = np.stack(test_labels).astype(np.int64)
            f.flush()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


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
                        f"fedcp-dist reads format_version {FORMAT_VERSION} (images) and "
                        f"format_version {TEXT_FORMAT_VERSION} (images or text); re-create it "
                        f"with fedcp-partition")
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


def read_info(path) -> ShardInfo:
    """Read and check the attributes of the shard at ``path``."""
    f = _open(path)
    try:
        with f:
            version = _check_version(f, path)
            attrs = f.attrs
            for key in _REQUIRED_ATTRS:
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
            info = ShardInfo(
                path=os.fspath(path),
                format_version=version,
                kind=kind,
                source=_as_str(attrs["source"]),
                num_classes=int(attrs["num_classes"]),
                num_clients=int(attrs["num_clients"]),
                input_shape=tuple(int(d) for d in np.atleast_1d(attrs["input_shape"])),
                mean=tuple(float(v) for v in np.atleast_1d(attrs["mean"])),
                std=tuple(float(v) for v in np.atleast_1d(attrs["std"])),
                partition=_as_str(attrs["partition"]),
                partition_params=params,
                seed=int(attrs["seed"]),
                train_counts=np.asarray(attrs["train_counts"], dtype=np.int64).reshape(-1),
                test_counts=np.asarray(attrs["test_counts"], dtype=np.int64).reshape(-1),
                train_label_counts=np.asarray(attrs["train_label_counts"], dtype=np.int64),
                test_label_counts=np.asarray(attrs["test_label_counts"], dtype=np.int64),
                vocab_size=vocab_size,
            )
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"shard file {path} could not be read (truncated or corrupt?): "
                        f"{' '.join(str(exc).split())}") from None
    n, c = info.num_clients, info.num_classes
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
    elif len(info.input_shape) != 3:
        raise UserError(f"shard file {path}: an image shard's 'input_shape' must be [C, H, W], "
                        f"found {list(info.input_shape)}")
    return info


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


def load_clients(path, client_ids) -> dict[int, dict[str, np.ndarray]]:
    """Read the arrays of the given clients, opening the file once.

    Returns ``{client_id: {"train_x", "train_y", "test_x", "test_y"}}``; text shards add
    ``"train_len"`` and ``"test_len"``.
    """
    f = _open(path)
    out: dict[int, dict[str, np.ndarray]] = {}
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
            for cid in client_ids:
                cid = int(cid)
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
                if len(arrays["train_x"]) != len(arrays["train_y"]) or \
                        len(arrays["test_x"]) != len(arrays["test_y"]):
                    raise UserError(f"shard file {path}: client {cid} has samples and labels "
                                    f"of different lengths")
                if kind == TEXT_KIND:
                    _check_text_arrays(path, cid, arrays, max_len, vocab_size)
                out[cid] = arrays
    except (OSError, RuntimeError, KeyError) as exc:
        raise UserError(f"shard file {path}: could not read client data (corrupt file?): "
                        f"{' '.join(str(exc).split())}") from None
    return out
