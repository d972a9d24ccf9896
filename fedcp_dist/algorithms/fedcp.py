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

from fedcp_dist.algorithms.base import Algorithm, LocalResult, copy_module, freeze, load_module, module_state
from fedcp_dist.local_train import batch_indices, sgd
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
        self.fe_g = freeze(copy.deepcopy(self.fe))
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
                with torch.no_grad():
                    h_g = self.fe_g(x)
                loss = loss + cfg.lam * mmd2(h, h_g)
            return loss

        params = [*self.fe.parameters(), *self.cpn.parameters(), *self.head_p.parameters()]
        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        loss_sum, seen = sgd(params, batches, loss_fn, cfg.lr)

        with torch.no_grad():
            new_head = module_state("head.", self.head_p)
            upload = {
                **module_state("features.", self.fe),
                **{k: 0.5 * (g + new_head[k]) for k, g in module_state("head.", self.head_g).items()},
                **module_state("cpn.", self.cpn),
            }
            new_state = {**new_head, "v": self.head_p.weight.detach().sum(dim=0).clone()}
        return LocalResult(upload=upload, client_state=new_state, loss_sum=loss_sum, samples=seen)

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.head_p, client_state, "head.")
        self.head_p.eval()
        out, _ = self.forward(self.fe_g, self.cpn_g, self.head_p, client_state["v"], x, self.cfg.cpn_eval_gumbel, ctx.generator)
        return out
