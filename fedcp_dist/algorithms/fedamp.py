"""FedAMP (Huang et al., AAAI 2021): attentive message passing between similar clients.

No global model. Before client i trains in round t it gets its own aggregated model

    u_i = ξ_ii·w_i + Σ_{j≠i} ξ_ij·w_j,   ξ_ij = α_K·A'(‖w_i − w_j‖²) = α_K·exp(−‖w_i − w_j‖²/σ)/σ,
    ξ_ii = 1 − Σ_{j≠i} ξ_ij,

over the models w_j that arrived in the previous round (the bank's ``fresh`` rows) and its own
current model w_i; with none (round 1) u_i = w_i. The client then trains its own model from w_i
on F_i(w) + (λ/(2·α_K))·‖w − u_i‖² (gradient ∇F_i + (λ/α_K)·(w − u_i)) with plain SGD. w_i is
its persistent state, what it shares, and what is evaluated. Distances and mixing use the
models' parameters; BatchNorm running statistics stay with their client.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fedcp_dist.algorithms.base import LocalResult
from fedcp_dist.algorithms.fedprox import ANCHOR, with_anchors
from fedcp_dist.algorithms.peers import PeerBankMethod
from fedcp_dist.local_train import ClientPhase
from fedcp_dist.options import Option, above, at_least


class FedAMP(PeerBankMethod):
    name = "fedamp"
    options = (
        Option("fedamp_alpha_k", 1.0, "FedAMP: α_K, step size of the attention update; the local proximal weight is "
               "fedamp_lam / α_K", above(0)),
        Option("fedamp_lam", 1.0, "FedAMP: λ, weight of the proximal term (λ / (2·α_K))·‖w − u_i‖² toward the "
               "client's aggregated model u_i", at_least(0)),
        Option("fedamp_sigma", 1.0, "FedAMP: σ of the attention function: ξ_ij = α_K · exp(−‖w_i − w_j‖² / σ) / σ "
               "for j ≠ i", above(0)),
    )

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.coef = cfg.fedamp_lam / cfg.fedamp_alpha_k
        if self.coef > 0:
            self.train_phase = dataclasses.replace(self.train_phase, name="attentive", loss=self.attentive_loss,
                                                   penalised=True)
            self.training_phases = [self.train_phase]

    def attentive_loss(self, step):
        """Cross-entropy plus (λ/(2·α_K))·‖w − u_i‖²."""
        return self.loss(step) + (0.5 * self.coef) * step.proximal(ANCHOR)

    def attention_weights(self, client: int, w: torch.Tensor) -> torch.Tensor:
        """ξ_i· over all N clients (0 for clients without a fresh model); ξ_ii = 1 − the rest."""
        cfg = self.cfg
        bank, fresh = self.gs["bank"], self.gs["fresh"]
        xi = torch.zeros(self.num_clients, dtype=torch.float64, device=w.device)
        for j in torch.nonzero(fresh).flatten().tolist():
            if j != client:
                d = float(torch.sum((bank[j] - w) ** 2, dtype=torch.float64))
                xi[j] = cfg.fedamp_alpha_k * math.exp(-d / cfg.fedamp_sigma) / cfg.fedamp_sigma
        xi[client] = 1.0 - xi.sum()
        return xi

    def aggregated_model(self, client: int, w: torch.Tensor) -> torch.Tensor:
        """u_i, flat."""
        xi = self.attention_weights(client, w)
        others = xi.clone()
        others[client] = 0.0
        u = float(xi[client]) * w
        if bool((others != 0).any()):
            u = u + torch.mv(self.gs["bank"].t(), others.to(self.gs["bank"].dtype))
        return u

    def phases(self, client_state, data, ctx):
        if self.coef <= 0:
            return [(self.train_phase, ClientPhase(client_state))]
        u = self.unflat(self.aggregated_model(ctx.client, self.flat(client_state)))
        return [(self.train_phase, ClientPhase(with_anchors(client_state, u, self.param_names)))]

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        new_state = self.own_state(o.values)
        return LocalResult(upload={}, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples,
                           extra={"peer": self.flat(new_state)})
