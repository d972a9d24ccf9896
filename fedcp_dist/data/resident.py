"""A rank's clients' data: resident on its device for the whole run (read once from the shard,
:class:`ResidentData`), or read from the shard when a round needs them (:class:`OnDemandData`).

Images stay uint8 on the device (4x less memory than float32) and are normalised per batch.
Text keeps its int32 token ids on the device (half of int64) and hands out int64 ids per batch,
unnormalised; the per-row lengths (real, non-padding tokens) stay alongside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Mapping, Optional

import numpy as np
import torch


@dataclass
class ClientData:
    cid: int
    train_x: torch.Tensor  # images: uint8 (n, C, H, W); text: int32 token ids (n, max_len)
    train_y: torch.Tensor  # int64 (n,)
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: Optional[torch.Tensor]  # images: (1, C, 1, 1); text: None
    inv_std: Optional[torch.Tensor]  # images: (1, C, 1, 1); text: None
    kind: str = "image"  # image | text | table
    train_len: Optional[torch.Tensor] = None  # text: int32 (n,) real tokens per row
    test_len: Optional[torch.Tensor] = None

    @property
    def n_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.test_y.shape[0])

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "text":
            return x.to(torch.int64)
        if self.kind == "table":
            return (x - self.mean) * self.inv_std
        return channels_last((x.to(torch.float32) * (1.0 / 255.0) - self.mean) * self.inv_std)

    def train_batch(self, idx: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the training rows ``idx`` (all of them when None).

        Images: float32 (B, C, H, W), normalised, channels-last in memory.  Text: int64 token ids
        (B, max_len).
        """
        if idx is None:
            return self._prepare(self.train_x), self.train_y
        return self._prepare(self.train_x[idx]), self.train_y[idx]

    def test_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._prepare(self.test_x[start:stop]), self.test_y[start:stop]

    def prepared_alike(self, other: "ClientData") -> bool:
        """True when ``other``'s batches are prepared as this client's (the same kind, mean and
        scale; a shard's clients all are), both by :class:`ClientData`'s own preparation (a subclass
        that prepares its batches otherwise is not): then :func:`stacked_train_batches` prepares
        theirs at once."""
        if self.kind != other.kind or not (_own_preparation(self) and _own_preparation(other)):
            return False
        return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in ((self.mean, other.mean), (self.inv_std, other.inv_std)))


def _own_preparation(d: ClientData) -> bool:
    return type(d).train_batch is ClientData.train_batch and type(d)._prepare is ClientData._prepare


def stacked_train_batches(datas, idxs, alike: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.stack`` of each client's ``train_batch(idx)`` and of its labels: (k, B, ...) inputs
    and (k, B) labels, the same values in the same memory layout. With ``alike`` (every client's
    batches are prepared as the first's, :meth:`ClientData.prepared_alike`) the raw rows are
    gathered client by client and prepared once for all of them: the same elementwise operations
    on the same values, a few operations per step instead of a few per client."""
    ys = torch.stack([d.train_y[i] for d, i in zip(datas, idxs)])
    if not alike:
        return torch.stack([d.train_batch(i)[0] for d, i in zip(datas, idxs)]), ys
    first = datas[0]
    raw = torch.stack([d.train_x[i] for d, i in zip(datas, idxs)])
    if first.kind == "image" and raw.dim() == 5 and raw.shape[2] > 1:
        # the layout of stacked channels-last batches: channels innermost (values unchanged)
        raw = raw.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
    if first.kind == "text":
        return raw.to(torch.int64), ys
    if first.kind == "table":
        return (raw - first.mean) * first.inv_std, ys
    return (raw.to(torch.float32) * (1.0 / 255.0) - first.mean) * first.inv_std, ys


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """A contiguous (B, C, H, W) batch in channels-last memory layout (same values and shape).

    A convolution given a channels-last input writes channels-last, and the max-pooling after it
    then runs several times faster than on NCHW (docs/performance.md has the
    figures). With one channel both layouts order the elements alike and
    ``contiguous(memory_format=...)`` keeps the NCHW strides, so the channels-last strides are set
    explicitly; the data are not copied then.
    """
    n, c, h, w = x.shape
    if c == 1:
        return x.contiguous().as_strided(x.shape, (h * w, 1, w, 1))
    return x.contiguous(memory_format=torch.channels_last)


def to_device(cid: int, arrays: Mapping[str, np.ndarray], mean, std, device: torch.device) -> ClientData:
    """Move one client's arrays (as :func:`~fedcp_dist.data.shards.load_clients` returns them)
    to ``device``.

    A text client is recognised by its ``train_len`` array; its ``mean`` and ``std`` (empty for
    text shards) are not used.  A table client is recognised by its float32 rows; ``mean`` and
    ``std`` hold one value per feature and standardise every batch.
    """

    def t(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    if "train_len" in arrays:
        return ClientData(
            cid=cid,
            train_x=t(arrays["train_x"], torch.int32),
            train_y=t(arrays["train_y"], torch.int64),
            test_x=t(arrays["test_x"], torch.int32),
            test_y=t(arrays["test_y"], torch.int64),
            mean=None,
            inv_std=None,
            kind="text",
            train_len=t(arrays["train_len"], torch.int32),
            test_len=t(arrays["test_len"], torch.int32),
        )
    if np.issubdtype(np.asarray(arrays["train_x"]).dtype, np.floating):
        f = len(mean)
        return ClientData(
            cid=cid,
            train_x=t(arrays["train_x"], torch.float32),
            train_y=t(arrays["train_y"], torch.int64),
            test_x=t(arrays["test_x"], torch.float32),
            test_y=t(arrays["test_y"], torch.int64),
            mean=torch.as_tensor(np.asarray(mean, dtype=np.float32)).view(1, f).to(device),
            inv_std=torch.as_tensor(1.0 / np.asarray(std, dtype=np.float64)).to(torch.float32).view(1, f).to(device),
            kind="table",
        )
    channels = len(mean)
    m = torch.as_tensor(np.asarray(mean, dtype=np.float32)).view(1, channels, 1, 1).to(device)
    s = torch.as_tensor(1.0 / np.asarray(std, dtype=np.float32)).view(1, channels, 1, 1).to(device)
    return ClientData(
        cid=cid,
        train_x=t(arrays["train_x"], torch.uint8),
        train_y=t(arrays["train_y"], torch.int64),
        test_x=t(arrays["test_x"], torch.uint8),
        test_y=t(arrays["test_y"], torch.int64),
        mean=m,
        inv_std=s,
    )


class ResidentData(dict):
    """{client: :class:`ClientData`}: every client of a rank, resident for the whole run. :meth:`hold`
    and :meth:`release` (what the round asks of :class:`OnDemandData`) have nothing to do."""

    def hold(self, cids: Iterable[int]) -> None:
        """The clients ``cids`` are about to be used (all of them are here already)."""

    def release(self) -> None:
        """The clients held are no longer needed."""

    def close(self) -> None:
        """End of the run."""


class OnDemandData:
    """A rank's clients' data read from the shard as the rounds need them (``client_data:
    on_demand``): :meth:`hold` reads the clients a round trains (or a block of those it evaluates)
    in one read of the open shard (:class:`~fedcp_dist.data.shards.ShardReader`), :meth:`release`
    drops them. A client asked for without being held is read alone. What a rank keeps resident is
    then the cohort's data, not its share of the population's: the same bits as :class:`ResidentData`
    holds (the same rows, converted alike), read again each time.

    ``clients``: the shard's id of every client of the run (client k of the run is shard client
    ``clients[k]``); ``mean``, ``std``: the shard's, as :func:`to_device` takes them."""

    def __init__(self, reader, clients, mean, std, device):
        self.reader, self.clients, self.mean, self.std, self.device = reader, clients, mean, std, device
        self._held: Dict[int, ClientData] = {}
        #: clients read from the shard so far, and the reads it took
        self.reads = self.clients_read = 0

    def hold(self, cids: Iterable[int]) -> None:
        missing = sorted({int(c) for c in cids} - set(self._held))
        if not missing:
            return
        arrays = self.reader.read([int(self.clients[c]) for c in missing])
        for c in missing:
            self._held[c] = to_device(c, arrays.pop(int(self.clients[c])), self.mean, self.std, self.device)
        self.reads += 1
        self.clients_read += len(missing)

    def release(self) -> None:
        self._held.clear()

    def __getitem__(self, cid: int) -> ClientData:
        if cid not in self._held:
            self.hold([cid])
        return self._held[cid]

    def __contains__(self, cid) -> bool:
        return cid in self._held

    def __len__(self) -> int:
        """Clients held now."""
        return len(self._held)

    def close(self) -> None:
        self._held.clear()
        self.reader.close()
