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

This is the FedFomo paper's update: the client's current model θ_i^{t−1} (its model after its last
training) is the reference point of every weight, and the M downloaded models are other clients'
(the own model, at distance 0, has no weight of its own).

``fedfomo_reference_compat=true`` is the reference library's FedFomo (PFLlib, 2023), behind the
FedCP paper's FedFomo numbers:

* P starts as the identity and the M models are the top M of P[i, ·] over *all* clients, the client
  itself included (ties: lower id first), never random (no ε-greedy); M is capped by the number of
  models that arrived in the previous round (none in the first round); a client whose model never
  arrived is represented by the initial model;
* the weights are measured against θ_i^old, the client's model as it was *before* its last
  training (after its last mix), with the loss on the validation split as the mean of per-batch mean
  losses (batches of ``batch_size``) and ‖θ_j − θ_i^old‖ + 10⁻⁵ as the distance:
  w_ij = (L_i(θ_i^old) − L_i(θ_j)) / (‖θ_j − θ_i^old‖ + 10⁻⁵), the own just-trained model among them;
* the new model is the weighted average Σ_j (max(w_ij, 0) / Σ_k max(w_ik, 0))·θ_j of the chosen
  models, own included (the client's current model if no weight is positive); it becomes θ_i^old
  for the next participation.

The reference's unshuffled loaders and its validation split (the last 20 % of the client's file
order) are not reproduced: the split stays the fixed random one and training batches are shuffled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, load_module
from fedcp_dist.algorithms.peers import PeerBankMethod
from fedcp_dist.local_train import ClientPhase
from fedcp_dist.models import mode_dependent
from fedcp_dist.options import Option, above, at_least, within
from fedcp_dist.state.placement import STREAM_INIT, stream_seed

SPLIT_TAG = 17  # keeps the validation-split stream apart from other STREAM_INIT draws
OLD = "fomo_old"  # reference_compat: the client's flat model before its last training
DIST_EPS = 1e-5  # reference_compat: added to the parameter distance


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
        Option("fedfomo_reference_compat", False, "FedFomo: the reference library's variant: affinity starting at the "
               "identity, the top M of all clients (itself included, no ε-greedy), weights against the model before "
               "its last training, the new model the weighted average of the chosen ones"),
    )

    bank_keys = ("bank", "affinity")

    def extra_peer_dim(self):
        return self.num_clients  # the client's row of weights w_i·

    @property
    def compat(self) -> bool:
        return bool(self.cfg.fedfomo_reference_compat)

    def init_global_state(self):
        n = self.num_clients
        # compat: the identity (materialised even with client_state=disk: its diagonal is not zero)
        affinity = torch.eye(n, device=self.device) if self.compat else self.zeros_per_client(n)
        return {**super().init_global_state(), "affinity": affinity}

    def init_client_state(self, client):
        state = super().init_client_state(client)
        if self.compat:  # before any training, the model before the last training is the initial one
            state[OLD] = self.flat(state).clone()
        return state

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
        if self.compat:  # the top M of the whole row, itself included; M capped by last round's arrivals
            m = min(cfg.fedfomo_m, int(self.gs["fresh"].sum()))
            row = self.gs["affinity"][client]
            return sorted(sorted(range(self.num_clients), key=lambda j: (-float(row[j]), j))[:m])
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
        if self.compat:
            return self.mix_reference(client_state, data, ctx, val_idx)
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

    def mix_reference(self, client_state, data, ctx, val_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``fedfomo_reference_compat``: (the weighted average of the chosen models, or the current model
        when no weight is positive; the row of weights w_i·, measured against θ_i^old)."""
        theta = self.flat(client_state)
        weights = torch.zeros(self.num_clients, device=theta.device)
        chosen = self.choose(ctx.client, ctx.round, ctx.generator)
        if not chosen or val_idx.numel() == 0:
            return theta, weights
        old = client_state[OLD]
        base_loss = self.batch_mean_loss({**client_state, **self.unflat(old)}, data, val_idx)
        models = {}
        for j in chosen:  # itself: its current model; a client never heard from: the initial model
            if j == ctx.client:
                models[j] = theta
            elif float(self.gs["seen"][j]) > 0:
                models[j] = self.gs["bank"][j]
            else:
                models[j] = self.flat(self._init_state)
            dist = float(torch.linalg.vector_norm(models[j] - old)) + DIST_EPS
            weights[j] = (base_loss - self.batch_mean_loss({**client_state, **self.unflat(models[j])}, data, val_idx)) / dist
        pos = weights.clamp_min(0.0)
        total = float(pos.sum())
        if total <= 0:
            return theta, weights
        mixed = torch.zeros_like(theta)
        for j in chosen:
            mixed.add_(models[j], alpha=float(pos[j] / total))
        return mixed, weights

    @torch.no_grad()
    def batch_mean_loss(self, state, data, idx: torch.Tensor) -> float:
        """The mean over batches of ``batch_size`` of each batch's mean cross-entropy (the reference's
        validation loss); a BatchNorm model drops the last incomplete batch, as its loader does."""
        load_module(self.eval_model, state, "")
        bs, n = self.cfg.batch_size, int(idx.shape[0])
        ends = range(bs, n + 1, bs) if mode_dependent(self.eval_model) else range(bs, n + bs, bs)
        losses = []
        for end in ends:
            x, y = data.train_batch(idx[end - bs : min(end, n)])
            losses.append(float(F.cross_entropy(self.eval_model(x), y)))
        return sum(losses) / len(losses) if losses else 0.0

    def phases(self, client_state, data, ctx):
        val_idx, train_idx = self.split(ctx.client, data.n_train)
        theta, weights = self.mix(client_state, data, ctx, val_idx)
        start = {**client_state, **self.unflat(theta)}
        info = {"weights": weights}
        if self.compat:  # the mixed model, before this training: the next participation's reference
            info["old"] = theta.clone()
        return [(self.train_phase, ClientPhase(start, index=train_idx, info=info))]

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        new_state = self.own_state(o.values)
        if self.compat:
            new_state[OLD] = o.info["old"]
        return LocalResult(upload={}, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples,
                           extra={"peer": torch.cat([self.flat(new_state), o.info["weights"]])})
