"""A character LSTM for next-character prediction (LEAF's Shakespeare), split into a feature
extractor f (to K = ``hidden``) and a head g.

    features: Embedding(V, E) → LSTM(E → H) × layers → the last position's hidden state (B, H)
    head:     Linear(H, C)

The defaults are the model of LEAF's Shakespeare baseline and of the FedAvg paper (McMahan et
al., 2017): an 8-dimensional embedding of the 80 characters, two LSTM layers of 256 units, a dense
layer from the last hidden state to the 80 characters. Input: int64 ids (B, L), every position a
real character (no padding: the last position is the one read).

Two forms of one computation:

* :meth:`LSTMFeatures.forward` (one client, the sequential path): ``nn.LSTM``, i.e. cuDNN on a GPU;
* :meth:`LSTMFeatures.forward_stacked` (``k`` clients at once, each with its own parameters, the
  fused path of :mod:`fedcp_dist.fused.forward`): the same recurrence written out step by step with
  batched matrix products over the stacked parameters. ``torch.vmap`` cannot run ``nn.LSTM`` (its
  ``aten::lstm`` has no batching rule), so the module carries its grouped form itself.

Both follow PyTorch's LSTM: gates (i, f, g, o) = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh,
c_t = σ(f) c_{t-1} + σ(i) tanh(g), h_t = σ(o) tanh(c_t), zero initial states.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

EMBED_DIM = 8
HIDDEN = 256
LAYERS = 2
#: activation elements the stepped recurrence keeps per position, layer and hidden unit for the
#: backward pass: the four gate pre-activations and their four activations, c, tanh(c) and h
KEPT_PER_UNIT = 11


class LSTMFeatures(nn.Module):
    """Embedding → stacked LSTM → the hidden state at the last position: (B, L) int64 → (B, H)."""

    def __init__(self, vocab_size: int, seq_len: int, embed_dim: int = EMBED_DIM, hidden: int = HIDDEN,
                 layers: int = LAYERS):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.hidden, self.layers = hidden, layers
        #: per sample, what the fused form keeps for its backward pass (see fused_memory)
        self.kept_activations = seq_len * (embed_dim + layers * KEPT_PER_UNIT * hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(ids))
        return out[:, -1]

    def forward_stacked(self, params: Dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """``k`` clients at once: ``params`` {name: (k, *shape)} (names as ``named_parameters``),
        ``ids`` (k, B, L) → (k, B, H)."""
        k, b, length = ids.shape
        emb = params["embedding.weight"]  # (k, V, E)
        slot = torch.arange(k, device=ids.device).view(k, 1, 1)
        x = emb[slot, ids]  # (k, B, L, E)
        for layer in range(self.layers):
            w_ih = params[f"lstm.weight_ih_l{layer}"]  # (k, 4H, in)
            w_hh = params[f"lstm.weight_hh_l{layer}"]  # (k, 4H, H)
            bias = params[f"lstm.bias_ih_l{layer}"] + params[f"lstm.bias_hh_l{layer}"]  # (k, 4H)
            # every position's input projection in one product: (k, B·L, in) → (k, B, L, 4H)
            xi = torch.baddbmm(bias.unsqueeze(1), x.reshape(k, b * length, -1), w_ih.transpose(1, 2))
            xi = xi.view(k, b, length, -1)
            w_hh_t = w_hh.transpose(1, 2)
            h = x.new_zeros(k, b, self.hidden)
            c = x.new_zeros(k, b, self.hidden)
            outs = []
            for t in range(length):
                gates = xi[:, :, t] + torch.bmm(h, w_hh_t)
                i, f, g, o = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            if layer + 1 < self.layers:
                x = torch.stack(outs, dim=2)  # (k, B, L, H): the next layer's input
        return h


class CharLSTM(nn.Module):
    """``features``: :class:`LSTMFeatures` (K = ``hidden``); ``head``: Linear(K, C)."""

    def __init__(self, vocab_size: int, seq_len: int, num_classes: int, embed_dim: int = EMBED_DIM,
                 hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        self.feature_dim = hidden
        self.features = LSTMFeatures(vocab_size, seq_len, embed_dim, hidden, layers)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, ids):
        return self.head(self.features(ids))
