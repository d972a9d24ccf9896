"""ResNet-18 (torchvision's, trained from scratch), split into a feature extractor f (K = 512) and a head g.

The network is ``torchvision.models.resnet18(weights=None, num_classes=C)`` with its stem unchanged
(7x7 stride-2 convolution, BatchNorm, ReLU, 3x3 stride-2 max-pool), as the reference uses it.
``features`` holds torchvision's own module objects in their forward order, up to and including the
global average pool and a flatten, so ``features(x)`` is (B, 512); ``head`` is torchvision's ``fc``.
No parameter is copied: the split shares the modules.

State: BatchNorm ``running_mean`` / ``running_var`` are floating buffers and travel with the
parameters in ``module_state`` / ``load_module`` / ``copy_module``; ``num_batches_tracked``
(int64) does not. That counter is only read when a BatchNorm's ``momentum`` is None (cumulative
averaging); every BatchNorm here keeps torchvision's momentum 0.1, so it is never used.
"""
from __future__ import annotations

from torch import nn

FEATURE_DIM = 512


class ResNet18(nn.Module):
    """torchvision ResNet-18: ``features`` (stem, layer1-4, avgpool, flatten) | ``head`` (fc)."""

    def __init__(self, num_classes: int):
        super().__init__()
        import torchvision  # here, not at module level: importing it takes seconds and only this model needs it

        net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
        self.feature_dim = FEATURE_DIM
        self.features = nn.Sequential(
            net.conv1, net.bn1, net.relu, net.maxpool,
            net.layer1, net.layer2, net.layer3, net.layer4,
            net.avgpool, nn.Flatten(1),
        )
        self.head = net.fc

    def forward(self, x):
        return self.head(self.features(x))
