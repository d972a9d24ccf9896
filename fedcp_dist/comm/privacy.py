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
from typing import Dict, Optional

import numpy as np
import torch

from fedcp_dist.comm.aggregate import Sums
from fedcp_dist.comm.keys import ADAPTIVE, start_up_problem
from fedcp_dist.comm.privacy_accounting import LIBRARY_FAILURES, Accountant, Sampling, calibrate_noise, round_event
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import STREAM_DP_COUNT, STREAM_DP_NOISE, cohort_size, stream_seed

#: the default count noise: this share of the (noise) cohort, as TensorFlow Federated's adaptive
#: clipping takes it, and never below σ (then z_Δ ≤ σ/√(3/4))
COUNT_STDDEV_SHARE = 0.05
#: the largest noise standard deviation a float32 sum takes: draws of up to ~10 standard deviations
#: (over 10⁹ values) and the sum itself stay finite below float32's 3.4e38 by a wide margin
NOISE_STD_MAX = 1e30
#: the largest argument of math.exp that stays finite in float64
EXP_MAX = 709.0

State = Dict[str, torch.Tensor]


def sampling_of(cfg, num_clients: int) -> Sampling:
    """How the run's cohorts are drawn (:func:`fedcp_dist.state.placement.sample_cohort`)."""
    if cfg.participation_sampling == "poisson":
        return Sampling("poisson", num_clients, float(cfg.participation))
    return Sampling("fixed", num_clients, cohort_size(cfg.participation, num_clients))


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
        """The noise is a larger cohort's: ε is no guarantee for this run (no noise: no cohort's)."""
        return self.noise_cohort > self.denominator and (self.sigma > 0 or bool(self.count_stddev))


#: the noise norm on a round's mean update, in units of the clip norm, above which the start line
#: says the model is likely swamped (the MNIST study's cohorts of 100 give about 10; 20 MNIST
#: clients at ρ = 0.1, a cohort of 2, about 1,000)
SWAMPED = 100.0


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
                                **({"limit": limit, "limited_by": (
                                    f"σ < 2·dp_clip_count_stddev, and dp_clip_count_stddev is "
                                    f"{cfg.dp_clip_count_stddev:g}; raise it, or leave it unset to let it grow with "
                                    f"σ")} if limit else {}))
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
        try:
            self.accountant = Accountant(plan.sampling, round_event(plan.sampling, plan.update_multiplier,
                                                                    plan.count_stddev if self.adaptive else None),
                                         plan.delta)
        except LIBRARY_FAILURES as e:
            raise UserError(f"config key 'dp_noise_multiplier': σ = {plan.sigma:g} is beyond what the privacy "
                            f"accountant (dp-accounting) computes ({type(e).__name__}: {e}); choose a σ a run could "
                            f"use (ε is ~0 long before)") from None
        if not self._noise_fits(self.clip):
            # the larger factor is the one to name (σ = 1e50 beside the default C was blamed on C)
            if plan.update_multiplier * plan.scale > self.clip:
                key, way_out = "dp_noise_multiplier", "choose a smaller σ"
            else:
                key, way_out = ("dp_clip_init" if self.adaptive else "dp_clip"), "choose a smaller C"
            raise UserError(f"config key '{key}': the noise's standard deviation σ·C = {self.noise_std():g} per value "
                            f"(σ = {plan.sigma:g}, C = {self.clip:g}) would overflow the float32 sum it is added "
                            f"to; {way_out}")
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

    def _noise_fits(self, clip: float) -> bool:
        """Whether noise of σ·``clip`` (scaled) stays far inside float32, the sum's dtype."""
        return math.isfinite(clip) and self.plan.update_multiplier * clip * self.plan.scale < NOISE_STD_MAX

    def nonfinite_hint(self) -> str:
        """What a non-finite round's message adds under DP: the noise the global model takes each round."""
        moved = ", C as adaptive clipping moved it" if self.adaptive else ""
        return (f"; dp=central noises the global model every round (standard deviation σ·C = {self.noise_std():g} per "
                f"value now{moved}): a large dp_clip or σ can wreck it")

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
            step = -self.clip_lr * (b - self.quantile)
            new = self.clip * math.exp(step) if step < EXP_MAX else math.inf
            if not (new > 0 and self._noise_fits(new)):  # a geometric step that left float range
                raise UserError(f"dp_clip=adaptive: round {t + 1}'s update would take the clip norm C from "
                                f"{self.clip:g} to {new:g} (noised unclipped fraction b̃ = {b:.4g}, target "
                                f"{self.quantile:g}, η_C = {self.clip_lr:g}); lower dp_clip_lr or dp_clip_count_stddev")
            self.clip = new
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
                f"are measurements, not covered{self.swamped_note(values)}")

    def swamped_note(self, values: int) -> str:
        """A note when the noise on a round's mean update is so much larger than the update that
        training cannot be expected to work: its norm, z_Δ·C/m̄·√values (the scale m̄/M of a larger
        noise cohort included), above :data:`SWAMPED` times the clipped mean's bound C."""
        p = self.plan
        ratio = p.update_multiplier * p.scale / p.denominator * math.sqrt(max(values, 1))
        if ratio <= SWAMPED:
            return ""
        return (f"; note: the noise on a round's mean update has a norm of about {ratio:,.0f}·C against at most C "
                f"for the clipped mean itself ({values:,} values, an expected cohort of {p.denominator:g}): a model "
                f"trained so is likely swamped by noise (DP-FedAvg trains with cohorts of hundreds: raise "
                f"participation or the number of clients)")

    def summary(self, rounds_done: int) -> dict:
        p = self.plan
        out = {"dp_epsilon": self.accountant.epsilon(rounds_done), "dp_delta": p.delta,
               "dp_noise_multiplier": p.sigma, "dp_noise_calibrated": p.calibrated, "dp_clip": self.clip,
               "dp_sampling": p.sampling.kind, "dp_adjacency": p.sampling.adjacency,
               "dp_guarantee": self.guarantee()}
        if p.simulated_cohort:
            # the key takes a client count: an integer where it is one (the expected cohort may not be)
            out["dp_noise_cohort_size"] = int(p.noise_cohort) if float(p.noise_cohort).is_integer() else p.noise_cohort
        return out
