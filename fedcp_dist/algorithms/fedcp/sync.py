"""How the policy's networks Θ (the CPN, the client vector's projection P, the group-level CPN) are
synchronised: one strategy that answers, per round t and client, whether the client trains Θ,
from which values, whether it uploads them, and how the server aggregates them.

* every round (the paper's): trained from the received Θ, uploaded, averaged;
* warm-up (``cpn_warmup_rounds`` = W): rounds t < W train with Θ frozen at the received values and
  upload none of it;
* caching (``policy_refresh_every`` = P): Θ is trained, uploaded and averaged only in rounds with
  t mod P = 0; in between clients use Θ_prev + (t mod P)/P·(Θ_last − Θ_prev), frozen, with Θ_prev
  the refreshed global Θ before the last refresh (kept in the global state under ``prev.``; a
  CPN's BatchNorm running statistics are each client's own and are not interpolated);
* ``cpn_upload_every`` = U: clients train Θ every round but upload it (and the server averages it)
  only in rounds with t mod U = 0;
* asynchronous (``cpn_async_min_rate`` = q): a client whose participation rate so far is below q
  trains with Θ frozen and uploads none; Θ is averaged over the clients that sent it.

The switches that leave Θ out of uploads put its tensors in their own aggregation group
(``policy``), averaged over its senders. Combinations are decided here and nowhere else.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fedcp_dist.algorithms.fedcp.modules import policy_prefixes
from fedcp_dist.options import Component, Option, at_least, within

#: the global-state prefix of Θ_prev
PREV = "prev."
#: BatchNorm running statistics: a client's own, not part of the interpolated Θ
_BN_STATS = (".running_mean", ".running_var")


def refresh_alpha(t: int, every: int) -> float:
    """α of round t (0-based) under ``policy_refresh_every`` = P: j/P with j = t mod P (0 in a
    refresh round, whose clients start from Θ_last)."""
    return (t % every) / every


def interpolate(prev, last, alpha: float):
    """Θ = Θ_prev + α(Θ_last − Θ_prev) (Θ_last itself at α = 1, Θ_prev at α = 0)."""
    if alpha == 0:
        return prev
    if alpha == 1:
        return last
    return prev + alpha * (last - prev)


class PolicyRound(NamedTuple):
    """What one client does with Θ in one round."""

    trains: bool  # the client trains Θ (else Θ is a constant of its step)
    sends: bool  # it uploads Θ
    values: Optional[dict]  # the values Θ starts from when not the received global ones (None: those)
    #: frozen by the asynchronous rule: the client itself leaves the policy group out (LocalResult.skipped)
    async_frozen: bool = False


class PolicySync(Component):
    options = (
        Option("cpn_warmup_rounds", 0, "FedCP: the first W rounds train extractor and heads with the CPN frozen at "
               "the initial global CPN (not uploaded)", at_least(0)),
        Option("policy_refresh_every", 1, "FedCP: P: the CPN is trained, uploaded and aggregated only in rounds t with "
               "t mod P = 0; in between it is frozen at Θ_prev + (t mod P)/P·(Θ_last − Θ_prev) of the last two "
               "refreshed global CPNs (1: every round, the paper's)", at_least(1)),
        Option("cpn_upload_every", 1, "FedCP: U: clients upload the CPN (and the server aggregates it) only in rounds "
               "t with t mod U = 0; they train it every round", at_least(1)),
        Option("cpn_async_min_rate", 0.0, "FedCP: q: a client whose participation rate so far (rounds it trained in "
               "before this one / rounds before this one) is below q trains with the CPN frozen and uploads none; "
               "the CPN is averaged over the clients that trained it (0: off)", within(0, 1)),
    )
    needs_cpn = ("cpn_warmup_rounds", "policy_refresh_every", "cpn_upload_every", "cpn_async_min_rate")

    @classmethod
    def check_config(cls, cfg):
        if cfg.cpn_warmup_rounds and cfg.cpn_warmup_rounds >= cfg.rounds:
            return "cpn_warmup_rounds", f"must be < rounds ({cfg.rounds}): the CPN would never train"
        skips = [k for k, on in (("policy_refresh_every", cfg.policy_refresh_every > 1),
                                 ("cpn_upload_every", cfg.cpn_upload_every > 1),
                                 ("cpn_async_min_rate", cfg.cpn_async_min_rate > 0),
                                 ("cpn_warmup_rounds", cfg.cpn_warmup_rounds > 0)) if on]
        if cfg.policy_refresh_every > 1:
            if cfg.cpn_warmup_rounds:
                return "policy_refresh_every", "freezes the CPN between refreshes itself: it does not combine with " \
                                               "cpn_warmup_rounds"
            for other in ("cpn_upload_every", "cpn_async_min_rate"):
                if other in skips:
                    return other, "does not combine with policy_refresh_every (the CPN is frozen at the cached policy " \
                                  "between refreshes)"
            if cfg.cpn_distill:
                return "cpn_distill", "does not combine with policy_refresh_every (the CPN is frozen at the cached " \
                                      "policy between refreshes)"
        if cfg.cpn_async_min_rate > 0 and cfg.cpn_upload_every > 1:
            return "cpn_async_min_rate", "does not combine with cpn_upload_every"
        if cfg.compress != "none":
            for key in skips:
                if key != "cpn_warmup_rounds":
                    return key, "leaves the CPN out of some uploads, which compress does not account: use compress=none"
        return None

    def __init__(self, cfg):
        self.warmup = int(cfg.cpn_warmup_rounds)
        self.every = int(cfg.policy_refresh_every)
        self.upload_every = int(cfg.cpn_upload_every)
        self.min_rate = float(cfg.cpn_async_min_rate)
        #: the value prefixes of Θ, the policy's networks: the CPN and the shared policy modules
        self.prefixes = policy_prefixes()

    @property
    def grouped(self) -> bool:
        """Whether some rounds or clients leave Θ out of their upload (Θ is then its own group)."""
        return bool(self.min_rate or self.warmup or self.every > 1 or self.upload_every > 1)

    # -- per round, the same for every client ---------------------------------------------------
    def trained(self, t: int) -> bool:
        """Round t's clients train Θ (a refresh round under caching, every round otherwise)."""
        return t % self.every == 0

    def uploaded(self, t: int) -> bool:
        """Round t's clients upload Θ and the server aggregates it."""
        return self.trained(t) and t % self.upload_every == 0

    def skipped(self, t: int) -> tuple:
        """The groups nobody sends in round t: Θ in a warm-up round and in a round that does not upload it."""
        return ("policy",) if t < self.warmup or not self.uploaded(t) else ()

    def values_at(self, gs: dict, t: int) -> dict:
        """Θ of round t: Θ_last (the global values) in a refresh round, else Θ_prev + α(Θ_last − Θ_prev)
        with α = (t mod P)/P (a value without Θ_prev, BatchNorm's statistics, as it is)."""
        keys = [k for k in gs if k.startswith(self.prefixes)]
        alpha = refresh_alpha(t, self.every)
        if alpha == 0:
            return {k: gs[k] for k in keys}
        return {k: interpolate(gs[PREV + k], gs[k], alpha) if PREV + k in gs else gs[k] for k in keys}

    # -- per client ----------------------------------------------------------------------------
    def async_frozen(self, client_state, t: int) -> bool:
        """The client's participation rate so far (rounds it trained in before t, over t) is below q (round 0: rate 1)."""
        return bool(self.min_rate) and t > 0 and float(client_state["participations"]) / t < self.min_rate

    def round_of(self, client_state, gs: dict, t: int) -> PolicyRound:
        if not self.trained(t):  # between refreshes: the interpolated policy, frozen
            return PolicyRound(False, False, self.values_at(gs, t))
        if self.async_frozen(client_state, t):
            return PolicyRound(False, False, None, True)
        return PolicyRound(t >= self.warmup, self.uploaded(t) and t >= self.warmup, None)

    # -- the state it keeps ---------------------------------------------------------------------
    def init_global(self, state: dict) -> dict:
        """Θ_prev, as Θ_last at the start (caching only)."""
        if self.every > 1:
            state.update({PREV + k: v.clone() for k, v in state.items()
                          if k.startswith(self.prefixes) and not k.endswith(_BN_STATS)})
        return state

    @staticmethod
    def upload_keys(global_state: dict) -> list:
        """Every global value but Θ_prev (the server keeps it)."""
        return [k for k in global_state if not k.startswith(PREV)]

    def groups(self, upload_keys: list) -> Optional[dict]:
        if not self.grouped:
            return None
        return {k: "policy" for k in upload_keys if k.startswith(self.prefixes)}

    def server_update(self, new: dict, old: dict, t: int) -> dict:
        """Caching's refresh round also sets Θ_prev ← Θ_last (the values before this round's average)."""
        if self.every > 1 and self.uploaded(t):
            new.update({PREV + k: old[k] for k in new if PREV + k in old})
        return new

    def init_client(self, state: dict, like) -> dict:
        if self.min_rate:  # the rounds it has trained in
            state["participations"] = like.new_zeros(1)
        return state

    def finish_client(self, new_state: dict, client_state: dict) -> dict:
        if self.min_rate:
            new_state["participations"] = client_state["participations"] + 1
        return new_state
