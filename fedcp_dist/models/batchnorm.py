"""BatchNorm that trains on a batch holding one value per channel.

In training mode torch's BatchNorm normalises by the batch's own mean and variance and refuses
a batch with a single value per channel ("Expected more than 1 value per channel"): a client
holding one training sample, or a last batch of one with ``drop_last=false``, meets that in any
BatchNorm1d on (B, C) features (FedCP's CPN with ``cpn_norm=batchnorm``) and in a BatchNorm2d on
1x1 feature maps (ResNet-18's last block on 28x28 or 32x32 images).

Such a batch has no variance to normalise by. The BatchNorms here normalise it by their running
statistics instead, as in evaluation mode: the gradient still reaches the sample's input and the
layer's weight and bias, and the running statistics (and ``num_batches_tracked``) are left as
they were, so the one sample does not pull them towards itself with a zero variance. Every other
batch is torch's own computation, bit for bit. State dicts, parameters and buffers are torch's;
the classes keep torch's names.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class _OneValueBatches:
    """Mixed in before a torch BatchNorm class: batches of one value per channel in training mode
    are normalised with the running statistics (see the module's docstring)."""

    def forward(self, input):
        if self.training and self.running_mean is not None and input.numel() == input.shape[1] > 0:
            self._check_input_dim(input)
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        return super().forward(input)


class BatchNorm1d(_OneValueBatches, nn.BatchNorm1d):
    pass


class BatchNorm2d(_OneValueBatches, nn.BatchNorm2d):
    pass


class BatchNorm3d(_OneValueBatches, nn.BatchNorm3d):
    pass


_SAFE = {nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d, nn.BatchNorm3d: BatchNorm3d}


def one_value_batches(module: nn.Module) -> nn.Module:
    """``module`` with every torch BatchNorm1d/2d/3d in it that keeps running statistics turned
    into this module's class of the same name, in place (same object, same parameters and
    buffers); returns ``module``. Idempotent and cheap: a walk over the submodules."""
    for m in module.modules():
        safe = _SAFE.get(type(m))
        if safe is not None and m.track_running_stats:
            m.__class__ = safe
    return module
