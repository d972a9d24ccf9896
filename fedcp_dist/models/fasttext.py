"""fastText for text classification, split into a feature extractor f (K = ``dim``) and a head g.

    Embedding(V, K, padding_idx=0) → mean over the positions → Linear(K, K) [→ log-softmax] → head Linear(K, C)

Three model keys choose the variant (:func:`fedcp_dist.models.build_model`):

* ``fasttext_mean``: ``padded`` (default) averages over all ``max_len`` positions, padding included;
  the padding row of the embedding is zero and gets no gradient, so the mean is the sum of the real
  tokens' embeddings divided by ``max_len``, as the FedCP authors' model computes it (its
  ``embedding(text).mean(1)``). ``tokens`` (this project's first variant) averages over the ids
  != 0 only; a row that is all padding then has a zero mean (its count is taken as max(count, 1)).
* ``fasttext_feature``: ``linear`` (default) takes the feature after ``Linear(K, K)``, the head
  starting on it: the model of the authors' FedCP repository (whose forward returns the head's
  output). ``log_softmax`` appends a log-softmax over the K features to f: PFLlib's fastText of
  2021-2024 ends in ``log_softmax`` and its head split replaces only the last Linear, so there the
  head reads log-softmax(Linear(mean)).
* ``fasttext_dim``: K = 32 (both the FedCP repository and PFLlib of 2023; PFLlib's current default
  ``feature_dim`` is 512).

There is no other nonlinearity: with ``linear``, f is affine in the mean embedding and f followed
by g is a linear classifier on it.

Input: int64 token ids (B, max_len), 0 the padding id.
"""
from __future__ import annotations

import torch
from torch import nn

EMBED_DIM = 32
PAD_ID = 0
#: ways to average the embeddings: over all positions (the reference) or over the real tokens
MEANS = ("padded", "tokens")
#: where the head starts: after Linear(K, K), or after a log-softmax on it
FEATURES = ("linear", "log_softmax")


class MeanEmbedding(nn.Module):
    """Embedding, then the mean over each row's positions: (B, L) int64 → (B, dim).

    ``mean="padded"``: over all L positions (the padding row is zero); ``"tokens"``: over the
    non-padding positions only."""

    def __init__(self, vocab_size: int, dim: int = EMBED_DIM, mean: str = "padded"):
        super().__init__()
        if mean not in MEANS:
            raise ValueError(f"fasttext_mean must be one of {', '.join(MEANS)}, got {mean!r}")
        self.mean = mean
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=PAD_ID)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(ids)  # (B, L, dim)
        keep = (ids != PAD_ID).unsqueeze(-1)  # (B, L, 1)
        if self.mean == "padded":
            # the padding positions pass no gradient, as padding_idx says; torch.vmap (fused training)
            # keeps padding_idx for the first client's table only and trained every other's padding
            # row. The same values forward, the same gradient for every other row, bit for bit.
            return torch.where(keep, emb, emb.detach()).mean(dim=1)
        total = (emb * keep.to(emb.dtype)).sum(dim=1)
        count = keep.sum(dim=1).clamp_min(1).to(emb.dtype)  # (B, 1)
        return total / count

    def extra_repr(self) -> str:
        return f"mean={self.mean}"


class FastText(nn.Module):
    """``features``: MeanEmbedding(V, K) → Linear(K, K) [→ LogSoftmax]; ``head``: Linear(K, C)."""

    def __init__(self, vocab_size: int, num_classes: int, dim: int = EMBED_DIM, mean: str = "padded",
                 feature: str = "linear"):
        super().__init__()
        if feature not in FEATURES:
            raise ValueError(f"fasttext_feature must be one of {', '.join(FEATURES)}, got {feature!r}")
        self.feature_dim = dim
        layers = [MeanEmbedding(vocab_size, dim, mean), nn.Linear(dim, dim)]
        if feature == "log_softmax":
            layers.append(nn.LogSoftmax(dim=1))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, ids):
        return self.head(self.features(ids))
