"""FedAvg: every participant trains the global model with SGD; the server averages by samples."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import Algorithm, LocalResult, copy_module, freeze, load_module, module_state
from fedcp_dist.local_train import batch_indices, sgd


class FedAvg(Algorithm):
    name = "fedavg"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.model = model.to(device)  # working copy, trained by each participant in turn
        self.global_model = freeze(copy.deepcopy(self.model)).eval()

    def init_global_state(self):
        return module_state("", self.model)

    def set_global(self, global_state):
        load_module(self.global_model, global_state, "")

    def local_train(self, client_state, data, ctx):
        model = self.model
        copy_module(model, self.global_model)
        model.train()

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            return F.cross_entropy(model(x), y)

        batches = batch_indices(data.n_train, self.cfg.batch_size, self.cfg.local_epochs, self.cfg.drop_last, ctx.generator)
        loss_sum, seen = sgd(model.parameters(), batches, loss_fn, self.cfg.lr)
        return LocalResult(upload=module_state("", model), client_state=None, loss_sum=loss_sum, samples=seen)

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        return self.global_model(x)


class FedAvgWithPersonalModel(FedAvg):
    """FedAvg plus a persistent per-client model that is what is evaluated (Ditto's v, pFedMe's θ).

    The client state is that model's parameters; before a client first trains it is the initial
    global model.
    """

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.eval_model = freeze(copy.deepcopy(self.model)).eval()
        self._init_state = module_state("", self.model)

    def init_client_state(self, client):
        return {k: v.clone() for k, v in self._init_state.items()}

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.eval_model, client_state, "")
        return self.eval_model(x)
