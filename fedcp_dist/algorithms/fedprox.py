"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term.

Each participant minimises h(w; w^t) = F(w) + (μ/2)·‖w − w^t‖² from w = w^t, with w^t the received
global model; the gradient of the added term is exactly μ·(w − w^t). With μ = 0 the method is
FedAvg, bit for bit (the term is then not built at all).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, copy_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import batch_indices, sgd


def proximal_term(params, anchors) -> torch.Tensor:
    """‖w − w^t‖² summed over every parameter tensor."""
    return sum(((p - a) ** 2).sum() for p, a in zip(params, anchors))


class FedProx(FedAvg):
    name = "fedprox"

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        mu = float(cfg.prox_mu)
        if mu == 0.0:
            return super().local_train(client_state, data, ctx)
        model = self.model
        copy_module(model, self.global_model)
        model.train()
        params = list(model.parameters())
        anchors = list(self.global_model.parameters())

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            return F.cross_entropy(model(x), y) + (0.5 * mu) * proximal_term(params, anchors)

        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        loss_sum, seen = sgd(params, batches, loss_fn, cfg.lr)
        return LocalResult(upload=module_state("", model), client_state=None, loss_sum=loss_sum, samples=seen)
