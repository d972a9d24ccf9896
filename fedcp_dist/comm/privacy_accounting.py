"""Privacy accounting of central user-level DP with Google's ``dp-accounting`` library (RDP).

One round of ``dp: central`` (:mod:`fedcp_dist.comm.privacy`) is one :class:`dp_accounting.DpEvent`:
the cohort's sampling wrapped around the Gaussian mechanism (or, with adaptive clipping, the two
Gaussian mechanisms the round releases: the noised sum of clipped updates and the noised count of
unclipped ones). The sampling is the engine's own (:func:`fedcp_dist.state.placement.sample_cohort`):

* ``participation_sampling: fixed``: m = ⌊ρN⌋ of the N clients drawn uniformly without
  replacement each round, :class:`~dp_accounting.SampledWithoutReplacementDpEvent`. The library's
  RDP accountant accounts it under *replace-one* adjacency only (N is public; a neighbouring
  population has one client's data replaced by another's). Replacing one client moves the sum of
  clipped updates by up to 2C (‖u − u'‖ ≤ ‖u‖ + ‖u'‖), not C, and the centred count of unclipped
  updates by up to 1, not ½: the library, which reads a noise multiplier as the noise's standard
  deviation over the sensitivity, gets half the multipliers of add/remove adjacency.
* ``participation_sampling: poisson``: every client joins with probability q = ρ on its own,
  :class:`~dp_accounting.PoissonSampledDpEvent` under *add/remove-one* adjacency (sensitivities C
  and ½).

The per-round RDP curve is the library's: one ``RdpAccountant.compose`` of the round's event at
start-up (its default orders). Its composition over t rounds is t times that curve (RDP composes
by addition: what ``compose(event, t)`` computes, bit for bit) and ε at δ is the library's
``compute_epsilon`` of it; the tests check both against a fresh accountant composed t times.
Calibrating the noise multiplier for a target ε is the library's ``calibrate_dp_mechanism``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fedcp_dist.errors import UserError

if TYPE_CHECKING:  # (imported at first use: see _lib)
    import dp_accounting
    import dp_accounting.rdp

#: the largest noise multiplier a target ε is calibrated within: a target that needs more is refused
MAX_NOISE_MULTIPLIER = 1e4
#: the calibration's tolerance on the noise multiplier
CALIBRATION_TOL = 1e-5
#: what the library's RDP routines raise for a noise multiplier beyond their arithmetic: σ = 1e300
#: overflows, and sampling without replacement (fixed cohorts) fails with "math domain error" from
#: about σ = 3e8 on (far past any ε of interest: ε is ~0 there)
LIBRARY_FAILURES = (OverflowError, ValueError, ZeroDivisionError, FloatingPointError)


def _lib():
    """The dp-accounting library, imported at first use: with SciPy it takes seconds to load, which
    every run (and every rank) without ``dp`` would otherwise pay at start-up."""
    import dp_accounting
    import dp_accounting.rdp

    return dp_accounting


def _quiet_library() -> None:
    """The library's fractional-order RDP routine logs a warning per order it leaves out (it then
    uses the others): one line per order and round would bury a run's output."""
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover - absl comes with dp-accounting
        pass


@dataclass(frozen=True)
class Sampling:
    """How a round's cohort is drawn from the run's N clients."""

    kind: str  # fixed | poisson
    population: int  # N
    #: fixed: m, the cohort's size; poisson: q, each client's probability
    size_or_rate: float

    @property
    def rate(self) -> float:
        """q: the chance that a given client trains in a round."""
        return self.size_or_rate / self.population if self.kind == "fixed" else float(self.size_or_rate)

    @property
    def expected_cohort(self) -> float:
        """m (fixed) or qN (poisson): the fixed denominator of the noised mean."""
        return float(self.size_or_rate) if self.kind == "fixed" else float(self.size_or_rate) * self.population

    @property
    def relation(self) -> "dp_accounting.NeighboringRelation":
        rel = _lib().NeighboringRelation
        return rel.REPLACE_ONE if self.kind == "fixed" else rel.ADD_OR_REMOVE_ONE

    @property
    def adjacency(self) -> str:
        return "replace-one" if self.kind == "fixed" else "add/remove-one"

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed-size cohorts of {int(self.size_or_rate)} of {self.population} (replace-one adjacency)"
        return f"Poisson cohorts, q = {self.rate:g} of {self.population} (add/remove-one adjacency)"


def round_event(sampling: Sampling, update_multiplier: float,
                count_stddev: Optional[float] = None) -> "dp_accounting.DpEvent":
    """One round's DP event: ``update_multiplier`` z_Δ (the update noise's standard deviation over
    the clip norm C) and, with adaptive clipping, the count noise's standard deviation σ_b (in
    clients), each over the sensitivity of its sum under the sampling's adjacency (module notes)."""
    dp_accounting = _lib()
    per_add_remove = [float(update_multiplier)] + ([2.0 * float(count_stddev)] if count_stddev is not None else [])
    if min(per_add_remove) <= 0:  # a sum released without noise: no finite ε
        return dp_accounting.NonPrivateDpEvent()
    factor = 0.5 if sampling.kind == "fixed" else 1.0  # replace-one doubles both sensitivities
    events = [dp_accounting.GaussianDpEvent(factor * z) for z in per_add_remove]
    inner = events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
    if sampling.kind == "fixed":
        return dp_accounting.SampledWithoutReplacementDpEvent(sampling.population, int(sampling.size_or_rate), inner)
    return dp_accounting.PoissonSampledDpEvent(sampling.rate, inner)


def fresh_accountant(sampling: Sampling) -> "dp_accounting.rdp.RdpAccountant":
    _quiet_library()
    return _lib().rdp.RdpAccountant(neighboring_relation=sampling.relation)


class Accountant:
    """ε at δ after t rounds of the same ``event`` (module notes)."""

    def __init__(self, sampling: Sampling, event, delta: float):
        acc = fresh_accountant(sampling)
        acc.compose(event)
        self.orders, self.per_round, self.delta, self.event = acc.orders, acc.rdp, float(delta), event

    def epsilon(self, rounds: int) -> float:
        """ε after ``rounds`` rounds (0 before any: nothing was released; ∞ without noise)."""
        if rounds <= 0:
            return 0.0
        eps = _lib().rdp.compute_epsilon(self.orders, rounds * self.per_round, self.delta)[0]
        return float(eps) if math.isfinite(eps) else math.inf


def epsilon_after(sampling: Sampling, event_of, sigma: float, rounds: int, delta: float) -> float:
    """ε at δ after ``rounds`` rounds of ``event_of(sigma)`` (a fresh library accountant)."""
    acc = fresh_accountant(sampling)
    acc.compose(event_of(sigma), rounds)
    eps = acc.get_epsilon(delta)
    return float(eps) if math.isfinite(eps) else math.inf


def calibrate_noise(sampling: Sampling, event_of, target: float, rounds: int, delta: float,
                    limit: float = MAX_NOISE_MULTIPLIER, limited_by: str = "") -> float:
    """The smallest noise multiplier σ ≤ ``limit`` whose ``rounds`` rounds of ``event_of(σ)`` stay
    within ε = ``target`` at ``delta`` (the library's calibration, within :data:`CALIBRATION_TOL`,
    never above the target). A target the limit does not reach is a one-line UserError, naming
    what sets the limit (``limited_by``) when it is not :data:`MAX_NOISE_MULTIPLIER`."""
    try:
        return _calibrate(sampling, event_of, target, rounds, delta, limit, limited_by)
    except LIBRARY_FAILURES as e:
        failed = f"the privacy accountant (dp-accounting) fails there ({type(e).__name__}: {e})"
        if limited_by:
            raise UserError(f"config key 'dp_clip_count_stddev': calibrating σ for ε = {target:g} searches noise "
                            f"multipliers up to {limit:.4g} (σ < 2·dp_clip_count_stddev), and {failed}; choose a "
                            f"dp_clip_count_stddev a run could use, or leave it unset to let it grow with σ") from None
        raise UserError(f"config key 'dp_target_epsilon': calibrating σ for ε = {target:g} searches noise multipliers "
                        f"up to {limit:.4g}, and {failed}") from None


def _calibrate(sampling: Sampling, event_of, target: float, rounds: int, delta: float, limit: float,
               limited_by: str) -> float:
    top = epsilon_after(sampling, event_of, limit, rounds, delta)
    if top > target:
        why = f" (it stays below {limit:.4g}: {limited_by})" if limited_by else ""
        raise UserError(f"config key 'dp_target_epsilon': {target:g} is not reachable in {rounds} rounds at "
                        f"dp_delta={delta:g} ({sampling.describe()}): even noise multiplier {limit:.4g}{why} gives "
                        f"ε = {top:.4g}; raise dp_target_epsilon or dp_delta, or plan fewer rounds")
    low = limit  # ε(low) ≤ target; step down until ε(low / 8) exceeds it: the root lies in [low / 8, low]
    while low > 1e-3 and epsilon_after(sampling, event_of, low / 8.0, rounds, delta) <= target:
        low /= 8.0
    dp_accounting = _lib()
    bracket = dp_accounting.ExplicitBracketInterval(low / 8.0, low)
    if low <= 1e-3:
        return float(low)  # the target is met with next to no noise
    _quiet_library()
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: fresh_accountant(sampling),
        lambda s: dp_accounting.SelfComposedDpEvent(event_of(s), rounds),
        float(target), float(delta), bracket, tol=CALIBRATION_TOL))
