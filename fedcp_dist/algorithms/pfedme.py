"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalisation with Moreau envelopes.

Client i's personalised model θ_i solves min_θ f_i(θ) + (λ/2)·‖θ − w‖² around its local copy w of
the global model. On each local batch D:

    K steps  θ ← θ − η_p·(∇f(θ; D) + λ·(θ − w))      (approximate inner solution, own lr η_p)
    then     w ← w − η·λ·(w − θ)                       (η = ``lr``)

θ and w both start from the received global model each round and θ warm-starts across batches.
The participants upload w (its floating buffers, BatchNorm's running statistics, are θ's: w itself
never runs forward); the server mixes: new global = (1 − β)·old + β·Σ n_i w_i / Σ n_i.
θ_i (persisted per client, the initial model until the client first trains) is what is evaluated,
as in the pFedMe paper.

``pfedme_reference_compat=true`` keeps and evaluates the client's local w after its training
instead (what the FedCP authors' library of 2023 evaluated, its personalised parameters being an
alias of the model's); training and uploads are unchanged.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, copy_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvgWithPersonalModel
from fedcp_dist.local_train import amp_autocast, batch_indices
from fedcp_dist.options import Option, above, at_least, within


class PFedMe(FedAvgWithPersonalModel):
    name = "pfedme"
    privacy_uploads = "its local copy w of the global model"
    privacy_keeps = "its personalised model θ_i"
    digits_preset = {"pfedme_lr": (0.05, "the personalized step's rate as lr on this tiny set")}
    own_loop = "pFedMe solves an inner problem of K steps on each batch before its local step"
    options = (
        Option("pfedme_lam", 15.0, "pFedMe: weight λ of (λ/2)·‖θ − w‖² in the personalized problem; also scales the "
               "local step w ← w − η·λ·(w − θ)", at_least(0)),
        Option("pfedme_k", 5, "pFedMe: K, steps that approximately solve the personalized problem on each batch",
               within(1, 10_000)),
        Option("pfedme_lr", 0.09, "pFedMe: personal learning rate of those K steps (η, the local rate of w, is `lr`)",
               above(0)),
        Option("pfedme_beta", 1.0, "pFedMe: server mixing β: new global = (1 − β)·old + β·average of the local w "
               "(1: plain averaging)", above(0)),
        Option("pfedme_reference_compat", False, "pFedMe: keep and evaluate the client's local w after training (the "
               "reference library's 2023 behaviour) instead of its personalised θ (the paper's)"),
    )

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.theta = copy.deepcopy(self.model)  # θ, trained on the inner problem

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        lam, eta, plr = float(cfg.pfedme_lam), float(cfg.lr), float(cfg.pfedme_lr)
        copy_module(self.model, self.global_model)
        copy_module(self.theta, self.global_model)
        self.model.train()
        self.theta.train()
        w = list(self.model.parameters())
        th = list(self.theta.parameters())
        loss_sum, seen = None, 0
        for idx in batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator):
            x, y = data.train_batch(idx)
            for _ in range(cfg.pfedme_k):
                with amp_autocast(cfg.amp, self.device):
                    loss = F.cross_entropy(self.theta(x), y)
                grads = list(torch.autograd.grad(loss, th))
                with torch.no_grad():
                    torch._foreach_add_(grads, torch._foreach_sub(th, w), alpha=lam)  # ∇f + λ(θ − w)
                    torch._foreach_add_(th, grads, alpha=-plr)
            with torch.no_grad():
                torch._foreach_add_(w, torch._foreach_sub(w, th), alpha=-eta * lam)  # w ← w − ηλ(w − θ)
            b = int(idx.shape[0])
            seen += b
            contrib = loss.detach() * b
            loss_sum = contrib if loss_sum is None else loss_sum + contrib
        with torch.no_grad():
            # w is never run forward: its floating buffers (BatchNorm running statistics) become θ's,
            # the network that saw the data, as in the reference where w's parameters sit in θ's network
            for b_w, b_th in zip(self.model.buffers(), self.theta.buffers()):
                if b_w.is_floating_point():
                    b_w.copy_(b_th)
        return LocalResult(
            upload=module_state("", self.model),
            client_state=module_state("", self.model if cfg.pfedme_reference_compat else self.theta)
            if seen else client_state,
            loss_sum=float(loss_sum) if loss_sum is not None else 0.0,
            samples=seen,
        )

    def server_update(self, global_state, averaged):
        beta = float(self.cfg.pfedme_beta)
        if beta == 1.0:
            return super().server_update(global_state, averaged)
        return {
            k: ((1.0 - beta) * v + beta * averaged[k]) if k in averaged else v for k, v in global_state.items()
        }
