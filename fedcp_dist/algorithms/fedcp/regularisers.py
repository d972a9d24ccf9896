"""The terms FedCP adds to the cross-entropy of its personalized output, one part each.

* :class:`MMD` — λ·MMD²(h, h_g) between the client's features and those of the frozen received
  extractor (batch statistics), the paper's global feature module (GFM). Kernels: ``multi``
  Σ_a exp(−d/(2a)) over the bandwidths a (the reference's 10, 15, 20, 50) on squared distances d;
  ``rbf`` exp(−d/(2σ²)) with σ a number or the batch's median pairwise distance. Both take squared
  distances, so σ² plays the part of a bandwidth a (a practitioner's RBF on plain distances would
  differ; the squared form keeps one code path for both kernels). ``fedcp_gfm=false`` (the paper's
  "w.o. GFM") drops the module and its term.
* :class:`Entropy` — β·mean Σ_k −(s_k log s_k + r_k log r_k): the entropy of each feature's pair (s, r),
  not of s alone, since s and r are the two outcomes of one split.
* :class:`Distillation` — κ·mean Σ_k KL(teacher ‖ own) of the soft, noiseless policies, the teacher being
  the last aggregated (received) CPN.
"""
from __future__ import annotations

import math
from typing import Optional, Union

from fedcp_dist.algorithms.fedcp.cpn import policy_kl
from fedcp_dist.losses import MEDIAN, MMD_BANDWIDTHS
from fedcp_dist.options import Component, Option, at_least, described, one_of, shown


def _number_or_median(v) -> Optional[str]:
    if v == MEDIAN or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        return None
    return f"must be a number > 0 or median, got {shown(v)}"


def _bandwidth_list(v) -> Optional[str]:
    if v is None:
        return None
    ok = isinstance(v, list) and v and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                           and math.isfinite(a) and a > 0 for a in v)
    return None if ok else f"must be null or a non-empty list of numbers > 0, got {shown(v)}"


class MMD(Component):
    """FedCP's global feature module: λ·MMD² between the client's features and the frozen received extractor's."""

    options = (
        Option("lam", 5.0, "FedCP: weight λ of the MMD term", at_least(0)),
        Option("mmd_kernel", "multi", "FedCP: MMD kernel on squared distances d: multi (Σ_a exp(−d/2a) over "
               "mmd_bandwidths, the reference's) | rbf (exp(−d/2σ²), σ = mmd_sigma)", one_of("multi", "rbf")),
        Option("mmd_sigma", MEDIAN, "FedCP: σ of mmd_kernel=rbf: a number, or median (the median pairwise distance "
               "of the batch's pooled features)", described("median | > 0", _number_or_median), kind=Union[float, str]),
        Option("mmd_bandwidths", None, "FedCP: the bandwidths a of mmd_kernel=multi (null: 10, 15, 20, 50, the "
               "reference's)", described("null or a non-empty list of numbers > 0", _bandwidth_list),
               kind=Optional[list]),
        Option("fedcp_gfm", True, "FedCP ablation (paper, Table 1): false drops the frozen global feature extractor "
               "module and its MMD term"),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.mmd_kernel == "rbf" and cfg.mmd_bandwidths is not None:
            return "mmd_bandwidths", "sets the kernels of mmd_kernel=multi; rbf takes mmd_sigma"
        if cfg.mmd_kernel == "multi" and cfg.mmd_sigma != MEDIAN:
            return "mmd_sigma", "sets the kernel of mmd_kernel=rbf; multi takes mmd_bandwidths"
        if not cfg.fedcp_gfm:
            for key in ("mmd_kernel", "mmd_sigma", "mmd_bandwidths"):
                if getattr(cfg, key) != next(o.default for o in cls.options if o.name == key):
                    return key, "sets the MMD term, which fedcp_gfm=false drops"
        return None

    def __init__(self, cfg):
        # without the global feature module the term is never built (λ is then ignored)
        self.lam = float(cfg.lam) if cfg.fedcp_gfm else 0.0
        if cfg.mmd_kernel == "rbf":
            self.bandwidths = MEDIAN if cfg.mmd_sigma == MEDIAN else (float(cfg.mmd_sigma) ** 2,)
        else:
            self.bandwidths = MMD_BANDWIDTHS if cfg.mmd_bandwidths is None else tuple(float(a) for a in cfg.mmd_bandwidths)

    def term(self, algo, step, out):
        if not self.lam > 0:
            return None
        h_g = step.shared(algo.fe_g, step.x, grad=False, batch_stats=True)
        return self.lam * step.mmd2(out.h, h_g, self.bandwidths)


class Entropy(Component):
    """FedCP: an entropy term on the policy's split (s, r)."""

    options = (
        Option("policy_entropy", 0.0, "FedCP: β of the policy entropy term β·mean Σ_k −(s_k log s_k + r_k log r_k) "
               "added to the loss (the entropy of each feature's pair (s, r)): > 0 pushes the policy to 0/1 splits, "
               "< 0 towards 0.5"),
    )
    needs_cpn = ("policy_entropy",)

    def __init__(self, cfg):
        self.beta = float(cfg.policy_entropy)

    def term(self, algo, step, out):
        return None if out.entropy is None else self.beta * step.mean(out.entropy)


class Distillation(Component):
    """FedCP: distillation of the policy towards the received (last aggregated) CPN's."""

    options = (
        Option("cpn_distill", 0.0, "FedCP: κ of the policy distillation term κ·mean Σ_k KL(teacher policy ‖ own "
               "policy), the teacher being the last aggregated (received) CPN", at_least(0)),
    )
    needs_cpn = ("cpn_distill",)

    def __init__(self, cfg):
        self.kappa = float(cfg.cpn_distill)

    def term(self, algo, step, out):
        if not self.kappa:
            return None
        kl = policy_kl(algo.policy.teacher_logits(step, out.c, algo.cpn_g, algo.received), out.policy_logits, algo.K,
                       algo.tau)
        return self.kappa * step.mean(kl)


#: the terms in the order they are added to the loss (the order the recorded results were made in)
REGULARISERS = (MMD, Entropy, Distillation)
