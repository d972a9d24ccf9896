"""What FedAMP and FedFomo share: personal models only, and a bank of every client's latest model.

Neither method has a global model. Each client keeps its own model (its persistent state, where
it is evaluated) and, after training, shares it with every rank through the engine's one
all-gather per round (``peer_dim`` values: the model flattened, plus whatever the method adds).
Every rank then writes the round's models into the same replicated *bank*, part of the global
state, so it is checkpointed with it and identical on every rank:

* ``bank``  (N, P) float32: the parameters of every client's latest model, flattened in
  ``named_parameters`` order (BatchNorm running statistics are not parameters: they stay with
  their client, as in the reference);
* ``fresh`` (N,): 1 for the clients whose model arrived in the last round, else 0;
* ``seen``  (N,): 1 for the clients whose model has ever arrived.

Memory per rank: N·P·4 bytes for the bank (with ``client_state: disk`` a file mapped into memory,
see :class:`~fedcp_dist.state.disk_store.DiskClientStore`) (the engine adds its exchange buffer and refuses a run
above ``peer_memory_mb``); for the 4-layer CNN on MNIST (P ≈ 582 k) that is 2.2 MiB per client.
"""
from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import SGDAlgorithm, State, freeze, load_module, module_state
from fedcp_dist.state.client_store import banks_in_files
from fedcp_dist.local_train import Phase
from fedcp_dist.options import Option, above


class PeerBankMethod(SGDAlgorithm):
    #: global tensors with a row per client: a disk client store (client_state=disk) keeps them in
    #: files mapped into memory, so they are updated in place, never copied whole
    bank_keys = ("bank",)
    averages_uploads = False
    privacy_uploads = ""  # dp=central is refused: the models travel to the other clients
    options = (
        Option("peer_memory_mb", 4096.0, "FedAMP/FedFomo: MiB per rank that the models exchanged between clients may "
               "use; a run above it is refused", above(0)),
    )

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.model = model.to(device)  # working copy, trained by each participant in turn
        self.eval_model = freeze(copy.deepcopy(self.model)).eval()
        self._init_state = module_state("", self.model)
        self.param_names = [n for n, _ in self.model.named_parameters()]
        self.shapes = {k: self._init_state[k].shape for k in self.param_names}
        self.model_dim = sum(s.numel() for s in self.shapes.values())
        self.gs: State = {}
        self.train_phase = Phase("train", self.loss, {"": self.model},
                                 trainable=tuple(n for n, p in self.model.named_parameters() if p.requires_grad),
                                 epochs=cfg.local_epochs)
        self.training_phases = [self.train_phase]

    def loss(self, step):
        """Cross-entropy of the client's model on the batch."""
        return step.cross_entropy(step.run("", step.x))

    def own_state(self, values: State) -> State:
        """The client's new model state (parameters and buffers) from a phase's values."""
        return {k: values[k] for k in self._init_state}

    @property
    def peer_dim(self) -> int:
        return self.model_dim + self.extra_peer_dim()

    # -- flat views of a model's parameters --------------------------------------
    def flat(self, state: State) -> torch.Tensor:
        """The parameters of a model state, flat (buffers left out)."""
        return torch.cat([state[k].reshape(-1) for k in self.param_names])

    def unflat(self, vec: torch.Tensor) -> State:
        """``{parameter name: view}`` of a flat parameter vector."""
        out, off = {}, 0
        for k, shape in self.shapes.items():
            n = shape.numel()
            out[k] = vec[off : off + n].view(shape)
            off += n
        return out

    # -- hooks ----------------------------------------------------------------
    def extra_peer_dim(self) -> int:
        """Values a participant shares beyond its model (default none)."""
        return 0

    def zeros_per_client(self, cols: int) -> torch.Tensor:
        """An (N, cols) tensor of zeros for a ``bank_keys`` entry. With ``client_state: disk`` on the CPU
        the store copies it into a file mapped into memory at once: then it is one row expanded, so
        that N rows are never allocated."""
        if banks_in_files(self.cfg.client_state, self.device):
            return torch.zeros(1, cols).expand(self.num_clients, cols)
        return torch.zeros(self.num_clients, cols, device=self.device)

    def init_global_state(self) -> State:
        n, dev = self.num_clients, self.device
        return {
            "bank": self.zeros_per_client(self.model_dim),
            "fresh": torch.zeros(n, device=dev),
            "seen": torch.zeros(n, device=dev),
        }

    def set_global(self, global_state):
        self.gs = global_state

    def upload_keys(self, global_state):
        return []  # nothing is averaged: the models travel through the peer exchange

    def init_client_state(self, client):
        return {k: v.clone() for k, v in self._init_state.items()}

    def peer_memory_bytes(self, num_clients):
        return num_clients * self.model_dim * 4

    def peer_payload(self, result):
        return result.extra["peer"]

    def receive_peers(self, round_idx, global_state, peers: Dict[int, torch.Tensor]):
        bank, fresh, seen = global_state["bank"], torch.zeros_like(global_state["fresh"]), global_state["seen"].clone()
        for cid, vec in peers.items():
            bank[cid] = vec[: self.model_dim]
            fresh[cid] = 1.0
            seen[cid] = 1.0
        return {**global_state, "bank": bank, "fresh": fresh, "seen": seen}

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.eval_model, client_state, "")
        return self.eval_model(x)

    @torch.no_grad()
    def mean_loss(self, state: State, data, idx: torch.Tensor) -> float:
        """Mean cross-entropy of the model ``state`` on the training samples ``idx``."""
        load_module(self.eval_model, state, "")
        total = 0.0
        bs = self.cfg.eval_batch_size
        for start in range(0, int(idx.shape[0]), bs):
            x, y = data.train_batch(idx[start : start + bs])
            total += float(F.cross_entropy(self.eval_model(x), y, reduction="sum"))
        return total / max(int(idx.shape[0]), 1)
