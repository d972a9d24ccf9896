"""A rank's per-client state: what each owned client keeps between rounds, in one place.

The store hands a client's persistent state to training and evaluation (creating it from the
method's ``init_client_state`` when first needed), keeps each client's own BatchNorm running
statistics when they are not aggregated, and is the one place that hands the algorithm the
global state (``set_global``), with the client's own statistics swapped in where it has them.
Checkpoints take its :meth:`checkpoint_part` (the states, or with a disk store its clients'
files) and give the states back through :meth:`load_state_dict`.

The stores that keep states in memory live here (on the device, or in host memory); the one that
keeps them on disk is :mod:`fedcp_dist.state.disk_store`, and which one a run gets is
:func:`fedcp_dist.state.disk_store.make_store`'s choice (``client_state``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Set, Union

import torch

from fedcp_dist.fused.memory import available_memory
from fedcp_dist.state.process_memory import state_bytes

State = Dict[str, torch.Tensor]

BN_STAT_SUFFIXES = (".running_mean", ".running_var")
BN_PREFIX = "__bn__/"  # a client's own BatchNorm statistics, inside its checkpointed state
EF_PREFIX = "__ef__/"  # what compression did not send yet (error feedback), inside its checkpointed state


@dataclass
class ClientFiles:
    """What a disk store hands a checkpoint: each client's file (in the checkpoint's layout, never
    changed in place: a new state is a new file renamed over the old name) and the clients whose
    file was written since the last checkpoint; ``saved()`` tells the store the checkpoint is
    complete (those clients then count as unchanged). ``digests``: the SHA-256 of what the
    store wrote in each file, so that a checkpoint copying a file changed on disk since (a flipped
    bit, another process) refuses it instead of recording the damage as the client's state."""
    paths: Dict[int, Path]
    changed: Set[int]
    saved: Callable[[], None]
    digests: Mapping[int, bytes] = field(default_factory=dict)
    #: raises an OSError when something the checkpoint copies from memory (a per-client bank mapped
    #: from a file) changed on disk since the run wrote it
    check: Callable[[], None] = lambda: None


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

    def peek(self, cid: int) -> Optional[State]:
        """Client ``cid``'s kept state, None when it has none yet (nothing is created)."""
        return self.states.get(cid)

    def prefetch(self, order) -> None:
        """Clients about to be used in this order (a store off the device reads ahead)."""

    def flush(self) -> None:
        """Every state handed to :meth:`put` is kept where the store keeps it."""

    def close(self) -> None:
        """End of the run."""

    def put(self, cid: int, state: Optional[State], upload: State, residual: Optional[State] = None) -> None:
        """Keep a trained client's new state and (with error feedback) what compression has not sent
        of its delta; its BatchNorm statistics leave ``upload`` for the store. One call a client a
        round, so a store on disk writes the client's file once."""
        if state is not None:
            self.states[cid] = state
        if self.bn_keys:  # a part not uploaded this round (a frozen CPN's) keeps its statistics
            self.bn[cid] = {**self.bn.get(cid, {}), **{k: upload.pop(k) for k in self.bn_keys if k in upload}}
        if residual is not None:
            self.residuals[cid] = residual

    def residual(self, cid: int) -> Optional[State]:
        """What compression has not sent of client ``cid``'s deltas (None before its first upload)."""
        return self.residuals.get(cid)

    def held_bytes(self) -> int:
        """Bytes of per-client tensors this store holds in memory (states, BatchNorm statistics,
        compression residuals); a disk store counts only the states in flight."""
        return (sum(state_bytes(s) for s in self.states.values()) + sum(state_bytes(s) for s in self.bn.values())
                + sum(state_bytes(s) for s in self.residuals.values()))

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoint_part(self) -> Union[Dict[int, State], ClientFiles]:
        """What a checkpoint takes of this store: :meth:`state_dict` (a disk store: its files)."""
        return self.state_dict()

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
            bn, ef, rest = unpack(state)
            if bn:
                self.bn[c] = bn
            if ef:
                self.residuals[c] = ef
            self.states[c] = rest if rest else None


def unpack(state: State):
    """A checkpointed client entry split into (BatchNorm statistics, error-feedback residual, state)."""
    bn = {k[len(BN_PREFIX):]: v for k, v in state.items() if k.startswith(BN_PREFIX)}
    ef = {k[len(EF_PREFIX):]: v for k, v in state.items() if k.startswith(EF_PREFIX)}
    rest = {k: v for k, v in state.items() if not k.startswith((BN_PREFIX, EF_PREFIX))}
    return bn, ef, rest



def pack(state: Optional[State], bn: Optional[State], ef: Optional[State]) -> State:
    """A client's kept entry (its checkpoint layout) from its state, BatchNorm statistics and residual."""
    return {**(state or {}), **{BN_PREFIX + k: v for k, v in (bn or {}).items()},
            **{EF_PREFIX + k: v for k, v in (ef or {}).items()}}


def banks_in_files(client_state: str, device) -> bool:
    """Whether a peer method's per-client banks (``bank_keys``) live in files mapped into memory:
    with a disk client store on the CPU (:meth:`DiskClientStore.set_global`). Then the banks are
    never allocated whole, and they are page cache, not the process's own memory."""
    return client_state == "disk" and torch.device(device).type == "cpu"

def available_memory_bytes(device) -> int:
    """What the budget of ``client_state: auto`` defaults to half of: the device's free memory
    (the same measure fused training sizes its groups by)."""
    return available_memory(torch.device(device))

def resolve_mode(mode: str, per_client_bytes: int, clients: int, budget_mb: float, device) -> tuple[str, str]:
    """(device | host | disk, why) for ``client_state``; ``auto`` keeps the states in memory
    (on the device) when ``clients`` states fit the budget (``client_state_budget_mb``; 0: half the
    memory available now), on disk otherwise."""
    if mode != "auto":
        return mode, "client_state"
    need = per_client_bytes * clients
    budget = budget_mb * 2**20 if budget_mb > 0 else available_memory_bytes(device) // 2
    chosen = "device" if need <= budget else "disk"
    each = (f"{per_client_bytes / 2**20:.2f} MiB" if per_client_bytes >= 2**20 else
            f"{per_client_bytes / 2**10:.1f} KiB = {need / 2**20:,.1f} MiB")  # a small state: not "0.00 MiB"
    return chosen, f"auto: {clients} x {each} vs a budget of {budget / 2**20:.0f} MiB"

class HostClientStore(ClientStore):
    """Client states kept in host memory, moved to the run's device when a client is used (on a
    CPU run that is where they are already: then it keeps them as the device store does)."""

    def __init__(self, algo, global_state: State, bn_keys=(), device="cpu"):
        super().__init__(algo, global_state, bn_keys)
        self.device = torch.device(device)

    def get(self, cid: int) -> Optional[State]:
        if cid not in self.states:
            self.states[cid] = _to(self.algo.init_client_state(cid), "cpu")
        return _to(self.states[cid], self.device)

    def put(self, cid: int, state: Optional[State], upload: State, residual: Optional[State] = None) -> None:
        super().put(cid, _to(state, "cpu"), upload, residual)

    def load_state_dict(self, states: Dict[int, State]) -> None:
        super().load_state_dict({c: _to(s, "cpu") for c, s in states.items()})


def _to(state: Optional[State], device) -> Optional[State]:
    return None if state is None else {k: v.to(device) for k, v in state.items()}

