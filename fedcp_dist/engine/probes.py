"""The probes of ``analysis: true``: per-client numbers of a round, moved in its one all-reduce.

A method that takes probes (:class:`fedcp_dist.capabilities.Probes`) computes the numbers
(``predict_probe``, ``StepOps.tally``, ``probe_losses``) and says how they are laid out in rows
(its :class:`~fedcp_dist.capabilities.ProbeLayout`); it reads or writes no file. The engine puts
each owned client's rows in a :class:`ProbeTable` (a training row per slot of the round's cohort and
an evaluation row per evaluated client), every rank's table rides at the end of the round's all-reduce buffer (a client's rows
are non-zero on its owner only, so the sum is every client's rows, exactly), and rank 0 has the
layout turn the summed rows into the lines of ``analysis.jsonl``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from fedcp_dist.capabilities import EvalTally, ProbeLayout


class ProbeTable:
    """A round's probe rows on this rank (float64): ``num_clients`` training rows and as many
    evaluation rows, or ``eval_rows`` of them where given (the engine's rows are the round's cohort
    slots and the evaluated clients, so their number follows the cohort and the evaluation, not
    the population)."""

    def __init__(self, num_clients: int, layout: ProbeLayout, eval_rows: Optional[int] = None):
        self.num_clients, self.layout = num_clients, layout
        self.eval_rows = num_clients if eval_rows is None else eval_rows
        self.train = torch.zeros(num_clients, layout.train_width, dtype=torch.float64)
        self.eval = torch.zeros(self.eval_rows, layout.eval_width, dtype=torch.float64)

    @staticmethod
    def size(num_clients: int, layout: ProbeLayout, eval_rows: Optional[int] = None) -> int:
        return num_clients * layout.train_width + (num_clients if eval_rows is None else eval_rows) * layout.eval_width

    def flat(self) -> torch.Tensor:
        return torch.cat([self.train.reshape(-1), self.eval.reshape(-1)])

    @classmethod
    def from_flat(cls, values: torch.Tensor, num_clients: int, layout: ProbeLayout,
                  eval_rows: Optional[int] = None) -> "ProbeTable":
        table = cls(num_clients, layout, eval_rows)
        values = values.detach().to("cpu", torch.float64)
        n = table.train.numel()
        table.train = values[:n].reshape(table.train.shape).clone()
        table.eval = values[n:].reshape(table.eval.shape).clone()
        return table


class RoundProbes:
    """One round's probes on this rank, from what the round gathers to the lines rank 0 writes.

    The simulator hands this to the evaluation, which fills :attr:`evals` (None: no evaluation
    probes this round) with a :meth:`tally` per client, adds each trained client's row with
    :meth:`add_train` where :attr:`train` says so, puts :meth:`pack` at the end of the round's
    all-reduce (one call in) and turns the reduced values into ``analysis.jsonl`` lines with
    :meth:`records` (one call out). With the probes off (``every`` = 0, or a method without a
    ``layout``) nothing is gathered, :meth:`pack` is None and :meth:`records` empty. ``final``: the
    evaluation after the last round (its training rows stay empty).

    Rows: ``num_clients`` training rows, row k the k-th of ``train_ids`` (the round's cohort, sorted;
    None: client k), and an evaluation row per client of ``eval_ids`` (the evaluated clients, sorted;
    None: ``num_clients`` rows, row k client k). The engine gives ``num_clients`` = the largest cohort
    a round may draw, so the rows (and the all-reduce) follow the cohort and the evaluation."""

    def __init__(self, every: int, num_clients: int, t: int, evaluated: bool, layout: Optional[ProbeLayout] = None,
                 final: bool = False, train_ids: Optional[Sequence[int]] = None,
                 eval_ids: Optional[Sequence[int]] = None):
        self.on, self.num_clients, self.t, self.layout = every > 0 and layout is not None, num_clients, t, layout
        #: whether round t trains with probes (rounds 1, k + 1, 2k + 1, … of analysis_every: k)
        self.train = self.on and not final and t % every == 0
        #: {client: its evaluation tally}, filled by the evaluation (None: no evaluation probes this round)
        self.evals: Optional[Dict[int, EvalTally]] = {} if self.on and evaluated else None
        self.train_ids, self._train_row = None, None
        if train_ids is not None:
            self.set_cohort(train_ids)
        self.eval_ids = None if eval_ids is None else np.asarray(eval_ids, dtype=np.int64)
        self.table = (ProbeTable(num_clients, layout, None if eval_ids is None else len(self.eval_ids))
                      if self.on and layout is not None else None)

    def set_cohort(self, train_ids: Sequence[int]) -> None:
        """The round's cohort (sorted), once drawn: training row k is its k-th client."""
        self.train_ids = [int(c) for c in train_ids]
        assert len(self.train_ids) <= self.num_clients, f"{len(self.train_ids)} clients, {self.num_clients} rows"
        self._train_row = {c: i for i, c in enumerate(self.train_ids)}

    @staticmethod
    def size(every: int, num_clients: int, layout: Optional[ProbeLayout], eval_rows: Optional[int] = None) -> int:
        """Values :meth:`pack` adds to the all-reduce (0: probes off)."""
        return ProbeTable.size(num_clients, layout, eval_rows) if every and layout is not None else 0

    def tally(self) -> EvalTally:
        """An empty evaluation tally for one client, of the method's layout."""
        assert self.layout is not None
        return self.layout.eval_tally()

    def add_train(self, cid: int, result, losses: tuple, loss_samples: int) -> None:
        """Client ``cid``'s training row from its result, and (Σ loss before, Σ loss after) over
        ``loss_samples`` training samples."""
        assert self.table is not None and self.layout is not None
        row = self._train_row[cid] if self._train_row is not None else cid
        self.table.train[row] = torch.tensor(self.layout.train_row(result, losses, loss_samples), dtype=torch.float64)

    def pack(self) -> Optional[torch.Tensor]:
        """This rank's table, flat, for the all-reduce (its rows are non-zero on their owners only)."""
        if self.table is None:
            return None
        for cid, tally in (self.evals or {}).items():
            row = tally.row()
            if row is not None:
                k = int(np.searchsorted(self.eval_ids, cid)) if self.eval_ids is not None else cid
                self.table.eval[k] = torch.tensor(row, dtype=torch.float64)
        return self.table.flat()

    def records(self, reduced: torch.Tensor) -> List[dict]:
        """The ``analysis.jsonl`` lines of the reduced table: the evaluation (after t rounds, if the
        round evaluated) and round t's training (if it probed)."""
        if self.table is None or self.layout is None:
            return []
        table = ProbeTable.from_flat(reduced, self.num_clients, self.layout, self.table.eval_rows)
        return self.layout.records(table.train, table.eval, self.t if self.train else None,
                                   self.t if self.evals is not None else None, train_ids=self.train_ids,
                                   eval_ids=None if self.eval_ids is None else self.eval_ids.tolist())


def keep_before(obj: dict, rounds_done: int) -> bool:
    """Whether an ``analysis.jsonl`` line belongs to the first ``rounds_done`` rounds (kept on
    resume from a checkpoint after them; the rest is computed again)."""
    if obj.get("kind") == "train":
        return isinstance(obj.get("round"), int) and obj["round"] <= rounds_done
    if obj.get("kind") == "eval":
        return isinstance(obj.get("evaluated_after"), int) and obj["evaluated_after"] < rounds_done
    return False
