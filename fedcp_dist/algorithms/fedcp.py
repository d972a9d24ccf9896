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

Practitioners' switches (each off by default, docs/methods.md "FedCP extensions: the policy and its
training"): the MMD kernel (``mmd_kernel``, ``mmd_sigma``, ``mmd_bandwidths``), an entropy term on
the policy (``policy_entropy``), a CPN warm-up and its own learning rate and schedule
(``cpn_warmup_rounds``, ``cpn_lr``, ``cpn_lr_schedule``, ``cpn_lr_min``), an annealed Gumbel
temperature and a straight-through hard policy (``tau_final``, ``tau_anneal``, ``cpn_hard``) and a
light CPN with a hidden layer (``cpn_hidden``). Every schedule is a function of the round number
alone, so a resumed run takes the same values.
"""
from __future__ import annotations

import copy
import math
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.errors import UserError
from fedcp_dist.algorithms.base import LocalResult, SGDAlgorithm, freeze, load_module, module_state
from fedcp_dist.local_train import ClientPhase, Phase, Step, split_policy
from fedcp_dist.losses import MEDIAN, MMD_BANDWIDTHS
from fedcp_dist.options import Option, above, at_least, one_of, within
from fedcp_dist.placement import STREAM_INIT, stream_seed


class Heads(NamedTuple):
    """What the personalized model computes on a batch."""

    personal: torch.Tensor  # the personal head's logits, g(s ⊙ h; W_i^hd)
    glob: Optional[torch.Tensor]  # the frozen global head's logits, g(r ⊙ h; W^hd) (None: no global head)
    h: torch.Tensor  # the feature
    s: Optional[torch.Tensor]  # the personal share of each feature (None: no CPN); r = 1 − s
    #: Σ_k −(s_k log s_k + r_k log r_k) per sample, of the soft policy (only where the loss needs it)
    entropy: Optional[torch.Tensor] = None
    c: Optional[torch.Tensor] = None  # the policy's input C
    policy_logits: Optional[torch.Tensor] = None  # the pair logits (..., 2K) the policy is the softmax of

    @property
    def logits(self) -> torch.Tensor:
        return self.personal if self.glob is None else self.personal + self.glob


def gumbel_noise(generator):
    """Gumbel(0, 1) noise shaped like its argument, as −log Exp(1), from ``generator``."""
    return lambda t: torch.empty_like(t).exponential_(generator=generator).log_().neg_()


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "batchnorm":
        return nn.BatchNorm1d(dim)
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
    """Conditional policy network: C (B, K) → (s, r), each (B, K), s + r = 1.

    ``hidden`` = 0: the paper's Linear(K, 2K) → norm → act; ``hidden`` = H: the light CPN
    Linear(K, H) → ReLU → Linear(H, 2K) → norm → act (norm and act: LayerNorm and ReLU unless a
    variant configures them)."""

    def __init__(self, feature_dim: int, hidden: int = 0, norm: str = "layernorm", act: str = "relu"):
        super().__init__()
        self.feature_dim = feature_dim
        k2 = 2 * feature_dim
        if hidden:
            self.net = nn.Sequential(nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, k2),
                                     make_norm(norm, k2), make_act(act))
        else:
            self.net = nn.Sequential(nn.Linear(feature_dim, k2), nn.LayerNorm(k2), nn.ReLU())

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


def cpn_cost(cpn: nn.Module) -> tuple:
    """(parameters, FLOPs per sample) of a CPN: a multiply-add counts 2 FLOPs, Linear layers only
    (2·in·out each; norms, activations and the pair softmax are O(K) and left out)."""
    params = sum(p.numel() for p in cpn.parameters())
    flops = sum(2 * m.in_features * m.out_features for m in cpn.modules() if isinstance(m, nn.Linear))
    return params, flops


def annealed_tau(tau: float, tau_final: Optional[float], kind: str, t: int, rounds: int) -> float:
    """τ of round t (0-based) of ``rounds``: ``tau`` in round 0, ``tau_final`` in the last round;
    exponential τ_t = τ·(τ_final/τ)^(t/(T−1)) or linear τ_t = τ + (τ_final − τ)·t/(T−1).
    ``tau_final`` None: ``tau`` in every round."""
    if tau_final is None:
        return tau
    f = min(max(t, 0), rounds - 1) / (rounds - 1) if rounds > 1 else 0.0
    if kind == "linear":
        return tau + (float(tau_final) - tau) * f
    return tau * (float(tau_final) / tau) ** f


def cpn_rate(lr: float, cpn_lr: Optional[float], schedule: str, lr_min: float, warmup: int, t: int,
             rounds: int) -> Optional[float]:
    """The CPN's learning rate in round t (0-based); None in the warm-up rounds t < W (frozen).

    ``constant``: cpn_lr (None: lr); ``cosine``: η_min + (η − η_min)·(1 + cos(π·(t − W)/(T − 1 − W)))/2,
    η in the first round after the warm-up, η_min in the last round (η throughout if only one round
    is left after the warm-up)."""
    if t < warmup:
        return None
    base = lr if cpn_lr is None else float(cpn_lr)
    span = rounds - 1 - warmup
    if schedule != "cosine" or span <= 0:
        return base
    f = min(t - warmup, span) / span
    return lr_min + (base - lr_min) * 0.5 * (1.0 + math.cos(math.pi * f))


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
    """(s, r, entropy) from a CPN output (..., 2K): :func:`split_policy`'s softmax over the pair,
    made 0/1 forward with the soft gradient backward (straight-through) when ``hard`` (ties go to
    the personal part), and the soft policy's entropy −Σ_k (s_k log s_k + r_k log r_k) per sample
    when ``entropy`` (else None)."""
    z = logits.view(*logits.shape[:-1], 2, feature_dim)
    if noise is not None:
        z = z + noise(z)
    z = z / tau
    p = torch.softmax(z, dim=-2)
    ent = -(p * torch.log_softmax(z, dim=-2)).sum((-2, -1)) if entropy else None
    if hard:
        first = (z[..., 0:1, :] >= z[..., 1:2, :]).to(p.dtype)
        p = _StraightThrough.apply(p, torch.cat([first, 1.0 - first], dim=-2))
    return p[..., 0, :], p[..., 1, :], ent


def policy_kl(teacher: torch.Tensor, student: torch.Tensor, feature_dim: int, tau: float) -> torch.Tensor:
    """Σ_k KL((s^T_k, r^T_k) ‖ (s_k, r_k)) per sample: the soft, noiseless policies at temperature τ
    of two CPN outputs (..., 2K), the teacher's and the student's."""
    zt = teacher.view(*teacher.shape[:-1], 2, feature_dim) / tau
    zs = student.view(*student.shape[:-1], 2, feature_dim) / tau
    log_t = torch.log_softmax(zt, dim=-2)
    return (log_t.exp() * (log_t - torch.log_softmax(zs, dim=-2))).sum((-2, -1))


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


def _number_or_median(v) -> Optional[str]:
    if v == MEDIAN or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        return None
    return f"must be a number > 0 or median, got {v!r}"


def _bandwidth_list(v) -> Optional[str]:
    if v is None:
        return None
    ok = isinstance(v, list) and v and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                           and math.isfinite(a) and a > 0 for a in v)
    return None if ok else f"must be null or a non-empty list of numbers > 0, got {v!r}"


def _positive_or_null(v) -> Optional[str]:
    ok = v is None or (math.isfinite(v) and v > 0)
    return None if ok else f"must be null or a number > 0, got {v!r}"


#: the value prefixes of the policy's trained networks: the CPN, the client vector's projection and the
#: group-level CPN;
#: the warm-up freezes them and cpn_lr is their rate
POLICY_PREFIXES = ("cpn.", "vproj.", "cpng.")
#: the extension keys that act on the CPN (refused where there is none: fedcp_cpn=false)
_CPN_KEYS = ("policy_entropy", "cpn_warmup_rounds", "cpn_lr", "cpn_lr_schedule", "cpn_lr_min", "tau_final",
             "tau_anneal", "cpn_hard", "cpn_hidden", "policy_refresh_every", "cpn_distill", "cpn_upload_every",
             "cpn_groups", "cpn_async_min_rate")
#: the global-state prefix of Θ_prev, the policy's networks as refreshed before the last refresh
PREV = "prev."


def refresh_alpha(t: int, every: int) -> float:
    """α of round t (0-based) under ``policy_refresh_every`` = P: j/P with j = t mod P (0 in a
    refresh round, whose clients start from Θ_last: α = 1 of the pair before it, 0 of the pair after)."""
    return (t % every) / every


def interpolate(prev: torch.Tensor, last: torch.Tensor, alpha: float) -> torch.Tensor:
    """Θ = Θ_prev + α(Θ_last − Θ_prev) (Θ_last itself at α = 1, Θ_prev at α = 0)."""
    if alpha == 0:
        return prev
    if alpha == 1:
        return last
    return prev + alpha * (last - prev)


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
        Option("mmd_kernel", "multi", "FedCP: MMD kernel: multi (Σ_a exp(−d/2a) over mmd_bandwidths, the reference's) | "
               "rbf (exp(−d/2σ²), σ = mmd_sigma)", one_of("multi", "rbf")),
        Option("mmd_sigma", MEDIAN, "FedCP: σ of mmd_kernel=rbf: a number, or median (the median pairwise distance "
               "of the batch's pooled features)", _number_or_median, kind=Union[float, str]),
        Option("mmd_bandwidths", None, "FedCP: the bandwidths a of mmd_kernel=multi (null: 10, 15, 20, 50, the "
               "reference's)", _bandwidth_list, kind=Optional[list]),
        Option("policy_entropy", 0.0, "FedCP: β of the policy entropy term β·mean Σ_k −(s_k log s_k + r_k log r_k) "
               "added to the loss: > 0 pushes the policy to 0/1 splits, < 0 towards 0.5"),
        Option("cpn_warmup_rounds", 0, "FedCP: the first W rounds train extractor and heads with the CPN frozen at "
               "the initial global CPN", at_least(0)),
        Option("cpn_lr", None, "FedCP: the CPN's learning rate (null: lr)", _positive_or_null, kind=Optional[float]),
        Option("cpn_lr_schedule", "constant", "FedCP: the CPN's rate over the rounds after the warm-up: constant | "
               "cosine (to cpn_lr_min in the last round)", one_of("constant", "cosine")),
        Option("cpn_lr_min", 0.0, "FedCP: the CPN's rate in the last round with cpn_lr_schedule=cosine", at_least(0)),
        Option("tau_final", None, "FedCP: anneal τ per round from tau (first round) to tau_final (last round); "
               "null: τ fixed", _positive_or_null, kind=Optional[float]),
        Option("tau_anneal", "exponential", "FedCP: the anneal of τ to tau_final: exponential | linear",
               one_of("exponential", "linear")),
        Option("cpn_hard", False, "FedCP: straight-through hard policy: s ∈ {0, 1} forward (training and "
               "evaluation), the soft Gumbel-softmax gradient backward"),
        Option("cpn_hidden", 0, "FedCP: light CPN Linear(K, H) → ReLU → Linear(H, 2K) → norm → act with H = "
               "cpn_hidden (0: the paper's Linear(K, 2K))", at_least(0)),
        Option("policy_refresh_every", 1, "FedCP: P: the CPN is trained, uploaded and aggregated only in rounds t with "
               "t mod P = 0; in between it is frozen at Θ_prev + (t mod P)/P·(Θ_last − Θ_prev) of the last two "
               "refreshed global CPNs (1: every round, the paper's)", at_least(1)),
        Option("cpn_distill", 0.0, "FedCP: κ of the policy distillation term κ·mean Σ_k KL(teacher policy ‖ own "
               "policy), the teacher being the last aggregated (received) CPN", at_least(0)),
        Option("cpn_upload_every", 1, "FedCP: U: clients upload the CPN (and the server aggregates it) only in rounds "
               "t with t mod U = 0; they train it every round", at_least(1)),
        Option("cpn_groups", 0, "FedCP: G > 0 (dividing K): a group-level policy Linear(G, 2G) → LayerNorm → ReLU on "
               "the policy input pooled over G contiguous blocks, combined with the feature-level one (0: none)",
               at_least(0)),
        Option("cpn_async_min_rate", 0.0, "FedCP: q: a client whose participation rate so far (rounds it trained in "
               "before this one / rounds before this one) is below q trains with the CPN frozen and uploads none; "
               "the CPN is averaged over the clients that trained it (0: off)", within(0, 1)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.cpn_client_vector != "head":
            if cfg.fused is True:
                return "cpn_client_vector", f"{cfg.cpn_client_vector} trains on the sequential path: set fused=false or auto"
            if getattr(cfg, "cpn_input", "both") != "both" or not getattr(cfg, "fedcp_cpn", True):
                return "cpn_client_vector", (f"{cfg.cpn_client_vector} extends the CPN's client vector: it needs "
                                             f"cpn_input=both and fedcp_cpn=true")
        if not getattr(cfg, "fedcp_cpn", True):
            for key in _CPN_KEYS:
                if getattr(cfg, key) != next(o.default for o in FedCP.options if o.name == key):
                    return key, "acts on the CPN, but fedcp_cpn=false has none"
        if cfg.mmd_kernel == "rbf" and cfg.mmd_bandwidths is not None:
            return "mmd_bandwidths", "sets the kernels of mmd_kernel=multi; rbf takes mmd_sigma"
        if cfg.mmd_kernel == "multi" and cfg.mmd_sigma != MEDIAN:
            return "mmd_sigma", "sets the kernel of mmd_kernel=rbf; multi takes mmd_bandwidths"
        if cfg.cpn_warmup_rounds and cfg.cpn_warmup_rounds >= cfg.rounds:
            return "cpn_warmup_rounds", f"must be < rounds ({cfg.rounds}): the CPN would never train"
        if cfg.cpn_lr_schedule == "constant" and cfg.cpn_lr_min != 0:
            return "cpn_lr_min", "applies to cpn_lr_schedule=cosine only"
        if cfg.cpn_lr_min > (cfg.lr if cfg.cpn_lr is None else cfg.cpn_lr):
            return "cpn_lr_min", "must not exceed the CPN's rate (cpn_lr, else lr)"
        if cfg.tau_final is None and cfg.tau_anneal != "exponential":
            return "tau_anneal", "needs tau_final"
        if cfg.cpn_hidden and getattr(cfg, "cpn_layers", 1) != 1:
            return "cpn_hidden", "is a one-hidden-layer CPN design; cpn_layers must stay 1"
        if cfg.policy_refresh_every > 1:
            if cfg.cpn_warmup_rounds:
                return "policy_refresh_every", "freezes the CPN between refreshes itself: it does not combine with cpn_warmup_rounds"
            if cfg.compress != "none":
                return "policy_refresh_every", "skips the CPN's uploads, which compress does not account: use compress=none"
            if cfg.cpn_upload_every > 1 or cfg.cpn_distill:
                key = "cpn_upload_every" if cfg.cpn_upload_every > 1 else "cpn_distill"
                return key, "does not combine with policy_refresh_every (the CPN is frozen at the cached policy between refreshes)"
        if cfg.cpn_async_min_rate > 0:
            if cfg.policy_refresh_every > 1 or cfg.cpn_upload_every > 1:
                return "cpn_async_min_rate", "does not combine with policy_refresh_every or cpn_upload_every"
            if cfg.compress != "none":
                return "cpn_async_min_rate", "leaves CPNs out of some uploads, which compress does not handle: use compress=none"
        if cfg.cpn_upload_every > 1 and cfg.compress != "none":
            return "cpn_upload_every", "skips the CPN's uploads, which compress does not account: use compress=none"
        return None

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.K = model.feature_dim
        # drawn from the same seeded global RNG as the model
        if cfg.cpn_hidden:
            self.cpn = CPN(self.K, cfg.cpn_hidden, getattr(cfg, "cpn_norm", "layernorm"),
                           getattr(cfg, "cpn_act", "relu")).to(device)
        else:
            self.cpn = CPN(self.K).to(device)
        self._tau = cfg.tau  # this round's temperature (annealed: set per round in phases and evaluation)
        if cfg.mmd_kernel == "rbf":
            self._bandwidths = MEDIAN if cfg.mmd_sigma == MEDIAN else (float(cfg.mmd_sigma) ** 2,)
        else:
            self._bandwidths = MMD_BANDWIDTHS if cfg.mmd_bandwidths is None else tuple(float(a) for a in cfg.mmd_bandwidths)
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
        self.cpng = None
        if cfg.cpn_groups:  # drawn after the CPN and the projection: the default draws nothing more
            if self.K % cfg.cpn_groups:
                raise UserError(f"config key 'cpn_groups': {cfg.cpn_groups} does not divide the feature size "
                                f"K = {self.K}")
            g = int(cfg.cpn_groups)
            self.cpng = nn.Sequential(nn.Linear(g, 2 * g), nn.LayerNorm(2 * g), nn.ReLU()).to(device)
            self.cpng_g = freeze(copy.deepcopy(self.cpng))
        self._stats = {}  # client → s_i (head+stats), computed once from its training rows
        # selection_vector=features: the loss tallies Σ h (float64) in every round; finish keeps its mean
        self.track_features = cfg.selection_vector == "features"
        self.fe = model.features.to(device)  # W_i^fe, trained
        self.head_p = model.head.to(device)  # W_i^hd, trained
        # received global parts, frozen: the MMD reference, the global head, and what evaluation uses
        self.fe_g = freeze(copy.deepcopy(self.fe)).eval()  # BatchNorm: running statistics at evaluation
        self.head_g = freeze(copy.deepcopy(self.head_p))
        self.cpn_g = freeze(copy.deepcopy(self.cpn))
        self._init_head = module_state("head.", self.head_p)
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, STREAM_INIT))
        self._init_v = torch.rand(self.K, generator=gen).to(device)
        self._round = 0  # the round being run (begin_round): the server update's refresh schedule
        self._eval_policy_round = None  # the round whose interpolated policy evaluation holds (refresh)
        self.gs = self.init_global_state()
        self._declare_phases()

    def _declare_phases(self) -> None:
        """The training phase and the evaluated model's modules (again after a subclass swaps the CPN)."""
        modules = {"features.": self.fe, "cpn.": self.cpn, "head.": self.head_p}
        if self.vproj is not None:
            modules["vproj."] = self.vproj
        if self.cpng is not None:
            modules["cpng."] = self.cpng
        if self.emb_p is not None:
            modules["emb."] = self.emb_p
        # the distillation's teacher: the received CPN (and group CPN), applied alike to every client
        shared = (self.fe_g, self.head_g)
        if self.cfg.cpn_distill:
            shared += (self.cpn_g,) + ((self.cpng_g,) if self.cpng is not None else ())
        # selection_vector=features: every round's Σ h over the samples trained on (their mean is kept)
        tallied = ("h",) if self.track_features else ()
        self.train_phase = Phase(
            "train", self.loss, modules,
            trainable=tuple(p + n for p, m in modules.items() for n, t in m.named_parameters() if t.requires_grad),
            epochs=self.cfg.local_epochs, shared=shared, tallied=tallied)
        # the CPN warm-up: the same loss, the policy's networks (the CPN and, with an extended client
        # vector, its projection) constants: they keep the received global values
        self.warmup_phase = Phase(
            "train-cpn-frozen", self.loss, modules,
            trainable=tuple(n for n in self.train_phase.trainable if not n.startswith(POLICY_PREFIXES)),
            epochs=self.cfg.local_epochs, shared=shared, tallied=tallied)
        self.training_phases = [self.train_phase]
        self.eval_modules = {"features.": self.fe_g, "cpn.": self.cpn_g, "head.": self.head_p}
        if self.vproj is not None:
            self.eval_modules["vproj."] = self.vproj_g
        if self.cpng is not None:
            self.eval_modules["cpng."] = self.cpng_g
        if self.emb_p is not None:
            self.eval_modules["emb."] = self.emb_p
        self.keys = {p: list(module_state(p, m)) for p, m in modules.items()}

    # -- state ------------------------------------------------------------
    def init_global_state(self):
        state = {**module_state("features.", self.fe), **module_state("head.", self.head_p), **module_state("cpn.", self.cpn)}
        if getattr(self, "vproj", None) is not None:
            state.update(module_state("vproj.", self.vproj))
        if getattr(self, "cpng", None) is not None:
            state.update(module_state("cpng.", self.cpng))
        if self.cfg.policy_refresh_every > 1:  # Θ_prev, as Θ_last (the cpn./vproj. values) at the start
            state.update({PREV + k: v.clone() for k, v in state.items() if k.startswith(POLICY_PREFIXES)})
        return state

    def set_global(self, global_state):
        load_module(self.fe_g, global_state, "features.")
        load_module(self.head_g, global_state, "head.")
        load_module(self.cpn_g, global_state, "cpn.")
        if self.vproj is not None:
            load_module(self.vproj_g, global_state, "vproj.")
        if self.cpng is not None:
            load_module(self.cpng_g, global_state, "cpng.")
        self.gs = global_state
        self._eval_policy_round = None

    # -- policy caching (policy_refresh_every) and skipped CPN uploads ---------------------
    def upload_keys(self, global_state):
        """Every global value but Θ_prev (the server keeps it)."""
        return [k for k in global_state if not k.startswith(PREV)]

    def aggregation_groups(self, upload_keys):
        """With a switch that leaves the policy's networks out of uploads (the warm-up, caching,
        cpn_upload_every, the asynchronous CPN) they form their own group: averaged over the
        clients that sent them, and out of the all-reduce in rounds nobody sends them."""
        cfg = self.cfg
        if not (cfg.cpn_async_min_rate or cfg.cpn_warmup_rounds or cfg.policy_refresh_every > 1
                or cfg.cpn_upload_every > 1):
            return None
        return {k: "policy" for k in upload_keys if k.startswith(POLICY_PREFIXES)}

    def skipped_groups(self, t: int) -> tuple:
        """Round t's clients send no policy networks in a warm-up round (t < W) and in a round that
        does not upload them (caching between refreshes, cpn_upload_every)."""
        return ("policy",) if t < self.cfg.cpn_warmup_rounds or not self.policy_uploaded(t) else ()

    def async_frozen(self, client_state, t: int) -> bool:
        """Whether the client trains with its CPN frozen in round t: its participation rate so far
        (rounds it trained in before t, over t) is below cpn_async_min_rate (round 0: rate 1)."""
        q = self.cfg.cpn_async_min_rate
        return bool(q) and t > 0 and float(client_state["participations"]) / t < q

    def begin_round(self, t: int) -> None:
        self._round = t

    def policy_trained(self, t: int) -> bool:
        """Whether round t's clients train the policy's networks (and upload them): a refresh round."""
        return t % self.cfg.policy_refresh_every == 0

    def policy_uploaded(self, t: int) -> bool:
        """Whether round t's clients upload the policy's networks and the server aggregates them."""
        return self.policy_trained(t) and t % self.cfg.cpn_upload_every == 0

    def policy_values(self, t: int) -> dict:
        """The policy's networks' values of round t: Θ_last (the global values) in a refresh round,
        else Θ_prev + α(Θ_last − Θ_prev) with α = (t mod P)/P."""
        keys = [k for k in self.gs if k.startswith(POLICY_PREFIXES)]
        alpha = refresh_alpha(t, self.cfg.policy_refresh_every)
        if alpha == 0:
            return {k: self.gs[k] for k in keys}
        return {k: interpolate(self.gs[PREV + k], self.gs[k], alpha) for k in keys}

    def _load_eval_policy(self, t: int) -> None:
        """The evaluated CPN (and projection) of round t's policy (refresh: interpolated)."""
        if self.cfg.policy_refresh_every == 1 or self._eval_policy_round == t:
            return
        values = self.policy_values(t)
        load_module(self.cpn_g, values, "cpn.")
        if self.vproj is not None:
            load_module(self.vproj_g, values, "vproj.")
        if self.cpng is not None:
            load_module(self.cpng_g, values, "cpng.")
        self._eval_policy_round = t

    def server_update(self, global_state, averaged):
        """The sample-weighted mean (the policy's networks are in it only in the rounds that upload
        them: else they stay as they were); caching's refresh round also sets Θ_prev ← Θ_last."""
        new = super().server_update(global_state, averaged)
        if self.cfg.policy_refresh_every > 1 and self.policy_uploaded(self._round):
            new.update({PREV + k: global_state[k] for k in new if k.startswith(POLICY_PREFIXES)})
        return new

    def init_client_state(self, client):
        """A copy of the initial global head, and one random client vector from the run seed
        (head+embed: and a zero embedding)."""
        state = {**{k: v.clone() for k, v in self._init_head.items()}, "v": self._init_v.clone()}
        if self.cfg.cpn_async_min_rate:  # the rounds it has trained in
            state["participations"] = torch.zeros(1, device=self._init_v.device)
        if self.emb_p is not None:
            state["emb.e"] = torch.zeros_like(self.emb_p.e.detach())
        if self.track_features:  # selection_vector=features: no features seen yet
            state["fmean"] = torch.zeros_like(self._init_v)
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
        if self.cfg.cpn_async_min_rate:
            return "cpn_async_min_rate freezes some clients' CPN: they train one at a time"
        if self.vector_kind != "head":
            return f"cpn_client_vector={self.vector_kind} trains one client at a time"
        return super().fused_reason()

    has_client_vector = True

    @property
    def client_vector_dim(self) -> int:
        return self.K

    def client_vector(self, client_state):
        """v_i: the column sums of the personal head's weight after the client's last round (the
        random initial vector before it has trained); with ``selection_vector=features`` the mean
        of its features h over the samples of its last local training (zero before it has trained)."""
        if self.track_features:
            return torch.zeros_like(self._init_v) if client_state is None else client_state["fmean"]
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
        c = self.policy_input(step, h)
        logits = step.run("cpn.net", c)
        cfg, ent = self.cfg, None
        if self.cpng is not None:
            logits = combine_group_logits(logits, step.run("cpng", group_pool(c, cfg.cpn_groups)), self.K)
        if cfg.cpn_hard or cfg.policy_entropy:
            s, r, ent = policy(logits, self.K, self._tau, noise, hard=cfg.cpn_hard, entropy=bool(cfg.policy_entropy))
        else:
            s, r = split_policy(logits, self.K, self._tau, noise)
        return Heads(step.run("head", s * h), step.shared(self.head_g, r * h), h, s, ent, c, logits)

    def teacher_logits(self, step, c):
        """The received (last aggregated) CPN's pair logits on the policy input C, without gradient."""
        c = c.detach()  # no gradient through the teacher on either path
        logits = step.shared(self.cpn_g.net, c, grad=False)
        if self.cpng is None:
            return logits
        return combine_group_logits(logits, step.shared(self.cpng_g, group_pool(c, self.cfg.cpn_groups), grad=False),
                                    self.K)

    def loss(self, step):
        """CE(personalized output) + λ·MMD²(h, h of the frozen received extractor, batch statistics)
        [+ β·mean policy entropy] [+ κ·mean Σ_k KL(teacher policy ‖ own policy)]."""
        cfg = self.cfg
        out = self.heads(step, cfg.cpn_train_gumbel)
        if self.track_features:  # selection_vector=features: the batch's Σ h (in float64), every round
            step.tally("h", out.h, dtype=torch.float64)
        if out.s is not None and step.tallies is not None:  # probing: Σ over the batch of s̄ = (1/K) Σ_k s^k
            step.tally("s", out.s.detach().mean(dim=-1))
        loss = step.cross_entropy(out.logits)
        if cfg.lam > 0:
            h_g = step.shared(self.fe_g, step.x, grad=False, batch_stats=True)
            loss = loss + cfg.lam * step.mmd2(out.h, h_g, self._bandwidths)
        if out.entropy is not None:
            loss = loss + cfg.policy_entropy * step.mean(out.entropy)
        if cfg.cpn_distill:
            kl = policy_kl(self.teacher_logits(step, out.c), out.policy_logits, self.K, self._tau)
            loss = loss + cfg.cpn_distill * step.mean(kl)
        return loss
    # -- the per-round schedules (functions of the round number: a resumed run takes the same) ----
    def tau_at(self, t: int) -> float:
        cfg = self.cfg
        return annealed_tau(cfg.tau, cfg.tau_final, cfg.tau_anneal, t, cfg.rounds)

    def cpn_rate_at(self, t: int) -> Optional[float]:
        cfg = self.cfg
        return cpn_rate(cfg.lr, cfg.cpn_lr, cfg.cpn_lr_schedule, cfg.cpn_lr_min, cfg.cpn_warmup_rounds, t, cfg.rounds)

    def _sgd_kwargs(self, ctx=None):
        kw = super()._sgd_kwargs(ctx)
        cfg = self.cfg
        if ctx is not None and (cfg.cpn_lr is not None or cfg.cpn_lr_schedule != "constant"):
            rate = self.cpn_rate_at(ctx.round)
            if rate is not None:
                kw["param_lr"] = {p: rate for p in POLICY_PREFIXES}
        return kw

    def describe(self) -> str:
        params, flops = cpn_cost(self.cpn)
        design = f"light, H={self.cfg.cpn_hidden}" if self.cfg.cpn_hidden else "Linear(K, 2K)"
        line = f"CPN ({design}, K={self.K}): {params} parameters, {flops} FLOPs/sample"
        if self.cpng is not None:
            gp, gf = cpn_cost(self.cpng)
            line += f"; group policy (G={self.cfg.cpn_groups}): {gp} parameters, {gf} FLOPs/sample"
        return line


    # -- local training ---------------------------------------------------
    def phases(self, client_state, data, ctx):
        k = self.keys
        start = {**{n: self.gs[n] for n in (*k["features."], *k["cpn."])}, **{n: client_state[n] for n in k["head."]},
                 "v": client_state["v"]}
        if self.vproj is not None:
            start.update({n: self.gs[n] for n in k["vproj."]})
            start.update(self._client_values(client_state, data, ctx.client))
        if self.cpng is not None:
            start.update({n: self.gs[n] for n in k["cpng."]})
        if self.emb_p is not None:
            start.update({n: client_state[n] for n in k["emb."]})
        self._tau = self.tau_at(ctx.round)
        phase = self.warmup_phase if ctx.round < self.cfg.cpn_warmup_rounds else self.train_phase
        if not self.policy_trained(ctx.round):  # between refreshes: the interpolated policy, frozen
            start.update(self.policy_values(ctx.round))
            phase = self.warmup_phase
        frozen = self.async_frozen(client_state, ctx.round)
        if frozen:
            phase = self.warmup_phase
        return [(phase, ClientPhase(start, info={"async_frozen": frozen}))]

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
            if self.cpng is not None:
                upload.update({n: v[n] for n in k["cpng."]})
            skipped = ()
            if self.cfg.cpn_async_min_rate:
                new_state["participations"] = client_state["participations"] + 1
                if o.info.get("async_frozen"):  # trained with the CPN frozen: sends none
                    skipped = ("policy",)
            if skipped or self.skipped_groups(ctx.round):  # not sent (nobody sends it this round)
                upload = {n: t for n, t in upload.items() if not n.startswith(POLICY_PREFIXES)}
            if self.emb_p is not None:
                new_state.update({n: v[n] for n in k["emb."]})
            tallies = o.tallies
            if self.track_features:  # the mean of h over every sample the local training saw
                tallies = dict(tallies)
                h_sum = tallies.pop("h", None)
                if h_sum is not None:
                    new_state["fmean"] = (h_sum / max(o.samples, 1)).to(self._init_v.dtype)
                else:  # no step (no training samples): its features are still unseen
                    new_state["fmean"] = torch.zeros_like(self._init_v)
        # probing: the trained values (no copies) for the loss after local learning
        return LocalResult(upload=upload, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples,
                           extra={"trained": v} if ctx.probe else {}, tallies=tallies, skipped=skipped)

    # -- evaluation -------------------------------------------------------
    def _eval_heads(self, client_state, x, ctx):
        # evaluation before round t sees the model of round t − 1: that round's temperature
        self._tau = self.tau_at(ctx.round - 1)
        self._load_eval_policy(ctx.round)  # evaluation before round t: the policy round t starts from
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
        self._load_eval_policy(ctx.round)
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
