"""A rank's training of its share of the cohort: the cohort trainer, the client store's hand-over
of the global and the clients' states, and a result's finiteness."""
from types import SimpleNamespace

import numpy as np
import torch

from helpers import FakeRuntime, Recorder
from fedcp_dist.comm.aggregate import FlatAggregator
from fedcp_dist.algorithms.base import LocalResult
from fedcp_dist.state.client_store import BN_PREFIX, ClientStore


CPU = torch.device("cpu")


def test_cohort_trainer_trains_owned_clients_and_leaves_a_nonfinite_one_out(capsys):
    """Rank 0 of two trains the cohort's clients it owns, each from its own stream; client 3's NaN
    result is neither kept nor aggregated; the rest go into the buffer weighted by their samples."""
    from fedcp_dist.comm.compress import Compressor
    from fedcp_dist.config import Config
    from fedcp_dist.engine.probes import RoundProbes
    from fedcp_dist.engine.training import CohortTrainer

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
    trainer = CohortTrainer(Config(seed=1), FakeRuntime(), algo, store, data,
                            np.array([0, 0, 1, 0]), None, agg, Compressor("none", 1.0, 32, False, agg.shapes))
    train, payloads = trainer.train(5, [0, 1, 2, 3], RoundProbes(0, 4, 5, False))
    assert [(t, c) for t, c, _ in algo.seen] == [(5, 0), (5, 1), (5, 3)]  # client 2 lives on rank 1
    assert algo.seen[0][2] == torch.rand(1, generator=trainer.generator(2, 5, 0)).item()  # STREAM_TRAIN, t, client
    assert (train.loss_sum, train.samples, train.nonfinite_clients, train.nonfinite_client_id_sum) == (6, 6, 1, 3)
    assert payloads == {} and "client 3 produced a non-finite loss" in capsys.readouterr().out
    assert store.get(1)["w"].tolist() == [4.0, 4.0] and store.peek(3)["w"].tolist() == [3.0, 3.0]  # its initial one
    # Σ n_i·w_i = 4·[1, 1] + 2·[2, 2], Σ n_i = 6
    assert agg.buffer.tolist() == [8.0, 8.0, 6.0]


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


def test_local_result_finiteness():
    ok = LocalResult({"w": torch.ones(2)}, {"h": torch.zeros(1)}, 1.0, 2)
    assert ok.is_finite()
    assert not LocalResult({"w": torch.tensor([1.0, float("nan")])}, None, 1.0, 2).is_finite()
    assert not LocalResult({}, {"h": torch.tensor([float("inf")])}, 1.0, 2).is_finite()
    assert not LocalResult({}, None, float("nan"), 2).is_finite()
    assert LocalResult({}, None, 0.0, 0).is_finite()
