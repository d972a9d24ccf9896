"""FedFomo (Zhang et al., ICLR 2021): each client weighs other clients' models on its own data.

No global model. Each client i holds out a fixed validation split (``fedfomo_val_ratio`` of its
training samples, chosen once from the run seed) and keeps its own model θ_i. Every round it

1. receives M = ``fedfomo_m`` models θ_j (j ≠ i) from the bank of every client's latest model:
   with probability ε_t = max(0, ε − t·``fedfomo_eps_decay``) M at random, otherwise the M with
   the highest affinity P[i, j] (ties: lower id first);
2. weighs each by its loss improvement per unit of parameter distance on the validation split,
   w_ij = (L_i(θ_i) − L_i(θ_j)) / ‖θ_j − θ_i‖, and moves
   θ_i ← θ_i + Σ_j (max(w_ij, 0) / Σ_k max(w_ik, 0))·(θ_j − θ_i)   (unchanged if no w_ij > 0);
3. trains θ_i on the rest of its samples with plain SGD for ``local_epochs``.

It shares θ_i and its row of w_ij; every rank adds the rows into the replicated affinity matrix,
P[i, j] += w_ij. θ_i is what is evaluated. Memory per rank: the bank (N·P floats) plus P (N²).
"""
from __future__ import annotations

import torch

from fedcp_dist.algorithms.base import LocalResult
from fedcp_dist.algorithms.peers import PeerBankMethod
from fedcp_dist.local_train import ClientPhase
from fedcp_dist.options import Option, above, at_least, within
from fedcp_dist.placement import STREAM_INIT, stream_seed

SPLIT_TAG = 17  # keeps the validation-split stream apart from other STREAM_INIT draws


class FedFomo(PeerBankMethod):
    name = "fedfomo"
    options = (
        Option("fedfomo_m", 5, "FedFomo: M, other clients' models each participant downloads and weighs every round",
               above(0)),
        Option("fedfomo_val_ratio", 0.2, "FedFomo: fraction of each client's training samples held out as its "
               "validation split", within(0, 1, low_open=True, high_open=True)),
        Option("fedfomo_eps", 0.3, "FedFomo: ε of the ε-greedy choice of models (random with probability ε, else the "
               "highest affinity)", within(0, 1)),
        Option("fedfomo_eps_decay", 0.05, "FedFomo: ε falls by this much every round (not below 0)", at_least(0)),
    )

    bank_keys = ("bank", "affinity")

    def extra_peer_dim(self):
        return self.num_clients  # the client's row of weights w_i·

    def init_global_state(self):
        n = self.num_clients
        return {**super().init_global_state(), "affinity": self.zeros_per_client(n)}

    def peer_memory_bytes(self, num_clients):
        return super().peer_memory_bytes(num_clients) + num_clients * num_clients * 4

    def receive_peers(self, round_idx, global_state, peers):
        out = super().receive_peers(round_idx, global_state, peers)
        affinity = global_state["affinity"]  # updated in place, as the bank is (no N x N copy)
        for cid, vec in peers.items():
            affinity[cid] += vec[self.model_dim :]
        out["affinity"] = affinity
        return out

    def split(self, client: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(validation, training) sample indices of a client holding ``n`` samples; fixed for the run."""
        gen = torch.Generator().manual_seed(stream_seed(self.cfg.seed, STREAM_INIT, SPLIT_TAG, client))
        perm = torch.randperm(n, generator=gen).to(self.device)
        n_val = 0 if n < 2 else min(n - 1, max(1, int(round(self.cfg.fedfomo_val_ratio * n))))
        return perm[:n_val], perm[n_val:]

    def choose(self, client: int, round_idx: int, generator: torch.Generator) -> list[int]:
        """The ids of the models client ``client`` downloads this round (ε-greedy on affinity)."""
        cfg = self.cfg
        cands = [j for j in torch.nonzero(self.gs["seen"]).flatten().tolist() if j != client]
        m = min(cfg.fedfomo_m, len(cands))
        if m == 0:
            return []
        eps = max(0.0, cfg.fedfomo_eps - cfg.fedfomo_eps_decay * round_idx)
        draw = float(torch.rand(1, generator=generator, device=generator.device))
        if draw < eps:
            pick = torch.randperm(len(cands), generator=generator, device=generator.device)[:m].tolist()
            return sorted(cands[k] for k in pick)
        row = self.gs["affinity"][client]
        return sorted(sorted(cands, key=lambda j: (-float(row[j]), j))[:m])

    def mix(self, client_state, data, ctx, val_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(θ_i after the weighted move toward the chosen models, the row of weights w_i·)."""
        theta = self.flat(client_state)
        weights = torch.zeros(self.num_clients, device=theta.device)
        chosen = self.choose(ctx.client, ctx.round, ctx.generator)
        if chosen and val_idx.numel() > 0:
            bank = self.gs["bank"]
            base_loss = self.mean_loss(client_state, data, val_idx)
            for j in chosen:  # another client's parameters with this client's own buffers
                dist = float(torch.linalg.vector_norm(bank[j] - theta))
                if dist > 0:
                    other = {**client_state, **self.unflat(bank[j])}
                    weights[j] = (base_loss - self.mean_loss(other, data, val_idx)) / dist
            pos = weights.clamp_min(0.0)
            if float(pos.sum()) > 0:
                step = torch.zeros_like(theta)
                for j in chosen:
                    if pos[j] > 0:
                        step.add_(bank[j] - theta, alpha=float(pos[j] / pos.sum()))
                theta = theta + step
        return theta, weights

    def phases(self, client_state, data, ctx):
        val_idx, train_idx = self.split(ctx.client, data.n_train)
        theta, weights = self.mix(client_state, data, ctx, val_idx)
        start = {**client_state, **self.unflat(theta)}
        return [(self.train_phase, ClientPhase(start, index=train_idx, info={"weights": weights}))]

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        new_state = self.own_state(o.values)
        return LocalResult(upload={}, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples,
                           extra={"peer": torch.cat([self.flat(new_state), o.info["weights"]])})
