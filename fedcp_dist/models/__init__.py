"""Models, each split into ``features`` (f, to ``feature_dim`` = K) and ``head`` (g)."""
from __future__ import annotations

from torch import nn

from fedcp_dist.models.cnn import CNN

MODELS = ("cnn",)


def build_model(name: str, input_shape, num_classes: int) -> nn.Module:
    """Build a model with ``.features``, ``.head`` and ``.feature_dim``.

    Parameters are drawn from torch's global RNG: seed it first for identical models on every rank.
    """
    if name == "cnn":
        return CNN(tuple(int(s) for s in input_shape), int(num_classes))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
