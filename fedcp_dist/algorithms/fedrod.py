"""FedRoD (Chen & Chao, ICLR 2022): a generic and a personalised predictor on one shared extractor.

* generic predictor: the shared extractor f and the generic head G, federated, trained with the
  balanced-softmax loss  −log( π_y·e^{z_y} / Σ_c π_c·e^{z_c} ) = CE(z + log π, y),  z = G(f(x)),
  π the client's train label distribution (classes it lacks get log π = −∞: out of its softmax);
* personalised predictor: z + P(f(x)) with the client's own linear head P, trained with plain CE
  on top of the generic logits, both inputs detached (z and the features), so P alone learns from it;
* per batch the two losses are added and one SGD step moves f, G and P; f and G are uploaded,
  P stays on the client. P starts at zero, so a client's personalised predictor starts as the generic one.

Evaluation: the current global f and G with the client's P: z + P(f(x)). (The paper's linear
P-head; its hypernetwork variant is not implemented.)

``fedrod_reference_compat=true`` is the reference library's variant: P starts as a copy of the
initial generic head G₀ (the run seed's), so a new client's personalised predictor is z + G₀(f(x)).
"""
from __future__ import annotations

import torch
from torch import nn

from fedcp_dist.algorithms.base import LocalResult, load_module
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import ClientPhase, Phase
from fedcp_dist.options import Option

PERSONAL = "phead."
LOG_PRIOR = "log_prior"  # the client's log label prior, a constant of its local training


def label_log_prior(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log π_c of the labels ``y`` (−∞ for classes that do not occur)."""
    counts = torch.bincount(y, minlength=num_classes).to(torch.float32)
    return torch.log(counts / counts.sum())


def balanced_softmax_loss(step, logits: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Mean of −log( π_y e^{z_y} / Σ_c π_c e^{z_c} ) over the step's batch: CE(z + log π, y)."""
    return step.cross_entropy(logits + log_prior)


class FedRoD(FedAvg):
    name = "fedrod"
    privacy_uploads = "the extractor and the generic head G"
    privacy_keeps = "its personal head P"
    options = (
        Option("fedrod_reference_compat", False, "FedRoD: the reference library's variant, the personal head P starting "
               "as a copy of the initial generic head, instead of zero (the personalised predictor starting as the generic one)"),
    )

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        head = self.model.head
        self.num_classes = head.out_features
        # the initial generic head G₀ (the model as built from the run seed), for the reference's start of P
        self.initial_head = {f"{PERSONAL}weight": head.weight.detach().clone(),
                             f"{PERSONAL}bias": head.bias.detach().clone()}
        self.phead = nn.Linear(head.in_features, head.out_features).to(device)  # P, trained
        self.eval_phead = nn.Linear(head.in_features, head.out_features).to(device)
        for p in self.eval_phead.parameters():
            p.requires_grad_(False)
        self.train_phase = Phase("rod", self.rod_loss, {"": self.model, PERSONAL: self.phead},
                                 trainable=(*self.train_phase.trainable, *(PERSONAL + n for n, _ in self.phead.named_parameters())),
                                 epochs=cfg.local_epochs)
        self.training_phases = [self.train_phase]

    def init_client_state(self, client):
        if self.cfg.fedrod_reference_compat:
            return {k: v.clone() for k, v in self.initial_head.items()}
        return {f"{PERSONAL}weight": torch.zeros_like(self.phead.weight.detach()),
                f"{PERSONAL}bias": torch.zeros_like(self.phead.bias.detach())}

    def rod_loss(self, step):
        """Balanced softmax of the generic predictor plus CE of the personalised one on detached inputs."""
        h = step.run("features", step.x)
        z = step.run("head", h)
        generic = balanced_softmax_loss(step, z, step.value(LOG_PRIOR))
        personal = step.cross_entropy(z.detach() + step.run("phead", h.detach()))
        return generic + personal

    def phases(self, client_state, data, ctx):
        start = {**self.gs, **client_state, LOG_PRIOR: label_log_prior(data.train_y, self.num_classes)}
        return [(self.train_phase, ClientPhase(start))]

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        return LocalResult(
            upload={k: o.values[k] for k in self.gs},
            client_state={k: o.values[k] for k in client_state},
            loss_sum=o.loss_sum,
            samples=o.samples,
        )

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.eval_phead, client_state, PERSONAL)
        h = self.global_model.features(x)
        return self.global_model.head(h) + self.eval_phead(h)
