"""The paper's 4-layer CNN, split into a feature extractor f (to K = 512) and a head g."""
from __future__ import annotations

from torch import nn


def _conv_out(size: int, kernel: int = 5) -> int:
    """Spatial size after a valid 5x5 convolution followed by a 2x2 max-pool."""
    return (size - kernel + 1) // 2


class CNN(nn.Module):
    """Conv(5x5,32)-ReLU-Pool-Conv(5x5,64)-ReLU-Pool-FC(512)-ReLU | FC(C).

    The flatten size follows from the input shape: 1024 for 1x28x28, 1600 for 3x32x32,
    10816 for 3x64x64.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, feature_dim: int = 512):
        super().__init__()
        channels, height, width = input_shape
        h, w = _conv_out(_conv_out(height)), _conv_out(_conv_out(width))
        if h < 1 or w < 1:
            raise ValueError(f"input shape {tuple(input_shape)} is too small for the 4-layer CNN")
        self.flat_dim = 64 * h * w
        self.feature_dim = feature_dim
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(self.flat_dim, feature_dim),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(feature_dim, num_classes)

    def forward(self, x):
        return self.head(self.features(x))
