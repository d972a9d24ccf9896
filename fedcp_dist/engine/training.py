"""A round's local training on one rank: the owned members of the cohort train (one by one or in
fused groups, each from its own seeded stream), a non-finite result is left out, the training
probes are taken, each new client state is kept in the store and each upload goes into the round's
all-reduce buffer (compressed first when ``compress`` is on). The algorithm computes; this unit
moves its results to where the round needs them."""
from __future__ import annotations

from typing import Optional

import torch

from fedcp_dist.algorithms.base import Context
from fedcp_dist.capabilities import PeerExchange, Probes, supports
from fedcp_dist.comm.aggregate import TrainSums
from fedcp_dist.fused.groups import GroupTrainer
from fedcp_dist.state.placement import STREAM_PROBE, STREAM_TRAIN, stream_seed


def stream_generator(seed: int, device, *keys: int) -> torch.Generator:
    """A generator on ``device`` seeded with the stream (seed, *keys): the same on every rank."""
    return torch.Generator(device=device).manual_seed(stream_seed(seed, *keys))


class CohortTrainer:
    """Trains this rank's participants of a round. ``owner``: every client's rank; ``data``: the
    owned clients' data; ``groups``: the fused groups' trainer (None: the clients train one by one)."""

    def __init__(self, cfg, rt, algo, store, data, owner, groups: Optional[GroupTrainer], agg, compressor, dp=None):
        self.cfg, self.rt, self.algo, self.store, self.data, self.owner = cfg, rt, algo, store, data, owner
        self.groups, self.agg, self.compressor = groups, agg, compressor
        #: the method's peer exchange (None: it has none)
        self.exchange = algo if supports(algo, PeerExchange) else None
        #: ``dp: central``'s mechanism (:class:`fedcp_dist.comm.privacy.CentralDP`; None: off)
        self.dp = dp

    def generator(self, *keys: int) -> torch.Generator:
        return stream_generator(self.cfg.seed, self.rt.device, *keys)

    def train(self, t: int, cohort, probes, order=None) -> tuple[TrainSums, dict]:
        """Round t's training of the cohort's owned clients, each finite result probed (when
        ``probes.train``), kept and added to the all-reduce. (Sums of the round's training,
        {client: peer payload} for a method that exchanges models.) ``order``: a
        :class:`~fedcp_dist.comm.aggregate.ClientOrder` with a slot per member of the cohort, in its order."""
        slot = {int(c): i for i, c in enumerate(cohort)}
        mine = [int(c) for c in cohort if self.owner[int(c)] == self.rt.rank]
        if not hasattr(self.data, "hold"):  # a plain {client: data}
            return self._train(t, mine, slot, probes, order)
        self.data.hold(mine)  # data read on demand: this round's clients in one read (resident: nothing to do)
        try:
            return self._train(t, mine, slot, probes, order)
        finally:
            self.data.release()

    def _train(self, t: int, mine: list, slot: dict, probes, order) -> tuple[TrainSums, dict]:
        train, bad, payloads = TrainSums(), [], {}
        for cid, res in self._results(t, mine, probes.train):
            if not res.is_finite():
                bad.append(cid)
                print(f"rank {self.rt.rank}: round {t + 1}: client {cid} produced a non-finite loss or update "
                      f"({'left out of the round' if self.cfg.on_nonfinite == 'skip' else 'stopping'})", flush=True)
                continue  # neither aggregated nor kept as the client's new state
            if probes.train:
                self._probe(t, cid, res, probes)
            upload, weight, residual = self._upload(cid, res)
            # put takes BatchNorm statistics out of res.upload (which ``upload`` is when neither compressed
            # nor clipped; those hold the aggregated tensors only)
            self.store.put(cid, res.client_state, res.upload, residual)
            if self.exchange is not None:
                payloads[cid] = self.exchange.peer_payload(res)
            self.agg.add(upload, weight, skip=res.skipped)
            mine = TrainSums(res.loss_sum, res.samples)
            if order is not None:
                order.add(slot[cid], mine)
            train += mine
        train += TrainSums(nonfinite_clients=len(bad), nonfinite_client_id_sum=sum(bad))
        return train, payloads

    def _results(self, t: int, cids: list, probe: bool):
        """(client, LocalResult) for this rank's participants, one by one or in fused groups (group
        by group: a group's states are read when it trains, each result kept before the next
        groups' states are read)."""
        if self.groups is not None:
            yield from self.groups.results(self.groups.round_groups(cids),
                                           lambda c: Context(t, c, self.generator(STREAM_TRAIN, t, c), probe))
            return
        self.store.prefetch(cids)  # a store off the device reads the next clients' states while one trains
        for c in cids:
            ctx = Context(t, c, self.generator(STREAM_TRAIN, t, c), probe)
            yield c, self.algo.local_train(self.store.activate(c), self.data[c], ctx)

    def _probe(self, t: int, cid: int, res, probes) -> None:
        """Client ``cid``'s training probes of round t; before its new state is kept (the state it
        had before the round, the global state as it received it)."""
        assert supports(self.algo, Probes), "probes are taken for a method that has them only"
        ctx = Context(t, cid, self.generator(STREAM_PROBE, t, cid))
        losses = self.algo.probe_losses(self.store.activate(cid), res, self.data[cid], ctx)
        probes.add_train(cid, res, losses, self.data[cid].n_train)

    def _upload(self, cid: int, res) -> tuple:
        """(what goes into the all-reduce, its weight, the client's new residual under error feedback
        or None): θ_i weighted by n_i; with compression Δ̂_i weighted by n_i, added to the global state
        after the all-reduce; with ``dp: central`` the clipped Δ_i (compressed when on) weighted by
        its clip factor, every participant counting once (:mod:`fedcp_dist.comm.privacy`)."""
        if self.dp is not None:
            assert not res.skipped, "dp=central is refused where clients leave parts of their upload out"
            return self.dp.client_upload(res.upload, self.store.global_state, self.agg.sent, self.compressor,
                                         self.store.residual(cid))
        if not self.compressor.enabled:
            return res.upload, self.data[cid].n_train, None
        decoded, residual = self.compressor.compress(res.upload, self.store.global_state, self.store.residual(cid))
        return decoded, self.data[cid].n_train, residual
