"""The policy part of FedCP: the conditional policy network (CPN) and the split it computes.

The CPN maps the policy input C (B, K) to pair logits (B, 2K), viewed as (B, 2, K); a softmax over
the pair at temperature τ gives (s, r), s + r = 1 (paper, eq. 4), with Gumbel noise −log Exp(1)
added to the logits while training (the reference's soft Gumbel-softmax). Designs:

* the paper's ``Linear(K, 2K) → LayerNorm(2K) → ReLU``;
* ``cpn_layers`` / ``cpn_norm`` / ``cpn_act`` (the paper's Table 10): L blocks Linear → norm → act,
  the first K → 2K, the others 2K → 2K;
* ``cpn_hidden`` = H (a light CPN): ``Linear(K, H) → ReLU → Linear(H, 2K) → norm → act``;
* ``cpn_groups`` = G: a second, group-level policy ``Linear(G, 2G) → LayerNorm → ReLU`` on C pooled
  over G contiguous blocks of K/G features, whose pair logits are added to each member feature's;
* ``cpn_hard``: s ∈ {0, 1} forward, the soft policy's gradient backward (straight-through);
* ``fedcp_cpn=false`` (the paper's ablation "w.o. CPN"): no policy, the whole feature goes to both heads.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fedcp_dist.algorithms.fedcp.modules import PolicyModule, register
from fedcp_dist.errors import UserError
from fedcp_dist.models.batchnorm import BatchNorm1d
from fedcp_dist.options import Component, Option, above, at_least, one_of, within

#: the paper's CPN design (cpn_layers, cpn_norm, cpn_act)
PAPER_DESIGN = (1, "layernorm", "relu")


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "batchnorm":  # a batch of one sample is normalised by the running statistics
        return BatchNorm1d(dim)
    if kind == "groupnorm":
        return nn.GroupNorm(2, dim)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown CPN norm {kind!r}")


def make_act(kind: str) -> nn.Module:
    acts = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
    if kind not in acts:
        raise ValueError(f"unknown CPN activation {kind!r}")
    return acts[kind]()


class CPN(nn.Module):
    """Conditional policy network: ``net`` maps C (..., K) to the pair logits (..., 2K).

    ``hidden`` = 0: ``layers`` blocks Linear → norm → act (1, layernorm, relu: the paper's
    Linear(K, 2K) → LayerNorm → ReLU); ``hidden`` = H: the light CPN Linear(K, H) → ReLU →
    Linear(H, 2K) → norm → act."""

    def __init__(self, feature_dim: int, hidden: int = 0, layers: int = 1, norm: str = "layernorm",
                 act: str = "relu"):
        super().__init__()
        self.feature_dim = feature_dim
        k2 = 2 * feature_dim
        if hidden:
            blocks = [nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, k2)]
            blocks += [make_norm(norm, k2), make_act(act)]
        else:
            blocks = []
            for i in range(layers):
                blocks += [nn.Linear(feature_dim if i == 0 else k2, k2), make_norm(norm, k2), make_act(act)]
        self.net = nn.Sequential(*blocks)


def group_cpn(groups: int) -> nn.Module:
    """The group-level policy Linear(G, 2G) → LayerNorm(2G) → ReLU."""
    return nn.Sequential(nn.Linear(groups, 2 * groups), nn.LayerNorm(2 * groups), nn.ReLU())


def cpn_cost(cpn: nn.Module) -> tuple:
    """(parameters, FLOPs per sample) of a CPN: a multiply-add counts 2 FLOPs, Linear layers only
    (2·in·out each; norms, activations and the pair softmax are O(K) and left out)."""
    params = sum(p.numel() for p in cpn.parameters())
    flops = sum(2 * m.in_features * m.out_features for m in cpn.modules() if isinstance(m, nn.Linear))
    return params, flops


class _StraightThrough(torch.autograd.Function):
    """The hard value forward, the gradient to the soft value backward (exactly 0/1 forward)."""

    @staticmethod
    def forward(ctx, soft, hard):
        return hard

    @staticmethod
    def backward(ctx, g):
        return g, None


def policy(logits: torch.Tensor, feature_dim: int, tau: float, noise=None, hard: bool = False,
           entropy: bool = False):
    """(s, r, entropy) from pair logits (..., 2K): a softmax over the pair of (logits + noise(logits))/τ
    (``noise``: Gumbel noise, or None), made 0/1 forward with the soft gradient backward
    (straight-through) when ``hard`` (ties go to the personal part), and the soft policy's entropy
    −Σ_k (s_k log s_k + r_k log r_k) per sample when ``entropy`` (else None). Index 0 of the pair is
    the personal share s."""
    z = logits.view(*logits.shape[:-1], 2, feature_dim)
    if noise is not None:
        z = z + noise(z)
    z = z / tau
    p = torch.softmax(z, dim=-2)
    ent = -(p * torch.log_softmax(z, dim=-2)).sum((-2, -1)) if entropy else None
    if hard:
        first = (z[..., 0:1, :] >= z[..., 1:2, :]).to(p.dtype)
        p = _StraightThrough.apply(p, torch.cat([first, 1.0 - first], dim=-2))
    s, r = p.unbind(-2)  # one node in the graph (two selections would each zero-fill a gradient of p's size)
    return s, r, ent


def group_pool(c: torch.Tensor, groups: int) -> torch.Tensor:
    """The policy input (..., K) pooled per group: the mean of each of ``groups`` contiguous blocks of K/G."""
    return c.view(*c.shape[:-1], groups, c.shape[-1] // groups).mean(-1)


def combine_group_logits(logits: torch.Tensor, group_logits: torch.Tensor, feature_dim: int) -> torch.Tensor:
    """The hierarchical policy's pair logits (..., 2K): feature k's pair plus its group g(k)'s pair
    (group_logits (..., 2G), feature k in group ⌊k·G/K⌋). Their softmax over the pair is
    s_k = s_k^sample·s_g^group / (s_k^sample·s_g^group + r_k^sample·r_g^group), r_k = 1 − s_k."""
    groups = group_logits.shape[-1] // 2
    z = logits.view(*logits.shape[:-1], 2, feature_dim)
    zg = group_logits.view(*group_logits.shape[:-1], 2, groups).repeat_interleave(feature_dim // groups, dim=-1)
    return (z + zg).reshape(logits.shape)


def policy_kl(teacher: torch.Tensor, student: torch.Tensor, feature_dim: int, tau: float) -> torch.Tensor:
    """Σ_k KL((s^T_k, r^T_k) ‖ (s_k, r_k)) per sample: the soft, noiseless policies at temperature τ
    of two pair logits (..., 2K), the teacher's and the student's."""
    zt = teacher.view(*teacher.shape[:-1], 2, feature_dim) / tau
    zs = student.view(*student.shape[:-1], 2, feature_dim) / tau
    log_t = torch.log_softmax(zt, dim=-2)
    return (log_t.exp() * (log_t - torch.log_softmax(zs, dim=-2))).sum((-2, -1))


class Policy(Component):
    """FedCP's conditional policy network (CPN): its design, temperature and noise, and the group-level policy."""

    options = (
        Option("tau", 1.0, "FedCP: Gumbel-softmax temperature τ of the policy", above(0)),
        Option("cpn_train_gumbel", True, "FedCP: add Gumbel noise to the policy during training (the reference does)"),
        Option("cpn_eval_gumbel", False, "FedCP: add Gumbel noise at evaluation too (the reference's stochastic "
               "evaluation)"),
        Option("cpn_hard", False, "FedCP: straight-through hard policy: s ∈ {0, 1} forward (training and evaluation), "
               "the soft Gumbel-softmax gradient backward"),
        Option("cpn_hidden", 0, "FedCP: light CPN Linear(K, H) → ReLU → Linear(H, 2K) → cpn_norm → cpn_act with H = "
               "cpn_hidden (0: the paper's Linear(K, 2K))", within(0, 65_536)),
        Option("cpn_groups", 0, "FedCP: G > 0 (dividing K): a group-level policy Linear(G, 2G) → LayerNorm → ReLU on "
               "the policy input pooled over G contiguous blocks of K/G features (not CNN channels: the feature "
               "vector has none), its pair logits added to each member feature's (0: none)", at_least(0)),
        Option("cpn_layers", 1, "FedCP design (paper, Table 10): fully connected layers in the CPN, 1–4 (each "
               "Linear → cpn_norm → cpn_act; 1 is the paper's)", within(1, 4)),
        Option("cpn_norm", "layernorm", "FedCP design: normalisation in the CPN: layernorm (the paper's) | batchnorm | "
               "groupnorm (2 groups) | none", one_of("layernorm", "batchnorm", "groupnorm", "none")),
        Option("cpn_act", "relu", "FedCP design: activation in the CPN: relu (the paper's) | tanh | sigmoid",
               one_of("relu", "tanh", "sigmoid")),
        Option("fedcp_cpn", True, "FedCP ablation (paper, Table 1): false drops the CPN: the whole feature goes to "
               "both heads"),
    )
    #: keys that act on a CPN: refused where there is none (fedcp_cpn=false)
    cpn_keys = ("tau", "cpn_hard", "cpn_hidden", "cpn_groups", "cpn_layers", "cpn_norm", "cpn_act",
                "cpn_eval_gumbel")

    @classmethod
    def check_config(cls, cfg):
        if cfg.cpn_hidden and cfg.cpn_layers != 1:
            return "cpn_hidden", "is a one-hidden-layer CPN design; cpn_layers must stay 1"
        return None

    def __init__(self, cfg, feature_dim: int):
        self.cfg, self.K = cfg, feature_dim
        self.enabled = bool(cfg.fedcp_cpn)
        self.groups = int(cfg.cpn_groups)
        #: the policy modules on in this run that add to the pair logits (FedCP sets them once built)
        self.extra: list = []

    def build_cpn(self) -> nn.Module:
        """The paper's CPN or the light one (drawn from the seeded global RNG after the model)."""
        cfg = self.cfg
        if cfg.cpn_hidden:
            return CPN(self.K, cfg.cpn_hidden, norm=cfg.cpn_norm, act=cfg.cpn_act)
        return CPN(self.K)

    def redesign(self, cpn: nn.Module) -> nn.Module:
        """The CPN the run trains: a Table 10 design replaces the paper's (drawn after it and the other
        policy modules, an order the recorded results keep); no CPN at all with fedcp_cpn=false."""
        cfg = self.cfg
        if not self.enabled:
            return nn.Module()  # no parameters: nothing trained, uploaded or kept in the global state
        design = (cfg.cpn_layers, cfg.cpn_norm, cfg.cpn_act)
        if design != PAPER_DESIGN and not cfg.cpn_hidden:
            return CPN(self.K, 0, *design)
        return cpn

    def build_groups(self) -> Optional[nn.Module]:
        if not self.groups:
            return None
        if self.K % self.groups:
            raise UserError(f"config key 'cpn_groups': {self.groups} does not divide the feature size K = {self.K}")
        return group_cpn(self.groups)

    def logits(self, step, c: torch.Tensor) -> torch.Tensor:
        """The pair logits (B, 2K) of the trained (or evaluated) CPN on the policy input C, with the
        shares of the policy modules that add to them (:attr:`extra`)."""
        logits = step.run("cpn.net", c)
        for m in self.extra:
            logits = m.logits(self, c, logits, lambda x, name=m.name: step.run(name, x))
        return logits

    def teacher_logits(self, step, c: torch.Tensor, cpn_g: nn.Module, received: dict) -> torch.Tensor:
        """The received (frozen) policy's pair logits on C (``received``: {name: the received copy of a
        shared policy module}; a client's own module is no part of it), without gradient on either path."""
        c = c.detach()
        logits = step.shared(cpn_g.net, c, grad=False)
        for m in (m for m in self.extra if m.shared):
            logits = m.logits(self, c, logits, lambda x, mod=received[m.name]: step.shared(mod, x, grad=False))
        return logits

    def split(self, logits: torch.Tensor, tau: float, noise, entropy: bool):
        """(s, r, entropy or None) of the pair logits."""
        return policy(logits, self.K, tau, noise, hard=self.cfg.cpn_hard, entropy=entropy)


def _group_logits(policy: Policy, c: torch.Tensor, logits: torch.Tensor, apply) -> torch.Tensor:
    return combine_group_logits(logits, apply(group_pool(c, policy.groups)), policy.K)


def _group_note(policy: Policy, module: nn.Module) -> str:
    params, flops = cpn_cost(module)
    return f"group policy (G={policy.groups}): {params} parameters, {flops} FLOPs/sample"


#: ``cpn_groups``: the group-level policy, shared, its pair logits added to each member feature's
GROUP_POLICY = register(PolicyModule("cpng", draw=2, shared=True, build=lambda algo: algo.policy.build_groups(),
                                     logits=_group_logits, note=_group_note))
