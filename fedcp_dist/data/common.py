"""What the data sources share: the :class:`Source` record a loader returns, the images'
normalisation, the progress bar of long passes, the block-wise image decoder and the line of a
text file that is not UTF-8.

:mod:`fedcp_dist.data.sources` (the built-in sources) and :mod:`fedcp_dist.data.owndata` (users'
own folders and tables) both build on this module; neither imports the other's internals.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

#: Per-channel normalisation used for every image source: x_float = (x / 255 - 0.5) / 0.5.
NORM_MEAN = 0.5
NORM_STD = 0.5


def progress(iterable, total: Optional[int] = None, desc: Optional[str] = None, unit: str = "it"):
    """A tqdm bar on stderr around ``iterable``; it appears only once a pass has taken 2 s."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, delay=2.0,
                mininterval=1.0, dynamic_ncols=True)


@dataclass
class Source:
    """A whole data set.

    Images: ``x`` (n, C, H, W) uint8.  Text: ``x`` (n, max_len) int32 token ids (0 = padding),
    ``lengths`` (n,) int32 real tokens per row and ``vocab`` the tokens in id order.  Labels
    ``y`` (n,) int64 in both.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    mean: tuple
    std: tuple
    name: str
    kind: str = "image"
    lengths: Optional[np.ndarray] = None
    vocab: Optional[list] = None
    #: how the source was built (text: max_len, vocab_size_cap, min_freq), recorded in the shard
    params: dict = field(default_factory=dict)
    #: natural partitions: each sample's client (index into ``group_names``); None otherwise
    groups: Optional[np.ndarray] = None
    group_names: Optional[list] = None
    #: tables: the feature columns' names
    feature_names: Optional[list] = None

    @property
    def input_shape(self) -> tuple:
        """Shape of one sample: (C, H, W) for images, (max_len,) for text, (features,) for tables."""
        return tuple(int(d) for d in self.x.shape[1:])

    @property
    def vocab_size(self) -> int:
        """Number of token ids (0 for images)."""
        return len(self.vocab) if self.vocab is not None else 0


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def undecodable_line(path) -> tuple[int, str]:
    """(number, what is wrong) of the first line of ``path`` that is not UTF-8. The decoder of a
    text file reads ahead by blocks, so its error does not tell the line; a multi-byte character
    never spans a newline, so each line is decoded on its own here."""
    number = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, f"byte {exc.start + 1} of the line is 0x{raw[exc.start]:02x}"
    return number, "a character cut at the end of the file"


def decode_images(files: list, shape: tuple, read, workers: int, block: int) -> np.ndarray:
    """Decode ``files`` with ``read`` (a path → a uint8 array of ``shape``) into one preallocated
    (n, *shape) uint8 array, ``block`` files at a time on ``workers`` threads (one block of decoded
    images is all that is held beyond the array)."""
    x = np.empty((len(files),) + tuple(shape), dtype=np.uint8)
    bar = progress(None, total=len(files), desc="decoding images", unit="img")
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for start in range(0, len(files), block):
                chunk = files[start:start + block]
                for i, image in enumerate(pool.map(read, chunk), start):
                    x[i] = image
                bar.update(len(chunk))
    finally:
        bar.close()
    return x
