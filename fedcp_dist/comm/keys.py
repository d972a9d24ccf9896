"""The config keys of what travels between ranks, declared apart from the code that reads them
(:mod:`fedcp_dist.comm.compress`, :mod:`fedcp_dist.comm.selection`, :mod:`fedcp_dist.comm.privacy`);
they apply to every method.
"""
from __future__ import annotations

import math
from typing import Optional, Union

from fedcp_dist.capabilities import ClientVectors, supports
from fedcp_dist.options import Component, Option, described, one_of, shown, within
from fedcp_dist.state.keys import cohort_size

COMPRESS_MODES = ("none", "topk")
COMPRESS_BITS = (32, 16, 8)


class CompressionOptions:
    """The config keys of upload compression (any method whose uploads are averaged)."""

    options = (
        Option("compress", "none", "uploads: none (dense float32) | topk (each tensor's delta to the received "
               "model, its largest entries only, quantised)", one_of(*COMPRESS_MODES)),
        Option("compress_ratio", 1.0, "compress=topk: fraction of each tensor's entries sent, in (0, 1]",
               within(0, 1, low_open=True)),
        Option("compress_bits", 32, "compress=topk: bits per sent value: 32 | 16 (half) | 8 (per-tensor scale and "
               "offset)", one_of(*COMPRESS_BITS)),
        Option("compress_error_feedback", False, "compress=topk: keep what was not sent in the client's state and add "
               "it to its next delta"),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.compress == "none":
            for key, default in (("compress_ratio", 1.0), ("compress_bits", 32), ("compress_error_feedback", False)):
                if getattr(cfg, key) != default:
                    return key, f"applies with compress=topk only (compress is none), got {getattr(cfg, key)!r}"
        elif not cfg.method_class.averages_uploads:
            return "compress", (f"{cfg.method} averages no uploads (its models travel in the peer exchange); "
                                f"use compress=none")
        return None


SELECTION_MODES = ("uniform", "feature_difference")
SELECTION_VECTORS = ("client", "features")


class SelectionOptions:
    """The config keys of client selection."""

    options = (
        Option("client_selection", "uniform", "cohorts with participation < 1: uniform | feature_difference (FedCP: "
               "p_i ∝ |D_i|·(1 − cos(v_i, mean v)))", one_of(*SELECTION_MODES)),
        Option("selection_min_prob", 0.01, "client_selection=feature_difference: floor of a client's draw "
               "probability before renormalising, in (0, 1]", within(0, 1, low_open=True)),
        Option("selection_vector", "client", "client_selection=feature_difference: the v_i compared: client (the "
               "method's client vector; FedCP: the head's column sums) | features (FedCP: the mean of the client's "
               "features h over its last local training)", one_of(*SELECTION_VECTORS)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.client_selection == "uniform" and cfg.selection_min_prob != 0.01:
            return "selection_min_prob", (f"applies with client_selection=feature_difference only (it is uniform), "
                                          f"got {cfg.selection_min_prob!r}")
        if cfg.client_selection == "uniform" and cfg.selection_vector != "client":
            return "selection_vector", (f"applies with client_selection=feature_difference only (it is uniform), "
                                        f"got {cfg.selection_vector!r}")
        if cfg.client_selection == "feature_difference" and cfg.participation_sampling == "poisson":
            return "client_selection", ("feature_difference draws a cohort of ⌊ρN⌋ by the clients' vectors; "
                                        "participation_sampling=poisson draws every client on its own: use uniform")
        if cfg.client_selection == "feature_difference" and not supports(cfg.method_class, ClientVectors):
            return "client_selection", f"feature_difference needs a method that keeps a client vector; {cfg.method} keeps none"
        return None


# ----------------------------------------------------------------------------------------------
# user-level differential privacy (the mechanism: fedcp_dist.comm.privacy)

DP_MODES = ("none", "central")
#: dp_clip's word for adaptive clipping
ADAPTIVE = "adaptive"
#: the keys of adaptive clipping (dp_clip: adaptive)
ADAPTIVE_KEYS = ("dp_clip_init", "dp_clip_quantile", "dp_clip_lr", "dp_clip_count_stddev")


def _clip_value(v) -> Optional[str]:
    if v == ADAPTIVE:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a number > 0 or {ADAPTIVE}, got {shown(v)}"
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


def expected_cohort(cfg, num_clients: int) -> float:
    """m̄, the expected cohort of a run on ``num_clients`` clients and dp=central's fixed denominator:
    ⌊ρN⌋ with fixed-size cohorts, ρN with Poisson sampling."""
    if cfg.participation_sampling == "poisson":
        return float(cfg.participation) * num_clients
    return float(cohort_size(cfg.participation, num_clients))


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
               "most this (dp_noise_multiplier then stays unset)", described("null | > 0", _positive_or_null),
               kind=Optional[float]),
        Option("dp_clip_init", 0.1, "dp_clip=adaptive: the clip norm of round 1", described(
            "> 0", lambda v: None if v > 0 else f"must be > 0, got {v}")),
        Option("dp_clip_quantile", 0.5, "dp_clip=adaptive: γ, the fraction of updates left unclipped that C tracks",
               within(0, 1)),
        Option("dp_clip_lr", 0.2, "dp_clip=adaptive: η_C of the geometric update C ← C·exp(−η_C·(b̃ − γ))",
               described(">= 0", lambda v: None if v >= 0 else f"must be >= 0, got {v}")),
        Option("dp_clip_count_stddev", None, "dp_clip=adaptive: σ_b, the count noise's standard deviation in clients "
               "(null: 0 without noise, else max(0.05·M, σ) with M the noise cohort)",
               described("null | >= 0", _at_least_or_null(0)), kind=Optional[float]),
        Option("dp_noise_cohort_size", None, "dp=central: M >= the expected cohort: noise as a cohort of M would get, "
               "scaled to the simulated one (ε is then a deployment's, not this run's guarantee; null: the cohort)",
               described("null | >= 1", _at_least_or_null(1)), kind=Optional[int]),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.dp == "none":
            return None  # its keys act on nothing then: inert_keys names those set
        defaults = {o.name: o.default for o in cls.options}
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
        if cfg.dp_target_epsilon is not None and cfg.dp_noise_multiplier != defaults["dp_noise_multiplier"]:
            return "dp_noise_multiplier", (f"is calibrated from dp_target_epsilon={cfg.dp_target_epsilon:g}; leave "
                                           f"dp_noise_multiplier unset (or drop dp_target_epsilon)")
        sigma_b = cfg.dp_clip_count_stddev
        if adaptive and sigma_b == 0 and cfg.dp_target_epsilon is not None:
            return "dp_clip_count_stddev", (f"0 releases adaptive clipping's count without noise, so no noise multiplier "
                                            f"reaches dp_target_epsilon={cfg.dp_target_epsilon:g}; set it > 0, or "
                                            f"leave it unset to let it grow with σ")
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
    def inert_keys(cls, cfg) -> dict:
        """Every DP key but ``dp`` acts on nothing while dp is none, and adaptive clipping's keys
        nothing while the clip norm is fixed (the start line names those set)."""
        if cfg.dp == "none":
            return {o.name: "applies with dp=central only (dp is none)" for o in cls.options if o.name != "dp"}
        inert = {}
        if cfg.dp_clip != ADAPTIVE:
            inert = {k: f"applies with dp_clip=adaptive only (dp_clip is {cfg.dp_clip!r})" for k in ADAPTIVE_KEYS}
        count_noise = cfg.dp_clip == ADAPTIVE and bool(cfg.dp_clip_count_stddev)
        if cfg.dp_noise_cohort_size is not None and cfg.dp_target_epsilon is None and cfg.dp_noise_multiplier == 0 \
                and not count_noise:
            inert["dp_noise_cohort_size"] = "scales the noise, and there is none (dp_noise_multiplier is 0)"
        return inert

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
        below = 10.0 ** math.floor(math.log10(0.1 / num_clients))  # a power of ten at most a tenth of 1/N
        return "dp_delta", (f"{cfg.dp_delta:g} is not below 1/N = 1/{num_clients}: such a δ allows leaking one "
                            f"client's data whole; dp_delta={below:g}, say")
    cohort = expected_cohort(cfg, num_clients)
    if cfg.dp_noise_cohort_size is not None and cfg.dp_noise_cohort_size < cohort:
        return "dp_noise_cohort_size", (f"{cfg.dp_noise_cohort_size} is below the expected cohort of {cohort:g} "
                                        f"(participation × {num_clients} clients)")
    return None


def rounds_scheduled(cfg: dict) -> Optional[str]:
    """Why ``rounds`` may not change when this (flat) config resumes (None: it may)."""
    if cfg.get("dp") == "central" and cfg.get("dp_target_epsilon") is not None:
        return "dp_target_epsilon calibrates the noise multiplier for the planned rounds"
    return None


