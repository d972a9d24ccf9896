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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.algorithms.base import LocalResult, copy_module, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import batch_indices, sgd

PERSONAL = "phead."


def label_log_prior(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log π_c of the labels ``y`` (−∞ for classes that do not occur)."""
    counts = torch.bincount(y, minlength=num_classes).to(torch.float32)
    return torch.log(counts / counts.sum())


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Mean of −log( π_y e^{z_y} / Σ_c π_c e^{z_c} ) over the batch."""
    return F.cross_entropy(logits + log_prior, y)


class FedRoD(FedAvg):
    name = "fedrod"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        head = self.model.head
        self.num_classes = head.out_features
        self.phead = nn.Linear(head.in_features, head.out_features).to(device)  # P, trained
        self.eval_phead = nn.Linear(head.in_features, head.out_features).to(device)
        for p in self.eval_phead.parameters():
            p.requires_grad_(False)

    def init_client_state(self, client):
        return {f"{PERSONAL}weight": torch.zeros_like(self.phead.weight.detach()),
                f"{PERSONAL}bias": torch.zeros_like(self.phead.bias.detach())}

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        model, phead = self.model, self.phead
        copy_module(model, self.global_model)
        load_module(phead, client_state, PERSONAL)
        model.train()
        phead.train()
        log_prior = label_log_prior(data.train_y, self.num_classes)

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            h = model.features(x)
            z = model.head(h)
            generic = balanced_softmax_loss(z, y, log_prior)
            personal = F.cross_entropy(z.detach() + phead(h.detach()), y)
            return generic + personal

        params = [*model.parameters(), *phead.parameters()]
        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        loss_sum, seen = sgd(params, batches, loss_fn, cfg.lr)
        return LocalResult(
            upload=module_state("", model),
            client_state=module_state(PERSONAL, phead),
            loss_sum=loss_sum,
            samples=seen,
        )

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.eval_phead, client_state, PERSONAL)
        h = self.global_model.features(x)
        return self.global_model.head(h) + self.eval_phead(h)
