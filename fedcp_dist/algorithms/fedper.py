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

from fedcp_dist.algorithms.base import LocalResult, freeze, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import ClientPhase

SHARED = "features."
PERSONAL = "head."


class FedPer(FedAvg):
    name = "fedper"
    privacy_uploads = "the extractor (base layers)"
    privacy_keeps = "its head (the personalisation layer)"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self._init_head = module_state(PERSONAL, self.model.head)
        self.eval_head = freeze(copy.deepcopy(self.model.head)).eval()

    def upload_keys(self, global_state):
        return [k for k in global_state if k.startswith(SHARED)]

    def init_client_state(self, client):
        return {k: v.clone() for k, v in self._init_head.items()}

    def phases(self, client_state, data, ctx):
        """The working model = global extractor + the client's head."""
        return [(self.train_phase, ClientPhase({**self.gs, **client_state}))]

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        return LocalResult(
            upload={k: v for k, v in o.values.items() if k.startswith(SHARED)},
            client_state={k: o.values[k] for k in client_state},
            loss_sum=o.loss_sum,
            samples=o.samples,
        )

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.eval_head, client_state, PERSONAL)
        return self.eval_head(self.global_model.features(x))
