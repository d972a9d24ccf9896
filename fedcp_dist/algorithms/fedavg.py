"""FedAvg: every participant trains the global model with SGD; the server averages by samples."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fedcp_dist import fused
from fedcp_dist.algorithms.base import Algorithm, LocalResult, copy_module, freeze, load_module, module_state
from fedcp_dist.local_train import amp_autocast, batch_indices, sgd


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
        loss_sum, seen = sgd(model.parameters(), batches, loss_fn, self.cfg.lr, amp=self.cfg.amp)
        return LocalResult(upload=module_state("", model), client_state=None, loss_sum=loss_sum, samples=seen)

    # -- fused training (fused=true): the same SGD for a group of clients at once -----------------
    def _fused_ok(self) -> bool:
        """The fused path is FedAvg's own local_train, so a subclass that overrides it keeps its own."""
        if type(self).local_train is not FedAvg.local_train:
            return False
        reason = fused.unsupported_reason(self.model)
        if reason is not None:
            fused.note_once(self, f"fused=true: {reason}; clients train one at a time")
            return False
        return True

    def _fused_memory(self, datas) -> "fused.MemoryPlan":
        """4 bytes per stacked parameter, its gradient and per upload element; activations from a probe."""
        x = fused.probe_input(datas)
        if "_fused_act" not in self.__dict__ and x is not None:
            self._fused_act = fused.activation_elements(lambda: self.model(x), [self.model])
        act = self.__dict__.get("_fused_act", 0)
        trained, total = fused.param_count(self.model, trainable=True), fused.param_count(self.model)
        per_slot = 4 * (2 * trained + (total - trained)) + fused.ACTIVATION_COPIES * 4 * self.cfg.batch_size * act
        return fused.MemoryPlan(per_slot=per_slot, per_result=4 * total)

    def fused_group_size(self, datas):
        if not self._fused_ok():
            return super().fused_group_size(datas)
        return self._fused_memory(datas).group_size(self.device, len(datas))

    def local_train_group(self, items):
        if not items or not self._fused_ok():
            return super().local_train_group(items)
        cfg, model = self.cfg, self.model
        datas = [d for _, d, _ in items]
        model.train()
        if "_fused_split" not in self.__dict__:
            x = fused.probe_input(datas)
            if x is None:
                return super().local_train_group(items)
            self._fused_split = fused.computes_head_of_features(model, x)
        split = self._fused_split
        start = {n: p.detach() for n, p in self.global_model.named_parameters()}
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]

        def step_loss(views, batch):
            if split:
                h = fused.grouped_forward(model.features, fused.sub_params(views, "features."), batch.x, batch.k)
                out = fused.grouped_forward(model.head, fused.sub_params(views, "head."), h, batch.k)
            else:
                out = fused.grouped_forward(model, views, batch.x, batch.k)
            return fused.masked_cross_entropy(out, batch.y, batch.mask, batch.count)

        outcomes = fused.train_fused(
            [fused.ClientRun(d, ctx.generator, start) for _, d, ctx in items],
            trainable=trainable,
            step_loss=step_loss,
            slots=self._fused_memory(datas).slots(self.device, len(items)),
            batch_size=cfg.batch_size,
            epochs=cfg.local_epochs,
            drop_last=cfg.drop_last,
            lr=cfg.lr,
            autocast=lambda: amp_autocast(cfg.amp, self.device),
        )
        return [LocalResult(upload=o.values, client_state=None, loss_sum=o.loss_sum, samples=o.samples) for o in outcomes]

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
