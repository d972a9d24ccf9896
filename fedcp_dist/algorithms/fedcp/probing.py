"""FedCP's evaluation and probes: the personalized model as evaluated (the received extractor and
policy, the client's own head), its policy's personal share s, the training loss before and after
local learning, and the rows they travel in (FedCP implements :class:`fedcp_dist.capabilities.Probes`).

The probes of ``analysis: true``, per client, per round with training probes (rounds 1, k+1, 2k+1, …
of ``analysis_every: k``):

* PIR over the training samples it saw in that round's local training, PIR_i = (1/K) Σ_k s̄_i^k,
  from the policy's s as training computed it (Gumbel noise included where training adds it);
* loss_bef / loss_aft: the personalized model's mean cross-entropy over all its training samples
  before and after its local learning.

Per client, at every evaluation (and the one after the last round): PIR over its test samples and
the histogram of s (every feature's s of every test sample) in ``S_BINS`` equal bins on [0, 1]:
bin j holds j/S_BINS ≤ s < (j+1)/S_BINS, the last one s = 1 too. The engine moves the rows
(:mod:`fedcp_dist.engine.probes`); :class:`PolicyProbeLayout` says what they hold and turns them
into the lines of ``analysis.jsonl``, the format :mod:`fedcp_dist.analysis.records` reads.
"""
from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from fedcp_dist.algorithms.base import load_module
from fedcp_dist.local_train import Step

S_BINS = 50
#: a client's training row: trained (1/0), samples seen, Σ s̄ over them, Σ loss before, Σ loss after, samples of the losses
TRAIN_WIDTH = 6
#: a client's evaluation row: evaluated (1/0), test samples, Σ s̄ over them, the histogram of s
EVAL_WIDTH = 3 + S_BINS


def s_histogram(s: torch.Tensor) -> torch.Tensor:
    """Counts of the values of ``s`` (any shape, in [0, 1]) in ``S_BINS`` equal bins, int64."""
    bins = torch.clamp(torch.floor(s.detach().double() * S_BINS).long(), 0, S_BINS - 1)
    return torch.bincount(bins.reshape(-1), minlength=S_BINS).cpu()


class PolicyTally:
    """One client's evaluation probes, added up over its test batches: samples, Σ s̄, the histogram of s."""

    def __init__(self):
        self.samples, self.s_sum, self.hist = 0, 0.0, torch.zeros(S_BINS, dtype=torch.int64)

    def add(self, s: torch.Tensor) -> None:
        """A test batch's s, (B, K)."""
        self.samples += int(s.shape[0])
        self.s_sum += float(s.detach().double().mean(dim=-1).sum())
        self.hist += s_histogram(s)

    def row(self) -> Optional[List[float]]:
        """The client's evaluation row (None: no test sample was probed)."""
        if not self.samples:
            return None
        return [1.0, self.samples, self.s_sum, *self.hist.tolist()]


def _share(v: float) -> float:
    """A mean of values in [0, 1], kept there against rounding."""
    return min(1.0, max(0.0, v))


class PolicyProbeLayout:
    """FedCP's probe rows (:class:`fedcp_dist.capabilities.ProbeLayout`)."""

    train_width = TRAIN_WIDTH
    eval_width = EVAL_WIDTH

    def train_row(self, result, losses: tuple, loss_samples: int) -> Sequence[float]:
        """Its round's samples and Σ s̄ (the result's ``s`` tally), and (Σ loss before, Σ loss after)
        over ``loss_samples`` training samples."""
        return [1.0, result.samples, result.tallies.get("s", 0.0), *losses, loss_samples]

    def eval_tally(self) -> PolicyTally:
        return PolicyTally()

    def records(self, train: torch.Tensor, evals: torch.Tensor, round_idx: Optional[int],
                evaluated_after: Optional[int], train_ids: Optional[Sequence[int]] = None,
                eval_ids: Optional[Sequence[int]] = None) -> List[dict]:
        """The ``analysis.jsonl`` lines of the reduced rows: the evaluation after ``evaluated_after``
        rounds (None: none), then round ``round_idx``'s training (0-based; None: none), each by client
        (row k is client ``train_ids[k]`` / ``eval_ids[k]``; None: client k)."""
        out = []
        if evaluated_after is not None:
            for c in range(evals.shape[0]):
                flag, m, s_sum = evals[c, :3].tolist()
                if flag > 0 and m > 0:
                    out.append({"kind": "eval", "evaluated_after": int(evaluated_after),
                                "client": int(eval_ids[c]) if eval_ids is not None else c,
                                "samples": int(m), "pir": _share(s_sum / m),
                                "s_hist": [int(v) for v in evals[c, 3:].tolist()]})
        if round_idx is not None:
            for c in range(train.shape[0]):
                flag, n, s_sum, bef, aft, n_loss = train[c].tolist()
                if flag > 0 and n > 0 and n_loss > 0:
                    out.append({"kind": "train", "round": int(round_idx) + 1,
                                "client": int(train_ids[c]) if train_ids is not None else c, "samples": int(n),
                                "pir": _share(s_sum / n), "loss_bef": bef / n_loss, "loss_aft": aft / n_loss})
        return out

    def scalars(self, lines: Iterable[dict]) -> Iterator[Tuple[str, int, float]]:
        """Per round, the sample-weighted means over the clients probed: ``analysis/pir_train``,
        ``analysis/loss_bef``, ``analysis/loss_aft`` at step ``round``, ``analysis/pir_test`` at step
        ``evaluated_after`` (as ``fedcp-analyze`` draws them)."""
        train: dict = {}
        evals: dict = {}
        for obj in lines:
            if obj.get("kind") == "train" and obj.get("samples", 0) > 0:
                train.setdefault(obj["round"], []).append(obj)
            elif obj.get("kind") == "eval" and obj.get("samples", 0) > 0:
                evals.setdefault(obj["evaluated_after"], []).append(obj)
        for r, objs in sorted(train.items()):
            for key, tag in (("pir", "pir_train"), ("loss_bef", "loss_bef"), ("loss_aft", "loss_aft")):
                yield f"analysis/{tag}", r, _weighted([(o["samples"], o[key]) for o in objs])
        for e, objs in sorted(evals.items()):
            yield "analysis/pir_test", e, _weighted([(o["samples"], o["pir"]) for o in objs])


def _weighted(pairs) -> float:
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total


class PolicyProbes:
    """Evaluation hooks and probes of :class:`~fedcp_dist.algorithms.fedcp.FedCP` (a mixin: it reads
    the algorithm's modules and parts)."""

    probe_layout = PolicyProbeLayout()

    def _load_eval_policy(self, t: int) -> None:
        """The evaluated policy's networks of round t (caching: interpolated between refreshes)."""
        if self.sync.every == 1 or self._eval_policy_round == t:
            return
        values = self.sync.values_at(self.gs, t)
        for prefix in self.sync.prefixes:
            if prefix in self.eval_modules:
                load_module(self.eval_modules[prefix], values, prefix)
        self._eval_policy_round = t

    def _load_own(self, client_state) -> None:
        """The client's own policy modules (head+embed's embedding), from its state."""
        for m in self._on(shared=False):
            load_module(self.own[m.name], client_state, m.prefix)

    def _eval_values(self, client_state, cid: int) -> dict:
        values = {"v": client_state["v"]}
        if self.vector.kind == "head+stats":  # prepare_eval's, or the client's once computed
            values["stats"] = client_state["stats"] if "stats" in client_state else self.vector._stats[cid]
        return values

    def _eval_heads(self, client_state, x, ctx):
        # evaluation before round t sees the model of round t − 1: that round's temperature
        self.tau = self.schedules.tau_at(ctx.round - 1)
        self._load_eval_policy(ctx.round)  # evaluation before round t: the policy round t starts from
        load_module(self.head_p, client_state, "head.")
        self.head_p.eval()
        self._load_own(client_state)
        step = Step(x, None, self.eval_modules, self._eval_values(client_state, ctx.client), ctx.generator)
        return self.heads(step, self.cfg.cpn_eval_gumbel)

    def head_outputs(self, client_state, x, ctx):
        """(g(s ⊙ h; W_i^hd), g(r ⊙ h; W^hd)): the personal and the global head's logits of the
        client's personalized model as evaluated; their sum is :meth:`predict`'s output. Runs with
        gradients enabled (for Grad-CAM)."""
        out = self._eval_heads(client_state, x, ctx)
        return out.personal, out.glob

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        return self._eval_heads(client_state, x, ctx).logits

    @torch.no_grad()
    def predict_probe(self, client_state, x, ctx):
        out = self._eval_heads(client_state, x, ctx)
        return out.logits, out.s

    @torch.no_grad()
    def _train_loss(self, modules, values: dict, data, ctx) -> float:
        """Σ cross-entropy of the personalized model on ``modules`` (values loaded, eval mode) over
        the client's training samples, in evaluation-sized batches."""
        bs, n, total = self.cfg.eval_batch_size, data.n_train, 0.0
        for i in range(0, n, bs):
            x, y = data.train_batch(torch.arange(i, min(i + bs, n), device=data.train_y.device))
            out = self.heads(Step(x, None, modules, values, ctx.generator), self.cfg.cpn_eval_gumbel)
            total += float(F.cross_entropy(out.logits.float(), y, reduction="sum"))
        return total

    def probe_losses(self, before, result, data, ctx):
        """Before: the model :meth:`predict` evaluates (the received extractor and CPN, the client's
        head and v). After: the client's trained extractor, CPN and head with its new v, the frozen
        received global head as in training; both without Gumbel noise unless ``cpn_eval_gumbel``."""
        load_module(self.head_p, before, "head.")
        self._load_own(before)
        self._load_eval_policy(ctx.round)
        modes = {m: m.training for m in self.train_phase.modules.values()}
        try:
            self.head_p.eval()
            bef = self._train_loss(self.eval_modules, self.vector.values(before, data, ctx.client), data, ctx)
            for prefix, m in self.train_phase.modules.items():
                load_module(m, result.extra["trained"], prefix)
                m.eval()
            after = self.vector.values(result.client_state, data, ctx.client)
            aft = self._train_loss(self.train_phase.modules, after, data, ctx)
        finally:
            for m, mode in modes.items():
                m.train(mode)
        return bef, aft
