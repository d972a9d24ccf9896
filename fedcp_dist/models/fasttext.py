"""fastText for text classification, split into a feature extractor f (K = 32) and a head g.

As the issue specifies it, literally:

    Embedding(V, 32, padding_idx=0) → mean over the non-padding tokens → Linear(32, 32) → head Linear(32, C)

There is no nonlinearity between ``Linear(32, 32)`` and the head: the specification names none, so
f is affine in the mean embedding and f followed by g is a linear classifier on it.

Input: int64 token ids (B, max_len), 0 the padding id. The mean runs over the ids != 0 only; a row
that is all padding has a zero mean embedding (its count is taken as max(count, 1)).
"""
from __future__ import annotations

import torch
from torch import nn

EMBED_DIM = 32
PAD_ID = 0


class MeanEmbedding(nn.Module):
    """Embedding, then the mean over each row's non-padding tokens: (B, L) int64 → (B, dim)."""

    def __init__(self, vocab_size: int, dim: int = EMBED_DIM):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=PAD_ID)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids != PAD_ID).unsqueeze(-1)  # (B, L, 1)
        emb = self.embedding(ids)  # (B, L, dim)
        total = (emb * keep.to(emb.dtype)).sum(dim=1)
        count = keep.sum(dim=1).clamp_min(1).to(emb.dtype)  # (B, 1)
        return total / count


class FastText(nn.Module):
    """``features``: MeanEmbedding(V, 32) → Linear(32, 32); ``head``: Linear(32, C)."""

    def __init__(self, vocab_size: int, num_classes: int, dim: int = EMBED_DIM):
        super().__init__()
        self.feature_dim = dim
        self.features = nn.Sequential(MeanEmbedding(vocab_size, dim), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, ids):
        return self.head(self.features(ids))
