"""The probes of ``analysis: true``: per-client numbers of a round, moved in its one all-reduce.

Methods compute the numbers (:meth:`~fedcp_dist.algorithms.base.Algorithm.predict_probe`,
``Step.tally``, :meth:`~fedcp_dist.algorithms.base.Algorithm.probe_losses`) and read or write no
file; the engine puts each owned client's numbers in its own row of a :class:`ProbeTable`, every
rank's table rides at the end of the round's all-reduce buffer (a client's row is non-zero on its
owner only, so the sum is every client's row, exactly), and rank 0 turns the rows into the lines
of ``analysis.jsonl`` (:func:`records`), the format :mod:`fedcp_dist.analysis.records` reads.

Per client, per round with training probes (rounds 1, k+1, 2k+1, … of ``analysis_every: k``):

* PIR over the training samples it saw in that round's local training, PIR_i = (1/K) Σ_k s̄_i^k,
  from the policy's s as training computed it (Gumbel noise included where training adds it);
* loss_bef / loss_aft: the personalized model's mean cross-entropy over all its training samples
  before and after its local learning.

Per client, at every evaluation (and the one after the last round): PIR over its test samples and
the histogram of s (every feature's s of every test sample) in ``S_BINS`` equal bins on [0, 1]:
bin j holds j/S_BINS ≤ s < (j+1)/S_BINS, the last one s = 1 too.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from fedcp_dist.options import Component, Option, at_least

S_BINS = 50
#: a client's training row: trained (1/0), samples seen, Σ s̄ over them, Σ loss before, Σ loss after, samples of the losses
TRAIN_WIDTH = 6
#: a client's evaluation row: evaluated (1/0), test samples, Σ s̄ over them, the histogram of s
EVAL_WIDTH = 3 + S_BINS


def s_histogram(s: torch.Tensor) -> torch.Tensor:
    """Counts of the values of ``s`` (any shape, in [0, 1]) in ``S_BINS`` equal bins, int64."""
    bins = torch.clamp(torch.floor(s.detach().double() * S_BINS).long(), 0, S_BINS - 1)
    return torch.bincount(bins.reshape(-1), minlength=S_BINS).cpu()


class EvalTally:
    """One client's evaluation probes, added up over its test batches."""

    def __init__(self):
        self.samples, self.s_sum, self.hist = 0, 0.0, torch.zeros(S_BINS, dtype=torch.int64)

    def add(self, s: torch.Tensor) -> None:
        """A test batch's s, (B, K)."""
        self.samples += int(s.shape[0])
        self.s_sum += float(s.detach().double().mean(dim=-1).sum())
        self.hist += s_histogram(s)


class ProbeTable:
    """A round's per-client probes on this rank, one row per client of the run (float64)."""

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.train = torch.zeros(num_clients, TRAIN_WIDTH, dtype=torch.float64)
        self.eval = torch.zeros(num_clients, EVAL_WIDTH, dtype=torch.float64)

    @staticmethod
    def size(num_clients: int) -> int:
        return num_clients * (TRAIN_WIDTH + EVAL_WIDTH)

    def add_train(self, cid: int, samples: int, s_sum: float, loss_bef_sum: float, loss_aft_sum: float,
                  loss_samples: int) -> None:
        self.train[cid] = torch.tensor([1.0, samples, s_sum, loss_bef_sum, loss_aft_sum, loss_samples],
                                       dtype=torch.float64)

    def add_evals(self, tallies: Dict[int, EvalTally]) -> None:
        for cid, t in tallies.items():
            self.eval[cid, :3] = torch.tensor([1.0, t.samples, t.s_sum], dtype=torch.float64)
            self.eval[cid, 3:] = t.hist.to(torch.float64)

    def flat(self) -> torch.Tensor:
        return torch.cat([self.train.reshape(-1), self.eval.reshape(-1)])

    @classmethod
    def from_flat(cls, values: torch.Tensor, num_clients: int) -> "ProbeTable":
        table = cls(num_clients)
        values = values.detach().to("cpu", torch.float64)
        n = table.train.numel()
        table.train = values[:n].reshape(table.train.shape).clone()
        table.eval = values[n:].reshape(table.eval.shape).clone()
        return table

    def records(self, round_idx: Optional[int], evaluated_after: Optional[int]) -> List[dict]:
        """The ``analysis.jsonl`` lines of this (reduced) table: the evaluation after
        ``evaluated_after`` rounds (None: none), then round ``round_idx``'s training (0-based; None:
        none), each by client."""
        out = []
        if evaluated_after is not None:
            for c in range(self.num_clients):
                flag, m, s_sum = self.eval[c, :3].tolist()
                if flag > 0 and m > 0:
                    out.append({"kind": "eval", "evaluated_after": int(evaluated_after), "client": c,
                                "samples": int(m), "pir": _share(s_sum / m),
                                "s_hist": [int(v) for v in self.eval[c, 3:].tolist()]})
        if round_idx is not None:
            for c in range(self.num_clients):
                flag, n, s_sum, bef, aft, n_loss = self.train[c].tolist()
                if flag > 0 and n > 0 and n_loss > 0:
                    out.append({"kind": "train", "round": int(round_idx) + 1, "client": c, "samples": int(n),
                                "pir": _share(s_sum / n), "loss_bef": bef / n_loss, "loss_aft": aft / n_loss})
        return out


class RoundProbes:
    """One round's probes on this rank, from what the round gathers to the lines rank 0 writes.

    The simulator hands :attr:`evals` to the evaluation (which fills it; None: no evaluation
    probes this round), adds each trained client's row with :meth:`add_train` where :attr:`train`
    says so, puts :meth:`pack` at the end of the round's all-reduce (one call in) and turns the
    reduced values into ``analysis.jsonl`` lines with :meth:`records` (one call out). With the
    probes off (``every`` = 0) nothing is gathered, :meth:`pack` is None and :meth:`records` empty.
    ``final``: the evaluation after the last round (its training rows stay empty)."""

    def __init__(self, every: int, num_clients: int, t: int, evaluated: bool, final: bool = False):
        self.on, self.num_clients, self.t = every > 0, num_clients, t
        #: whether round t trains with probes (rounds 1, k + 1, 2k + 1, … of analysis_every: k)
        self.train = self.on and not final and t % every == 0
        #: {client: EvalTally} the evaluation fills (None: no evaluation probes this round)
        self.evals: Optional[Dict[int, EvalTally]] = {} if self.on and evaluated else None
        self.table = ProbeTable(num_clients) if self.on else None

    @staticmethod
    def size(every: int, num_clients: int) -> int:
        """Values :meth:`pack` adds to the all-reduce (0: probes off)."""
        return ProbeTable.size(num_clients) if every else 0

    def add_train(self, cid: int, result, losses: tuple, loss_samples: int) -> None:
        """Client ``cid``'s training probes: its round's samples and Σ s̄ (from the result's
        tallies), and (Σ loss before, Σ loss after) over ``loss_samples`` training samples."""
        self.table.add_train(cid, result.samples, result.tallies.get("s", 0.0), *losses, loss_samples)

    def pack(self) -> Optional[torch.Tensor]:
        """This rank's table, flat, for the all-reduce (its rows are non-zero on their owners only)."""
        if not self.on:
            return None
        self.table.add_evals(self.evals or {})
        return self.table.flat()

    def records(self, reduced: torch.Tensor) -> List[dict]:
        """The ``analysis.jsonl`` lines of the reduced table: the evaluation (after t rounds, if the
        round evaluated) and round t's training (if it probed)."""
        if not self.on:
            return []
        table = ProbeTable.from_flat(reduced, self.num_clients)
        return table.records(self.t if self.train else None, self.t if self.evals is not None else None)


def _share(v: float) -> float:
    """A mean of values in [0, 1], kept there against rounding."""
    return min(1.0, max(0.0, v))


def keep_before(obj: dict, rounds_done: int) -> bool:
    """Whether an ``analysis.jsonl`` line belongs to the first ``rounds_done`` rounds (kept on
    resume from a checkpoint after them; the rest is computed again)."""
    if obj.get("kind") == "train":
        return isinstance(obj.get("round"), int) and obj["round"] <= rounds_done
    if obj.get("kind") == "eval":
        return isinstance(obj.get("evaluated_after"), int) and obj["evaluated_after"] < rounds_done
    return False


class Probing(Component):
    """The analysis probes (FedCP's policy)."""

    options = (
        Option("analysis", False, "probes for analysis.jsonl (FedCP): PIR and s histograms at every evaluation, PIR and "
               "the training loss before/after local learning of every trained client every analysis_every rounds; "
               "results are unchanged"),
        Option("analysis_every", 0, "take the training probes every this many rounds (rounds 1, k+1, 2k+1, ...); > 0 "
               "also turns analysis on", at_least(0)),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.probe_every and not cfg.method_class.probes:
            return ("analysis" if cfg.analysis else "analysis_every",
                    f"{cfg.method} has no probes (they measure FedCP's policy)")
        return None
