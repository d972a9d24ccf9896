"""Image data sources, loaded whole into memory as uint8 arrays.

Each source merges its train and test sets (train first, then test); the partitioner later
splits every client's share into its own train and test parts.  ``digits`` (scikit-learn's
bundled 8x8 digits, upsampled to 28x28) needs neither a root nor a network and is the offline
default; the others are read through :mod:`torchvision.datasets` from ``root``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fedcp_dist.errors import UserError

#: Per-channel normalisation used for every source: x_float = (x / 255 - 0.5) / 0.5.
NORM_MEAN = 0.5
NORM_STD = 0.5


@dataclass
class Source:
    """A whole data set: images ``x`` (n, C, H, W) uint8 and labels ``y`` (n,) int64."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    mean: tuple
    std: tuple
    name: str

    @property
    def input_shape(self) -> tuple:
        """Shape of one image, (C, H, W)."""
        return tuple(int(d) for d in self.x.shape[1:])


def _make_source(name: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> Source:
    channels = int(x.shape[1])
    return Source(
        x=np.ascontiguousarray(x, dtype=np.uint8),
        y=np.ascontiguousarray(y, dtype=np.int64),
        num_classes=int(num_classes),
        mean=(NORM_MEAN,) * channels,
        std=(NORM_STD,) * channels,
        name=name,
    )


def _load_digits(root, download) -> Source:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) * (255.0 / 16.0)
    t = torch.from_numpy(images).unsqueeze(1)  # (n, 1, 8, 8)
    t = F.interpolate(t, size=(28, 28), mode="bilinear", align_corners=False)
    x = t.round().clamp_(0, 255).to(torch.uint8).numpy()
    return _make_source("digits", x, np.asarray(bunch.target, dtype=np.int64), 10)


def _torchvision_loader(name: str, class_name: str, num_classes: int) -> Callable:
    def load(root, download) -> Source:
        if root is None:
            raise UserError(f"source '{name}' needs a data directory: pass --root DIR "
                            f"(and --download to fetch it there)")
        import torchvision.datasets as tvd

        cls = getattr(tvd, class_name)
        parts = []
        for train in (True, False):
            try:
                ds = cls(root=str(root), train=train, download=download)
            except (RuntimeError, OSError) as exc:
                detail = " ".join(str(exc).split())
                if download:
                    raise UserError(f"could not download source '{name}' into root '{root}': "
                                    f"{detail}") from None
                raise UserError(f"source '{name}' not found under root '{root}' ({detail}); "
                                f"pass --download to fetch it") from None
            parts.append(_arrays_of(ds))
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        return _make_source(name, x, y, num_classes)

    return load


def _arrays_of(ds) -> tuple[np.ndarray, np.ndarray]:
    """The raw (x, y) arrays of a torchvision image data set, as (n, C, H, W) uint8 and int64."""
    data = ds.data
    data = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    if data.ndim == 3:  # MNIST-style (n, H, W)
        x = data[:, None, :, :]
    elif data.ndim == 4:  # CIFAR-style (n, H, W, C)
        x = data.transpose(0, 3, 1, 2)
    else:
        raise UserError(f"unexpected image array shape {tuple(data.shape)} in {type(ds).__name__}")
    targets = ds.targets
    y = targets.numpy() if hasattr(targets, "numpy") else np.asarray(targets)
    return np.ascontiguousarray(x, dtype=np.uint8), y.astype(np.int64)


_LOADERS: dict[str, Callable] = {
    "digits": _load_digits,
    "mnist": _torchvision_loader("mnist", "MNIST", 10),
    "fmnist": _torchvision_loader("fmnist", "FashionMNIST", 10),
    "cifar10": _torchvision_loader("cifar10", "CIFAR10", 10),
    "cifar100": _torchvision_loader("cifar100", "CIFAR100", 100),
}

#: Names accepted by :func:`load_source`.
SOURCE_NAMES: tuple[str, ...] = tuple(_LOADERS)


def check_source_name(name: str) -> None:
    """Raise :class:`UserError` unless ``name`` is a known source."""
    if name not in _LOADERS:
        raise UserError(f"unknown source '{name}'; known sources: {', '.join(SOURCE_NAMES)}")


def load_source(name: str, root=None, download: bool = False) -> Source:
    """Load source ``name`` (train and test merged, train first) from ``root``.

    ``download`` lets torchvision fetch a missing data set into ``root``.
    """
    check_source_name(name)
    return _LOADERS[name](root, download)
