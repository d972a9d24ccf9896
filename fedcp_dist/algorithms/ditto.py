"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a global model as FedAvg plus a personal model.

Each participant (1) trains the received global model w^t for ``local_epochs`` exactly as FedAvg
and uploads it, and (2) trains its persistent personal model v for ``ditto_epochs`` on
f(v) + (λ/2)·‖v − w^t‖² (gradient ∇f(v) + λ·(v − w^t), the same lr), anchored to the *received*
global model. v never leaves the client; it starts as the initial global model and is what is
evaluated. The reported training loss covers the batches of both models.
"""
from __future__ import annotations

import copy

import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvgWithPersonalModel
from fedcp_dist.algorithms.fedprox import proximal_term
from fedcp_dist.local_train import batch_indices, sgd


class Ditto(FedAvgWithPersonalModel):
    name = "ditto"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.personal = copy.deepcopy(self.model)  # v, trained

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        res = super().local_train(None, data, ctx)  # the global model's update, as FedAvg
        v = self.personal
        load_module(v, client_state, "")
        v.train()
        params = list(v.parameters())
        anchors = list(self.global_model.parameters())  # w^t as received
        lam = float(cfg.ditto_lam)

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            loss = F.cross_entropy(v(x), y)
            if lam > 0:
                loss = loss + (0.5 * lam) * proximal_term(params, anchors)
            return loss

        batches = batch_indices(data.n_train, cfg.batch_size, cfg.ditto_epochs, cfg.drop_last, ctx.generator)
        p_loss, p_seen = sgd(params, batches, loss_fn, cfg.lr)
        return LocalResult(
            upload=res.upload,
            client_state=module_state("", v),
            loss_sum=res.loss_sum + p_loss,
            samples=res.samples + p_seen,
        )
