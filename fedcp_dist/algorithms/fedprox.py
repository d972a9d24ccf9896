"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term.

Each participant minimises h(w; w^t) = F(w) + (μ/2)·‖w − w^t‖² from w = w^t, with w^t the received
global model; the gradient of the added term is exactly μ·(w − w^t). With μ = 0 the method is
FedAvg, bit for bit (the term is then not built at all).
"""
from __future__ import annotations

import dataclasses

from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import ClientPhase
from fedcp_dist.options import Option, at_least

ANCHOR = "anchor."


def with_anchors(start: dict, anchors: dict, names) -> dict:
    """``start`` plus the constants ``anchor.<name>`` = ``anchors[name]`` a proximal term reads."""
    return {**start, **{ANCHOR + n: anchors[n] for n in names}}


class FedProx(FedAvg):
    name = "fedprox"
    options = (
        Option("prox_mu", 1.0, "FedProx: weight μ of the proximal term (μ/2)·‖w − w_global‖² (0 reproduces FedAvg exactly)",
               at_least(0)),
    )

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.mu = float(cfg.prox_mu)
        if self.mu != 0.0:
            self.train_phase = dataclasses.replace(self.train_phase, name="prox", loss=self.prox_loss, penalised=True)
            self.training_phases = [self.train_phase]

    def prox_loss(self, step):
        """Cross-entropy plus (μ/2)·‖w − w^t‖² over every parameter."""
        return self.loss(step) + (0.5 * self.mu) * step.proximal(ANCHOR)

    def phases(self, client_state, data, ctx):
        if self.mu == 0.0:
            return super().phases(client_state, data, ctx)
        return [(self.train_phase, ClientPhase(with_anchors(self.gs, self.gs, self.param_names)))]
