"""Writing a shard: every client's arrays checked, appended a block at a time, fingerprinted (and
each array digested, :mod:`fedcp_dist.data.shards.verify`), and the file moved into place only when
complete."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from array import array
from typing import Iterable

import h5py
import numpy as np

from fedcp_dist.data.shards.layout import (ARRAY_DIGESTS, ATTRIBUTE_BYTES, CHUNK_SAMPLES, FINGERPRINT,
                                           FORMAT_VERSION, GROUP_VERSIONS, KIND, KINDS, SPLITS, TABLE_KIND,
                                           TEXT_KIND, TEXT_SPLITS, WRITE_SAMPLES, Rows, normalisation_problem,
                                           training_attributes)
from fedcp_dist.data.shards.verify import ATTRIBUTES, ArrayHash, attributes_digest, offsets_digest
from fedcp_dist import interrupts
from fedcp_dist.fileio import atomic_path, os_error_behind
from fedcp_dist.errors import UserError


class WrittenElsewhere(UserError):
    """Another process finished a shard at the same path while this one wrote it; theirs is kept."""


class _Fingerprint:
    """The running SHA-256 of a shard's content as it is written (see the package's docstring), and
    each array's digest (:mod:`fedcp_dist.data.shards.verify`)."""

    def __init__(self, names, x_dtype, input_shape: tuple):
        self.h = hashlib.sha256()
        self.arrays = {n: ArrayHash(n) for n in names}
        self.dtypes = {n: (x_dtype if n.endswith("_x") else np.int64 if n.endswith("_y") else np.int32) for n in names}
        self.row_shapes = {n: (input_shape if n.endswith("_x") else ()) for n in names}

    def add(self, name: str, x) -> None:
        """One client's array (an array or :class:`Rows`), read a block of rows at a time."""
        self.h.update(f"{name}|{np.dtype(x.dtype).str}|{tuple(x.shape)}|".encode())
        for start in range(0, len(x), WRITE_SAMPLES):
            block = np.ascontiguousarray(x[start:start + WRITE_SAMPLES])
            self.h.update(block.tobytes())
            self.arrays[name].add(block)

    def finish(self, meta: dict, counts: dict) -> tuple:
        """(the fingerprint, {array: digest}) once every client is added; ``counts``: the
        per-client sample counts of each split."""
        self.h.update(json.dumps(meta, sort_keys=True).encode())
        digests = {n: h.hexdigest(self.dtypes[n], self.row_shapes[n]) for n, h in self.arrays.items()}
        for split in ("train", "test"):
            digests[f"{split}_offsets"] = offsets_digest(f"{split}_offsets", counts[f"{split}_counts"])
        digests[ATTRIBUTES] = attributes_digest(meta)
        return f"sha256:{self.h.hexdigest()}", digests


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
    """Each client's train and test sample counts (8 bytes each a client: a million clients take
    16 MB) and, when ``keep_labels``, its per-class counts; :meth:`add` returns the latter, which
    version 3 appends to the file as they come instead of holding N × C of them."""

    def __init__(self, num_classes: int, keep_labels: bool):
        self.num_classes = num_classes
        self.train, self.test = array("q"), array("q")
        self.train_labels, self.test_labels = ([], []) if keep_labels else (None, None)

    def add(self, train_y: np.ndarray, test_y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.train.append(len(train_y))
        self.test.append(len(test_y))
        labels = (np.bincount(train_y, minlength=self.num_classes),
                  np.bincount(test_y, minlength=self.num_classes))
        if self.train_labels is not None:
            self.train_labels.append(labels[0])
            self.test_labels.append(labels[1])
        return labels

    def __len__(self) -> int:
        return len(self.train)

    def sizes(self) -> dict[str, np.ndarray]:
        """``train_counts``, ``test_counts``: (N,) int64."""
        return {"train_counts": np.frombuffer(self.train, dtype=np.int64) if self.train else np.zeros(0, np.int64),
                "test_counts": np.frombuffer(self.test, dtype=np.int64) if self.test else np.zeros(0, np.int64)}

    def arrays(self) -> dict[str, np.ndarray]:
        """:meth:`sizes` and ``*_label_counts`` (N, C), all int64 (``keep_labels`` only)."""
        return {**self.sizes(), "train_label_counts": np.stack(self.train_labels).astype(np.int64),
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

    def buffered(self) -> int:
        """Bytes of rows held in the buffer, not written yet."""
        return self.buf[:self.fill].nbytes

    def close(self) -> None:
        """Write what the buffer holds."""
        if self.fill:
            rows = self.ds.shape[0]
            self.ds.resize(rows + self.fill, axis=0)
            self.ds[rows:rows + self.fill] = self.buf[:self.fill]
            self.fill = 0


class _SplitWriter:
    """Version 3: every client's rows appended to one dataset per split and array."""

    #: version 3 appends each client's per-class counts to the file as it is written
    keep_labels = False

    def __init__(self, f: h5py.File, kind: str, input_shape: tuple, num_classes: int):
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
        # a chunk of label counts holds about WRITE_SAMPLES values, whatever the number of classes
        rows = max(1, WRITE_SAMPLES // max(1, num_classes))
        self.labels = [_Appender(f, f"{split}_label_counts", np.int64, (num_classes,), rows)
                       for split in ("train", "test")]

    def add(self, i: int, checked: list, labels: tuple) -> None:
        for name, arr in zip(self.names, checked):
            self.columns[name].append(arr)
        for column, row in zip(self.labels, labels):
            column.append(row[None])

    def buffered_bytes(self) -> int:
        """Bytes of rows appended but still in the columns' buffers."""
        return sum(column.buffered() for column in (*self.columns.values(), *self.labels))

    def finish(self, counts: _Counts) -> None:
        for column in (*self.columns.values(), *self.labels):
            column.close()
        for split, sizes in zip(("train", "test"), counts.sizes().values()):
            offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
            self.f.create_dataset(f"{split}_offsets", data=offsets)


class _GroupWriter:
    """Versions 1 and 2: a group per client, the counts among the root attributes."""

    #: the counts go to the root attributes at the end
    keep_labels = True

    @staticmethod
    def buffered_bytes() -> int:
        """Nothing is held back: each client's rows are written as it comes."""
        return 0

    def __init__(self, f: h5py.File, kind: str, version: int):
        self.f, self.version = f, version
        self.names = TEXT_SPLITS if kind == TEXT_KIND else SPLITS
        self.root = f.create_group("clients")

    def add(self, i: int, checked: list, labels: tuple) -> None:
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
                columns=None, replace: bool = True) -> None:
    """Write ``clients`` to ``path``.

    Images: each client is ``(train_x, train_y, test_x, test_y)``.  Text (``kind="text"``, with
    ``vocab`` the tokens in id order): ``(train_x, train_y, test_x, test_y, train_len,
    test_len)``.  Any ``*_x`` may be a :class:`Rows` view, copied a block at a time.
    ``format_version`` is :data:`FORMAT_VERSION`, or the group-per-client version of the kind
    (1 for images, 2 for text) for readers that know no other.  Tables (``kind="table"``,
    version 3 only): float32 feature rows, ``mean`` / ``std`` one value per feature, ``columns``
    the feature names.

    The file appears at ``path`` only once it is complete; on any failure the temporary file is
    removed and whatever was at ``path`` before is left as it was. Without ``replace`` a file that
    another process wrote at ``path`` meanwhile is kept, and this one refused (a UserError).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if format_version not in (FORMAT_VERSION, GROUP_VERSIONS.get(kind, FORMAT_VERSION)):
        raise ValueError(f"a {kind} shard is written as format_version {FORMAT_VERSION} or "
                         f"{GROUP_VERSIONS[kind]}, not {format_version!r}")
    if kind == TABLE_KIND:
        if len(tuple(input_shape)) != 1:  # one mean and std per feature: normalisation_problem
            raise ValueError(f"a table shard's input_shape is (features,), got {tuple(input_shape)}")
        if columns is not None and len(columns) != input_shape[0]:
            raise ValueError(f"{len(columns)} column names for {input_shape[0]} features")
    elif columns is not None:
        raise ValueError("only a table shard has feature column names")
    problem = normalisation_problem(kind, input_shape, mean, std)
    if problem:
        raise ValueError(f"shard attribute {problem}")
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
    if num_classes < 2:
        raise ValueError(f"a shard needs at least two classes, got num_classes={num_classes}")
    ids = _IdRange(len(vocab)) if kind == TEXT_KIND else None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        _write(path, clients, source, num_classes, input_shape, mean, std, partition, partition_params, seed, kind,
               vocab, format_version, columns, ids, replace)
    except FileExistsError:
        raise WrittenElsewhere(f"{path} was written by another process while this one wrote it (a second fedcp-partition "
                        f"to the same --out?); it is left as that process wrote it: use it, or pass --force to "
                        f"replace it") from None


@contextlib.contextmanager
def _hdf5_file(tmp, path):
    """``h5py.File(tmp, "w")``, closed whatever happens inside. A write of the shard that fails for
    the file system's reason (a full disk, a quota) is an OSError naming ``path``; any other error
    (an input file's, a refusal) is raised as it was.

    HDF5, closing a file whose writes failed, fails again on the chunks it still holds, and the
    objects it then leaves open crashed the interpreter at exit (a segfault after two tracebacks).
    So a file given up on (the caller removes it) is closed with its descriptor pointed at an
    anonymous file in memory: what HDF5 still has to write goes there (its cached chunks, a few MB
    at most), and the close succeeds."""
    f = h5py.File(tmp, "w")
    try:
        yield f
        f.flush()  # a full disk fails here, before the close, which then has nothing large left to write
    except BaseException as exc:
        _close_into_memory(f)
        err = _hdf5_os_error(exc) if isinstance(exc, (OSError, RuntimeError)) else None
        if (err is not None and err.errno is not None and err.filename in (None, str(tmp))
                and not isinstance(err, (FileExistsError, BrokenPipeError))):
            raise OSError(err.errno, os.strerror(err.errno), str(path)) from None  # HDF5's own write failed
        raise  # another file's error (an input read), a refusal, an interrupt: as it was
    try:
        f.close()
    except (RuntimeError, OSError) as exc:
        err = _hdf5_os_error(exc)
        raise OSError(err.errno if err is not None else errno.EIO,
                      os.strerror(err.errno if err is not None else errno.EIO), str(path)) from None


def _hdf5_os_error(exc: BaseException):
    """The OSError behind ``exc``, or the one HDF5 names only in its message (``errno = 27``: a flush
    that a file size limit cut short comes out of h5py as a RuntimeError); None if there is none."""
    err = os_error_behind(exc)
    if err is None and isinstance(exc, RuntimeError):
        found = re.search(r"\berrno = (\d+)", str(exc))
        if found and int(found.group(1)) > 0:
            err = OSError(int(found.group(1)), os.strerror(int(found.group(1))))
    return err


#: bytes a shard's file may still take besides its rows: HDF5's metadata (chunk indexes, the
#: attributes and the per-client offsets written at the end are counted apart)
FSIZE_SLACK = 64 << 10


def _file_size_limit():
    """The largest file this process may write (``ulimit -f``, RLIMIT_FSIZE) in bytes; None: no limit."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return None if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, OSError, ValueError):
        return None


def _check_file_size(f, path, limit, body, pending: int) -> None:
    """Under a file size limit, an OSError naming ``path`` before ``pending`` more bytes of rows
    (uncompressed: compression only shrinks them) are given to the writer, where the file could
    pass the limit: HDF5 fails on a write past it inside the finalizers of its objects, where the
    failure cannot be caught and the interpreter crashed (a segfault). What HDF5 caches is written
    first (a flush), so the file's size is exact; the rows the writer holds in its buffers count."""
    if limit is None:
        return
    f.flush()
    size = os.fstat(f.id.get_vfd_handle()).st_size
    if size + body.buffered_bytes() + pending + FSIZE_SLACK > limit:
        raise OSError(errno.EFBIG, f"File too large: the shard could pass this process's file size limit, "
                                   f"{limit >> 10:,} KiB (ulimit -f {limit >> 10}), with its next rows (counted before "
                                   f"compression); raise the limit", os.fspath(path))


def _close_into_memory(f) -> None:
    """Close ``f``, a file given up on, writing what HDF5 still holds into memory (see
    :func:`_hdf5_file`); an error of the close is dropped."""
    try:
        if not f.id.valid:
            return
        if _file_size_limit() is not None:  # a memory file is a file too: its writes would fail again past the limit
            void = os.open(os.devnull, os.O_RDWR)
        elif hasattr(os, "memfd_create"):
            void = os.memfd_create("fedcp-unwritten-shard")
        else:
            import tempfile

            with tempfile.TemporaryFile() as scratch:
                void = os.dup(scratch.fileno())
        os.dup2(void, f.id.get_vfd_handle())
        os.close(void)
        f.close()
    except (RuntimeError, OSError, ValueError, TypeError):
        pass


def _write(path, clients, source, num_classes, input_shape, mean, std, partition, partition_params, seed, kind,
           vocab, format_version, columns, ids, replace) -> None:
    with atomic_path(path, replace=replace, orphans=True) as tmp, _hdf5_file(tmp, path) as f:
        if format_version == FORMAT_VERSION:
            body = _SplitWriter(f, kind, input_shape, num_classes)
        else:
            body = _GroupWriter(f, kind, format_version)
        counts = _Counts(num_classes, body.keep_labels)
        x_dtype = {KIND: np.uint8, TEXT_KIND: np.int32, TABLE_KIND: np.float32}[kind]
        fingerprint = _Fingerprint(body.names, x_dtype, input_shape)
        limit = _file_size_limit()
        for i, arrays in enumerate(clients):
            interrupts.check()  # a stop signal swallowed in one of h5py's finalizers is raised here
            checked = _check_client(i, arrays, input_shape, num_classes, kind, ids)
            _check_file_size(f, path, limit, body, sum(int(getattr(a, "nbytes", 0)) for a in checked))
            body.add(i, checked, counts.add(checked[1], checked[3]))
            for name, arr in zip(body.names, checked):
                fingerprint.add(name, arr)
        if len(counts) == 0:
            raise ValueError("write_shard needs at least one client")
        # what the end writes besides the rows: the offsets (16 bytes a client), the attributes
        _check_file_size(f, path, limit, body, 16 * len(counts) + (sum(len(t) + 8 for t in vocab) if vocab else 0))
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
        a[FINGERPRINT], digests = fingerprint.finish(
            training_attributes(kind, num_classes, input_shape, mean, std, vocab, columns), counts.sizes())
        a[ARRAY_DIGESTS] = json.dumps(digests, sort_keys=True)
        body.finish(counts)
