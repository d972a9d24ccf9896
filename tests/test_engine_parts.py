"""The engine's parts on hand-computed numbers, in-process: named round sums, the peer exchange
packing, the client store, evaluation sums, stop signals, start-up checks."""
import math
import re
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedcp_dist import startup
from fedcp_dist.aggregate import FlatAggregator, pack_peers, reduce_sums, sums_size, unpack_peers
from fedcp_dist.algorithms.base import LocalResult
from fedcp_dist.client_store import BN_PREFIX, ClientStore
from fedcp_dist.data.resident import to_device
from fedcp_dist.errors import UserError
from fedcp_dist.evaluation import EvalSums, evaluate_clients, micro_auc
from fedcp_dist.runtime import StopSignals
from fedcp_dist.aggregate import TrainSums

CPU = torch.device("cpu")


class OneRank:
    world_size, rank, device = 1, 0, CPU

    def all_reduce_sum_(self, t):
        return t


class TwoRanks(OneRank):
    """A collective whose other rank contributes ``other`` (what a real all-reduce would add)."""

    world_size = 2

    def __init__(self, other):
        self.other = other

    def all_reduce_sum_(self, t):
        t.add_(self.other)
        return t

    def all_gather(self, t):
        return torch.stack([t, self.other])


# ---------------------------------------------------------------------------------- named sums


def test_round_sums_travel_by_name():
    agg = FlatAggregator({"w": torch.Size([2])}, sums_size(TrainSums, EvalSums), CPU)
    agg.add({"w": torch.tensor([1.0, 3.0])}, 2)
    train = TrainSums(loss_sum=4.5, samples=9)
    train += TrainSums(loss_sum=0.5, samples=1, nonfinite_clients=1, nonfinite_client_id_sum=7)
    ev = EvalSums(correct=3, test_samples=4, acc_client_sum=0.75, clients=1, auc_weighted_sum=2.0, loss_sum=1.2)
    # the other rank: one client of weight 1 with w = (5, 5), and its own sums
    other = torch.zeros_like(agg.buffer)
    other[:2] = torch.tensor([5.0, 5.0])
    other[2] = 1.0
    other[3:] = torch.tensor(TrainSums(1.0, 2.0, 1.0).values() + EvalSums(1, 4, 0.25, 1, 3.0, 2.0).values(),
                             dtype=other.dtype)
    mean, total, (t, e) = reduce_sums(agg, TwoRanks(other), train, ev)
    assert total == 3 and mean["w"].tolist() == pytest.approx([(2 + 5) / 3, (6 + 5) / 3])
    assert (t.loss_sum, t.samples, t.stop_requests, t.nonfinite_clients, t.nonfinite_client_id_sum) == (6.0, 12.0, 1.0, 1.0, 7.0)
    assert e == EvalSums(4, 8, 1.0, 2, 5.0, 3.2)
    assert e.summary() == pytest.approx({"acc": 0.5, "acc_client_mean": 0.5, "auc": 5 / 8, "test_loss": 0.4})


def test_sums_refuse_a_wrong_length():
    with pytest.raises(AssertionError):
        EvalSums.from_values([1.0, 2.0])


# ---------------------------------------------------------------------------------- peers


def test_peer_packing_round_trip_over_two_ranks():
    mine = pack_peers({3: torch.tensor([1.0, 2.0])}, rows=2, dim=2, device=CPU)
    assert mine.tolist() == [[4.0, 1.0, 2.0], [0.0, 0.0, 0.0]]  # client 3 tagged 4; an empty row
    theirs = pack_peers({2: torch.tensor([7.0, 8.0]), 0: torch.tensor([5.0, 6.0])}, rows=2, dim=2, device=CPU)
    peers = unpack_peers(TwoRanks(theirs).all_gather(mine), dim=2)
    assert list(peers) == [0, 2, 3]
    assert [peers[c].tolist() for c in peers] == [[5.0, 6.0], [7.0, 8.0], [1.0, 2.0]]


# ---------------------------------------------------------------------------------- the client store


class Recorder:
    """An algorithm stand-in that records what the store hands it."""

    def __init__(self):
        self.globals, self.inits = [], []

    def set_global(self, gs):
        self.globals.append(dict(gs))

    def init_client_state(self, cid):
        self.inits.append(cid)
        return {"w": torch.full((2,), float(cid))}


def test_client_store_initialises_once_and_keeps_bn_statistics_per_client():
    algo = Recorder()
    gs = {"w": torch.zeros(2), "bn.running_mean": torch.zeros(1)}
    store = ClientStore(algo, gs, bn_keys=["bn.running_mean"])
    assert store.get(4)["w"].tolist() == [4.0, 4.0] and store.get(4) is store.get(4)
    assert algo.inits == [4]
    upload = {"w": torch.ones(2), "bn.running_mean": torch.tensor([0.5])}
    store.put(4, {"w": torch.tensor([9.0, 9.0])}, upload)
    assert list(upload) == ["w"]  # the statistics stay with the client, out of the average
    store.activate(4)
    assert algo.globals[-1]["bn.running_mean"].item() == 0.5 and algo.globals[-1]["w"].tolist() == [0.0, 0.0]
    store.activate(5)  # no statistics of its own yet: the global ones
    assert algo.globals[-1]["bn.running_mean"].item() == 0.0
    saved = store.state_dict()
    assert set(saved) == {4, 5} and saved[4][BN_PREFIX + "bn.running_mean"].item() == 0.5
    other = ClientStore(Recorder(), gs, bn_keys=["bn.running_mean"])
    other.load_state_dict({**saved, 6: {BN_PREFIX + "bn.running_mean": torch.tensor([2.0])}})
    assert other.get(4)["w"].tolist() == [9.0, 9.0] and other.bn[4]["bn.running_mean"].item() == 0.5
    assert other.get(6) is None and other.algo.inits == []  # only statistics: no state, none created


def test_client_store_without_bn_hands_the_global_state_once():
    algo = Recorder()
    store = ClientStore(algo, {"w": torch.zeros(2)})
    store.activate(0)
    store.activate(1)
    assert len(algo.globals) == 1  # set once at start: no per-client swap when nothing is per client


# ---------------------------------------------------------------------------------- evaluation


class Fixed:
    """Predicts fixed logits per client (what a trained model would), no state."""

    def __init__(self, logits):
        self.logits = logits

    def prepare_eval(self, state, data, ctx):
        return state

    def predict(self, state, x, ctx):
        return self.logits[ctx.client][: len(x)]


def _data(cid, labels):
    n = len(labels)
    arrays = {"train_x": np.zeros((1, 1, 2, 2), np.uint8), "train_y": np.zeros(1, np.int64),
              "test_x": np.zeros((n, 1, 2, 2), np.uint8), "test_y": np.asarray(labels)}
    return to_device(cid, arrays, (0.5,), (0.5,), CPU)


def test_evaluation_sums_hand_computed():
    datas = {0: _data(0, [0, 1, 1]), 1: _data(1, [1])}
    logits = {0: torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), 1: torch.tensor([[0.0, 0.0]])}
    store = ClientStore(Recorder(), {})
    sums = evaluate_clients(Fixed(logits), store, datas, [0, 1], 0, lambda t, c: None, batch_size=2)
    ce2 = math.log(1 + math.exp(-2))  # a confident right answer
    assert sums.correct == 2 and sums.test_samples == 4 and sums.clients == 2
    assert sums.acc_client_sum == pytest.approx(2 / 3 + 0.0)  # argmax of a tie is class 0: wrong
    assert sums.loss_sum == pytest.approx(2 * ce2 + (2 + ce2) + math.log(2))
    auc0 = micro_auc(np.array([0, 1, 1]), torch.softmax(logits[0], 1).numpy())
    assert sums.auc_weighted_sum == pytest.approx(3 * auc0 + 1 * 0.5)


def test_micro_auc_perfect_and_inverted():
    probs = np.array([[0.9, 0.1], [0.2, 0.8]])
    assert micro_auc(np.array([0, 1]), probs) == 1.0
    assert micro_auc(np.array([1, 0]), probs) == 0.0


# ---------------------------------------------------------------------------------- other parts


def test_local_result_finiteness():
    ok = LocalResult({"w": torch.ones(2)}, {"h": torch.zeros(1)}, 1.0, 2)
    assert ok.is_finite()
    assert not LocalResult({"w": torch.tensor([1.0, float("nan")])}, None, 1.0, 2).is_finite()
    assert not LocalResult({}, {"h": torch.tensor([float("inf")])}, 1.0, 2).is_finite()
    assert not LocalResult({}, None, float("nan"), 2).is_finite()
    assert LocalResult({}, None, 0.0, 0).is_finite()


def test_stop_signals_are_noted_then_restored():
    before = signal.getsignal(signal.SIGUSR2)
    with StopSignals(0, ("SIGUSR2", "SIGTERM")) as stop:
        assert stop.signum is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.signum == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not replace the first
        assert stop.signum == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) == before


def test_shard_checks_name_the_key():
    info = SimpleNamespace(num_clients=20, source="digits", input_shape=(1, 28, 28), kind="image")
    cfg = SimpleNamespace(model="cnn", data=SimpleNamespace(num_clients=0, source="", input_shape=None, path="x.h5",
                                                            clients=None))
    startup.check_shard(cfg, info)
    for key, value, words in (("num_clients", 10, "holds 20 clients"), ("source", "mnist", "holds 'digits'"),
                              ("input_shape", [3, 32, 32], "shape [1, 28, 28]"),
                              ("clients", 21, "asks for 21 clients but x.h5 holds 20"),
                              ("clients", [3, 20], "lists client 20 but x.h5 holds clients 0..19")):
        bad = SimpleNamespace(model="cnn", data=SimpleNamespace(**{**vars(cfg.data), key: value}))
        with pytest.raises(UserError, match=rf"'data.{key}'.*{re.escape(words)}"):
            startup.check_shard(bad, info)
    # a model for another kind of shard: named, with the models that read this one
    with pytest.raises(UserError, match=r"'model': 'mlp' reads table shards but x.h5 holds image data \(model: cnn, resnet18\)"):
        startup.check_shard(SimpleNamespace(model="mlp", data=cfg.data), info)


def test_ranks_agree_on_a_failed_start():
    startup.agree(OneRank(), None)
    with pytest.raises(UserError, match="another rank failed to start"):
        startup.agree(TwoRanks(torch.tensor([1.0])), None)
    with pytest.raises(UserError, match="mine"):
        startup.agree(TwoRanks(torch.tensor([0.0])), UserError("mine"))
    assert startup.all_ok(TwoRanks(torch.tensor([0.0])), True)
    assert not startup.all_ok(TwoRanks(torch.tensor([1.0])), True)


def test_round_record_by_hand():
    from fedcp_dist.aggregate import TrainSums
    from fedcp_dist.evaluation import EvalSums
    from fedcp_dist.round_record import final_eval, round_record

    class Agg:
        last_seconds, nbytes = 0.5, 800

    times = {"seconds": 2.0, "train_seconds": 1.0, "train_cpu_seconds": 0.75, "eval_seconds": 0.25}
    train = TrainSums(loss_sum=6.0, samples=4.0, nonfinite_clients=1.0)
    ev = EvalSums(correct=3.0, test_samples=4.0, acc_client_sum=1.5, clients=2.0, auc_weighted_sum=2.0, loss_sum=1.0)
    rec = round_record(2, times, Agg, [4, 1, 7], train, {"uplink_bytes_saved": 12}, ev, with_cohort=True)
    assert rec == {"kind": "round", "round": 3, **times, "allreduce_seconds": 0.5, "allreduce_bytes": 800,
                   "participants": 3, "train_loss": 1.5, "nonfinite_skipped": 1, "uplink_bytes_saved": 12,
                   "cohort": [4, 1, 7], "evaluated_after": 2, "acc": 0.75, "acc_client_mean": 0.75, "auc": 0.5,
                   "test_loss": 0.25}
    assert list(rec)[:8] == ["kind", "round", "seconds", "train_seconds", "train_cpu_seconds", "eval_seconds",
                             "allreduce_seconds", "allreduce_bytes"]  # metrics.jsonl's order
    # no evaluation, no cohort list, a peer exchange: its time after the all-reduce's
    rec = round_record(0, {**times, "peer_exchange_seconds": 0.125}, Agg, [0], TrainSums(), {}, None, False)
    assert "acc" not in rec and "cohort" not in rec and rec["train_loss"] == 0.0
    assert list(rec)[7:9] == ["allreduce_bytes", "peer_exchange_seconds"]
    assert final_eval(5, ev.values()) == {"evaluated_after": 5, "acc": 0.75, "acc_client_mean": 0.75, "auc": 0.5,
                                          "test_loss": 0.25}


def test_cohort_trainer_trains_owned_clients_and_leaves_a_nonfinite_one_out(capsys):
    """Rank 0 of two trains the cohort's clients it owns, each from its own stream; client 3's NaN
    result is neither kept nor aggregated; the rest go into the buffer weighted by their samples."""
    from fedcp_dist.compress import Compressor
    from fedcp_dist.config import Config
    from fedcp_dist.probes import RoundProbes
    from fedcp_dist.training import CohortTrainer

    class Algo(Recorder):
        peer_dim, seen = 0, []

        def local_train(self, state, data, ctx):
            self.seen.append((ctx.round, ctx.client, torch.rand(1, generator=ctx.generator).item()))
            w = torch.full((2,), float("nan") if ctx.client == 3 else ctx.client + 1.0)
            return LocalResult(upload={"w": w}, client_state={"w": 2 * w}, loss_sum=float(data.n_train),
                               samples=data.n_train)

    algo = Algo()
    store = ClientStore(algo, {"w": torch.zeros(2)})
    agg = FlatAggregator({"w": torch.Size([2])}, 0, CPU)
    data = {c: SimpleNamespace(n_train=n) for c, n in ((0, 4), (1, 2), (3, 5))}
    trainer = CohortTrainer(Config(seed=1), SimpleNamespace(rank=0, device=CPU), algo, store, data,
                            np.array([0, 0, 1, 0]), None, agg, Compressor("none", 1.0, 32, False, agg.shapes))
    train, payloads = trainer.train(5, [0, 1, 2, 3], RoundProbes(0, 4, 5, False))
    assert [(t, c) for t, c, _ in algo.seen] == [(5, 0), (5, 1), (5, 3)]  # client 2 lives on rank 1
    assert algo.seen[0][2] == torch.rand(1, generator=trainer.generator(2, 5, 0)).item()  # STREAM_TRAIN, t, client
    assert (train.loss_sum, train.samples, train.nonfinite_clients, train.nonfinite_client_id_sum) == (6, 6, 1, 3)
    assert payloads == {} and "client 3 produced a non-finite loss" in capsys.readouterr().out
    assert store.get(1)["w"].tolist() == [4.0, 4.0] and store.peek(3)["w"].tolist() == [3.0, 3.0]  # its initial one
    # Σ n_i·w_i = 4·[1, 1] + 2·[2, 2], Σ n_i = 6
    assert agg.buffer.tolist() == [8.0, 8.0, 6.0]


def test_client_order_sums_are_the_one_rank_sum_on_any_split():
    """Per-client fractions summed over ranks: rank by rank, 1 + (1e-16 + 1e-16) rounds up where
    client by client (1 + 1e-16) + 1e-16 stays 1; through ClientOrder's rows every split of the
    clients over ranks gives the one-rank sum, bit for bit."""
    from fedcp_dist.aggregate import ClientOrder, TrainSums

    losses = [1.0, 1e-16, 1e-16]
    one_rank = 0.0
    for v in losses:
        one_rank += v
    by_rank = 1.0 + (1e-16 + 1e-16)
    assert by_rank != one_rank  # the order matters here
    for split in ([[0, 1, 2]], [[0], [1, 2]], [[1], [0, 2]], [[2], [1], [0]]):
        rows = torch.zeros(ClientOrder.size(TrainSums, 3), dtype=torch.float64)
        for part in split:  # each rank fills its clients' slots; the all-reduce adds the ranks' rows
            order = ClientOrder(TrainSums, 3)
            for c in part:
                order.add(c, TrainSums(loss_sum=losses[c], samples=1))
            rows += order.values
        got = TrainSums(loss_sum=123.0, samples=3)
        ClientOrder(TrainSums, 3).apply(rows, got)
        assert got.loss_sum == one_rank and got.samples == 3, split
