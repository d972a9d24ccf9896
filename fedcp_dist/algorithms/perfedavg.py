"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020), first-order variant.

The global model w is a meta-model for the personalised objective F_i(w) = f_i(w − α·∇f_i(w)).
Each local step draws two batches D and D' (consecutive batches of the client's shuffled epochs):

    w̃ = w − α·∇f(w; D)          (inner, adaptation step)
    w ← w − β·∇f(w̃; D')          (outer step; first-order: the Hessian term is dropped)

The server averages the w's as FedAvg does. A client's personalised model is the global w after one
adaptation step on one of its train batches (drawn from the evaluation stream), which is what
``prepare_eval`` returns; nothing persists per client.

``perfedavg_reference_compat=true`` is the reference library's variant, behind the FedCP paper's
Per-FedAvg figures: the outer step uses β = ``lr`` (not ``perfedavg_beta``) and a client runs its
local training twice per round (two passes of ``local_epochs``, the second from where the first
ended, each with its own batch order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, copy_module, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import amp_autocast, batch_indices
from fedcp_dist.options import Option, above


class PerFedAvg(FedAvg):
    name = "perfedavg"
    privacy_uploads = "the meta-model w it trained"
    digits_preset = {"perfedavg_alpha": (0.05, "10 × its default, as lr is on this tiny set"),
                     "perfedavg_beta": (0.01, "10 × its default, as lr is on this tiny set")}
    own_loop = "Per-FedAvg's meta step takes two gradients per update (inner and outer)"
    options = (
        Option("perfedavg_alpha", 0.005, "Per-FedAvg: step size α of the inner (adaptation) step, also used for the "
               "one-step adaptation at evaluation", above(0)),
        Option("perfedavg_beta", 0.001, "Per-FedAvg: step size β of the outer (meta) step (first-order variant)", above(0)),
        Option("perfedavg_reference_compat", False, "Per-FedAvg: the reference library's variant (outer step β = lr, "
               "local training run twice per round) instead of the paper's (β = perfedavg_beta, once)"),
    )

    def _grads(self, params, data, idx, amp: bool = True):
        x, y = data.train_batch(idx)
        with amp_autocast(self.cfg.amp if amp else "none", self.device):
            loss = F.cross_entropy(self.model(x), y)
        return loss, torch.autograd.grad(loss, params)

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        model = self.model
        copy_module(model, self.global_model)
        model.train()
        params = list(model.parameters())
        compat = cfg.perfedavg_reference_compat
        beta = cfg.lr if compat else cfg.perfedavg_beta
        loss_sum, seen = None, 0
        for _ in range(2 if compat else 1):
            batches = list(batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator))
            # one meta step per pair of consecutive batches (an odd last batch is left out); a client with
            # a single batch uses it as both D and D'
            steps = max(1, len(batches) // 2) if batches else 0
            for j in range(steps):
                d_in, d_out = batches[2 * j], batches[(2 * j + 1) % len(batches)]
                w = [p.detach().clone() for p in params]
                _, g_in = self._grads(params, data, d_in)
                with torch.no_grad():
                    torch._foreach_add_(params, g_in, alpha=-cfg.perfedavg_alpha)  # w̃
                loss, g_out = self._grads(params, data, d_out)
                with torch.no_grad():
                    torch._foreach_copy_(params, w)
                    torch._foreach_add_(params, g_out, alpha=-beta)
                b = int(d_out.shape[0])
                seen += b
                contrib = loss.detach() * b
                loss_sum = contrib if loss_sum is None else loss_sum + contrib
        return LocalResult(
            upload=module_state("", model),
            client_state=None,
            loss_sum=float(loss_sum) if loss_sum is not None else 0.0,
            samples=seen,
        )

    def prepare_eval(self, client_state, data, ctx):
        """The global model after one step of size α on one train batch (drawn from ctx.generator)."""
        if data.n_train == 0:
            return None
        model = self.model
        copy_module(model, self.global_model)
        # the adaptation is a training step, whatever mode the last predict left the model in
        # (BatchNorm: batch statistics, and its running statistics move with that batch)
        model.train()
        params = list(model.parameters())
        g = ctx.generator
        idx = torch.randperm(data.n_train, generator=g, device=g.device)[: self.cfg.batch_size]
        with torch.enable_grad():  # the engine evaluates under no_grad
            _, grads = self._grads(params, data, idx, amp=False)  # evaluation stays float32
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-self.cfg.perfedavg_alpha)
        return module_state("", model)

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        if client_state is None:
            return self.global_model(x)
        load_module(self.model, client_state, "")
        self.model.eval()
        return self.model(x)
