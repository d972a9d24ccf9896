"""A rank's clients, resident on its device for the whole run (read once from the shard).

Images stay uint8 on the device (4x less memory than float32) and are normalised per batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch


@dataclass
class ClientData:
    cid: int
    train_x: torch.Tensor  # uint8 (n, C, H, W)
    train_y: torch.Tensor  # int64 (n,)
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: torch.Tensor  # (1, C, 1, 1)
    inv_std: torch.Tensor  # (1, C, 1, 1)

    @property
    def n_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.test_y.shape[0])

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) * (1.0 / 255.0) - self.mean) * self.inv_std

    def train_batch(self, idx: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if idx is None:
            return self._norm(self.train_x), self.train_y
        return self._norm(self.train_x[idx]), self.train_y[idx]

    def test_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm(self.test_x[start:stop]), self.test_y[start:stop]


def to_device(cid: int, arrays: Mapping[str, np.ndarray], mean, std, device: torch.device) -> ClientData:
    channels = len(mean)
    m = torch.as_tensor(np.asarray(mean, dtype=np.float32)).view(1, channels, 1, 1).to(device)
    s = torch.as_tensor(1.0 / np.asarray(std, dtype=np.float32)).view(1, channels, 1, 1).to(device)

    def t(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    return ClientData(
        cid=cid,
        train_x=t(arrays["train_x"], torch.uint8),
        train_y=t(arrays["train_y"], torch.int64),
        test_x=t(arrays["test_x"], torch.uint8),
        test_y=t(arrays["test_y"], torch.int64),
        mean=m,
        inv_std=s,
    )
