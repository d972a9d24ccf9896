"""Central user-level differential privacy (DP-FedAvg): clipped uploads, server-side Gaussian noise,
uniform weights and a fixed denominator, adaptive clipping, and the accountant's ε every round.

With ``dp: central`` every participant's upload is one vector: its difference Δ_i from the round's
global values over every tensor it uploads (what the engine averages; BatchNorm statistics stay with
each client: ``aggregate_bn_stats`` is refused). Each round:

1. each client clips: Δ_i ← Δ_i · min(1, C / ‖Δ_i‖) (one L2 norm per client, on the sequential and
   the fused path alike; with compression the clip comes first and again after quantisation, see
   :meth:`fedcp_dist.comm.compress.Compressor.compress`);
2. every participant weighs 1 (not its sample count, whose sensitivity is unbounded): the result
   differs from the non-DP sample-weighted average wherever clients hold different amounts of data;
3. after the one all-reduce the server adds N(0, (z_Δ·C·m̄/M)²) to every value of the sum, drawn
   from a stream of the run seed and the round (the same bits on every rank and world size, and on
   resume), and divides by the fixed m̄, the expected cohort (⌊ρN⌋, or qN with Poisson sampling),
   whoever trained; the method's own server update then takes global + that noised mean delta
   (post-processing: pFedMe's β mixing and FedCP's caching of the CPN act on the noised mean);
4. with ``dp_clip: adaptive`` (Andrew et al., NeurIPS 2021) each client also reports
   b_i = [‖Δ_i‖ ≤ C] as b_i − ½ in the same all-reduce; the server noises the count,
   b̃ = (Σ(b_i − ½) + N(0, (σ_b·m̄/M)²)) / m̄ + ½, and sets C ← C·exp(−η_C·(b̃ − γ)). The two
   Gaussian mechanisms together are one of noise multiplier σ when the update's is
   z_Δ = (σ^−2 − (2σ_b)^−2)^−1/2 (the paper's Theorem 1), which the accountant is given as such.

M is ``dp_noise_cohort_size`` (default m̄): noise calibrated as if M clients took part, scaled to
the simulated cohort. The ε then reported is that of such a deployment at the simulated rate q, not
a guarantee for the simulated run, and every output says so.

The accounting is :mod:`fedcp_dist.comm.privacy_accounting`'s (dp-accounting, RDP). What the guarantee
covers: the sequence of global states the server releases, with respect to all of one client's
data. Outside it: what never leaves the client (its personal parts, which it never uploads), and
everything the simulation measures on clients' data to report it (accuracies, losses, probes).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional, Union

import numpy as np
import torch

from fedcp_dist.comm.aggregate import Sums
from fedcp_dist.errors import UserError
from fedcp_dist.options import Component, Option, described, one_of, within
from fedcp_dist.state.placement import STREAM_DP_COUNT, STREAM_DP_NOISE, cohort_size, stream_seed
from fedcp_dist.comm.privacy_accounting import Accountant, Sampling, calibrate_noise, round_event

DP_MODES = ("none", "central")
ADAPTIVE = "adaptive"
#: the default count noise: this share of the (noise) cohort, as TensorFlow Federated's adaptive
#: clipping takes it, and never below σ (then z_Δ ≤ σ/√(3/4))
COUNT_STDDEV_SHARE = 0.05

State = Dict[str, torch.Tensor]


def _clip_value(v) -> Optional[str]:
    if v == ADAPTIVE:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a number > 0 or {ADAPTIVE}, got {v!r}"
    return None if math.isfinite(v) and v > 0 else f"must be a number > 0 or {ADAPTIVE}, got {v}"


def _positive_or_null(v) -> Optional[str]:
    return None if v is None or v > 0 else f"must be > 0 (or null), got {v}"


def _at_least_or_null(lo: float):
    return lambda v: None if v is None or v >= lo else f"must be >= {lo} (or null), got {v}"


def known_clients(cfg) -> Optional[int]:
    """The run's client count where the config alone says it (``data.clients``, ``data.num_clients``)."""
    d = cfg.data
    if isinstance(d.clients, list):
        return len(d.clients)
    if isinstance(d.clients, int):
        return d.clients
    return d.num_clients or None


def sampling_of(cfg, num_clients: int) -> Sampling:
    """How the run's cohorts are drawn (:func:`fedcp_dist.state.placement.sample_cohort`)."""
    if cfg.participation_sampling == "poisson":
        return Sampling("poisson", num_clients, float(cfg.participation))
    return Sampling("fixed", num_clients, cohort_size(cfg.participation, num_clients))


class Privacy(Component):
    """User-level differential privacy: central DP-FedAvg (clipped uploads, server-side Gaussian noise, an RDP accountant)."""

    options = (
        Option("dp", "none", "user-level differential privacy: none | central (each upload clipped to dp_clip, uniform "
               "weights, Gaussian noise on the sum, ε reported every round; the Privacy page)", one_of(*DP_MODES)),
        Option("dp_clip", 0.1, "dp=central: C, the L2 norm each client's whole upload delta is clipped to, or adaptive "
               "(C tracks a quantile of the update norms from a noised count)", described(
                   "a number > 0 | adaptive", _clip_value), kind=Union[float, str]),
        Option("dp_noise_multiplier", 1.0, "dp=central: σ, the noise's standard deviation over C on the sum (0: clipping "
               "only, ε = ∞); with adaptive clipping σ of the two mechanisms together", described(">= 0", lambda v: (
                   None if v >= 0 else f"must be >= 0, got {v}"))),
        Option("dp_delta", 1e-5, "dp=central: δ of the (ε, δ) reported; must be < 1/N", within(0, 1, low_open=True,
                                                                                               high_open=True)),
        Option("dp_target_epsilon", None, "dp=central: calibrate σ before round 1 so that ε after `rounds` rounds is at "
               "most this (dp_noise_multiplier then stays unset)", described("null or > 0", _positive_or_null),
               kind=Optional[float]),
        Option("dp_clip_init", 0.1, "dp_clip=adaptive: the clip norm of round 1", described(
            "> 0", lambda v: None if v > 0 else f"must be > 0, got {v}")),
        Option("dp_clip_quantile", 0.5, "dp_clip=adaptive: γ, the fraction of updates left unclipped that C tracks",
               within(0, 1)),
        Option("dp_clip_lr", 0.2, "dp_clip=adaptive: η_C of the geometric update C ← C·exp(−η_C·(b̃ − γ))",
               described(">= 0", lambda v: None if v >= 0 else f"must be >= 0, got {v}")),
        Option("dp_clip_count_stddev", None, "dp_clip=adaptive: σ_b, the count noise's standard deviation in clients "
               "(null: 0 without noise, else max(0.05·M, σ) with M the noise cohort)",
               described("null or >= 0", _at_least_or_null(0)), kind=Optional[float]),
        Option("dp_noise_cohort_size", None, "dp=central: M >= the expected cohort: noise as a cohort of M would get, "
               "scaled to the simulated one (ε is then a deployment's, not this run's guarantee; null: the cohort)",
               described("null or an integer >= 1", _at_least_or_null(1)), kind=Optional[int]),
    )

    @classmethod
    def check_config(cls, cfg):
        defaults = {o.name: o.default for o in cls.options}
        if cfg.dp == "none":
            for key, default in defaults.items():
                if key != "dp" and getattr(cfg, key) != default:
                    return key, f"applies with dp=central only (dp is none), got {getattr(cfg, key)!r}"
            return None
        method = cfg.method_class
        if not method.averages_uploads:
            return "dp", (f"{cfg.method} sends each client's model to the other clients (its peer exchange), which no "
                          f"noise on the server's sum covers; use dp=none")
        uneven = method.uneven_uploads(cfg)
        if uneven is not None:
            key, why = uneven
            return key, f"{why}; dp=central needs every participant to send the same tensors (one fixed denominator)"
        if cfg.aggregate_bn_stats:
            return "aggregate_bn_stats", ("averages BatchNorm running variances, which dp=central's noise can make "
                                          "negative; keep them with each client (aggregate_bn_stats=false)")
        if cfg.participation_range is not None:
            return "participation_range", ("draws each round's cohort size, which dp=central's accountant cannot "
                                           "account for; use participation (fixed or poisson sampling)")
        if cfg.client_selection != "uniform":
            return "client_selection", (f"{cfg.client_selection} picks cohorts from the clients' vectors (their data), "
                                        f"which dp=central's accountant cannot account for; use uniform")
        adaptive = cfg.dp_clip == ADAPTIVE
        if not adaptive:
            for key in ("dp_clip_init", "dp_clip_quantile", "dp_clip_lr", "dp_clip_count_stddev"):
                if getattr(cfg, key) != defaults[key]:
                    return key, f"applies with dp_clip=adaptive only (dp_clip is {cfg.dp_clip!r})"
        if cfg.dp_target_epsilon is not None and cfg.dp_noise_multiplier != defaults["dp_noise_multiplier"]:
            return "dp_noise_multiplier", (f"is calibrated from dp_target_epsilon={cfg.dp_target_epsilon:g}; leave "
                                           f"dp_noise_multiplier unset (or drop dp_target_epsilon)")
        sigma_b = cfg.dp_clip_count_stddev
        if adaptive and sigma_b is not None and cfg.dp_target_epsilon is None and cfg.dp_noise_multiplier > 0 \
                and not cfg.dp_noise_multiplier < 2 * sigma_b:
            return "dp_clip_count_stddev", (f"{sigma_b:g} is too small for dp_noise_multiplier="
                                            f"{cfg.dp_noise_multiplier:g}: the count's noise alone must stay below σ "
                                            f"(σ < 2·σ_b)")
        n = known_clients(cfg)
        if n is not None:
            problem = start_up_problem(cfg, n)
            if problem is not None:
                return problem
        return None


    @classmethod
    def reference_notes(cls, methods: dict) -> str:
        """The configuration reference's table of what dp=central covers for each of ``methods``
        ({name: method class})."""
        rows = ["What `dp: central` covers, method by method: each participant's upload (clipped as one vector, "
                "the sum noised); what never leaves the client is outside the mechanism, and so is every figure "
                "the simulation measures on clients' data to report it (accuracies, losses, probes). The Privacy "
                "page has the details.", "",
                "| method | uploaded each round: covered | never leaves the client: outside |", "| --- | --- | --- |"]
        for name, method in methods.items():
            if not method.averages_uploads:
                rows.append(f"| {name} | refused: each client's model goes to the other clients (the peer exchange), "
                            f"which no noise on the server's sum covers | |")
                continue
            rows.append(f"| {name} | {method.privacy_uploads} | {method.privacy_keeps or 'nothing'} |")
        return "\n".join(rows)


def start_up_problem(cfg, num_clients: int) -> Optional[tuple]:
    """(key, why) for what the run's client count rules out (None: fine)."""
    if cfg.dp_delta >= 1.0 / num_clients:
        return "dp_delta", (f"{cfg.dp_delta:g} is not below 1/N = 1/{num_clients}: such a δ allows leaking one "
                            f"client's data whole")
    cohort = sampling_of(cfg, num_clients).expected_cohort
    if cfg.dp_noise_cohort_size is not None and cfg.dp_noise_cohort_size < cohort:
        return "dp_noise_cohort_size", (f"{cfg.dp_noise_cohort_size} is below the expected cohort of {cohort:g} "
                                        f"(participation × {num_clients} clients)")
    return None


def rounds_scheduled(cfg: dict) -> Optional[str]:
    """Why ``rounds`` may not change when this (flat) config resumes (None: it may)."""
    if cfg.get("dp") == "central" and cfg.get("dp_target_epsilon") is not None:
        return "dp_target_epsilon calibrates the noise multiplier for the planned rounds"
    return None


# ----------------------------------------------------------------------------------------------
# the run's mechanism


@dataclass(frozen=True)
class Plan:
    """The run's mechanism, fixed at start-up."""

    sampling: Sampling
    sigma: float  # σ: the noise multiplier of the round (both mechanisms together when adaptive)
    calibrated: bool  # σ was calibrated from dp_target_epsilon
    update_multiplier: float  # z_Δ
    count_stddev: Optional[float]  # σ_b (adaptive only)
    noise_cohort: float  # M
    delta: float

    @property
    def denominator(self) -> float:
        return self.sampling.expected_cohort

    @property
    def scale(self) -> float:
        """m̄ / M: the simulated noise's share of the deployment's."""
        return self.denominator / self.noise_cohort

    @property
    def simulated_cohort(self) -> bool:
        """The noise is a larger cohort's: ε is no guarantee for this run."""
        return self.noise_cohort > self.denominator


def split_noise(sigma: float, count_stddev: Optional[float], noise_cohort: float) -> tuple:
    """(z_Δ, σ_b) of adaptive clipping for a total σ (module notes); σ_b None: its default."""
    if sigma == 0:
        return 0.0, 0.0 if count_stddev is None else float(count_stddev)
    sigma_b = max(COUNT_STDDEV_SHARE * noise_cohort, sigma) if count_stddev is None else float(count_stddev)
    return (sigma ** -2 - (2.0 * sigma_b) ** -2) ** -0.5, sigma_b


def plan_run(cfg, num_clients: int) -> Plan:
    """The mechanism of a run on ``num_clients`` clients; σ calibrated from ``dp_target_epsilon``
    when set. A value the client count rules out is a one-line UserError."""
    problem = start_up_problem(cfg, num_clients)
    if problem is not None:
        raise UserError(f"config key '{problem[0]}': {problem[1]}")
    sampling = sampling_of(cfg, num_clients)
    noise_cohort = float(cfg.dp_noise_cohort_size or sampling.expected_cohort)
    adaptive = cfg.dp_clip == ADAPTIVE

    def event_of(sigma: float):
        if not adaptive:
            return round_event(sampling, sigma)
        z, sigma_b = split_noise(sigma, cfg.dp_clip_count_stddev, noise_cohort)
        return round_event(sampling, z, sigma_b)

    sigma = float(cfg.dp_noise_multiplier)
    if cfg.dp_target_epsilon is not None:
        limit = None
        if adaptive and cfg.dp_clip_count_stddev is not None:
            limit = 2.0 * cfg.dp_clip_count_stddev * (1 - 1e-9)  # σ < 2σ_b
        sigma = calibrate_noise(sampling, event_of, cfg.dp_target_epsilon, cfg.rounds, cfg.dp_delta,
                                **({"limit": limit} if limit else {}))
    z, sigma_b = split_noise(sigma, cfg.dp_clip_count_stddev, noise_cohort) if adaptive else (sigma, None)
    return Plan(sampling, sigma, cfg.dp_target_epsilon is not None, z, sigma_b, noise_cohort, float(cfg.dp_delta))


@dataclasses.dataclass
class PrivacySums(Sums):
    """What a round's DP adds up over participants and ranks: Σ(b_i − ½) of adaptive clipping (exact: halves)."""

    unclipped_minus_half: float = 0.0


def total_norm(tensors) -> float:
    """‖(t_1, …, t_k)‖₂ of the tensors as one vector, in float64."""
    tensors = list(tensors)
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))))


def clip_factor(norm: float, clip: float) -> float:
    """min(1, C / ‖Δ‖): the factor that brings a vector of L2 norm ``norm`` within ``clip``."""
    return 1.0 if norm <= clip else clip / norm


def deltas(upload: State, reference: State, keys) -> State:
    """Δ = θ − θ_reference of each of ``keys``, float32."""
    return {k: upload[k].detach().to(torch.float32) - reference[k].to(torch.float32) for k in keys}


def add_noise_(values: torch.Tensor, std: float, seed: int, *keys: int) -> torch.Tensor:
    """``values`` += N(0, std²) drawn from the stream (seed, *keys) on ``values``' device, in its dtype."""
    if std > 0:
        g = torch.Generator(device=values.device).manual_seed(stream_seed(seed, *keys))
        values.add_(torch.randn(values.shape, generator=g, dtype=values.dtype, device=values.device), alpha=std)
    return values


def clip_and_noise(upload: State, reference: State, keys, clip: float, noise_std: float,
                   generator: Optional[torch.Generator] = None) -> State:
    """One upload as the Gaussian mechanism would release it alone: reference + clip(Δ, C) +
    N(0, noise_std²) over ``keys`` (what an attacker who knows every other participant's update
    reads off the noised sum; for ``fedcp-dlg``)."""
    d = deltas(upload, reference, keys)
    s = clip_factor(total_norm(d.values()), clip)
    out = dict(upload)
    for k, v in d.items():
        noise = torch.randn(v.shape, generator=generator, dtype=torch.float64, device=v.device) * noise_std \
            if noise_std > 0 else 0.0
        out[k] = (reference[k].double() + v.double() * s + noise).to(upload[k].dtype)
    return out


class CentralDP:
    """The run's mechanism on one rank (the same on every rank): the clip norm C of the round (its
    state, checkpointed: adaptive clipping moves it), each client's clipped upload, the noise on the
    all-reduced sum, the count's update of C, and ε after every round."""

    def __init__(self, cfg, plan: Plan):
        self.plan, self.seed = plan, int(cfg.seed)
        self.adaptive = cfg.dp_clip == ADAPTIVE
        self.clip = float(cfg.dp_clip_init if self.adaptive else cfg.dp_clip)
        self.quantile, self.clip_lr = float(cfg.dp_clip_quantile), float(cfg.dp_clip_lr)
        self.accountant = Accountant(plan.sampling, round_event(plan.sampling, plan.update_multiplier,
                                                                plan.count_stddev if self.adaptive else None),
                                     plan.delta)
        #: this rank's Σ(b_i − ½) of the round
        self.local = PrivacySums()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"clip": self.clip}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.adaptive:
            if not isinstance(state, dict) or not isinstance(state.get("clip"), float):
                raise UserError("the checkpoint holds no adaptive clip norm (dp_clip=adaptive): use another out_dir, "
                                "or overwrite=true to start afresh")
            self.clip = state["clip"]

    # -- a round -------------------------------------------------------------------------------
    def begin_round(self) -> None:
        self.local = PrivacySums()

    def client_upload(self, upload: State, global_state: State, keys, compressor, residual) -> tuple:
        """(the client's clipped delta over ``keys``, the weight to add it with, its new
        error-feedback residual or None); counts whether it was left unclipped."""
        if compressor.enabled:
            sent, weight, new_residual, norm = compressor.compress_clipped(upload, global_state, keys, self.clip,
                                                                           residual)
        else:
            sent, new_residual = deltas(upload, global_state, keys), None
            norm = total_norm(sent.values())
            weight = clip_factor(norm, self.clip)
        self.local.unclipped_minus_half += (1.0 if norm <= self.clip else 0.0) - 0.5
        return sent, weight, new_residual

    def noise_std(self) -> float:
        """The standard deviation of the noise on each value of the round's sum."""
        return self.plan.update_multiplier * self.clip * self.plan.scale

    def privatizer(self, t: int):
        """For :meth:`fedcp_dist.comm.aggregate.FlatAggregator.reduce`: noises the all-reduced sum of
        round t in place and returns the fixed denominator."""
        def apply(values: torch.Tensor) -> float:
            add_noise_(values, self.noise_std(), self.seed, STREAM_DP_NOISE, t)
            return self.plan.denominator
        return apply

    def end_round(self, t: int, sums: Optional[PrivacySums]) -> dict:
        """Round t's record entries (ε after it, the C it clipped to; adaptive: the noised unclipped
        fraction b̃) and, with adaptive clipping, C for the next round."""
        record = {"dp_epsilon": self.accountant.epsilon(t + 1), "dp_clip": self.clip}
        if self.adaptive:
            std = (self.plan.count_stddev or 0.0) * self.plan.scale
            noise = float(np.random.default_rng(stream_seed(self.seed, STREAM_DP_COUNT, t)).normal()) * std
            b = (sums.unclipped_minus_half + noise) / self.plan.denominator + 0.5
            record["dp_unclipped_fraction"] = b
            self.clip = self.clip * math.exp(-self.clip_lr * (b - self.quantile))
        if self.plan.simulated_cohort:
            record["dp_guarantee"] = False
        return record

    # -- what it says --------------------------------------------------------------------------
    def epsilon_line(self, rounds: int) -> str:
        eps = self.accountant.epsilon(rounds)
        return f"ε = {eps:.4g}" if math.isfinite(eps) else "ε = ∞ (no noise)"

    def guarantee(self) -> str:
        p = self.plan
        if p.simulated_cohort:
            return (f"not a guarantee for this run: the noise is that of a cohort of {p.noise_cohort:g} "
                    f"(dp_noise_cohort_size), scaled to this run's {p.denominator:g}; ε is that deployment's at the "
                    f"same sampling rate")
        return f"user-level (ε, δ) of the global states released, {p.sampling.adjacency} adjacency"

    def describe(self, rounds: int, uploads: str, keeps: str, values: int) -> str:
        """The start line's account: the mechanism, its ε after ``rounds`` and what it covers."""
        p = self.plan
        clip = (f"adaptive clip from C={self.clip:g} toward quantile {self.quantile:g} (η_C={self.clip_lr:g}, count "
                f"noise σ_b={p.count_stddev:g})" if self.adaptive else f"clip C={self.clip:g}")
        sigma = f"σ={p.sigma:.4g}" + (" calibrated" if p.calibrated else "")
        if self.adaptive and p.sigma > 0:
            sigma += f" (update z_Δ={p.update_multiplier:.4g})"
        noise_cohort = f", noise of a cohort of {p.noise_cohort:g}" if p.simulated_cohort else ""
        covers = f"covers each upload ({uploads}: {values:,} values)"
        outside = f"; outside it, never uploaded: {keeps}" if keeps else ""
        return (f"DP central: {clip} per client, uniform weights, {sigma}{noise_cohort}, ÷ {p.denominator:g}, "
                f"{p.sampling.describe()}; {self.epsilon_line(rounds)} after {rounds} rounds at δ={p.delta:g} "
                f"(RDP, dp-accounting; {self.guarantee()}); {covers}{outside}; the reported accuracies and losses "
                f"are measurements, not covered")

    def summary(self, rounds_done: int) -> dict:
        p = self.plan
        out = {"dp_epsilon": self.accountant.epsilon(rounds_done), "dp_delta": p.delta,
               "dp_noise_multiplier": p.sigma, "dp_noise_calibrated": p.calibrated, "dp_clip": self.clip,
               "dp_sampling": p.sampling.kind, "dp_adjacency": p.sampling.adjacency,
               "dp_guarantee": self.guarantee()}
        if p.simulated_cohort:
            out["dp_noise_cohort_size"] = p.noise_cohort
        return out
