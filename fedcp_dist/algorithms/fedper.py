"""FedPer (Arivazhagan et al., 2019): shared base layers, personal head.

The feature extractor is federated; the head (the personalisation layer) stays on the client. A
participant loads the global extractor and its own head, trains both with SGD, uploads only the
extractor (``upload_keys``) and keeps the head. A client's head starts as the initial global head.
Evaluation: the current global extractor with the client's own head. The global state keeps the
initial head under ``head.`` (never updated, never uploaded).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, copy_module, freeze, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import batch_indices, sgd

SHARED = "features."
PERSONAL = "head."


class FedPer(FedAvg):
    name = "fedper"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self._init_head = module_state(PERSONAL, self.model.head)
        self.eval_head = freeze(copy.deepcopy(self.model.head)).eval()

    def upload_keys(self, global_state):
        return [k for k in global_state if k.startswith(SHARED)]

    def init_client_state(self, client):
        return {k: v.clone() for k, v in self._init_head.items()}

    def _receive(self, client_state):
        """The working model = global extractor + the client's head, in training mode."""
        copy_module(self.model, self.global_model)
        load_module(self.model.head, client_state, PERSONAL)
        self.model.train()

    def _result(self, loss_sum, seen):
        return LocalResult(
            upload=module_state(SHARED, self.model.features),
            client_state=module_state(PERSONAL, self.model.head),
            loss_sum=loss_sum,
            samples=seen,
        )

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        self._receive(client_state)
        model = self.model

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            return F.cross_entropy(model(x), y)

        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        return self._result(*sgd(model.parameters(), batches, loss_fn, cfg.lr))

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.eval_head, client_state, PERSONAL)
        return self.eval_head(self.global_model.features(x))
