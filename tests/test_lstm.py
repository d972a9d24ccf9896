"""The character LSTM (model: lstm): its size, its recurrence against a hand-written one, its fused
form against the sequential one, and what fused training plans for its memory."""
import math

import numpy as np
import pytest
import torch

from fedcp_dist.fused import slots as fused
from fedcp_dist.fused import memory as fused_memory
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.ditto import Ditto
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.algorithms.fedcp import FedCP
from fedcp_dist.algorithms.fedper import FedPer
from fedcp_dist.algorithms.fedrod import FedRoD
from fedcp_dist.data.resident import to_device
from fedcp_dist.fused.forward import grouped_forward, sub_params
from fedcp_dist.fused.groups import train_group
from fedcp_dist.models import build_model
from fedcp_dist.models.lstm import CharLSTM, LSTMFeatures
from helpers import algo_with_moved_global

CPU = torch.device("cpu")


def test_default_size_is_leafs_shakespeare_model():
    """Embedding(80, 8), LSTM 8→256→256, Linear(256, 80): the parameter counts by hand."""
    m = build_model("lstm", [80], 80, vocab_size=80)
    assert isinstance(m, CharLSTM) and m.feature_dim == 256 and m.input_kind == "text"
    embedding = 80 * 8
    layer0 = 4 * 256 * (8 + 256) + 2 * 4 * 256  # W_ih, W_hh and the two biases
    layer1 = 4 * 256 * (256 + 256) + 2 * 4 * 256
    assert (embedding, layer0, layer1) == (640, 272_384, 526_336)
    assert sum(p.numel() for p in m.features.parameters()) == embedding + layer0 + layer1
    assert sum(p.numel() for p in m.head.parameters()) == 256 * 80 + 80
    out = m(torch.randint(0, 80, (3, 80)))
    assert out.shape == (3, 80)


def _recurrence(emb, layers, ids):
    """The LSTM written out in float64 from PyTorch's documented equations (gates i, f, g, o)."""
    x = emb[ids]  # (B, L, E)
    for w_ih, w_hh, b_ih, b_hh in layers:
        h = torch.zeros(x.shape[0], w_hh.shape[1], dtype=torch.float64)
        c = torch.zeros_like(h)
        outs = []
        for t in range(x.shape[1]):
            z = x[:, t] @ w_ih.T + b_ih + h @ w_hh.T + b_hh
            i, f, g, o = z.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        x = torch.stack(outs, 1)
    return h


def test_both_forms_compute_the_lstm_equations():
    torch.manual_seed(3)
    f = LSTMFeatures(vocab_size=6, seq_len=5, embed_dim=3, hidden=4, layers=2).double()
    ids = torch.randint(0, 6, (2, 5))
    p = dict(f.named_parameters())
    layers = [tuple(p[f"lstm.{n}_l{j}"] for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")) for j in range(2)]
    want = _recurrence(p["embedding.weight"], layers, ids)
    assert torch.allclose(f(ids), want, atol=1e-12, rtol=0)
    stacked = {n: t.detach().unsqueeze(0) for n, t in p.items()}
    assert torch.allclose(f.forward_stacked(stacked, ids.unsqueeze(0))[0], want, atol=1e-12, rtol=0)


def test_stacked_form_equals_each_clients_own_forward_and_gradients():
    """k = 3 clients, each its own parameters: the grouped forward (fused_forward) gives each the
    output and parameter gradients of its own nn.LSTM."""
    torch.manual_seed(0)
    models = [build_model("lstm", [12], 5, vocab_size=7, lstm_hidden=16, lstm_embed=4) for _ in range(3)]
    ids = torch.randint(0, 7, (3, 4, 12))
    names = [n for n, _ in models[0].named_parameters()]
    params = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]).requires_grad_() for n in names}
    h = grouped_forward(models[0].features, sub_params(params, "features."), ids, 3)
    y = grouped_forward(models[0].head, sub_params(params, "head."), h, 3)
    y.square().sum().backward()
    for i, m in enumerate(models):
        out = m(ids[i])
        assert torch.allclose(y[i], out, atol=1e-6, rtol=0)
        out.square().sum().backward()
        for n, t in m.named_parameters():
            assert torch.allclose(params[n].grad[i], t.grad, atol=1e-5, rtol=1e-4), n


def test_memory_plan_counts_every_step_the_fused_form_keeps():
    """Per sample: L·(E + layers·11·H) kept by the recurrence, plus the head's C outputs."""
    m = build_model("lstm", [80], 80, vocab_size=80, lstm_hidden=16, lstm_embed=8, lstm_layers=2)
    x = torch.randint(0, 80, (3, 80))
    per_sample = 80 * (8 + 2 * 11 * 16) + 80
    assert per_sample == 28_880
    assert fused_memory.activation_elements(lambda: m(x), [m]) == 3 * per_sample


def text_client(cid, n, length=12, vocab=7, classes=5, test=3):
    g = torch.Generator().manual_seed(100 + cid)
    arrays = {"train_x": torch.randint(0, vocab, (n, length), generator=g, dtype=torch.int32).numpy(),
              "train_y": torch.randint(0, classes, (n,), generator=g).numpy(),
              "test_x": torch.randint(0, vocab, (test, length), generator=g, dtype=torch.int32).numpy(),
              "test_y": torch.randint(0, classes, (test,), generator=g).numpy(),
              "train_len": np.full(n, length, np.int32), "test_len": np.full(test, length, np.int32)}
    return to_device(cid, arrays, (), (), CPU)


@pytest.mark.parametrize("cls, kw", [(FedAvg, {}), (FedCP, {"lam": 0.5}), (FedPer, {}), (Ditto, {}), (FedRoD, {})])
def test_head_splitting_methods_train_the_lstm_fused_as_sequentially(monkeypatch, cls, kw):
    """Clients of 23, 7 and 16 samples (ragged batches, one shorter than a batch), two epochs."""
    calls = []
    real = fused.train_fused
    monkeypatch.setattr(fused, "train_fused", lambda clients, phase, **k: calls.append(len(clients)) or real(clients, phase, **k))
    net = build_model("lstm", [12], 5, vocab_size=7, lstm_hidden=8, lstm_embed=4)
    algo, gs = algo_with_moved_global(cls, net=net, local_epochs=2, lr=0.3, **kw)
    assert algo.fused_reason() is None
    datas = [text_client(i, n) for i, n in enumerate((23, 7, 16))]

    def items():
        return [(algo.init_client_state(d.cid), d, Context(3, d.cid, torch.Generator().manual_seed(11 + d.cid)))
                for d in datas]

    fus = train_group(algo, items())
    assert sum(calls) >= len(datas)
    seq = [algo.local_train(s, d, c) for s, d, c in items()]
    for s, f in zip(seq, fus):
        assert f.samples == s.samples and f.loss_sum == pytest.approx(s.loss_sum, rel=1e-4)
        for k in s.upload:
            assert torch.allclose(s.upload[k], f.upload[k], atol=2e-5, rtol=0), k
        moved = max((s.upload[k] - gs[k]).abs().max().item() for k in s.upload)
        assert moved > 1e-3 and math.isfinite(moved)  # training moved the model
