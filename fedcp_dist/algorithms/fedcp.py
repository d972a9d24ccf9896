"""FedCP: a conditional policy network splits each feature into a global and a personal part.

Per client i (paper, section 4):

* h = f(x; W_i^fe), the client's feature extractor, overwritten by the global W^fe when selected;
* C_i = v̂_i ⊙ h, with v_i the column sums of the personal head's weight, L2-normalised;
* the CPN Θ_i: Linear(K, 2K) → LayerNorm(2K) → ReLU, viewed as (B, 2, K); a softmax over the
  pair gives (s, r) with s + r = 1 (soft Gumbel-softmax with temperature τ while training);
* out = g(s ⊙ h; W_i^hd) + g(r ⊙ h; W^hd): the personal head on the personal part, the frozen
  global head on the global part;
* loss = CE(out, y) + λ · MMD²(h, f(x; W^fe)) against the frozen received extractor.

Upload: W_i^fe, (W^hd + W_i^hd) / 2 and Θ_i. Persistent client state: W_i^hd and v_i.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist import fused
from fedcp_dist.algorithms.base import Algorithm, LocalResult, copy_module, freeze, load_module, module_state
from fedcp_dist.models import forward_batch_stats
from fedcp_dist.local_train import amp_autocast, batch_indices, full_precision, sgd
from fedcp_dist.placement import STREAM_INIT, stream_seed

MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)


def _sq_dists(a: torch.Tensor, b: torch.Tensor, a_sq: torch.Tensor, b_sq: torch.Tensor) -> torch.Tensor:
    return (a_sq[:, None] + b_sq[None, :] - 2.0 * (a @ b.T)).clamp_min(0.0)


def mmd2(x: torch.Tensor, y: torch.Tensor, bandwidths: Sequence[float] = MMD_BANDWIDTHS) -> torch.Tensor:
    """Biased MMD² between the rows of ``x`` and ``y`` (all pairs, diagonal included).

    Kernel: Σ_a exp(−d / (2a)) over the bandwidths a, d the squared Euclidean distance.
    """
    x_sq, y_sq = (x * x).sum(1), (y * y).sum(1)
    dxx, dyy, dxy = _sq_dists(x, x, x_sq, x_sq), _sq_dists(y, y, y_sq, y_sq), _sq_dists(x, y, x_sq, y_sq)
    k = 0.0
    for a in bandwidths:
        c = -0.5 / a
        k = k + (dxx * c).exp().mean() + (dyy * c).exp().mean() - 2.0 * (dxy * c).exp().mean()
    return k


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is if wider (bf16 activations under autocast are widened)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def grouped_mmd2(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: torch.Tensor,
                 bandwidths: Sequence[float] = MMD_BANDWIDTHS) -> torch.Tensor:
    """:func:`mmd2` for each of k padded batches at once: x, y (k, B, K); mask (k, B) marks the
    real rows and count (k,) their number. Returns (k,) MMD² over the real rows only."""
    x_sq, y_sq = (x * x).sum(2), (y * y).sum(2)

    def sq_dists(a, b, a_sq, b_sq):
        return (a_sq[:, :, None] + b_sq[:, None, :] - 2.0 * torch.bmm(a, b.transpose(1, 2))).clamp_min(0.0)

    dxx, dyy, dxy = sq_dists(x, x, x_sq, x_sq), sq_dists(y, y, y_sq, y_sq), sq_dists(x, y, x_sq, y_sq)
    pairs = mask[:, :, None] * mask[:, None, :]
    n2 = count * count

    def mean(t):
        return (t * pairs).sum((1, 2)) / n2

    k = 0.0
    for a in bandwidths:
        c = -0.5 / a
        k = k + mean((dxx * c).exp()) + mean((dyy * c).exp()) - 2.0 * mean((dxy * c).exp())
    return k


class CPN(nn.Module):
    """Conditional policy network: C (B, K) → (s, r), each (B, K), s + r = 1."""

    def __init__(self, feature_dim: int):
        super().__init__()
        self.feature_dim = feature_dim
        self.net = nn.Sequential(nn.Linear(feature_dim, 2 * feature_dim), nn.LayerNorm(2 * feature_dim), nn.ReLU())

    def forward(self, c: torch.Tensor, tau: float = 1.0, gumbel: bool = False, generator=None):
        logits = self.net(c).view(-1, 2, self.feature_dim)
        if gumbel:
            # Gumbel(0, 1) noise as −log(Exp(1)), drawn from the client's own stream
            noise = torch.empty_like(logits).exponential_(generator=generator).log_().neg_()
            logits = logits + noise
        p = torch.softmax(logits / tau, dim=1)
        return p[:, 0], p[:, 1]


class FedCP(Algorithm):
    name = "fedcp"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.K = model.feature_dim
        self.cpn = CPN(self.K).to(device)  # drawn from the same seeded global RNG as the model
        self.fe = model.features.to(device)  # W_i^fe, trained
        self.head_p = model.head.to(device)  # W_i^hd, trained
        # received global parts, frozen: the MMD reference, the global head, and what evaluation uses
        self.fe_g = freeze(copy.deepcopy(self.fe)).eval()  # BatchNorm: running statistics at evaluation
        self.head_g = freeze(copy.deepcopy(self.head_p))
        self.cpn_g = freeze(copy.deepcopy(self.cpn))
        self._init_head = module_state("head.", self.head_p)
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, STREAM_INIT))
        self._init_v = torch.rand(self.K, generator=gen).to(device)

    # -- state ------------------------------------------------------------
    def init_global_state(self):
        return {**module_state("features.", self.fe), **module_state("head.", self.head_p), **module_state("cpn.", self.cpn)}

    def set_global(self, global_state):
        load_module(self.fe_g, global_state, "features.")
        load_module(self.head_g, global_state, "head.")
        load_module(self.cpn_g, global_state, "cpn.")

    def init_client_state(self, client):
        """A copy of the initial global head, and one random client vector from the run seed."""
        return {**{k: v.clone() for k, v in self._init_head.items()}, "v": self._init_v.clone()}

    # -- model ------------------------------------------------------------
    def forward(self, fe, cpn, head_p, v, x, gumbel, generator):
        """(logits, h) of the personalized model: head_p(s ⊙ h) + head_g(r ⊙ h)."""
        h = fe(x)
        s, r = cpn(F.normalize(v, dim=0) * h, tau=self.cfg.tau, gumbel=gumbel, generator=generator)
        return head_p(s * h) + self.head_g(r * h), h

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        copy_module(self.fe, self.fe_g)
        copy_module(self.cpn, self.cpn_g)
        load_module(self.head_p, client_state, "head.")
        v = client_state["v"]
        for m in (self.fe, self.cpn, self.head_p):
            m.train()

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            out, h = self.forward(self.fe, self.cpn, self.head_p, v, x, cfg.cpn_train_gumbel, ctx.generator)
            loss = F.cross_entropy(out, y)
            if cfg.lam > 0:
                h_g = forward_batch_stats(self.fe_g, x)  # batch statistics, as the reference; no buffer moves
                with full_precision(x.device):  # bf16 would cancel the distances away
                    loss = loss + cfg.lam * mmd2(_at_least_fp32(h), _at_least_fp32(h_g))
            return loss

        params = [*self.fe.parameters(), *self.cpn.parameters(), *self.head_p.parameters()]
        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        loss_sum, seen = sgd(params, batches, loss_fn, cfg.lr, amp=cfg.amp)

        with torch.no_grad():
            new_head = module_state("head.", self.head_p)
            upload = {
                **module_state("features.", self.fe),
                **{k: 0.5 * (g + new_head[k]) for k, g in module_state("head.", self.head_g).items()},
                **module_state("cpn.", self.cpn),
            }
            new_state = {**new_head, "v": self.head_p.weight.detach().sum(dim=0).clone()}
        return LocalResult(upload=upload, client_state=new_state, loss_sum=loss_sum, samples=seen)

    # -- fused training (fused=true): local_train for a group of clients at once ----------------
    def _fused_ok(self) -> bool:
        """Only FedCP's own local_train, forward and CPN are fused; a subclass changing any keeps its own."""
        if (type(self).local_train is not FedCP.local_train or type(self).forward is not FedCP.forward
                or type(self.cpn).forward is not CPN.forward):
            return False
        reason = fused.unsupported_reason(self.fe, self.cpn, self.head_p, self.fe_g, self.head_g)
        if reason is not None:
            fused.note_once(self, f"fused=true: {reason}; clients train one at a time")
            return False
        return True

    def _fused_memory(self, datas) -> "fused.MemoryPlan":
        """Per slot: W^fe, Θ, W^hd and their gradients, v, and the activations of f, the CPN and g;
        per result: the upload and the new client state (4 bytes per element)."""
        x = fused.probe_input(datas)
        if "_fused_act" not in self.__dict__ and x is not None:
            def run():
                h = self.fe(x)
                self.cpn.net(h)
                self.head_p(h)

            self._fused_act = fused.activation_elements(run, [self.fe, self.cpn, self.head_p])
        act = self.__dict__.get("_fused_act", 0)
        trained = fused.param_count(self.fe, self.cpn, self.head_p)
        head = fused.param_count(self.head_p)
        per_slot = 4 * (2 * trained + self.K) + fused.ACTIVATION_COPIES * 4 * self.cfg.batch_size * act
        return fused.MemoryPlan(per_slot=per_slot, per_result=4 * (trained + head + self.K))

    def fused_group_size(self, datas):
        if not self._fused_ok():
            return super().fused_group_size(datas)
        return self._fused_memory(datas).group_size(self.device, len(datas))

    def local_train_group(self, items):
        if not items or not self._fused_ok():
            return super().local_train_group(items)
        cfg, K, device = self.cfg, self.K, self.device
        fe, cpn, head_p = self.fe, self.cpn, self.head_p
        for m in (fe, cpn, head_p):
            m.train()
        shared = {**module_state("features.", self.fe_g), **module_state("cpn.", self.cpn_g)}
        head_keys = list(module_state("head.", head_p))
        trainable = [*(f"features.{n}" for n, p in fe.named_parameters() if p.requires_grad),
                     *(f"cpn.{n}" for n, p in cpn.named_parameters() if p.requires_grad),
                     *(f"head.{n}" for n, p in head_p.named_parameters() if p.requires_grad)]

        fe_g_params = fused.stack_once(dict(self.fe_g.named_parameters()))

        def step_loss(views, batch):
            k, x = batch.k, batch.x
            b = x.shape[1]
            h = fused.grouped_forward(fe, fused.sub_params(views, "features."), x, k)  # (k, B, K)
            c = F.normalize(views["v"], dim=1)[:, None, :] * h
            logits = fused.grouped_forward(cpn.net, fused.sub_params(views, "cpn.net."), c, k).reshape(k, b, 2, K)
            if cfg.cpn_train_gumbel:
                # each client's Gumbel noise from its own stream, the same draws as alone; padding: log 1 = 0
                e = torch.ones_like(logits)
                for j, (n, g) in enumerate(zip(batch.sizes, batch.generators)):
                    e[j, :n].exponential_(generator=g)
                logits = logits + e.log_().neg_()
            p = torch.softmax(logits / cfg.tau, dim=2)
            s, r = p[:, :, 0], p[:, :, 1]
            out = fused.grouped_forward(head_p, fused.sub_params(views, "head."), s * h, k)
            out = out + self.head_g((r * h).reshape(k * b, K)).view(k, b, -1)
            loss = fused.masked_cross_entropy(out, batch.y, batch.mask, batch.count)
            if cfg.lam > 0:
                with torch.no_grad():  # the frozen extractor on all k·B samples at once, channels-last
                    h_g = fused.grouped_forward(self.fe_g, fe_g_params, x.reshape(1, k * b, *x.shape[2:]), 1).view(k, b, -1)
                with full_precision(device):
                    loss = loss + cfg.lam * grouped_mmd2(_at_least_fp32(h), _at_least_fp32(h_g), batch.mask, batch.count)
            return loss

        datas = [d for _, d, _ in items]
        runs = [fused.ClientRun(d, ctx.generator, {**shared, **{k: state[k] for k in head_keys}, "v": state["v"]})
                for state, d, ctx in items]
        outcomes = fused.train_fused(
            runs,
            trainable=trainable,
            step_loss=step_loss,
            slots=self._fused_memory(datas).slots(device, len(items)),
            batch_size=cfg.batch_size,
            epochs=cfg.local_epochs,
            drop_last=cfg.drop_last,
            lr=cfg.lr,
            autocast=lambda: amp_autocast(cfg.amp, device),
        )
        head_g = module_state("head.", self.head_g)
        results = []
        with torch.no_grad():
            for o in outcomes:
                v = o.values
                new_head = {k: v[k] for k in head_keys}
                upload = {
                    **{k: t for k, t in v.items() if k.startswith("features.")},
                    **{k: 0.5 * (g + new_head[k]) for k, g in head_g.items()},
                    **{k: t for k, t in v.items() if k.startswith("cpn.")},
                }
                new_state = {**new_head, "v": new_head["head.weight"].sum(dim=0)}
                results.append(LocalResult(upload=upload, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples))
        return results

    def head_outputs(self, client_state, x, ctx):
        """(g(s ⊙ h; W_i^hd), g(r ⊙ h; W^hd)): the personal and the global head's logits of the
        client's personalized model as evaluated (received extractor and CPN, the client's head);
        their sum is :meth:`predict`'s output. Runs with gradients enabled (for Grad-CAM)."""
        load_module(self.head_p, client_state, "head.")
        self.head_p.eval()
        h = self.fe_g(x)
        s, r = self.cpn_g(F.normalize(client_state["v"], dim=0) * h, tau=self.cfg.tau,
                          gumbel=self.cfg.cpn_eval_gumbel, generator=ctx.generator)
        return self.head_p(s * h), self.head_g(r * h)

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.head_p, client_state, "head.")
        self.head_p.eval()
        out, _ = self.forward(self.fe_g, self.cpn_g, self.head_p, client_state["v"], x, self.cfg.cpn_eval_gumbel, ctx.generator)
        return out
