"""FedPHP (Li, Zhan, Shao, Li, Song, ECML PKDD 2021): federated personalisation with an inherited
private model (HPM).

Each client keeps its HPM v_i, a temporal ensemble of its past personalised (locally trained)
models; it starts as the initial global model. A participant

1. trains the received global model w with SGD on (1 − λ)·CE + λ·MMD²(f_w(x), f_v(x)): the MMD
   between its features and the HPM's (frozen, no gradient) transfers the HPM's knowledge; both
   feature sets normalise by the batch's own statistics where the model has BatchNorm, as the
   reference's (training-mode) HPM does, and the HPM's running statistics are left untouched;
2. folds the trained w into the HPM:  v ← μ·v + (1 − μ)·w,  with
   μ = μ̄·min(1, k / max(1, ⌊ρ·T⌋)), k the client's earlier participations, ρ the participation
   rate (the middle of ``participation_range`` when that is set) and T = ``rounds``: a new client's
   HPM follows its local models, a frequent one's is an ever slower average;
3. uploads w (averaged as FedAvg).

The HPM is what is evaluated. The MMD² is FedCP's (the same RBF kernels).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import LocalResult, copy_module, freeze, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.algorithms.fedcp import mmd2
from fedcp_dist.local_train import batch_indices, sgd
from fedcp_dist.models import forward_batch_stats

HPM = "hpm."
COUNT = "participations"


def hpm_momentum(mu_max: float, participations: int, participation: float, rounds: int) -> float:
    """μ for a client that has trained ``participations`` times before: μ̄·k/⌊ρT⌋, capped at μ̄."""
    expected = max(1, int(participation * rounds + 1e-9))
    return float(min(max(mu_max * participations / expected, 0.0), mu_max))


class FedPHP(FedAvg):
    name = "fedphp"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.hpm = freeze(copy.deepcopy(self.model)).eval()
        self._init_state = module_state(HPM, self.model)

    def init_client_state(self, client):
        state = {k: v.clone() for k, v in self._init_state.items()}
        state[COUNT] = torch.zeros((), device=self.device)
        return state

    def _participation(self) -> float:
        r = self.cfg.participation_range
        return float(self.cfg.participation) if r is None else 0.5 * (float(r[0]) + float(r[1]))

    def local_train(self, client_state, data, ctx):
        cfg = self.cfg
        lam = float(cfg.fedphp_lam)
        model = self.model
        copy_module(model, self.global_model)
        model.train()
        load_module(self.hpm, client_state, HPM)

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            h = model.features(x)
            loss = F.cross_entropy(model.head(h), y)
            if lam > 0:
                h_hpm = forward_batch_stats(self.hpm.features, x)
                loss = (1.0 - lam) * loss + lam * mmd2(h, h_hpm)
            return loss

        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        loss_sum, seen = sgd(model.parameters(), batches, loss_fn, cfg.lr)

        k = int(client_state[COUNT].item())
        mu = hpm_momentum(float(cfg.fedphp_mu), k, self._participation(), int(cfg.rounds))
        local = module_state(HPM, model)
        with torch.no_grad():
            new_state = {key: mu * client_state[key] + (1.0 - mu) * local[key] for key in local}
        new_state[COUNT] = client_state[COUNT] + 1
        return LocalResult(upload=module_state("", model), client_state=new_state, loss_sum=loss_sum, samples=seen)

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.hpm, client_state, HPM)
        return self.hpm(x)
