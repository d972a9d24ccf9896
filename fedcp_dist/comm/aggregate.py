"""Sample-weighted aggregation in one flat buffer and one all-reduce per round, and the packing
of the per-round exchange of client models (FedAMP, FedFomo).

Layout of the buffer: ``[Σ n_i·θ_i (every upload tensor, flattened) | Σ n_i | metric sums | extra]``;
with aggregation groups (a method whose clients upload some tensors in some rounds only) the one
Σ n_i becomes one per group, then one count of contributing clients per extra group:
``[Σ n_i·θ_i | Σ n_i (all) | Σ n_i (group 1) … | contributors (group 1) … | metric sums | extra]``;
each tensor is then averaged over the clients that sent its group (its own sample-weighted mean).
A group that no client sends in a round (the method says which: ``skipped_groups(t)``, the same on
every rank) leaves the round's buffer altogether: its tensors are not packed (the all-reduce is that
much shorter), its weight and count are 0 and the server keeps its values as they were.
``extra`` (absent unless asked for) carries the per-client rows of the probes (:mod:`fedcp_dist.engine.probes`).
The metric sums of the round (named :class:`Sums`) ride in the same all-reduce as the
parameters. The buffer is float64 by default: the sums are then exact enough that the order in
which ranks add them (which changes with the world size) does not show in the float32 result.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Mapping, Optional, Sequence, Type

import numpy as np
import torch


@dataclasses.dataclass
class Sums:
    """Named float sums that are added over clients and ranks; a subclass lists them as fields
    (in the order they sit in the all-reduce buffer), and in ``ORDERED`` those whose per-client
    values are not whole numbers: their sums are taken in client order (:class:`ClientOrder`)."""

    ORDERED = ()

    @classmethod
    def size(cls) -> int:
        return len(dataclasses.fields(cls))

    def values(self) -> list:
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_values(cls, values: Sequence[float]) -> "Sums":
        assert len(values) == cls.size(), f"{cls.__name__} takes {cls.size()} values, got {len(values)}"
        return cls(*[float(v) for v in values])

    def __iadd__(self, other: "Sums") -> "Sums":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclasses.dataclass
class TrainSums(Sums):
    """What a round's local training adds up over participants (and ranks)."""

    ORDERED = ("loss_sum",)

    loss_sum: float = 0.0
    samples: float = 0.0
    stop_requests: float = 0.0  # ranks that got a preemption signal
    nonfinite_clients: float = 0.0
    nonfinite_client_id_sum: float = 0.0  # names the client when there is one

    def nonfinite_message(self, round_idx: int) -> str:
        who = (f"client {int(self.nonfinite_client_id_sum)}" if self.nonfinite_clients == 1
               else f"{int(self.nonfinite_clients)} clients")
        return (f"round {round_idx + 1}: {who} produced a non-finite loss or update (on_nonfinite=error); the global "
                f"model was not updated and the last complete checkpoint is kept; on_nonfinite=skip leaves such "
                f"clients out of their round")


class FlatAggregator:
    def __init__(self, spec: Mapping[str, torch.Size], num_metrics: int, device: torch.device, dtype=torch.float64,
                 extra: int = 0, groups: Optional[Mapping[str, str]] = None, rows: int = 0):
        self.names = list(spec)
        #: {upload name: its aggregation group} for the names outside the main group (None: one group)
        self.group_of = {k: g for k, g in (groups or {}).items() if k in spec}
        #: the extra groups, in order (their slots follow the main weight)
        self.groups = sorted(set(self.group_of.values()))
        self.num_weights = 1 + 2 * len(self.groups)
        self.shapes = {k: torch.Size(spec[k]) for k in self.names}
        #: values of the whole upload (what one client sends when it skips nothing)
        self.num_params = sum(s.numel() for s in self.shapes.values())
        self.num_metrics = num_metrics
        self.num_extra = extra
        #: most values of per-client rows (:class:`ClientOrder`) a round may carry
        self.max_rows = rows
        self.num_rows = 0
        self._storage = torch.zeros(self.num_params + self.num_weights + num_metrics + rows + extra, device=device,
                                    dtype=dtype)
        self.last_seconds = 0.0
        #: after :meth:`reduce`: {extra group: (Σ weights, contributing clients)} summed over ranks
        self.group_totals: Dict[str, tuple] = {}
        self.begin_round()

    def begin_round(self, skipped_groups: Sequence[str] = (), rows: int = 0, uploads: bool = True) -> None:
        """Lay out and zero the buffer of a round whose clients all leave out ``skipped_groups``:
        their tensors are not in it (the buffer is the first part of the full one), the rest packed
        in order. A group none of whose tensors is aggregated here is no group of this buffer.
        ``rows``: values of per-client rows the round carries (after the metric sums).
        ``uploads=False``: a reduction without training (the evaluation after the last round),
        whose buffer holds no tensor, only the weights, the metric sums, the rows and the extra part."""
        assert rows <= self.max_rows, f"{rows} row values, room for {self.max_rows}"
        self.num_rows = rows
        self.round_skipped = frozenset(skipped_groups) & set(self.groups)
        #: the tensors in this round's buffer, and where each starts
        self.sent = [k for k in self.names if uploads and self.group_of.get(k) not in self.round_skipped]
        self.offsets, off = {}, 0
        for k in self.sent:
            self.offsets[k] = off
            off += self.shapes[k].numel()
        #: values of this round's upload in the buffer
        self.sent_params = off
        self.buffer = self._storage[: off + self.num_weights + self.num_metrics + rows + self.num_extra]
        self.buffer.zero_()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def group_numel(self, group: str) -> int:
        """Values of the upload in the extra group ``group``."""
        return sum(self.shapes[k].numel() for k, g in self.group_of.items() if g == group)

    def add(self, upload: Mapping[str, torch.Tensor], weight: float, skip: Sequence[str] = ()) -> None:
        """Accumulate ``weight · upload`` and ``weight`` itself; ``skip``: extra groups this client did
        not send (their tensors may be absent from ``upload``; neither they nor the weight count there);
        the round's skipped groups (:meth:`begin_round`) count as skipped by every client."""
        skip = set(skip)
        assert skip <= set(self.groups), f"unknown aggregation groups {sorted(skip - set(self.groups))}"
        skip |= self.round_skipped
        sent = [k for k in self.sent if self.group_of.get(k) not in skip]
        assert set(sent) <= set(upload) and set(upload) <= set(self.names), "upload keys differ from the aggregation spec"
        for k in sent:
            off = self.offsets[k]
            n = self.shapes[k].numel()
            self.buffer[off : off + n].add_(upload[k].detach().reshape(-1), alpha=float(weight))
        self.buffer[self.sent_params] += float(weight)
        for i, g in enumerate(self.groups):
            if g not in skip:
                self.buffer[self.sent_params + 1 + i] += float(weight)
                self.buffer[self.sent_params + 1 + len(self.groups) + i] += 1.0

    def add_metrics(self, values: Sequence[float]) -> None:
        assert len(values) == self.num_metrics
        start = self.sent_params + self.num_weights
        self.buffer[start : start + self.num_metrics] += torch.as_tensor(values, dtype=self.buffer.dtype, device=self.buffer.device)

    def add_extra(self, values: torch.Tensor) -> None:
        """Add ``values`` (``extra`` long) to the buffer's extra part."""
        assert values.numel() == self.num_extra
        self.buffer[self.buffer.numel() - self.num_extra :] += values.to(self.buffer.device, self.buffer.dtype)

    def extra(self) -> torch.Tensor:
        """The extra part (after :meth:`reduce`: summed over ranks), on the CPU."""
        return self.buffer[self.buffer.numel() - self.num_extra :].cpu()

    def rows(self) -> torch.Tensor:
        """The round's per-client rows (``rows`` values; filled before :meth:`reduce`, summed over
        ranks after it)."""
        start = self.sent_params + self.num_weights + self.num_metrics
        return self.buffer[start : start + self.num_rows]

    def reduce(self, runtime, base=None, privatize=None) -> tuple[dict, float, list]:
        """All-reduce (SUM) once; return (weighted mean of every tensor, Σ weights, metric sums).

        With ``base`` ({name: tensor}) the buffer holds weighted deltas and the mean is
        base + Σ n_i·Δ_i / Σ n_i, added in the buffer's precision. With aggregation groups a
        tensor is divided by its group's Σ n_i, and left out of the mean when no client sent it (as
        are the round's skipped groups). ``privatize`` (``dp: central``, :mod:`fedcp_dist.comm.privacy`):
        called with the all-reduced sum of the round's tensors, which it noises in place; it returns
        the fixed denominator that every tensor is then divided by, whoever sent it (a round without
        any upload too: the noise is released all the same)."""
        t0 = time.perf_counter()
        runtime.all_reduce_sum_(self.buffer)
        w = self.num_weights
        tail = self.buffer[self.sent_params : self.sent_params + w + self.num_metrics].tolist()  # also synchronises the device
        self.last_seconds = time.perf_counter() - t0
        total, metrics = tail[0], tail[w:]
        ng = len(self.groups)
        self.group_totals = {g: (tail[1 + i], tail[1 + ng + i]) for i, g in enumerate(self.groups)}
        mean = {}
        denominator = privatize(self.buffer[: self.sent_params]) if privatize is not None else None
        if denominator is not None:
            flat = self.buffer[: self.sent_params] / denominator
            for k in self.sent:
                off = self.offsets[k]
                part = flat[off : off + self.shapes[k].numel()].view(self.shapes[k])
                mean[k] = (base[k].to(part.dtype) + part).to(torch.float32)
        elif total > 0:
            flat = self.buffer[: self.sent_params] / total
            for k in self.sent:
                off = self.offsets[k]
                if k in self.group_of:
                    g_total = self.group_totals[self.group_of[k]][0]
                    if g_total <= 0:
                        continue
                    part = (self.buffer[off : off + self.shapes[k].numel()] / g_total).view(self.shapes[k])
                else:
                    part = flat[off : off + self.shapes[k].numel()].view(self.shapes[k])
                if base is not None:
                    part = base[k].to(part.dtype) + part
                mean[k] = part.to(torch.float32)
        return mean, total, metrics


def reduce_sums(aggregator: FlatAggregator, runtime, *sums: Sums, base=None, orders: Sequence["ClientOrder"] = (),
                privatize=None):
    """Add ``sums`` to the aggregator's metrics, all-reduce once; (mean, Σ weights, reduced sums
    of the same classes, in order). ``base``, ``privatize``: see :meth:`FlatAggregator.reduce`.
    ``orders``: one :class:`ClientOrder` (or None) per sums object, its rows carried in the
    aggregator's rows (begun with room for all of them), whose client-order sums replace the ordered
    fields."""
    values = [v for s in sums for v in s.values()]
    aggregator.add_metrics(values)
    packed = [o for o in orders if o is not None]
    if packed:
        aggregator.rows().copy_(torch.cat([o.values for o in packed]).to(aggregator.buffer.device, aggregator.buffer.dtype))
    mean, total, metrics = aggregator.reduce(runtime, base, privatize)
    reduced = aggregator.rows().cpu()
    out, off, row = [], 0, 0
    for i, s in enumerate(sums):
        n = type(s).size()
        got = type(s).from_values(metrics[off : off + n])
        order = orders[i] if i < len(orders) else None
        if order is not None:
            order.apply(reduced[row : row + order.values.numel()], got)
            row += order.values.numel()
        out.append(got)
        off += n
    return mean, total, out


class ClientOrder:
    """Each client's values of a :class:`Sums` class's ``ORDERED`` fields, one slot per client,
    carried through the all-reduce so that every rank adds them up in slot (client) order.

    A float sum over ranks is added in rank order, which changes with the world size, and a sum
    of fractions (a client's accuracy, its loss) rounds differently in another order. In the slots
    each value meets only zeros from the other ranks (exact), and the sum taken afterwards from
    0.0 in slot order is the very sum a single rank adds up client by client: the same bits on
    any world size.

    ``ids`` (sorted client ids, one per slot): :meth:`add` takes a client id and finds its slot
    (an evaluation of a sample of the clients); None: the slot is what :meth:`add` is given."""

    def __init__(self, cls, slots: int, ids: Optional[np.ndarray] = None):
        self.fields = tuple(cls.ORDERED)
        self.width = len(self.fields)
        self.values = torch.zeros(slots * self.width, dtype=torch.float64)
        self.ids = None if ids is None else np.asarray(ids, dtype=np.int64)
        assert self.ids is None or len(self.ids) == slots

    @staticmethod
    def size(sums_class, slots: int) -> int:
        """Row values of ``slots`` clients of ``sums_class``."""
        return slots * len(sums_class.ORDERED)

    def add(self, slot: int, sums: Sums) -> None:
        """Client ``slot``'s own contribution ``sums`` (its ordered fields); with ``ids``, ``slot``
        is the client's id."""
        if self.ids is not None:
            i = int(np.searchsorted(self.ids, slot))
            assert i < len(self.ids) and self.ids[i] == slot, f"client {slot} has no slot"
            slot = i
        for j, name in enumerate(self.fields):
            self.values[slot * self.width + j] = float(getattr(sums, name))

    def apply(self, reduced: torch.Tensor, sums: Sums) -> None:
        """Set ``sums``' ordered fields to the client-order sums of the ``reduced`` rows: each the
        running sum from 0.0, slot by slot (numpy's cumulative sum adds strictly in order, so it
        is the very sum a loop over the slots takes, at the speed of one array pass)."""
        rows = reduced.detach().to("cpu", torch.float64).numpy().reshape(-1, self.width)
        for j, name in enumerate(self.fields):
            column = np.concatenate(([0.0], rows[:, j]))
            setattr(sums, name, float(np.cumsum(column)[-1]))


def sums_size(*classes: Type[Sums]) -> int:
    return sum(c.size() for c in classes)


# ----------------------------------------------------------------------------------------------
# the per-round exchange of client models


def pack_peers(payloads: Dict[int, torch.Tensor], rows: int, dim: int, device) -> torch.Tensor:
    """This rank's participants' payloads as ``rows`` × (1 + dim): column 0 is the client id + 1
    (0 marks an empty row: fewer participants here than the fullest rank has)."""
    buf = torch.zeros(rows, dim + 1, dtype=torch.float32, device=device)
    for i, cid in enumerate(sorted(payloads)):
        buf[i, 0] = cid + 1
        buf[i, 1:] = payloads[cid]
    return buf


def exchange_peers(runtime, owner, cohort, payloads: Dict[int, torch.Tensor], dim: int) -> Dict[int, torch.Tensor]:
    """Every participant's payload on every rank (one all-gather): ``{client: payload}``.

    ``owner`` is every client's rank; each rank sends as many rows as the fullest rank has
    participants this round."""
    rows = max(1, int(np.bincount(owner[np.asarray(cohort, dtype=np.int64)], minlength=runtime.world_size).max()))
    return unpack_peers(runtime.all_gather(pack_peers(payloads, rows, dim, runtime.device)), dim)


def unpack_peers(gathered: torch.Tensor, dim: int) -> Dict[int, torch.Tensor]:
    """``{client: payload}`` from every rank's packed rows (gathered), in client order."""
    rows = gathered.reshape(-1, dim + 1)
    tags = rows[:, 0].long().tolist()
    return {tag - 1: rows[i, 1:] for i, tag in sorted(enumerate(tags), key=lambda it: it[1]) if tag > 0}
