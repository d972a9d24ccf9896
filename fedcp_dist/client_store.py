"""A rank's per-client state: what each owned client keeps between rounds, in one place.

The store hands a client's persistent state to training and evaluation (creating it from the
method's ``init_client_state`` when first needed), keeps each client's own BatchNorm running
statistics when they are not aggregated, and is the one place that hands the algorithm the
global state (``set_global``), with the client's own statistics swapped in where it has them.
Checkpoints take its :meth:`state_dict` and give it back through :meth:`load_state_dict`.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

State = Dict[str, torch.Tensor]

BN_STAT_SUFFIXES = (".running_mean", ".running_var")
BN_PREFIX = "__bn__/"  # a client's own BatchNorm statistics, inside its checkpointed state
EF_PREFIX = "__ef__/"  # what compression did not send yet (error feedback), inside its checkpointed state


class ClientStore:
    def __init__(self, algo, global_state: State, bn_keys=()):
        self.algo = algo
        #: upload keys that stay with each client (BatchNorm running statistics); empty: none
        self.bn_keys = list(bn_keys)
        self.states: Dict[int, Optional[State]] = {}
        self.bn: Dict[int, State] = {}
        #: each client's compression residual (compress_error_feedback), created on its first upload
        self.residuals: Dict[int, State] = {}
        self.set_global(global_state)

    @classmethod
    def for_run(cls, algo, global_state: State, aggregate_bn_stats: bool) -> "ClientStore":
        """The store of a run: BatchNorm running statistics stay with each client unless
        ``aggregate_bn_stats`` (then they are averaged like the parameters)."""
        upload = algo.upload_keys(global_state)
        bn_keys = [] if aggregate_bn_stats else [k for k in upload if k.endswith(BN_STAT_SUFFIXES)]
        return cls(algo, global_state, bn_keys)

    # -- the global state ------------------------------------------------------------------
    def set_global(self, global_state: State) -> None:
        """The new global state (after start-up, resume, aggregation or the peer exchange)."""
        self.global_state = global_state
        self.algo.set_global(global_state)

    def activate(self, cid: int) -> Optional[State]:
        """Client ``cid``'s state, with the algorithm holding the global state and, where the
        client has them, its own BatchNorm statistics."""
        if self.bn_keys:
            own = self.bn.get(cid)
            self.algo.set_global({**self.global_state, **own} if own else self.global_state)
        return self.get(cid)

    # -- per-client state ------------------------------------------------------------------
    def get(self, cid: int) -> Optional[State]:
        if cid not in self.states:
            self.states[cid] = self.algo.init_client_state(cid)
        return self.states[cid]

    def put(self, cid: int, state: Optional[State], upload: State) -> None:
        """Keep a trained client's new state; its BatchNorm statistics leave ``upload`` for the store."""
        if state is not None:
            self.states[cid] = state
        if self.bn_keys:
            self.bn[cid] = {k: upload.pop(k) for k in self.bn_keys}

    def residual(self, cid: int) -> Optional[State]:
        """What compression has not sent of client ``cid``'s deltas (None before its first upload)."""
        return self.residuals.get(cid)

    def put_residual(self, cid: int, residual: Optional[State]) -> None:
        if residual is not None:
            self.residuals[cid] = residual

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> Dict[int, State]:
        """{client: its state, its BatchNorm statistics and its compression residual (both
        prefixed)} for the clients that have any."""
        return {
            c: {**(self.states.get(c) or {}), **{BN_PREFIX + k: v for k, v in self.bn.get(c, {}).items()},
                **{EF_PREFIX + k: v for k, v in self.residuals.get(c, {}).items()}}
            for c in set(self.states) | set(self.bn) | set(self.residuals)
        }

    def load_state_dict(self, states: Dict[int, State]) -> None:
        for c, state in states.items():
            bn = {k[len(BN_PREFIX):]: v for k, v in state.items() if k.startswith(BN_PREFIX)}
            ef = {k[len(EF_PREFIX):]: v for k, v in state.items() if k.startswith(EF_PREFIX)}
            rest = {k: v for k, v in state.items() if not k.startswith((BN_PREFIX, EF_PREFIX))}
            if bn:
                self.bn[c] = bn
            if ef:
                self.residuals[c] = ef
            self.states[c] = rest if rest else None
