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

Client vector extension (``cpn_client_vector``, for settings such as fraud detection where the
head's column sums say little about a client): ``head`` is the above.  ``head+stats`` and
``head+embed`` build z_i = [v̂_i ; s_i] or [v̂_i ; e_i] and project it to K with one linear layer P
(global, trained and averaged with the CPN; drawn from the seeded RNG after the CPN), then
C = normalize(P z_i) ⊙ h.  s_i are the client's own data statistics, from its training rows: the
label prior (C values, n_c / n) then the input means (tables: each standardised feature's mean;
images: each normalised channel's mean; text: none).  e_i is a learned per-client embedding of
``cpn_embed_dim`` values, zero at the start, trained with the client's model and kept in its
state (``emb.e``, never uploaded), so it persists across rounds, checkpoints and resumes.
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.algorithms.base import LocalResult, SGDAlgorithm, freeze, load_module, module_state
from fedcp_dist.local_train import ClientPhase, Phase, Step, split_policy
from fedcp_dist.options import Option, above, at_least, one_of
from fedcp_dist.placement import STREAM_INIT, stream_seed


class Heads(NamedTuple):
    """What the personalized model computes on a batch."""

    personal: torch.Tensor  # the personal head's logits, g(s ⊙ h; W_i^hd)
    glob: Optional[torch.Tensor]  # the frozen global head's logits, g(r ⊙ h; W^hd) (None: no global head)
    h: torch.Tensor  # the feature
    s: Optional[torch.Tensor]  # the personal share of each feature (None: no CPN); r = 1 − s

    @property
    def logits(self) -> torch.Tensor:
        return self.personal if self.glob is None else self.personal + self.glob


def gumbel_noise(generator):
    """Gumbel(0, 1) noise shaped like its argument, as −log Exp(1), from ``generator``."""
    return lambda t: torch.empty_like(t).exponential_(generator=generator).log_().neg_()


class CPN(nn.Module):
    """Conditional policy network: C (B, K) → (s, r), each (B, K), s + r = 1."""

    def __init__(self, feature_dim: int):
        super().__init__()
        self.feature_dim = feature_dim
        self.net = nn.Sequential(nn.Linear(feature_dim, 2 * feature_dim), nn.LayerNorm(2 * feature_dim), nn.ReLU())

    def forward(self, c: torch.Tensor, tau: float = 1.0, gumbel: bool = False, generator=None):
        return split_policy(self.net(c), self.feature_dim, tau, gumbel_noise(generator) if gumbel else None)


CLIENT_VECTORS = ("head", "head+stats", "head+embed")


class ClientEmbedding(nn.Module):
    """A client's learned embedding e_i (dim,): its forward ignores the input and returns e_i."""

    def __init__(self, dim: int):
        super().__init__()
        self.e = nn.Parameter(torch.zeros(dim))

    def forward(self, _x):
        return self.e


@torch.no_grad()
def client_stats(data, num_classes: int, chunk: int = 1024) -> torch.Tensor:
    """s_i: the label prior of the client's training rows (num_classes values, n_c / n), then the
    mean of every input feature as the model sees it (tables: standardised features; images: each
    normalised channel; text: nothing).  Zeros when the client has no training rows."""
    n = data.n_train
    prior = torch.bincount(data.train_y, minlength=num_classes).to(torch.float32) / max(n, 1)
    if data.kind == "text":
        return prior
    total = None
    for i in range(0, n, chunk):
        x, _ = data.train_batch(torch.arange(i, min(n, i + chunk), device=data.train_y.device))
        part = x.sum(dim=0) if x.dim() == 2 else x.sum(dim=(0, 2, 3))
        total = part if total is None else total + part
    if total is None:
        width = data.mean.numel()
        total = torch.zeros(width, device=prior.device)
    return torch.cat([prior, total.to(prior.device) / max(n, 1)])


def stats_dim(model, num_classes: int) -> int:
    """The length of :func:`client_stats` for ``model``'s input."""
    kind, shape = getattr(model, "input_kind", "image"), getattr(model, "input_shape", ())
    return num_classes + (0 if kind == "text" else int(shape[0]))


class FedCP(SGDAlgorithm):
    name = "fedcp"
    options = (
        Option("lam", 5.0, "FedCP: weight λ of the MMD term", at_least(0)),
        Option("tau", 1.0, "FedCP: Gumbel-softmax temperature τ of the policy", above(0)),
        Option("cpn_train_gumbel", True, "FedCP: add Gumbel noise to the policy during training (the reference does)"),
        Option("cpn_eval_gumbel", False, "FedCP: add Gumbel noise at evaluation too (the reference's stochastic evaluation)"),
        Option("cpn_client_vector", "head", "FedCP: the client vector the CPN sees: head (v̂, the paper's) | head+stats "
               "(v̂ and the client's label prior and input means, projected to K) | head+embed (v̂ and a learned "
               "per-client embedding, projected to K)", one_of(*CLIENT_VECTORS)),
        Option("cpn_embed_dim", 8, "FedCP: length of the learned per-client embedding of cpn_client_vector=head+embed",
               at_least(1)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.cpn_client_vector != "head":
            if cfg.fused is True:
                return "cpn_client_vector", f"{cfg.cpn_client_vector} trains on the sequential path: set fused=false or auto"
            if getattr(cfg, "cpn_input", "both") != "both" or not getattr(cfg, "fedcp_cpn", True):
                return "cpn_client_vector", (f"{cfg.cpn_client_vector} extends the CPN's client vector: it needs "
                                             f"cpn_input=both and fedcp_cpn=true")
        return None

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.K = model.feature_dim
        self.cpn = CPN(self.K).to(device)  # drawn from the same seeded global RNG as the model
        self.vector_kind = getattr(cfg, "cpn_client_vector", "head")
        self.num_classes = int(model.head.out_features)
        self.vproj = self.emb_p = None
        if self.vector_kind != "head":  # drawn after the CPN: the default draws nothing more
            extra = (stats_dim(model, self.num_classes) if self.vector_kind == "head+stats"
                     else int(cfg.cpn_embed_dim))
            self.vproj = nn.Linear(self.K + extra, self.K).to(device)
            self.vproj_g = freeze(copy.deepcopy(self.vproj))
            if self.vector_kind == "head+embed":
                self.emb_p = ClientEmbedding(int(cfg.cpn_embed_dim)).to(device)
        self._stats = {}  # client → s_i (head+stats), computed once from its training rows
        self.fe = model.features.to(device)  # W_i^fe, trained
        self.head_p = model.head.to(device)  # W_i^hd, trained
        # received global parts, frozen: the MMD reference, the global head, and what evaluation uses
        self.fe_g = freeze(copy.deepcopy(self.fe)).eval()  # BatchNorm: running statistics at evaluation
        self.head_g = freeze(copy.deepcopy(self.head_p))
        self.cpn_g = freeze(copy.deepcopy(self.cpn))
        self._init_head = module_state("head.", self.head_p)
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, STREAM_INIT))
        self._init_v = torch.rand(self.K, generator=gen).to(device)
        self.gs = self.init_global_state()
        self._declare_phases()

    def _declare_phases(self) -> None:
        """The training phase and the evaluated model's modules (again after a subclass swaps the CPN)."""
        modules = {"features.": self.fe, "cpn.": self.cpn, "head.": self.head_p}
        if self.vproj is not None:
            modules["vproj."] = self.vproj
        if self.emb_p is not None:
            modules["emb."] = self.emb_p
        self.train_phase = Phase(
            "train", self.loss, modules,
            trainable=tuple(p + n for p, m in modules.items() for n, t in m.named_parameters() if t.requires_grad),
            epochs=self.cfg.local_epochs, shared=(self.fe_g, self.head_g))
        self.training_phases = [self.train_phase]
        self.eval_modules = {"features.": self.fe_g, "cpn.": self.cpn_g, "head.": self.head_p}
        if self.vproj is not None:
            self.eval_modules["vproj."] = self.vproj_g
        if self.emb_p is not None:
            self.eval_modules["emb."] = self.emb_p
        self.keys = {p: list(module_state(p, m)) for p, m in modules.items()}

    # -- state ------------------------------------------------------------
    def init_global_state(self):
        state = {**module_state("features.", self.fe), **module_state("head.", self.head_p), **module_state("cpn.", self.cpn)}
        if getattr(self, "vproj", None) is not None:
            state.update(module_state("vproj.", self.vproj))
        return state

    def set_global(self, global_state):
        load_module(self.fe_g, global_state, "features.")
        load_module(self.head_g, global_state, "head.")
        load_module(self.cpn_g, global_state, "cpn.")
        if self.vproj is not None:
            load_module(self.vproj_g, global_state, "vproj.")
        self.gs = global_state

    def init_client_state(self, client):
        """A copy of the initial global head, and one random client vector from the run seed
        (head+embed: and a zero embedding)."""
        state = {**{k: v.clone() for k, v in self._init_head.items()}, "v": self._init_v.clone()}
        if self.emb_p is not None:
            state["emb.e"] = torch.zeros_like(self.emb_p.e.detach())
        return state

    def _client_values(self, client_state, data, cid: int) -> dict:
        """The per-client constants the policy input reads: v (and, head+stats, s_i)."""
        values = {"v": client_state["v"]}
        if self.vector_kind == "head+stats":
            if cid not in self._stats:
                self._stats[cid] = client_stats(data, self.num_classes).to(client_state["v"].device)
            values["stats"] = self._stats[cid]
        return values

    def prepare_eval(self, client_state, data, ctx):
        if self.vector_kind != "head+stats":
            return client_state
        return {**client_state, "stats": self._client_values(client_state, data, ctx.client)["stats"]}

    def fused_reason(self):
        if self.vector_kind != "head":
            return f"cpn_client_vector={self.vector_kind} trains one client at a time"
        return super().fused_reason()

    has_client_vector = True

    @property
    def client_vector_dim(self) -> int:
        return self.K

    def client_vector(self, client_state):
        """v_i: the column sums of the personal head's weight after the client's last round (the
        random initial vector before it has trained)."""
        return self._init_v if client_state is None else client_state["v"]

    # -- the personalized model and its loss, written once for training, fused training and evaluation
    def policy_input(self, step, h):
        """C = v̂ ⊙ h: the client vector, L2-normalised, times the sample's feature (extended:
        C = normalize(P [v̂ ; s_i or e_i]) ⊙ h)."""
        v = F.normalize(step.value("v"), dim=-1)
        if self.vector_kind == "head":
            return v * h
        extra = step.value("stats") if self.vector_kind == "head+stats" else step.run("emb", h)
        return F.normalize(step.run("vproj", torch.cat([v, extra], dim=-1)), dim=-1) * h

    def heads(self, step, gumbel: bool) -> Heads:
        """The personalized model on the step's batch: g(s ⊙ h; W_i^hd) (the personal head on the
        personal part), g(r ⊙ h; W^hd) (the frozen global head on the global part), h and s."""
        h = step.run("features", step.x)
        noise = step.gumbel_like if gumbel else None
        s, r = split_policy(step.run("cpn.net", self.policy_input(step, h)), self.K, self.cfg.tau, noise)
        return Heads(step.run("head", s * h), step.shared(self.head_g, r * h), h, s)

    def loss(self, step):
        """CE(personalized output) + λ·MMD²(h, h of the frozen received extractor, batch statistics)."""
        cfg = self.cfg
        out = self.heads(step, cfg.cpn_train_gumbel)
        if out.s is not None and step.tallies is not None:  # probing: Σ over the batch of s̄ = (1/K) Σ_k s^k
            step.tally("s", out.s.detach().mean(dim=-1))
        loss = step.cross_entropy(out.logits)
        if cfg.lam > 0:
            h_g = step.shared(self.fe_g, step.x, grad=False, batch_stats=True)
            loss = loss + cfg.lam * step.mmd2(out.h, h_g)
        return loss

    # -- local training ---------------------------------------------------
    def phases(self, client_state, data, ctx):
        k = self.keys
        start = {**{n: self.gs[n] for n in (*k["features."], *k["cpn."])}, **{n: client_state[n] for n in k["head."]},
                 "v": client_state["v"]}
        if self.vproj is not None:
            start.update({n: self.gs[n] for n in k["vproj."]})
            start.update(self._client_values(client_state, data, ctx.client))
        if self.emb_p is not None:
            start.update({n: client_state[n] for n in k["emb."]})
        return [(self.train_phase, ClientPhase(start))]

    def finish(self, client_state, outcomes, ctx):
        """Upload W_i^fe, (W^hd + W_i^hd)/2 and Θ_i; keep W_i^hd and v_i = its weight's column sums."""
        o, k = outcomes[0], self.keys
        v = o.values
        with torch.no_grad():
            upload = {**{n: v[n] for n in k["features."]}, **{n: 0.5 * (self.gs[n] + v[n]) for n in k["head."]},
                      **{n: v[n] for n in k["cpn."]}}
            new_state = {**{n: v[n] for n in k["head."]}, "v": v["head.weight"].sum(dim=0)}
            if self.vproj is not None:
                upload.update({n: v[n] for n in k["vproj."]})
            if self.emb_p is not None:
                new_state.update({n: v[n] for n in k["emb."]})
        # probing: the trained values (no copies) for the loss after local learning
        return LocalResult(upload=upload, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples,
                           extra={"trained": v} if ctx.probe else {}, tallies=o.tallies)

    # -- evaluation -------------------------------------------------------
    def _eval_heads(self, client_state, x, ctx):
        load_module(self.head_p, client_state, "head.")
        self.head_p.eval()
        if self.emb_p is not None:
            load_module(self.emb_p, client_state, "emb.")
        values = {"v": client_state["v"]}
        if self.vector_kind == "head+stats":  # prepare_eval's, or the client's once computed
            values["stats"] = client_state["stats"] if "stats" in client_state else self._stats[ctx.client]
        step = Step(x, None, self.eval_modules, values, ctx.generator)
        return self.heads(step, self.cfg.cpn_eval_gumbel)

    def head_outputs(self, client_state, x, ctx):
        """(g(s ⊙ h; W_i^hd), g(r ⊙ h; W^hd)): the personal and the global head's logits of the
        client's personalized model as evaluated (received extractor and CPN, the client's head);
        their sum is :meth:`predict`'s output. Runs with gradients enabled (for Grad-CAM)."""
        out = self._eval_heads(client_state, x, ctx)
        return out.personal, out.glob

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        return self._eval_heads(client_state, x, ctx).logits

    # -- probes -----------------------------------------------------------
    probes = True

    @torch.no_grad()
    def predict_probe(self, client_state, x, ctx):
        out = self._eval_heads(client_state, x, ctx)
        return out.logits, out.s

    @torch.no_grad()
    def _train_loss(self, modules, v, data, ctx) -> float:
        """Σ cross-entropy of the personalized model on ``modules`` (values loaded, eval mode) over
        the client's training samples, in evaluation-sized batches."""
        bs, n, total = self.cfg.eval_batch_size, data.n_train, 0.0
        for i in range(0, n, bs):
            x, y = data.train_batch(torch.arange(i, min(i + bs, n), device=data.train_y.device))
            out = self.heads(Step(x, None, modules, {"v": v}, ctx.generator), self.cfg.cpn_eval_gumbel)
            total += float(F.cross_entropy(out.logits.float(), y, reduction="sum"))
        return total

    def probe_losses(self, before, result, data, ctx):
        """Before: the model :meth:`predict` evaluates (the received extractor and CPN, the client's
        head and v). After: the client's trained extractor, CPN and head with its new v, the frozen
        received global head as in training; both without Gumbel noise unless ``cpn_eval_gumbel``."""
        load_module(self.head_p, before, "head.")
        modes = {m: m.training for m in self.train_phase.modules.values()}
        try:
            self.head_p.eval()
            bef = self._train_loss(self.eval_modules, before["v"], data, ctx)
            for prefix, m in self.train_phase.modules.items():
                load_module(m, result.extra["trained"], prefix)
                m.eval()
            aft = self._train_loss(self.train_phase.modules, result.client_state["v"], data, ctx)
        finally:
            for m, mode in modes.items():
                m.train(mode)
        return bef, aft
