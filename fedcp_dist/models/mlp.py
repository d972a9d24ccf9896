"""A multi-layer perceptron for tables of standardised numeric features.

``features``: Linear(F, H) → ReLU → Linear(H, H) → ReLU, so K = H (``mlp_hidden``);
``head``: Linear(H, C).  Input: float32 (B, F), standardised by the engine with the shard's
training-row mean and standard deviation.
"""
from __future__ import annotations

from torch import nn

DEFAULT_HIDDEN = 64


class MLP(nn.Module):
    def __init__(self, num_features: int, num_classes: int, hidden: int = DEFAULT_HIDDEN):
        super().__init__()
        self.feature_dim = hidden
        self.features = nn.Sequential(nn.Linear(num_features, hidden), nn.ReLU(),
                                      nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.features(x))
