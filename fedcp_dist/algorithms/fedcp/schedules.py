"""FedCP's per-round schedules: the policy's temperature τ and the CPN's learning rate.

Each is a function of the round number alone, so a resumed run takes the same values; both span
the run's ``rounds``, so a run continued to more rounds follows another schedule (the run
directory refuses that through :meth:`Schedules.rounds_scheduled`).
"""
from __future__ import annotations

import math
from typing import Optional

from fedcp_dist.options import Component, Option, at_least, described, one_of, shown


def _positive_or_null(v) -> Optional[str]:
    ok = v is None or (math.isfinite(v) and v > 0)
    return None if ok else f"must be null or a number > 0, got {shown(v)}"


described("null | > 0", _positive_or_null)


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


class Schedules(Component):
    options = (
        Option("cpn_lr", None, "FedCP: the CPN's learning rate (null: lr)", _positive_or_null, kind=Optional[float]),
        Option("cpn_lr_schedule", "constant", "FedCP: the CPN's rate over the rounds after the warm-up: constant | "
               "cosine (to cpn_lr_min in the last round)", one_of("constant", "cosine")),
        Option("cpn_lr_min", 0.0, "FedCP: the CPN's rate in the last round with cpn_lr_schedule=cosine", at_least(0)),
        Option("tau_final", None, "FedCP: anneal τ per round from tau (first round) to tau_final (last round); "
               "null: τ fixed", _positive_or_null, kind=Optional[float]),
        Option("tau_anneal", "exponential", "FedCP: the anneal of τ to tau_final: exponential | linear",
               one_of("exponential", "linear")),
    )
    needs_cpn = ("cpn_lr", "cpn_lr_schedule", "cpn_lr_min", "tau_final", "tau_anneal")

    @classmethod
    def check_config(cls, cfg):
        if cfg.cpn_lr_schedule == "constant" and cfg.cpn_lr_min != 0:
            return "cpn_lr_min", "applies to cpn_lr_schedule=cosine only"
        if cfg.cpn_lr_min > (cfg.lr if cfg.cpn_lr is None else cfg.cpn_lr):
            return "cpn_lr_min", "must not exceed the CPN's rate (cpn_lr, else lr)"
        if cfg.tau_final is None and cfg.tau_anneal != "exponential":
            return "tau_anneal", "needs tau_final"
        return None

    @staticmethod
    def rounds_scheduled(cfg: dict) -> Optional[str]:
        """Why a run under the flat config ``cfg`` depends on its total number of rounds (None: it does not)."""
        if cfg.get("tau_final") is not None or cfg.get("cpn_lr_schedule") == "cosine":
            return "tau_final and cpn_lr_schedule=cosine anneal over the total number of rounds"
        return None

    def __init__(self, cfg):
        self.cfg = cfg

    def tau_at(self, t: int) -> float:
        cfg = self.cfg
        return annealed_tau(cfg.tau, cfg.tau_final, cfg.tau_anneal, t, cfg.rounds)

    def cpn_rate_at(self, t: int) -> Optional[float]:
        cfg = self.cfg
        return cpn_rate(cfg.lr, cfg.cpn_lr, cfg.cpn_lr_schedule, cfg.cpn_lr_min, cfg.cpn_warmup_rounds, t, cfg.rounds)

    def param_lr(self, t: int, prefixes: tuple) -> Optional[dict]:
        """{prefix: rate} of the policy's networks in round t where they have their own rate (None: lr)."""
        cfg = self.cfg
        if cfg.cpn_lr is None and cfg.cpn_lr_schedule == "constant":
            return None
        rate = self.cpn_rate_at(t)
        return None if rate is None else {p: rate for p in prefixes}
