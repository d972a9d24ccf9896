"""The config keys of where client state lives and of which clients train where, declared apart from
the code that reads them (:mod:`fedcp_dist.state.client_store`, :mod:`fedcp_dist.state.placement`).
"""
from __future__ import annotations

import math
from typing import Optional

from fedcp_dist.options import Component, Option, described, finite, one_of, within

#: the values of ``client_state``
CLIENT_STATE_MODES = ("device", "host", "disk", "auto")
#: the values of ``client_data``
CLIENT_DATA_MODES = ("auto", "resident", "on_demand")


class ClientStates(Component):
    """Where each client's persistent state and its data live between rounds."""

    options = (
        Option("aggregate_bn_stats", False, "BatchNorm running statistics (ResNet-18): false keeps each client's own "
               "(the reference's behaviour); true averages them across participants with the same sample weights as "
               "the parameters"),
        Option("client_state", "device", "where each client's persistent state lives between rounds: device | host "
               "(moved to the device when used) | disk (one file per client, read ahead, written back in the "
               "background) | auto (device when this rank's states fit client_state_budget_mb, disk otherwise)",
               one_of(*CLIENT_STATE_MODES)),
        Option("client_state_budget_mb", 0.0, "client_state=auto: MiB this rank's client states may take in memory; 0: "
               "half the memory available at start",
               described(">= 0", lambda v: None if math.isfinite(v) and v >= 0
                         else f"must be a number >= 0 (MiB), got {v}")),
        Option("client_state_dir", "", "client_state=disk (or auto): root directory of the state files (a local "
               "scratch disk); each run keeps its files in a folder of its own under it, named by its out_dir and "
               "locked while it runs; empty: out_dir/client_state"),
        Option("client_data", "auto", "where a rank keeps its clients' samples: resident (read once at start, kept on "
               "its device) | on_demand (read from the shard when a round trains or evaluates them, so that a rank's "
               "memory follows the cohort, not its share of the population) | auto (on_demand where client states "
               "live on disk or this rank's data would take more than a quarter of the memory available, resident "
               "otherwise); results are the same bits either way", one_of(*CLIENT_DATA_MODES)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.client_state_dir and cfg.client_state in ("device", "host"):
            return "client_state_dir", f"is where client_state=disk (or auto) keeps its files; client_state={cfg.client_state} " \
                                       f"writes none"
        if cfg.client_state_budget_mb and cfg.client_state != "auto":
            return "client_state_budget_mb", f"sizes client_state=auto; client_state={cfg.client_state} ignores it"
        return None


#: how a drop-out round's participants are counted (``participation_draw``)
PARTICIPATION_DRAWS = ("rho", "count")
#: how a round's cohort is drawn (``participation_sampling``)
PARTICIPATION_SAMPLINGS = ("fixed", "poisson")
#: how clients are weighted when placed on ranks (config key ``placement``)
PLACEMENTS = ("auto", "samples", "steps")


def _rho_range(r) -> "str | None":
    ok = (r is None or (len(r) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
                        and 0 < r[0] <= r[1] <= 1))
    return None if ok else f"must be [rho_min, rho_max] with 0 < rho_min <= rho_max <= 1, got {r}"


def cohort_size(rho: float, num_clients: int) -> int:
    """⌊ρN⌋ clients (at least one, at most N): a round's cohort at participation ρ."""
    return max(1, min(num_clients, int(math.floor(rho * num_clients + 1e-9))))


class Participation(Component):
    """Which clients train each round, and which rank hosts each client."""

    options = (
        Option("participation", 1.0, "fraction ρ of clients that train each round, in (0, 1]",
               described("(0, 1]", lambda v: finite(v) or within(0, 1, low_open=True)(v))),
        Option("participation_range", None, "if set, [ρ_min, ρ_max]: ρ is drawn uniformly from this range each round "
               "(drop-out study)", described("null or [ρ_min, ρ_max], 0 < ρ_min <= ρ_max <= 1", _rho_range),
               kind=Optional[list]),
        Option("participation_sampling", "fixed", "how a round's cohort is drawn: fixed (⌊ρN⌋ clients, at least one, uniformly "
               "without replacement) | poisson (each client on its own with probability ρ: the cohort's size varies, "
               "and may be 0)", one_of(*PARTICIPATION_SAMPLINGS)),
        Option("participation_draw", "rho", "with participation_range: rho draws ρ uniformly and trains ⌊ρN⌋ clients (at least one); "
               "count draws the number of participants uniformly from {⌊ρ_min·N⌋ … ⌊ρ_max·N⌋} (the reference "
               "library's rule, which reaches N)", one_of(*PARTICIPATION_DRAWS)),
        Option("placement", "auto", "what clients are weighted by when placed on ranks (largest first, to the "
               "least-loaded rank): samples | steps (local SGD steps: batches × local_epochs) | auto (steps unless "
               "fused=false)", one_of(*PLACEMENTS)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.participation_sampling == "poisson" and cfg.participation_range is not None:
            return "participation_range", ("draws each round's cohort size; participation_sampling=poisson draws "
                                           "every client on its own with probability participation: use one of them")
        if cfg.participation_draw != "rho" and cfg.participation_range is None:
            return "participation_draw", f"{cfg.participation_draw} draws from participation_range, which is not set"
        return None
