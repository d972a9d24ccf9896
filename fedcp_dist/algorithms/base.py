"""The algorithm interface: a handful of hooks the engine calls.

An algorithm holds its math and nothing else: no ``torch.distributed``, no file I/O, no rank
checks. The engine owns placement, aggregation, checkpoints and logging.

State is kept as flat ``{name: tensor}`` dicts:

* the *global state* is replicated on every rank; the engine replaces it with
  ``server_update(global_state, Σ n_i·upload_i / Σ n_i)`` after every round and tells the
  algorithm through ``set_global``;
* the *client state* persists on the rank that owns the client for the whole run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import nn

State = Dict[str, torch.Tensor]


@dataclass
class Context:
    """Where a hook is called: the round, the client, and its own random stream."""

    round: int
    client: int
    generator: torch.Generator


@dataclass
class LocalResult:
    upload: State  # aggregated with weight = the client's train-sample count
    client_state: Optional[State]  # the client's new persistent state
    loss_sum: float  # Σ over local batches of (mean batch loss · batch size)
    samples: int  # samples seen in local training
    extra: dict = field(default_factory=dict)


def module_state(prefix: str, module: nn.Module) -> State:
    """Detached copies of a module's parameters and floating buffers, keys prefixed."""
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_floating_point():
            out[f"{prefix}{name}"] = t.detach().clone()
    return out


@torch.no_grad()
def load_module(module: nn.Module, state: State, prefix: str) -> None:
    """Copy ``state[prefix + name]`` into a module's parameters and floating buffers in place."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_floating_point():
            t.copy_(state[f"{prefix}{name}"])


@torch.no_grad()
def copy_module(dst: nn.Module, src: nn.Module) -> None:
    """Copy the parameters and floating buffers of ``src`` into the same-shaped ``dst``."""
    for a, b in zip(list(dst.parameters()) + list(dst.buffers()), list(src.parameters()) + list(src.buffers())):
        if a.is_floating_point():
            a.copy_(b)


def freeze(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class Algorithm:
    """Base class. Subclasses implement the hooks below."""

    name = "base"

    def __init__(self, cfg, model: nn.Module, device: torch.device):
        self.cfg = cfg
        self.device = device
        #: clients in the run; the engine sets it from the shard before ``init_global_state``
        self.num_clients = int(cfg.data.num_clients)

    def init_global_state(self) -> State:
        raise NotImplementedError

    def set_global(self, global_state: State) -> None:
        """Called with the current global state before training and evaluation use it."""
        raise NotImplementedError

    def init_client_state(self, client: int) -> Optional[State]:
        """A client's persistent state before it has trained (None: the method keeps none)."""
        return None

    def local_train(self, client_state: Optional[State], data, ctx: Context) -> LocalResult:
        raise NotImplementedError

    def local_train_group(self, items: list) -> list:
        """Train several clients, ``items`` = [(client_state, data, ctx), ...]; one LocalResult each.

        The engine calls this instead of ``local_train`` when ``fused=true``. The default trains
        them one after another; a method with a fused path trains the group at once and must give
        the same results within float tolerance.
        """
        return [self.local_train(state, data, ctx) for state, data, ctx in items]

    def fused_group_size(self, datas: list) -> int:
        """Clients per fused group when ``fused_group=0`` (default: all of them at once)."""
        return max(1, len(datas))

    # -- the peer exchange (methods that need other clients' models: FedAMP, FedFomo) ------------
    #: length of the flat float32 vector each participant shares with every rank (0: no exchange)
    peer_dim = 0

    def peer_payload(self, result: LocalResult) -> torch.Tensor:
        """The flat float32 vector (``peer_dim`` long) a participant shares after training."""
        raise NotImplementedError

    def receive_peers(self, round_idx: int, global_state: State, peers: Dict[int, torch.Tensor]) -> State:
        """New global state from the round's ``{client: payload}`` (the same on every rank)."""
        raise NotImplementedError

    def peer_memory_bytes(self, num_clients: int) -> int:
        """Bytes per rank the method keeps for other clients' models (its part of the global state)."""
        return 0

    def upload_keys(self, global_state: State) -> list:
        """The global-state keys that participants upload and the server averages (default: all)."""
        return list(global_state)

    def prepare_eval(self, client_state: Optional[State], data, ctx: Context) -> Optional[State]:
        """Called once per client before its test batches go through ``predict`` (default: as is).

        A method that adapts before evaluating (Per-FedAvg's step on a train batch) returns the
        adapted state here; the client's persistent state is not changed.
        """
        return client_state

    def server_update(self, global_state: State, averaged: State) -> State:
        """New global state from the sample-weighted mean of the round's uploads."""
        return {k: averaged[k].clone() if k in averaged else v for k, v in global_state.items()}

    def predict(self, client_state: Optional[State], x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Logits of the client's personalized model (the global one for FedAvg) on ``x``."""
        raise NotImplementedError
