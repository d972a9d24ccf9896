"""Personalized evaluation: each owned client's model on its own test split, summed for the all-reduce.

The reported accuracy is Σ correct / Σ test samples over all clients (the paper's); the client
mean and a micro-averaged ROC AUC (weighted by test samples) ride along.  Binary tasks (two
classes, label 1 the positive class: fraud, disease) add, pooled over every client's test
samples, the positive class's recall TP / (TP + FN) and the balanced accuracy
(TP / (TP + FN) + TN / (TN + FP)) / 2; other tasks never count them and report neither.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedcp_dist.comm.aggregate import Sums
from fedcp_dist.algorithms.base import Context
from fedcp_dist.engine.probes import RoundProbes


@dataclass
class EvalSums(Sums):
    """What one evaluation adds up over clients (and ranks)."""

    ORDERED = ("acc_client_sum", "auc_weighted_sum", "loss_sum")

    correct: float = 0.0
    test_samples: float = 0.0
    acc_client_sum: float = 0.0  # Σ over clients of each client's accuracy
    clients: float = 0.0
    auc_weighted_sum: float = 0.0  # Σ over clients of AUC · test samples
    loss_sum: float = 0.0
    # binary tasks only (0 otherwise): positives predicted positive, positives, negatives
    # predicted negative, negatives
    true_pos: float = 0.0
    positives: float = 0.0
    true_neg: float = 0.0
    negatives: float = 0.0

    def summary(self) -> dict:
        n = max(self.test_samples, 1.0)
        out = {
            "acc": self.correct / n,
            "acc_client_mean": self.acc_client_sum / max(self.clients, 1.0),
            "auc": self.auc_weighted_sum / n,
            "test_loss": self.loss_sum / n,
        }
        if self.positives + self.negatives > 0:
            out.update(binary_metrics(self.true_pos, self.positives, self.true_neg, self.negatives))
        return out


def binary_metrics(tp: float, pos: float, tn: float, neg: float) -> dict:
    """``pos_recall`` = TP / P and ``balanced_acc`` = (TP / P + TN / N) / 2 (NaN where P or N is 0)."""
    tpr = tp / pos if pos else float("nan")
    tnr = tn / neg if neg else float("nan")
    return {"balanced_acc": (tpr + tnr) / 2, "pos_recall": tpr}


def micro_auc(labels: np.ndarray, probs: np.ndarray) -> float:
    """Micro-averaged one-vs-rest ROC AUC: every (sample, class) pair is one binary decision.

    Computed here as scikit-learn's ``roc_auc_score(onehot.ravel(), probs.ravel())`` computes it (the
    ROC curve's points at the distinct scores, collinear ones dropped, then the trapezoid rule), so
    the value is the same float; without its input checks it is many times faster, which counts when
    thousands of clients are evaluated every round (tests/test_client_store.py compares the two)."""
    num_classes = probs.shape[1]
    if num_classes < 2 or len(labels) == 0:
        return float("nan")
    onehot = np.zeros(probs.shape, dtype=np.float64)
    onehot[np.arange(len(labels)), labels] = 1.0
    return binary_auc(onehot.ravel(), probs.ravel())


def binary_auc(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """ROC AUC of 0/1 labels ``y_true`` (float64, both classes present) and scores ``y_score``."""
    order = np.argsort(y_score, kind="stable")[::-1]
    score, truth = y_score[order], y_true[order]
    idx = np.concatenate([np.nonzero(np.diff(score))[0], [truth.size - 1]])
    tps = np.cumsum(truth, dtype=np.float64)[idx]
    fps = 1 + idx.astype(np.float64) - tps
    if fps.shape[0] > 2:  # drop the points on a straight line between their neighbours
        keep = np.nonzero(np.concatenate([[True], np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), [True]]))[0]
        fps, tps = fps[keep], tps[keep]
    fpr = np.concatenate([[0.0], fps]) / fps[-1]
    tpr = np.concatenate([[0.0], tps]) / tps[-1]
    return float((np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0).sum())


#: clients whose data an evaluation holds at once when they are read on demand (``client_data``)
EVAL_BLOCK = 256


#: seconds between the progress lines of a long evaluation
PROGRESS_S = 15.0


@torch.no_grad()
def evaluate_clients(algo, store, datas: dict, clients: Iterable[int], round_idx: int,
                     generator: Callable[[int, int], torch.Generator], batch_size: int,
                     probes: Optional[RoundProbes] = None, order=None,
                     progress: Optional[Callable[[str], None]] = None,
                     stop: Optional[Callable[[], bool]] = None) -> EvalSums:
    """The sums over ``clients`` of their personalized models' test metrics.

    ``store`` hands each client's state (and swaps its own BatchNorm statistics in); ``datas``: their
    data (read a block of :data:`EVAL_BLOCK` clients at a time where it has ``hold``/``release``);
    ``generator(round, client)`` is the client's evaluation stream (stochastic policies).
    ``probes`` (analysis on, the round evaluated with probes): its ``evals`` filled with each client's
    tally of the method's probes, from the very forward passes whose logits are scored. ``order``
    (a :class:`~fedcp_dist.comm.aggregate.ClientOrder` with a slot per client): each client's own values.
    ``progress``: where a line goes every :data:`PROGRESS_S` seconds of a long evaluation (10⁵ clients
    took 45 s with nothing said), naming how far it is. ``stop()`` true (a preemption signal): the
    evaluation ends before its next client, its sums partial (the caller discards them).
    """
    probed = probes is not None and probes.evals is not None
    started = last = time.monotonic()
    sums = EvalSums()
    clients = [int(c) for c in clients]
    hold, release = getattr(datas, "hold", None), getattr(datas, "release", None)
    for i, cid in enumerate(clients):
        if stop is not None and stop():
            break
        if progress is not None and time.monotonic() - last >= PROGRESS_S:
            last = time.monotonic()
            progress(f"  evaluating: {i:,} of this rank's {len(clients):,} clients after {last - started:.0f} s")
        if hold is not None and i % EVAL_BLOCK == 0:  # data read on demand: a block of clients at a time
            release()
            hold(clients[i:i + EVAL_BLOCK])
        d = datas[cid]
        if d.n_test == 0:
            continue
        ctx = Context(round_idx, cid, generator(round_idx, cid))
        state = algo.prepare_eval(store.activate(cid), d, ctx)
        if not probed:
            logits = torch.cat([algo.predict(state, d.test_batch(i, i + batch_size)[0], ctx)
                                for i in range(0, d.n_test, batch_size)])
        else:
            parts, tally = [], probes.tally()
            for i in range(0, d.n_test, batch_size):
                out, probe = algo.predict_probe(state, d.test_batch(i, i + batch_size)[0], ctx)
                parts.append(out)
                if probe is not None:
                    tally.add(probe)
            logits = torch.cat(parts)
            probes.evals[cid] = tally
        loss = float(F.cross_entropy(logits, d.test_y, reduction="sum"))
        correct = float((logits.argmax(1) == d.test_y).sum())
        auc = micro_auc(d.test_y.cpu().numpy(), torch.softmax(logits.float(), 1).cpu().numpy())
        binary = ()
        if logits.shape[1] == 2:
            pred, pos = logits.argmax(1) == 1, d.test_y == 1
            binary = (float((pred & pos).sum()), float(pos.sum()), float((~pred & ~pos).sum()), float((~pos).sum()))
        mine = EvalSums(correct, d.n_test, correct / d.n_test, 1.0, auc * d.n_test, loss, *binary)
        if order is not None:
            order.add(cid, mine)
        sums += mine
    if release is not None:
        release()
    return sums
