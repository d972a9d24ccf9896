"""The algorithm interface: a handful of hooks the engine calls.

An algorithm holds its math and nothing else: no ``torch.distributed``, no file I/O, no rank
checks. The engine owns placement, aggregation, checkpoints and logging. What only some methods do
(exchange models with peers, keep a client vector, take probes) are the small protocols of
:mod:`fedcp_dist.capabilities`, which a method implements by defining their members.

State is kept as flat ``{name: tensor}`` dicts:

* the *global state* is replicated on every rank; the engine replaces it with
  ``server_update(global_state, Σ n_i·upload_i / Σ n_i)`` after every round and tells the
  algorithm through ``set_global``;
* the *client state* persists on the rank that owns the client for the whole run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

# load_module and module_state live with the training loop that uses them; the methods take them from here
from fedcp_dist.local_train import (ClientPhase, Phase, PhaseOutcome, load_module, module_state,  # noqa: F401
                                    train_sequential, unsupported_reason)

State = Dict[str, torch.Tensor]


@dataclass
class Context:
    """Where a hook is called: the round, the client, and its own random stream."""

    round: int
    client: int
    generator: torch.Generator
    #: the engine takes this round's probes (analysis on): training tallies what the method's loss
    #: tallies (``Step.tally``) into ``LocalResult.tallies``; results are the same either way
    probe: bool = False


@dataclass
class LocalResult:
    upload: State  # aggregated with weight = the client's train-sample count
    client_state: Optional[State]  # the client's new persistent state
    loss_sum: float  # Σ over local batches of (mean batch loss · batch size)
    samples: int  # samples seen in local training
    extra: dict = field(default_factory=dict)
    #: {name: Σ over the samples seen} of the loss's tallies (with ``Context.probe``; else empty)
    tallies: dict = field(default_factory=dict)
    #: aggregation groups (:meth:`Algorithm.aggregation_groups`) this client did not send this round
    skipped: tuple = ()

    def is_finite(self) -> bool:
        """The loss, the upload and the new client state (a personal-only method uploads nothing) are finite."""
        if not math.isfinite(self.loss_sum):
            return False
        tensors = [*self.upload.values(), *(self.client_state or {}).values()]
        return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


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

    #: why this method trains its clients one at a time whatever ``fused`` says (None: it can fuse)
    own_loop: Optional[str] = None
    #: the config keys this class adds (:class:`fedcp_dist.options.Option`), gathered by the config loader
    options: tuple = ()
    #: {key: (value, why)} where the method's preset on the embedded digits set
    #: (``configs/digits_<name>.yaml``, generated from the declarations) departs from a declared default
    digits_preset: dict = {}

    @classmethod
    def check_config(cls, cfg) -> Optional[Tuple[str, str]]:
        """(key, why) when the options of this class contradict each other in ``cfg``, else None."""
        return None

    @classmethod
    def rounds_scheduled(cls, cfg: dict) -> Optional[str]:
        """Why this method's training under the flat config ``cfg`` depends on the total number of
        rounds, so that ``rounds`` must not change when the run resumes (None: it does not)."""
        return None

    #: whether the server averages the clients' uploads (False: the models travel in the peer
    #: exchange, so upload compression has nothing to compress, and ``dp: central`` is refused)
    averages_uploads = True

    # -- what leaves a client (``dp: central`` covers the upload; the Privacy page) ---------------
    #: what a participant uploads each round, in words
    privacy_uploads = "the whole model it trained"
    #: what the client keeps and never uploads, in words ("": nothing)
    privacy_keeps = ""

    @classmethod
    def privacy_coverage(cls, cfg) -> Tuple[str, str]:
        """(what a participant uploads, what never leaves it) under the flat config ``cfg``."""
        return cls.privacy_uploads, cls.privacy_keeps

    @classmethod
    def uneven_uploads(cls, cfg) -> Optional[Tuple[str, str]]:
        """(key, why) when ``cfg`` lets some participants of a round leave parts of their upload out
        (:attr:`LocalResult.skipped`), each such part averaged over its senders; None: every
        participant of a round sends the same tensors."""
        return None

    def describe(self) -> str:
        """A note on the method's own design for the run's start line ("": none)."""
        return ""

    def fused_reason(self) -> Optional[str]:
        """Why this method's clients cannot train fused here (None: they can, through the engine's
        :mod:`fedcp_dist.fused.groups`, from :meth:`SGDAlgorithm.phases` and ``finish``)."""
        return self.own_loop or f"{self.name} has its own local training loop"

    def upload_keys(self, global_state: State) -> list:
        """The global-state keys that participants upload and the server averages (default: all)."""
        return list(global_state)

    def prepare_eval(self, client_state: Optional[State], data, ctx: Context) -> Optional[State]:
        """Called once per client before its test batches go through ``predict`` (default: as is).

        A method that adapts before evaluating (Per-FedAvg's step on a train batch) returns the
        adapted state here; the client's persistent state is not changed.
        """
        return client_state

    def begin_round(self, t: int) -> None:
        """Called on every rank at the start of round t (0-based), before anything of it runs."""

    def aggregation_groups(self, upload_keys: list) -> Optional[Dict[str, str]]:
        """{upload key: group} for the tensors some clients may leave out of their upload
        (:attr:`LocalResult.skipped`); each such tensor is averaged over the clients that sent its
        group. None (default): every client sends every tensor."""
        return None

    def skipped_groups(self, t: int) -> tuple:
        """The aggregation groups that no participant sends in round t (a function of t alone, so
        every rank agrees): the engine leaves them out of the round's all-reduce, counts their bytes
        as saved and keeps their global values. Default: none."""
        return ()

    def server_update(self, global_state: State, averaged: State) -> State:
        """New global state from the sample-weighted mean of the round's uploads."""
        return {k: averaged[k].clone() if k in averaged else v for k, v in global_state.items()}

    def predict(self, client_state: Optional[State], x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Logits of the client's personalized model (the global one for FedAvg) on ``x``."""
        raise NotImplementedError


class SGDAlgorithm(Algorithm):
    """A method whose local training is plain SGD on losses it declares once as phases.

    Subclasses set ``self.training_phases`` (the :class:`~fedcp_dist.local_train.Phase` s they
    train, in order) and implement :meth:`phases` (each client's starting values per phase) and
    :meth:`finish` (upload and new client state from the phases' outcomes). The sequential path
    (:meth:`local_train`) and the engine's fused path (:mod:`fedcp_dist.fused.groups`) then run
    the very same loss code, under ``amp`` alike.
    """

    training_phases: List[Phase] = []

    def phases(self, client_state: Optional[State], data, ctx: Context) -> List[Tuple[Phase, ClientPhase]]:
        raise NotImplementedError

    def finish(self, client_state: Optional[State], outcomes: List[PhaseOutcome], ctx: Context) -> LocalResult:
        raise NotImplementedError

    def sgd_settings(self, ctx: Optional[Context] = None) -> dict:
        """The SGD settings of a round's local training (``ctx``: the round; a subclass may add
        ``param_lr``, per-parameter rates)."""
        cfg = self.cfg
        return dict(batch_size=cfg.batch_size, drop_last=cfg.drop_last, lr=cfg.lr)

    def local_train(self, client_state, data, ctx):
        outcomes = [train_sequential(phase, cp, data, ctx.generator, amp=self.cfg.amp, tally=ctx.probe,
                                     **self.sgd_settings(ctx))
                    for phase, cp in self.phases(client_state, data, ctx)]
        return self.finish(client_state, outcomes, ctx)

    def fused_reason(self) -> Optional[str]:
        if self.own_loop is not None:
            return self.own_loop
        modules = [m for phase in self.training_phases for m in (*phase.modules.values(), *phase.shared)]
        return unsupported_reason(*modules)
