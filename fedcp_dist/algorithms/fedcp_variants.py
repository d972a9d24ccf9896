"""FedCP's ablations (paper, section 5) and CPN design variants (paper, appendix C).

One class, :class:`FedCPVariant`, a FedCP whose pieces the config switches; with every switch at
its default it is FedCP itself (``make_algorithm`` then builds plain FedCP). The switches:

* ``cpn_input`` — what the CPN sees: ``both`` C = v̂ ⊙ h (the paper's), ``sample`` C = h (no client
  vector), ``client`` C = v̂ (no sample vector), ``none`` a fixed random vector drawn from the run
  seed (frozen, L2-normalised, the same for every client and sample);
* ``cpn_layers`` / ``cpn_norm`` / ``cpn_act`` — the CPN's design: L blocks Linear → norm → act
  (the first K → 2K, the others 2K → 2K), norm layernorm | batchnorm | groupnorm (2 groups) |
  none, act relu | tanh | sigmoid; the pair softmax over its (B, 2, K) output is unchanged;
* ``fedcp_gfm=false`` — without the frozen global feature extractor module: no MMD term (λ is
  ignored); evaluation still uses the received global extractor, as FedCP's does;
* ``fedcp_cpn=false`` — without the CPN: out = g(h; W_i^hd) + g(h; W^hd), the whole feature to
  both heads; the global state then holds no CPN;
* ``fedcp_global_head=false`` (with ``fedcp_cpn=false``) — without the frozen global head:
  out = g(h; W_i^hd); only the extractor is uploaded (with ``fedcp_gfm=false`` too this is FedPer).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.algorithms.base import freeze
from fedcp_dist.algorithms.fedcp import CPN, FedCP, Heads
from fedcp_dist.options import Option, one_of, within
from fedcp_dist.placement import STREAM_INIT, stream_seed

#: sub-stream of STREAM_INIT for the fixed CPN input of cpn_input=none (0 is the client vector's)
_FIXED_INPUT_STREAM = 1


def is_variant(cfg) -> bool:
    """True when the config asks FedCP for anything but the paper's design."""
    return any(getattr(cfg, o.name, o.default) != o.default for o in FedCPVariant.options)


def _norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "batchnorm":
        return nn.BatchNorm1d(dim)
    if kind == "groupnorm":
        return nn.GroupNorm(2, dim)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown CPN norm {kind!r}")


def _act(kind: str) -> nn.Module:
    acts = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
    if kind not in acts:
        raise ValueError(f"unknown CPN activation {kind!r}")
    return acts[kind]()


class VariantCPN(CPN):
    """The CPN with ``layers`` blocks Linear → norm → act; (1, layernorm, relu) is FedCP's CPN."""

    def __init__(self, feature_dim: int, layers: int = 1, norm: str = "layernorm", act: str = "relu"):
        nn.Module.__init__(self)
        self.feature_dim = feature_dim
        blocks = []
        for i in range(layers):
            blocks += [nn.Linear(feature_dim if i == 0 else 2 * feature_dim, 2 * feature_dim),
                       _norm(norm, 2 * feature_dim), _act(act)]
        self.net = nn.Sequential(*blocks)


class FedCPVariant(FedCP):
    name = "fedcp"
    options = (
        Option("cpn_input", "both", "FedCP variant: CPN input: both (v̂ ⊙ h, the paper's) | sample (h) | client (v̂) | "
               "none (a fixed random vector)", one_of("both", "sample", "client", "none")),
        Option("cpn_layers", 1, "FedCP variant: fully connected layers in the CPN, 1–4 (each Linear → norm → "
               "activation; 1 is the paper's)", within(1, 4)),
        Option("cpn_norm", "layernorm", "FedCP variant: normalisation in the CPN: layernorm (the paper's) | batchnorm | "
               "groupnorm (2 groups) | none", one_of("layernorm", "batchnorm", "groupnorm", "none")),
        Option("cpn_act", "relu", "FedCP variant: activation in the CPN: relu (the paper's) | tanh | sigmoid",
               one_of("relu", "tanh", "sigmoid")),
        Option("fedcp_gfm", True, "FedCP ablation: false drops the frozen global feature extractor module and its "
               "MMD term (λ ignored)"),
        Option("fedcp_cpn", True, "FedCP ablation: false drops the CPN: the whole feature goes to both heads"),
        Option("fedcp_global_head", True, "FedCP ablation: false drops the frozen global head (needs fedcp_cpn=false; "
               "only the extractor is shared)"),
    )

    @classmethod
    def check_config(cls, cfg):
        if not cfg.fedcp_global_head and cfg.fedcp_cpn:
            return "fedcp_global_head", "false needs fedcp_cpn=false too: the CPN splits features between the two heads"
        if cfg.method == "fedcp" and not cfg.fedcp_cpn and (cfg.analysis or cfg.analysis_every):
            return "analysis", "the probes measure the CPN's policy (PIR, s), and fedcp_cpn=false has none"
        return None

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.cpn_input = getattr(cfg, "cpn_input", "both")
        self.use_cpn = bool(getattr(cfg, "fedcp_cpn", True))
        self.use_global_head = bool(getattr(cfg, "fedcp_global_head", True))
        if not self.use_global_head and self.use_cpn:
            raise ValueError("fedcp_global_head=false needs fedcp_cpn=false")
        if not getattr(cfg, "fedcp_gfm", True):
            # without the global feature module FedCP is FedCP with λ = 0: the MMD term is never built
            self.cfg = copy.copy(cfg)
            self.cfg.lam = 0.0
        if not self.use_cpn:
            self.cpn = nn.Module()  # no parameters: nothing trained, uploaded or kept in the global state
        else:
            design = (getattr(cfg, "cpn_layers", 1), getattr(cfg, "cpn_norm", "layernorm"), getattr(cfg, "cpn_act", "relu"))
            if design != (1, "layernorm", "relu"):
                # drawn from the seeded global RNG after FedCP's own CPN: the same on every rank
                self.cpn = VariantCPN(self.K, *design).to(device)
        self.cpn_g = freeze(copy.deepcopy(self.cpn)).eval()  # batchnorm: running statistics at evaluation
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, STREAM_INIT, _FIXED_INPUT_STREAM))
        self._fixed_input = F.normalize(torch.rand(self.K, generator=gen), dim=0).to(device)
        self.gs = self.init_global_state()
        self._declare_phases()

    def upload_keys(self, global_state):
        if self.use_global_head:
            return list(global_state)
        return [k for k in global_state if k.startswith("features.")]

    def policy_input(self, step, h):
        if self.cpn_input == "both":
            return super().policy_input(step, h)
        if self.cpn_input == "sample":
            return h
        if self.cpn_input == "client":
            return F.normalize(step.value("v"), dim=-1).expand_as(h)
        return self._fixed_input.expand_as(h)

    def heads(self, step, gumbel):
        if self.use_cpn:
            return super().heads(step, gumbel)
        h = step.run("features", step.x)
        return Heads(step.run("head", h), step.shared(self.head_g, h) if self.use_global_head else None, h, None)

    def finish(self, client_state, outcomes, ctx):
        res = super().finish(client_state, outcomes, ctx)
        if not self.use_global_head:
            res.upload = {k: t for k, t in res.upload.items() if k.startswith("features.")}
        return res
