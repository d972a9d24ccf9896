"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a global model as FedAvg plus a personal model.

Each participant (1) trains the received global model w^t for ``local_epochs`` exactly as FedAvg
and uploads it, and (2) trains its persistent personal model v for ``ditto_epochs`` on
f(v) + (λ/2)·‖v − w^t‖² (gradient ∇f(v) + λ·(v − w^t), the same lr), anchored to the *received*
global model. v never leaves the client; it starts as the initial global model and is what is
evaluated. The reported training loss covers the batches of both models.
"""
from __future__ import annotations

import copy

from fedcp_dist.algorithms.base import LocalResult
from fedcp_dist.algorithms.fedavg import FedAvgWithPersonalModel
from fedcp_dist.algorithms.fedprox import ANCHOR, with_anchors
from fedcp_dist.local_train import ClientPhase, Phase
from fedcp_dist.options import Option, at_least, within


class Ditto(FedAvgWithPersonalModel):
    name = "ditto"
    privacy_uploads = "the global model it trained"
    privacy_keeps = "its personal model v"
    options = (
        Option("ditto_lam", 0.1, "Ditto: weight λ of (λ/2)·‖v − w_global‖² on the personal model v", at_least(0)),
        Option("ditto_epochs", 1, "Ditto: local epochs of the personal model v each round (the global model trains "
               "`local_epochs`)", within(1, 10_000)),
    )

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.personal = copy.deepcopy(self.model)  # v, trained
        self.lam = float(cfg.ditto_lam)
        self.personal_phase = Phase("personal", self.personal_loss, {"": self.personal},
                                    trainable=self.train_phase.trainable, epochs=cfg.ditto_epochs,
                                    penalised=self.lam > 0)
        self.training_phases = [self.train_phase, self.personal_phase]

    def personal_loss(self, step):
        """Cross-entropy of v plus (λ/2)·‖v − w^t‖²."""
        loss = step.cross_entropy(step.run("", step.x))
        if self.lam > 0:
            loss = loss + (0.5 * self.lam) * step.proximal(ANCHOR)
        return loss

    def phases(self, client_state, data, ctx):
        personal = with_anchors(client_state, self.gs, self.param_names) if self.lam > 0 else client_state
        return [*super().phases(client_state, data, ctx), (self.personal_phase, ClientPhase(personal))]

    def finish(self, client_state, outcomes, ctx):
        res = super().finish(client_state, outcomes[:1], ctx)  # the global model's update, as FedAvg
        p = outcomes[1]
        return LocalResult(
            upload=res.upload,
            client_state={k: p.values[k] for k in client_state},
            loss_sum=res.loss_sum + p.loss_sum,
            samples=res.samples + p.samples,
        )
