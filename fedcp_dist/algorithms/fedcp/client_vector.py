"""The policy input of FedCP: what the CPN conditions on.

``cpn_input`` (the paper's ablations of the input, Table 1):

* ``both`` C = ĉ ⊙ h, the client vector times the sample's feature (the paper's);
* ``sample`` C = h (the paper's "w.o. cs": no client vector);
* ``client`` C = v̂ (no sample feature);
* ``none`` a fixed random vector from the run seed, L2-normalised, the same for every client and sample.

The client vector ĉ (``cpn_client_vector``, with ``cpn_input=both``), one strategy each:

* ``head`` ĉ = v̂_i, the column sums of the personal head's weight, L2-normalised (the paper's); before a
  client has trained, one random vector from the run seed, shared by every client;
* ``head+stats`` ĉ = normalize(P [v̂_i ; s_i]) with s_i the client's label prior (n_c / n) and input means
  (tables: each standardised feature; images: each normalised channel; text: none), from its training rows;
* ``head+embed`` ĉ = normalize(P [v̂_i ; e_i]) with e_i a learned per-client embedding (zero at the start,
  trained with the client's model, kept in its state as ``emb.e`` and never uploaded).

P is one global linear layer (``vproj``), trained and averaged with the CPN, drawn from the seeded
RNG after the CPN (the paper's default draws nothing more).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.algorithms.fedcp.modules import PolicyModule, register
from fedcp_dist.options import Component, Option, one_of, within
from fedcp_dist.state.placement import STREAM_INIT, stream_seed

CLIENT_VECTORS = ("head", "head+stats", "head+embed")
CPN_INPUTS = ("both", "sample", "client", "none")
#: sub-stream of STREAM_INIT for the fixed CPN input of cpn_input=none (0 is the client vector's)
_FIXED_INPUT_STREAM = 1


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
        total = torch.zeros(data.mean.numel(), device=prior.device)
    return torch.cat([prior, total.to(prior.device) / max(n, 1)])


def stats_dim(model, num_classes: int) -> int:
    """The length of :func:`client_stats` for ``model``'s input."""
    return num_classes + (0 if model.input_kind == "text" else int(model.input_shape[0]))


class ClientVector(Component):
    """FedCP's policy input: what the CPN conditions on (the client vector and the sample's feature)."""

    options = (
        Option("cpn_input", "both", "FedCP ablation (paper, Table 1): what the CPN sees: both (ĉ ⊙ h, the paper's) | "
               "sample (h: without the client vector) | client (v̂) | none (a fixed random vector)", one_of(*CPN_INPUTS)),
        Option("cpn_client_vector", "head", "FedCP: the client vector the CPN sees: head (v̂, the paper's) | head+stats "
               "(v̂ and the client's label prior and input means, projected to K) | head+embed (v̂ and a learned "
               "per-client embedding, projected to K)", one_of(*CLIENT_VECTORS)),
        Option("cpn_embed_dim", 8, "FedCP: length of the learned per-client embedding of cpn_client_vector=head+embed",
               within(1, 65_536)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.cpn_client_vector != "head":
            if cfg.fused is True:
                return "cpn_client_vector", f"{cfg.cpn_client_vector} trains on the sequential path: set fused=false or auto"
            if cfg.cpn_input != "both" or not cfg.fedcp_cpn:
                return "cpn_client_vector", (f"{cfg.cpn_client_vector} extends the CPN's client vector: it needs "
                                             f"cpn_input=both and fedcp_cpn=true")
        if cfg.cpn_embed_dim != 8 and cfg.cpn_client_vector != "head+embed":
            return "cpn_embed_dim", "sets the embedding of cpn_client_vector=head+embed"
        return None

    def __init__(self, cfg, feature_dim: int, model, num_classes: int):
        self.K, self.num_classes = feature_dim, num_classes
        self.input, self.kind = cfg.cpn_input, cfg.cpn_client_vector
        self.embed_dim = int(cfg.cpn_embed_dim)
        self.extra = 0
        if self.kind == "head+stats":
            self.extra = stats_dim(model, num_classes)
        elif self.kind == "head+embed":
            self.extra = self.embed_dim
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, STREAM_INIT, _FIXED_INPUT_STREAM))
        self.fixed_input = F.normalize(torch.rand(self.K, generator=gen), dim=0) if self.input == "none" else None
        self._stats = {}  # client → s_i (head+stats), computed once from its training rows

    def build_projection(self) -> Optional[nn.Module]:
        """P: Linear(K + extra, K), drawn from the seeded global RNG after the CPN (None: the paper's vector)."""
        return nn.Linear(self.K + self.extra, self.K) if self.extra else None

    def build_embedding(self) -> Optional[nn.Module]:
        return ClientEmbedding(self.embed_dim) if self.kind == "head+embed" else None

    def to(self, device) -> "ClientVector":
        if self.fixed_input is not None:
            self.fixed_input = self.fixed_input.to(device)
        return self

    def values(self, client_state, data, cid: int) -> dict:
        """The per-client constants the policy input reads: v (and, head+stats, s_i)."""
        values = {"v": client_state["v"]}
        if self.kind == "head+stats":
            if cid not in self._stats:
                self._stats[cid] = client_stats(data, self.num_classes).to(client_state["v"].device)
            values["stats"] = self._stats[cid]
        return values

    def policy_input(self, step, h: torch.Tensor) -> torch.Tensor:
        """C for the step's batch (its features h)."""
        if self.input == "sample":
            return h
        if self.input == "none":
            return self.fixed_input.expand_as(h)
        v = F.normalize(step.value("v"), dim=-1)
        if self.input == "client":
            return v.expand_as(h)
        if self.kind == "head":
            return v * h
        extra = step.value("stats") if self.kind == "head+stats" else step.run("emb", h)
        return F.normalize(step.run("vproj", torch.cat([v, extra], dim=-1)), dim=-1) * h


#: ``cpn_client_vector`` head+stats or head+embed: the projection P of [v̂ ; extra] to K, shared with the CPN
PROJECTION = register(PolicyModule("vproj", draw=1, shared=True, build=lambda algo: algo.vector.build_projection()))
#: ``cpn_client_vector=head+embed``: the client's learned embedding e_i, its own (zero at first)
EMBEDDING = register(PolicyModule("emb", draw=3, shared=False, build=lambda algo: algo.vector.build_embedding()))
