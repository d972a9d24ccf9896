"""The fused step's leaner pieces give exactly what the per-client operations they replace give.

A fused step stacks the active clients' batches, draws their Gumbel noise and pools the frozen
extractor's activations; each of these now runs as fewer, larger operations. The default path's
bit-identity (golden digests, world sizes) rests on each being the same values in the same layout.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.algorithms.fedcp.cpn import policy
from fedcp_dist.data.resident import stacked_train_batches, to_device
from fedcp_dist.fused.forward import halving_max_pool, max_pool_2x2
from helpers import CPU, Data64


def _image_clients(shape, mean, std, n=7, k=3):
    out = []
    for c in range(k):
        g = np.random.default_rng(c)
        arrays = {"train_x": g.integers(0, 256, (n, *shape), dtype=np.uint8), "train_y": g.integers(0, 10, n),
                  "test_x": np.zeros((0, *shape), np.uint8), "test_y": np.zeros(0, np.int64)}
        out.append(to_device(c, arrays, mean, std, CPU))
    return out


def _idxs(k, n=7, b=4):
    g = torch.Generator().manual_seed(5)
    return [torch.randperm(n, generator=g)[:b] for _ in range(k)]


def _assert_same_batches(datas, idxs):
    assert all(datas[0].prepared_alike(d) for d in datas[1:])
    x1, y1 = stacked_train_batches(datas, idxs, alike=False)
    x2, y2 = stacked_train_batches(datas, idxs, alike=True)
    assert x1.dtype == x2.dtype and x1.shape == x2.shape and x1.stride() == x2.stride()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # and the per-client path is each client's own train_batch, stacked
    assert torch.equal(x1[1], datas[1].train_batch(idxs[1])[0])
    return x2


def test_stacked_batches_prepared_at_once_equal_per_client_ones_bit_for_bit():
    # one channel (MNIST), three channels (CIFAR: channels-last strides), text ids, table rows
    one = _assert_same_batches(_image_clients((1, 6, 6), (0.1307,), (0.3081,)), _idxs(3))
    assert one.shape == (3, 4, 1, 6, 6)
    three = _assert_same_batches(_image_clients((3, 5, 5), (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)), _idxs(3))
    assert three.stride()[2] == 1  # channels innermost
    # a hand-computed pixel: (v / 255 − mean) / std
    d = _image_clients((1, 6, 6), (0.5,), (0.25,))
    x = _assert_same_batches(d, _idxs(3))
    v = float(d[2].train_x[_idxs(3)[2][1], 0, 3, 4])
    assert abs(float(x[2, 1, 0, 3, 4]) - (v / 255 - 0.5) * 4) < 1e-6
    texts = []
    for c in range(2):
        g = np.random.default_rng(c)
        texts.append(to_device(c, {"train_x": g.integers(0, 50, (7, 9), dtype=np.int32), "train_y": g.integers(0, 4, 7),
                                   "test_x": np.zeros((0, 9), np.int32), "test_y": np.zeros(0, np.int64),
                                   "train_len": np.full(7, 9, np.int32), "test_len": np.zeros(0, np.int32)},
                               (), (), CPU))
    assert _assert_same_batches(texts, _idxs(2)).dtype == torch.int64
    tables = []
    for c in range(2):
        g = np.random.default_rng(c)
        tables.append(to_device(c, {"train_x": g.normal(size=(7, 5)).astype(np.float32), "train_y": g.integers(0, 2, 7),
                                    "test_x": np.zeros((0, 5), np.float32), "test_y": np.zeros(0, np.int64)},
                                [0.5] * 5, [2.0] * 5, CPU))
    _assert_same_batches(tables, _idxs(2))


def test_clients_prepared_otherwise_are_not_alike():
    a, b = _image_clients((1, 4, 4), (0.5,), (0.25,), k=2)
    c = _image_clients((1, 4, 4), (0.4,), (0.25,), k=1)[0]
    assert a.prepared_alike(b) and not a.prepared_alike(c)
    # a subclass with its own train_batch (float64 batches) keeps the per-client path
    d64 = Data64(**{f: getattr(b, f) for f in b.__dataclass_fields__})
    assert not a.prepared_alike(d64) and not d64.prepared_alike(a)


def test_max_pool_2x2_is_max_pool2d_without_indices():
    x = torch.randn(2, 3, 4, 7, 9)
    x[0, 1, 2, 2, 3] = float("nan")
    y = max_pool_2x2(x)
    ref = F.max_pool2d(x.reshape(6, 4, 7, 9), 2).reshape(2, 3, 4, 3, 4)
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(ref, nan=7.0))
    assert torch.isnan(y[0, 1, 2, 1, 1])
    small = torch.tensor([[[[1.0, 5.0, 2.0], [3.0, 4.0, 9.0], [8.0, 0.0, 6.0]]]])
    assert max_pool_2x2(small).flatten().tolist() == [5.0]  # the last odd row and column dropped
    assert halving_max_pool(nn.MaxPool2d(2)) and halving_max_pool(nn.MaxPool2d((2, 2), stride=2))
    assert not halving_max_pool(nn.MaxPool2d(2, ceil_mode=True)) and not halving_max_pool(nn.MaxPool2d(3, 2))
    assert not halving_max_pool(nn.MaxPool2d(2, stride=1)) and not halving_max_pool(nn.AvgPool2d(2))


def test_policy_gradient_through_both_halves_is_unchanged_by_unbind():
    torch.manual_seed(0)
    logits = torch.randn(3, 2 * 4, dtype=torch.float64, requires_grad=True)
    noise = torch.rand(3, 2, 4, dtype=torch.float64)
    s, r, _ = policy(logits, 4, tau=0.5, noise=lambda z: noise)
    (s * torch.arange(4.0) + 3 * r).sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    # the same graph with the two halves selected separately
    z = (logits.view(3, 2, 4) + noise) / 0.5
    p = torch.softmax(z, dim=-2)
    (p[:, 0, :] * torch.arange(4.0) + 3 * p[:, 1, :]).sum().backward()
    assert torch.equal(g, logits.grad)
