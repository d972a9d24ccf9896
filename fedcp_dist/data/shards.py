"""The partitioned-data file: one HDF5 file holding every client's train and test images.

Layout (no pickled objects anywhere)::

    /                       attributes: format_version, kind, source, num_classes, num_clients,
                            input_shape, mean, std, partition, partition_params (JSON), seed,
                            train_counts, test_counts, train_label_counts, test_label_counts
    /clients/{i}/train_x    uint8 (n, C, H, W), chunked by whole images, gzip 4 + shuffle
    /clients/{i}/train_y    int64 (n,)
    /clients/{i}/test_x     uint8 (m, C, H, W)
    /clients/{i}/test_y     int64 (m,)

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

FORMAT_VERSION = 1
KIND = "image"
CHUNK_SAMPLES = 256
SPLITS = ("train_x", "train_y", "test_x", "test_y")

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


def _write_x(group: h5py.Group, name: str, x: np.ndarray) -> None:
    if len(x) == 0:
        group.create_dataset(name, shape=x.shape, dtype=np.uint8)
        return
    chunk = (min(CHUNK_SAMPLES, len(x)),) + tuple(x.shape[1:])
    group.create_dataset(name, data=x, chunks=chunk, compression="gzip", compression_opts=4,
                         shuffle=True)


def _check_client(i: int, arrays, input_shape: tuple, num_classes: int):
    if len(arrays) != 4:
        raise ValueError(f"client {i}: expected (train_x, train_y, test_x, test_y), "
                         f"got {len(arrays)} items")
    out = []
    for split in (0, 2):
        x = np.asarray(arrays[split])
        y = np.asarray(arrays[split + 1])
        if x.dtype != np.uint8:
            raise ValueError(f"client {i}: {SPLITS[split]} must be uint8, got {x.dtype}")
        if x.shape[1:] != input_shape or x.ndim != 4:
            raise ValueError(f"client {i}: {SPLITS[split]} has shape {x.shape}, "
                             f"expected (n, {', '.join(map(str, input_shape))})")
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"client {i}: {SPLITS[split + 1]} has shape {y.shape}, "
                             f"expected ({len(x)},)")
        if not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"client {i}: {SPLITS[split + 1]} must be integer, got {y.dtype}")
        y = y.astype(np.int64)
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"client {i}: labels must lie in [0, {num_classes})")
        out += [np.ascontiguousarray(x), y]
    return out


def write_shard(path, clients: Iterable, *, source: str, num_classes: int, input_shape,
                mean, std, partition: str, partition_params: dict, seed: int) -> None:
    """Write ``clients`` (an iterable of ``(train_x, train_y, test_x, test_y)``) to ``path``.

    The file appears at ``path`` only once it is complete; on any failure the temporary file is
    removed and whatever was at ``path`` before is left as it was.
    """
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    input_shape = tuple(int(d) for d in input_shape)
    num_classes = int(num_classes)
    try:
        with h5py.File(tmp, "w") as f:
            root = f.create_group("clients")
            train_counts, test_counts, train_labels, test_labels = [], [], [], []
            for i, arrays in enumerate(clients):
                train_x, train_y, test_x, test_y = _check_client(i, arrays, input_shape,
                                                                 num_classes)
                g = root.create_group(str(i))
                _write_x(g, "train_x", train_x)
                g.create_dataset("train_y", data=train_y)
                _write_x(g, "test_x", test_x)
                g.create_dataset("test_y", data=test_y)
                train_counts.append(len(train_y))
                test_counts.append(len(test_y))
                train_labels.append(np.bincount(train_y, minlength=num_classes))
                test_labels.append(np.bincount(test_y, minlength=num_classes))
            n = len(train_counts)
            if n == 0:
                raise ValueError("write_shard needs at least one client")
            a = f.attrs
            a["format_version"] = np.int64(FORMAT_VERSION)
            a["kind"] = KIND
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
    if version != FORMAT_VERSION:
        raise UserError(f"shard file {path} has format_version {version}, this version of "
                        f"fedcp-dist reads format_version {FORMAT_VERSION}; re-create it with "
                        f"fedcp-partition")
    return version


def _as_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


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
            try:
                params = json.loads(_as_str(attrs["partition_params"]))
            except ValueError:
                raise UserError(f"shard file {path}: attribute 'partition_params' "
                                f"is not valid JSON") from None
            info = ShardInfo(
                path=os.fspath(path),
                format_version=version,
                kind=_as_str(attrs["kind"]),
                source=_as_str(attrs["source"]),
                num_classes=int(attrs["num_classes"]),
                num_clients=int(attrs["num_clients"]),
                input_shape=tuple(int(d) for d in np.asarray(attrs["input_shape"])),
                mean=tuple(float(v) for v in np.atleast_1d(attrs["mean"])),
                std=tuple(float(v) for v in np.atleast_1d(attrs["std"])),
                partition=_as_str(attrs["partition"]),
                partition_params=params,
                seed=int(attrs["seed"]),
                train_counts=np.asarray(attrs["train_counts"], dtype=np.int64).reshape(-1),
                test_counts=np.asarray(attrs["test_counts"], dtype=np.int64).reshape(-1),
                train_label_counts=np.asarray(attrs["train_label_counts"], dtype=np.int64),
                test_label_counts=np.asarray(attrs["test_label_counts"], dtype=np.int64),
            )
    except (OSError, RuntimeError, KeyError) as exc:
        raise UserError(f"shard file {path} could not be read (truncated or corrupt?): "
                        f"{' '.join(str(exc).split())}") from None
    if info.kind != KIND:
        raise UserError(f"shard file {path} has kind '{info.kind}', expected '{KIND}'")
    n, c = info.num_clients, info.num_classes
    for key in ("train_counts", "test_counts"):
        if getattr(info, key).shape != (n,):
            raise UserError(f"shard file {path}: attribute '{key}' has shape "
                            f"{getattr(info, key).shape}, expected ({n},)")
    for key in ("train_label_counts", "test_label_counts"):
        if getattr(info, key).shape != (n, c):
            raise UserError(f"shard file {path}: attribute '{key}' has shape "
                            f"{getattr(info, key).shape}, expected ({n}, {c})")
    return info


def load_clients(path, client_ids) -> dict[int, dict[str, np.ndarray]]:
    """Read the arrays of the given clients, opening the file once.

    Returns ``{client_id: {"train_x", "train_y", "test_x", "test_y"}}``.
    """
    f = _open(path)
    out: dict[int, dict[str, np.ndarray]] = {}
    try:
        with f:
            _check_version(f, path)
            num_clients = int(f.attrs.get("num_clients", -1))
            for cid in client_ids:
                cid = int(cid)
                key = f"clients/{cid}"
                if key not in f:
                    raise UserError(f"shard file {path} has no client {cid} "
                                    f"(it holds {num_clients} clients)")
                group = f[key]
                arrays = {}
                for name in SPLITS:
                    if name not in group:
                        raise UserError(f"shard file {path}: client {cid} lacks dataset '{name}'")
                    arrays[name] = group[name][()]
                if len(arrays["train_x"]) != len(arrays["train_y"]) or \
                        len(arrays["test_x"]) != len(arrays["test_y"]):
                    raise UserError(f"shard file {path}: client {cid} has images and labels "
                                    f"of different lengths")
                out[cid] = arrays
    except (OSError, RuntimeError, KeyError) as exc:
        raise UserError(f"shard file {path}: could not read client data (corrupt file?): "
                        f"{' '.join(str(exc).split())}") from None
    return out
