"""FedCP's evaluation and probes: the personalized model as evaluated (the received extractor and
policy, the client's own head), its policy's personal share s, and the training loss before and
after local learning."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import load_module
from fedcp_dist.local_train import Step


class PolicyProbes:
    """Evaluation hooks of :class:`~fedcp_dist.algorithms.fedcp.FedCP` (a mixin: it reads the
    algorithm's modules and parts)."""

    probes = True

    def _load_eval_policy(self, t: int) -> None:
        """The evaluated policy's networks of round t (caching: interpolated between refreshes)."""
        if self.sync.every == 1 or self._eval_policy_round == t:
            return
        values = self.sync.values_at(self.gs, t)
        for prefix in ("cpn.", "vproj.", "cpng."):
            if prefix in self.eval_modules:
                load_module(self.eval_modules[prefix], values, prefix)
        self._eval_policy_round = t

    def _eval_values(self, client_state, cid: int) -> dict:
        values = {"v": client_state["v"]}
        if self.vector.kind == "head+stats":  # prepare_eval's, or the client's once computed
            values["stats"] = client_state["stats"] if "stats" in client_state else self.vector._stats[cid]
        return values

    def _eval_heads(self, client_state, x, ctx):
        # evaluation before round t sees the model of round t − 1: that round's temperature
        self.tau = self.schedules.tau_at(ctx.round - 1)
        self._load_eval_policy(ctx.round)  # evaluation before round t: the policy round t starts from
        load_module(self.head_p, client_state, "head.")
        self.head_p.eval()
        if self.emb_p is not None:
            load_module(self.emb_p, client_state, "emb.")
        step = Step(x, None, self.eval_modules, self._eval_values(client_state, ctx.client), ctx.generator)
        return self.heads(step, self.cfg.cpn_eval_gumbel)

    def head_outputs(self, client_state, x, ctx):
        """(g(s ⊙ h; W_i^hd), g(r ⊙ h; W^hd)): the personal and the global head's logits of the
        client's personalized model as evaluated; their sum is :meth:`predict`'s output. Runs with
        gradients enabled (for Grad-CAM)."""
        out = self._eval_heads(client_state, x, ctx)
        return out.personal, out.glob

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        return self._eval_heads(client_state, x, ctx).logits

    @torch.no_grad()
    def predict_probe(self, client_state, x, ctx):
        out = self._eval_heads(client_state, x, ctx)
        return out.logits, out.s

    @torch.no_grad()
    def _train_loss(self, modules, values: dict, data, ctx) -> float:
        """Σ cross-entropy of the personalized model on ``modules`` (values loaded, eval mode) over
        the client's training samples, in evaluation-sized batches."""
        bs, n, total = self.cfg.eval_batch_size, data.n_train, 0.0
        for i in range(0, n, bs):
            x, y = data.train_batch(torch.arange(i, min(i + bs, n), device=data.train_y.device))
            out = self.heads(Step(x, None, modules, values, ctx.generator), self.cfg.cpn_eval_gumbel)
            total += float(F.cross_entropy(out.logits.float(), y, reduction="sum"))
        return total

    def probe_losses(self, before, result, data, ctx):
        """Before: the model :meth:`predict` evaluates (the received extractor and CPN, the client's
        head and v). After: the client's trained extractor, CPN and head with its new v, the frozen
        received global head as in training; both without Gumbel noise unless ``cpn_eval_gumbel``."""
        load_module(self.head_p, before, "head.")
        if self.emb_p is not None:
            load_module(self.emb_p, before, "emb.")
        self._load_eval_policy(ctx.round)
        modes = {m: m.training for m in self.train_phase.modules.values()}
        try:
            self.head_p.eval()
            bef = self._train_loss(self.eval_modules, self.vector.values(before, data, ctx.client), data, ctx)
            for prefix, m in self.train_phase.modules.items():
                load_module(m, result.extra["trained"], prefix)
                m.eval()
            after = self.vector.values(result.client_state, data, ctx.client)
            aft = self._train_loss(self.train_phase.modules, after, data, ctx)
        finally:
            for m, mode in modes.items():
                m.train(mode)
        return bef, aft
