"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021): shared representation, personal head.

Each round a participant loads the global extractor φ and its own head h_i, then

1. trains the head alone for ``fedrep_head_epochs`` epochs, φ frozen;
2. trains φ alone for ``local_epochs`` epochs (1, the paper's), the head frozen;

and uploads φ only; the head stays on the client. While φ is frozen its features do not change,
so step 1 computes them once (chunks of ``eval_batch_size``, no graph) and trains the head on them:
the same updates (up to float rounding) as running the extractor on every batch, without its cost.
That holds only for an extractor that computes each sample on its own: with BatchNorm (or dropout)
a feature depends on its batch, so such an extractor (ResNet-18) runs, frozen and in training
mode, on every head batch instead, as the reference does (its running statistics follow those batches).
Evaluation: the global extractor with the client's head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import load_module, module_state
from fedcp_dist.algorithms.fedper import FedPer
from fedcp_dist.local_train import PhaseOutcome, batch_indices, sgd
from fedcp_dist.options import Option, within
from fedcp_dist.models import mode_dependent


class FedRep(FedPer):
    name = "fedrep"
    own_loop = "FedRep trains its head on features computed once per round, then its extractor alone"
    options = (
        Option("fedrep_head_epochs", 10, "FedRep: local epochs of the personal head (extractor frozen) before the "
               "extractor's `local_epochs`", within(1, 10_000)),
    )

    @torch.no_grad()
    def _features(self, data) -> torch.Tensor:
        fe = self.model.features
        step = max(1, int(self.cfg.eval_batch_size))
        chunks = [fe(data.train_batch(torch.arange(i, min(i + step, data.n_train), device=data.train_y.device))[0])
                  for i in range(0, data.n_train, step)]
        return torch.cat(chunks) if chunks else torch.zeros(0, self.model.head.in_features, device=data.train_y.device)

    def _train_head(self, data, ctx):
        """Head epochs on the frozen extractor's features; returns (loss sum, samples)."""
        cfg = self.cfg
        fe, head = self.model.features, self.model.head
        if mode_dependent(fe):

            def loss_fn(idx):
                x, y = data.train_batch(idx)
                with torch.no_grad():
                    h = fe(x)
                return F.cross_entropy(head(h), y)

        else:
            h, y = self._features(data), data.train_y

            def loss_fn(idx):
                return F.cross_entropy(head(h[idx]), y[idx])

        batches = batch_indices(data.n_train, cfg.batch_size, cfg.fedrep_head_epochs, cfg.drop_last, ctx.generator)
        return sgd(head.parameters(), batches, loss_fn, cfg.lr, amp=cfg.amp)

    def _train_extractor(self, data, ctx):
        """Extractor epochs with the head frozen (only the extractor's parameters step)."""
        cfg = self.cfg
        model = self.model

        def loss_fn(idx):
            x, y = data.train_batch(idx)
            return F.cross_entropy(model(x), y)

        batches = batch_indices(data.n_train, cfg.batch_size, cfg.local_epochs, cfg.drop_last, ctx.generator)
        return sgd(model.features.parameters(), batches, loss_fn, cfg.lr, amp=cfg.amp)

    def local_train(self, client_state, data, ctx):
        load_module(self.model, {**self.gs, **client_state}, "")  # global extractor + the client's head
        self.model.train()
        l_head, n_head = self._train_head(data, ctx)
        l_fe, n_fe = self._train_extractor(data, ctx)
        outcome = PhaseOutcome(module_state("", self.model), l_head + l_fe, n_head + n_fe)
        return self.finish(client_state, [outcome], ctx)
