"""Reading a shard: its attributes and per-client counts checked (:func:`read_info`), its
vocabulary, and chosen clients' arrays (:func:`load_clients`), each failure one :class:`UserError`
naming the file."""
from __future__ import annotations

import json
import os
from typing import Optional

import h5py
import numpy as np

from fedcp_dist.data.shards.layout import (_COUNT_ATTRS, _REQUIRED_ATTRS, ARRAY_DIGESTS, FINGERPRINT, FORMAT_VERSION,
                                           IMAGE_FORMAT_VERSION, KIND, KINDS, READABLE_VERSIONS, SPLITS,
                                           TABLE_KIND, TEXT_FORMAT_VERSION, TEXT_KIND, TEXT_SPLITS,
                                           WRITE_SAMPLES, ShardInfo, layout_digest, layout_hash,
                                           normalisation_problem)
from fedcp_dist.data.shards.verify import finite_rows, labels_in_range
from fedcp_dist.errors import UserError


def _open(path) -> h5py.File:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserError(f"shard file {path} does not exist")
    if os.path.isdir(path):
        raise UserError(f"shard file {path} is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        said = " ".join(str(exc).split())
        if "unable to lock file" in said:  # another process holds it open for writing
            raise UserError(f"shard file {path} is locked by another process that has it open for writing (HDF5: "
                            f"{said}); let that process finish, or read a copy") from None
        raise UserError(f"shard file {path} is not a readable HDF5 file "
                        f"(truncated or corrupt?): {said}") from None


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


#: what a shard of each kind stores its samples as: (the dtype test, the words a refusal uses)
SAMPLE_DTYPES = {KIND: (lambda dt: dt == np.uint8, "uint8 pixel values 0-255"),
                 TEXT_KIND: (lambda dt: np.issubdtype(dt, np.integer), "integer token ids"),
                 TABLE_KIND: (lambda dt: dt == np.float32, "float32 feature values")}


def _values(sample: Optional[np.ndarray]) -> str:
    """`` (0.0 to 255.0 in its first rows, NaN among them)``: what a few of an array's values are."""
    if sample is None or not np.size(sample) or not np.issubdtype(sample.dtype, np.number):
        return ""
    finite = sample[np.isfinite(sample)] if np.issubdtype(sample.dtype, np.floating) else sample
    span = f"{finite.min().item()!r} to {finite.max().item()!r}" if finite.size else "no finite value"
    odd = sorted({str(v) for v in sample[~np.isfinite(sample)].ravel()[:1000]}) if finite.size < sample.size else []
    return f" ({span} in its first rows{', ' + ' and '.join(odd) + ' among them' if odd else ''})"


def dtype_ok(kind: str, name: str, dtype) -> bool:
    """Whether a shard of ``kind`` stores its array ``name`` as ``dtype``."""
    return SAMPLE_DTYPES[kind][0](np.dtype(dtype)) if name.endswith("_x") else np.issubdtype(dtype, np.integer)


def check_ds_dtype(path, kind: str, name: str, ds: h5py.Dataset) -> None:
    """:func:`check_dtype` of a dataset, some of its values read only when it is refused."""
    if not dtype_ok(kind, name, ds.dtype):
        check_dtype(path, kind, name, ds.dtype, sample=ds[:WRITE_SAMPLES])


def check_dtype(path, kind: str, name: str, dtype, client: Optional[int] = None,
                sample: Optional[np.ndarray] = None) -> None:
    """Refuse an array of a dtype the shard's kind does not store (images as float, labels as
    float, ...), in one line naming it, its dtype and (``sample``: some of its values) its values."""
    dtype = np.dtype(dtype)
    whose = f"client {client}'s " if client is not None else "dataset "
    if name.endswith("_x"):
        ok, what = SAMPLE_DTYPES[kind]
        if not ok(dtype):
            hint = (": images stored as float would train unscaled, as a table's features; re-create the shard "
                    "with fedcp-partition, whose --from-npz converts float images"
                    if kind == KIND and np.issubdtype(dtype, np.floating) else "")
            raise UserError(f"shard file {path}: {whose}'{name}' holds {dtype} values{_values(sample)}, but "
                            f"{'an' if kind == KIND else 'a'} {kind} shard stores {what}{hint}")
    elif not np.issubdtype(dtype, np.integer):
        what = "labels" if name.endswith("_y") else "lengths"
        raise UserError(f"shard file {path}: {whose}'{name}' holds {dtype} values{_values(sample)}, but {what} "
                        f"are integers")


def _label_dataset(f: h5py.File, path, key: str, num_clients: int, num_classes: int) -> h5py.Dataset:
    """The checked dataset ``{split}_label_counts``: (N, num_classes)."""
    if key not in f or not isinstance(f[key], h5py.Dataset):
        raise UserError(f"shard file {path} lacks the dataset '{key}'")
    if f[key].shape != (num_clients, num_classes):
        raise UserError(f"shard file {path}: dataset '{key}' has shape {f[key].shape}, "
                        f"expected ({num_clients}, {num_classes})")
    return f[key]


def _split_counts(f: h5py.File, path, num_clients: int, num_classes: int, kind: str,
                  label_counts: bool = True) -> dict:
    """The per-client counts of a version-3 shard (ShardInfo's fields), checked together;
    without ``label_counts`` the per-class counts are checked for their shape only and not read
    (ShardInfo's label counts are then None)."""
    names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
    out = {}
    for split in ("train", "test"):
        counts = np.diff(_offsets(f, path, split, num_clients, names))
        for name in names:
            if name.startswith(split):
                check_ds_dtype(path, kind, name, f[name])
        key = f"{split}_label_counts"
        ds = _label_dataset(f, path, key, num_clients, num_classes)
        labels = None
        if label_counts:
            labels = np.asarray(ds[()], dtype=np.int64)
            if not np.array_equal(labels.sum(axis=1), counts):
                raise UserError(f"shard file {path}: dataset '{key}' does not add up to the client "
                                f"sizes of '{split}_offsets' (corrupt file?)")
        out[f"{split}_counts"], out[key] = counts, labels
    return out


#: rows of the per-class counts read at a time by :func:`layout_digest_of`
LABEL_BLOCK = 1 << 16


def layout_digest_of(path, info: ShardInfo) -> str:
    """:func:`~fedcp_dist.data.shards.layout_digest` of the shard at ``path`` whose ``info`` was read
    without its per-class counts: those are read a block of :data:`LABEL_BLOCK` clients at a time
    (the same digest, in memory that does not grow with the population)."""
    if info.train_label_counts is not None or info.format_version < FORMAT_VERSION:
        return layout_digest(info)
    h = layout_hash(info)
    f = _open(path)
    try:
        with f:
            for split in ("train", "test"):
                ds = _label_dataset(f, path, f"{split}_label_counts", info.num_clients, info.num_classes)
                counts = getattr(info, f"{split}_counts")
                for start in range(0, info.num_clients, LABEL_BLOCK):
                    block = np.asarray(ds[start:start + LABEL_BLOCK], dtype=np.int64)
                    if not np.array_equal(block.sum(axis=1), counts[start:start + LABEL_BLOCK]):
                        raise UserError(f"shard file {path}: dataset '{split}_label_counts' does not add up to the "
                                        f"client sizes of '{split}_offsets' (corrupt file?)")
                    h.update(np.ascontiguousarray(block).tobytes())
    except (OSError, RuntimeError, KeyError) as exc:
        raise UserError(f"shard file {path} could not be read (truncated or corrupt?): "
                        f"{' '.join(str(exc).split())}") from None
    return f"sha256:{h.hexdigest()}"


def read_info(path, label_counts: bool = True) -> ShardInfo:
    """Read and check the attributes (and, from version 3 on, the per-client counts) of the
    shard at ``path``. ``label_counts=False`` (version 3): the per-class counts, (N, classes) for
    each split, are not read (ShardInfo's are None; :func:`layout_digest_of` streams them)."""
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
            try:
                digests = json.loads(_as_str(attrs[ARRAY_DIGESTS])) if ARRAY_DIGESTS in attrs else {}
            except ValueError:
                digests = None
            if not isinstance(digests, dict):
                raise UserError(f"shard file {path}: attribute '{ARRAY_DIGESTS}' is not a JSON object")
            n, c = int(attrs["num_clients"]), int(attrs["num_classes"])
            if c < 2:  # every metric but the accuracy is undefined, and the accuracy is 100 % untrained
                raise UserError(f"shard file {path}: it holds {c} class{'es' if c != 1 else ''}; "
                                f"a classifier needs at least two")
            if version >= FORMAT_VERSION:
                counts = _split_counts(f, path, n, c, kind, label_counts)
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
                array_digests=digests,
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
        if getattr(info, key) is not None and getattr(info, key).shape != (n, c):
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
        if len(info.input_shape) != 1 or info.input_shape[0] < 1:  # mean and std: normalisation_problem
            raise UserError(f"shard file {path}: a table shard's 'input_shape' must be [features], found "
                            f"{list(info.input_shape)}")
    elif len(info.input_shape) != 3:
        raise UserError(f"shard file {path}: an image shard's 'input_shape' must be [C, H, W], "
                        f"found {list(info.input_shape)}")
    problem = normalisation_problem(kind, info.input_shape, info.mean, info.std)
    if problem:
        raise UserError(f"shard file {path}: attribute {problem}")
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
            row, col = (int(v) for v in np.argwhere((x < 0) | (x >= vocab_size))[0])
            raise UserError(f"shard file {path}: client {cid} '{split}_x' holds token ids "
                            f"outside [0, {vocab_size}): {int(x[row, col])} (its row {row}, position {col})")
        if lengths.size and (lengths.min() < 0 or lengths.max() > max_len):
            row = int(np.flatnonzero((lengths < 0) | (lengths > max_len))[0])
            raise UserError(f"shard file {path}: client {cid} '{split}_len' holds lengths "
                            f"outside [0, {max_len}]: {int(lengths[row])} (its row {row})")


def _check_client_values(path, kind: str, cid: int, arrays: dict, num_classes: Optional[int]) -> None:
    """A loaded client's arrays: dtypes, labels in [0, num_classes), a table's values finite."""
    for name, a in arrays.items():
        if not dtype_ok(kind, name, a.dtype):
            check_dtype(path, kind, name, a.dtype, cid, sample=a[:WRITE_SAMPLES])
    for split in ("train", "test"):
        if num_classes is not None:
            labels_in_range(path, split, arrays[f"{split}_y"], [0, len(arrays[f"{split}_y"])], num_classes, cid)
        if kind == TABLE_KIND:
            finite_rows(path, f"{split}_x", cid, 0, arrays[f"{split}_x"])


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


def _load_split_rows(f: h5py.File, path, ids: list[int], names, num_clients: int, kind: str,
                     num_classes: Optional[int], offsets: Optional[dict] = None) -> dict:
    """Version 3: each client's rows of every dataset in ``names`` (views of one array each), each
    array's dtype, labels and a table's values checked once for all of them. ``offsets``: each
    split's checked offsets, read before (None: read here)."""
    order = np.unique(np.asarray(ids, dtype=np.int64))
    out: dict[int, dict[str, np.ndarray]] = {int(c): {} for c in order}
    for split in ("train", "test"):
        split_offsets = offsets[split] if offsets is not None else _offsets(f, path, split, num_clients, names)
        lengths = split_offsets[order + 1] - split_offsets[order]
        rows = _row_ranges(split_offsets[order], lengths)
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        for name in names:
            if name.startswith(split):
                check_ds_dtype(path, kind, name, f[name])
                data = _gather_rows(f[name], rows)
                if name.endswith("_y") and num_classes is not None:
                    labels_in_range(path, split, data, bounds, num_classes, clients=order)
                if kind == TABLE_KIND and name.endswith("_x") and not np.isfinite(data).all():
                    k = int(np.searchsorted(bounds, np.argwhere(~np.isfinite(data))[0][0], side="right") - 1)
                    finite_rows(path, name, int(order[k]), 0, data[bounds[k]:bounds[k + 1]])
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


class ShardReader:
    """A shard opened once for reads of some clients at a time (:meth:`read`): what a run that reads
    each round's clients from the shard keeps open (``client_data: on_demand``). The attributes and
    (version 3) each split's offsets are read and checked when it opens; a read then costs the rows
    of the clients asked for, not the population's. :func:`load_clients` is one read of one."""

    def __init__(self, path):
        self.path = path
        self._f = _open(path)
        try:
            self._setup()
        except (OSError, RuntimeError, KeyError) as exc:
            self.close()
            raise UserError(f"shard file {path}: could not read client data (corrupt file?): "
                            f"{' '.join(str(exc).split())}") from None
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        f, path = self._f, self.path
        self.version = _check_version(f, path)
        self.num_clients = int(f.attrs.get("num_clients", -1))
        self.kind = kind = _as_str(f.attrs.get("kind", KIND))
        _check_kind(path, kind, self.version)
        self.names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
        self.num_classes = int(f.attrs["num_classes"]) if "num_classes" in f.attrs else None
        if kind == TEXT_KIND:
            for key in ("vocab_size", "input_shape"):
                if key not in f.attrs:
                    raise UserError(f"shard file {path} lacks the attribute '{key}'")
            self.vocab_size = int(f.attrs["vocab_size"])
            self.max_len = int(np.atleast_1d(f.attrs["input_shape"])[0])
        self.offsets = None
        if self.version >= FORMAT_VERSION:
            if "num_clients" not in f.attrs:
                raise UserError(f"shard file {path} lacks the attribute 'num_clients'")
            self.offsets = {split: _offsets(f, path, split, self.num_clients, self.names) for split in ("train", "test")}

    def read(self, client_ids) -> dict[int, dict[str, np.ndarray]]:
        """``{client_id: {"train_x", "train_y", "test_x", "test_y"}}`` (text adds ``"train_len"``,
        ``"test_len"``), each client's arrays checked. Memory: their arrays plus one block of rows."""
        path, kind = self.path, self.kind
        ids = [int(cid) for cid in client_ids]
        try:
            if self.offsets is not None:
                for cid in ids:
                    if not 0 <= cid < self.num_clients:
                        raise UserError(f"shard file {path} has no client {cid} "
                                        f"(it holds {self.num_clients} clients)")
                out = _load_split_rows(self._f, path, ids, self.names, self.num_clients, kind, self.num_classes,
                                       self.offsets)
            else:
                out = _load_groups(self._f, path, ids, self.names, self.num_clients)
                for cid, arrays in out.items():
                    _check_client_values(path, kind, cid, arrays, self.num_classes)
            for cid, arrays in out.items():
                if len(arrays["train_x"]) != len(arrays["train_y"]) or \
                        len(arrays["test_x"]) != len(arrays["test_y"]):
                    raise UserError(f"shard file {path}: client {cid} has samples and labels "
                                    f"of different lengths")
                if kind == TEXT_KIND:
                    _check_text_arrays(path, cid, arrays, self.max_len, self.vocab_size)
        except (OSError, RuntimeError, KeyError) as exc:
            raise UserError(f"shard file {path}: could not read client data (corrupt file?): "
                            f"{' '.join(str(exc).split())}") from None
        return out

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            finally:
                self._f = None

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_clients(path, client_ids) -> dict[int, dict[str, np.ndarray]]:
    """Read the arrays of the given clients, opening the file once.

    Returns ``{client_id: {"train_x", "train_y", "test_x", "test_y"}}``; text shards add
    ``"train_len"`` and ``"test_len"``.  Memory: the clients' arrays plus one block of rows.
    """
    with ShardReader(path) as reader:
        return reader.read(client_ids)
