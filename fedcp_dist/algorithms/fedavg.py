"""FedAvg: every participant trains the global model with SGD; the server averages by samples."""
from __future__ import annotations

import copy

import torch

from fedcp_dist.algorithms.base import LocalResult, SGDAlgorithm, freeze, load_module, module_state
from fedcp_dist.local_train import ClientPhase, Phase


class FedAvg(SGDAlgorithm):
    name = "fedavg"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.model = model.to(device)  # working copy, trained by each participant in turn
        self.global_model = freeze(copy.deepcopy(self.model)).eval()
        self.gs = module_state("", self.model)
        self.param_names = [n for n, p in self.model.named_parameters()]
        self.train_phase = Phase("train", self.loss, {"": self.model},
                                 trainable=tuple(n for n, p in self.model.named_parameters() if p.requires_grad),
                                 epochs=cfg.local_epochs)
        self.training_phases = [self.train_phase]

    def init_global_state(self):
        return module_state("", self.model)

    def set_global(self, global_state):
        load_module(self.global_model, global_state, "")
        self.gs = global_state

    def loss(self, step):
        """Cross-entropy of the model on the batch."""
        return step.cross_entropy(step.run("", step.x))

    def phases(self, client_state, data, ctx):
        return [(self.train_phase, ClientPhase(self.gs))]

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        return LocalResult(upload={k: o.values[k] for k in self.gs}, client_state=None, loss_sum=o.loss_sum,
                           samples=o.samples)

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
