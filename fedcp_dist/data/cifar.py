"""CIFAR-10/100's python-pickle batches, read by this project's own reader (the ``cifar10`` and
``cifar100`` sources of :mod:`fedcp_dist.data.sources`).

torchvision's classes insist on the md5 sums of the original files and so refuse any other copy in
the same layout; here every file is checked for its structure instead (a dict with a uint8
``data`` array of (n, 3072) rows, channel-major, and n labels in range). Only numpy's array
globals may appear in the pickles, so a planted pickle cannot run code.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from fedcp_dist.data.common import one_line as _one_line
from fedcp_dist.errors import UserError


@dataclass(frozen=True)
class CifarLayout:
    folder: str
    train: tuple
    test: tuple
    meta: str
    meta_key: str
    label_key: str
    num_classes: int
    torchvision_class: str


CIFAR = {
    "cifar10": CifarLayout("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                            ("test_batch",), "batches.meta", "label_names", "labels", 10,
                            "CIFAR10"),
    "cifar100": CifarLayout("cifar-100-python", ("train",), ("test",), "meta",
                             "fine_label_names", "fine_labels", 100, "CIFAR100"),
}

_CIFAR_ROW = 3 * 32 * 32


def _pickle_globals() -> dict:
    """The only globals a CIFAR pickle may name: numpy's array and scalar rebuilders."""
    reconstruct = np.ndarray.__reduce__(np.zeros(1, dtype=np.uint8))[0]
    scalar = np.int64(0).__reduce__()[0]
    import codecs

    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               ("_codecs", "encode"): codecs.encode}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
        allowed[(module, "scalar")] = scalar
    return allowed


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that builds plain containers and numpy arrays, and nothing else."""

    _allowed: Optional[dict] = None

    def find_class(self, module, name):
        if _ArrayUnpickler._allowed is None:
            _ArrayUnpickler._allowed = _pickle_globals()
        obj = _ArrayUnpickler._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"it names the global {module}.{name}, which a CIFAR "
                                         f"batch never holds (refused)")
        return obj


def read_cifar_pickle(path) -> dict:
    """Read one CIFAR python batch: a dict, its bytes keys decoded to str."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing")
    try:
        with open(path, "rb") as f:
            obj = _ArrayUnpickler(f, encoding="latin1").load()
    except Exception as exc:  # any unpickling failure of a truncated or foreign file
        raise UserError(f"{path} is not a readable CIFAR pickle (truncated or corrupt?): "
                        f"{_one_line(exc)}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, expected a dict")
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}


def cifar_batch(path: Path, layout: CifarLayout) -> tuple[np.ndarray, np.ndarray]:
    d = read_cifar_pickle(path)
    for key in ("data", layout.label_key):
        if key not in d:
            raise UserError(f"{path} lacks the key '{key}' (found: "
                            f"{', '.join(map(str, d)) or 'nothing'})")
    data = d["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != _CIFAR_ROW:
        what = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
                else type(data).__name__)
        raise UserError(f"{path}: 'data' is a {what}, expected a uint8 array of shape "
                        f"(n, {_CIFAR_ROW})")
    try:
        labels = np.asarray(d[layout.label_key])
    except Exception as exc:
        raise UserError(f"{path}: '{layout.label_key}' is not a list of labels "
                        f"({_one_line(exc)})") from None
    if labels.ndim != 1 or len(labels) != len(data) or \
            (len(labels) and not np.issubdtype(labels.dtype, np.integer)):
        raise UserError(f"{path}: '{layout.label_key}' must be {len(data)} integer labels, found "
                        f"{labels.dtype} of shape {labels.shape}")
    labels = labels.astype(np.int64)
    if len(labels) and (labels.min() < 0 or labels.max() >= layout.num_classes):
        raise UserError(f"{path}: '{layout.label_key}' must lie in [0, {layout.num_classes}), "
                        f"found [{labels.min()}, {labels.max()}]")
    return data, labels
