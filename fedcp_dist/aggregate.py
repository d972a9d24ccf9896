"""Sample-weighted aggregation in one flat buffer and one all-reduce per round.

Layout of the buffer: ``[Σ n_i·θ_i (every upload tensor, flattened) | Σ n_i | metric sums]``.
The metric sums of the round ride in the same all-reduce as the parameters. The buffer is
float64 by default: the sums are then exact enough that the order in which ranks add them (which
changes with the world size) does not show in the float32 result.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch


class FlatAggregator:
    def __init__(self, spec: Mapping[str, torch.Size], num_metrics: int, device: torch.device, dtype=torch.float64):
        self.names = list(spec)
        self.shapes = {k: torch.Size(spec[k]) for k in self.names}
        self.offsets = {}
        off = 0
        for k in self.names:
            self.offsets[k] = off
            off += self.shapes[k].numel()
        self.num_params = off
        self.num_metrics = num_metrics
        self.buffer = torch.zeros(off + 1 + num_metrics, device=device, dtype=dtype)
        self.last_seconds = 0.0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def zero(self) -> None:
        self.buffer.zero_()

    def add(self, upload: Mapping[str, torch.Tensor], weight: float) -> None:
        """Accumulate ``weight · upload`` and ``weight`` itself."""
        assert set(upload) == set(self.names), "upload keys differ from the aggregation spec"
        for k in self.names:
            off = self.offsets[k]
            n = self.shapes[k].numel()
            self.buffer[off : off + n].add_(upload[k].detach().reshape(-1), alpha=float(weight))
        self.buffer[self.num_params] += float(weight)

    def add_metrics(self, values: Sequence[float]) -> None:
        assert len(values) == self.num_metrics
        self.buffer[self.num_params + 1 :] += torch.as_tensor(values, dtype=self.buffer.dtype, device=self.buffer.device)

    def reduce(self, runtime) -> tuple[dict, float, list]:
        """All-reduce (SUM) once; return (weighted mean of every tensor, Σ weights, metric sums)."""
        t0 = time.perf_counter()
        runtime.all_reduce_sum_(self.buffer)
        tail = self.buffer[self.num_params :].tolist()  # also synchronises the device
        self.last_seconds = time.perf_counter() - t0
        total, metrics = tail[0], tail[1:]
        mean = {}
        if total > 0:
            flat = self.buffer[: self.num_params] / total
            for k in self.names:
                off = self.offsets[k]
                mean[k] = flat[off : off + self.shapes[k].numel()].view(self.shapes[k]).to(torch.float32)
        return mean, total, metrics
