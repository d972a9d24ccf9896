"""FedAMP and FedFomo: the methods that use other clients' models, on hand-checkable numbers,
and the engine's peer exchange (one all-gather per round, a memory budget)."""
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cmd
from fedcp_dist.comm.aggregate import pack_peers, unpack_peers
from fedcp_dist.algorithms.base import Context, load_module
from fedcp_dist.algorithms.fedamp import FedAMP
from fedcp_dist.algorithms.fedfomo import FedFomo
from fedcp_dist.config import Config
from fedcp_dist.local_train import batch_indices
from helpers import FakeRuntime, Tiny
from helpers import tiny_data as _data

CPU = torch.device("cpu")
P = sum(p.numel() for p in Tiny().parameters())  # 27


def _algo(cls, n_clients=3, **kw):
    kw.setdefault("lr", 0.1)
    kw.setdefault("batch_size", 4)
    cfg = Config(**kw)
    torch.manual_seed(0)
    algo = cls(cfg, Tiny(), CPU)
    algo.num_clients = n_clients
    gs = algo.init_global_state()
    algo.set_global(gs)
    return algo, gs


def _ctx(client=0, rnd=0, seed=3):
    return Context(rnd, client, torch.Generator().manual_seed(seed))


def _unit(i):
    e = torch.zeros(P)
    e[i] = 1.0
    return e


# ----------------------------------------------------------------------------------------------
# FedAMP


def test_fedamp_attention_weights_and_aggregated_model_by_hand():
    algo, gs = _algo(FedAMP, fedamp_alpha_k=0.5, fedamp_sigma=2.0)
    w = algo.flat(algo.init_client_state(0))
    gs["bank"][0] = w + 100.0  # client 0's own row: never used for itself
    gs["bank"][1] = w + 1.0 * _unit(0)  # ‖w1 − w‖² = 1
    gs["bank"][2] = w + 2.0 * _unit(5)  # ‖w2 − w‖² = 4
    gs["fresh"][:] = 1.0
    xi = algo.attention_weights(0, w)
    x1, x2 = 0.5 * math.exp(-1 / 2.0) / 2.0, 0.5 * math.exp(-4 / 2.0) / 2.0
    assert xi.tolist() == pytest.approx([1 - x1 - x2, x1, x2], abs=1e-12)
    u = algo.aggregated_model(0, w)
    expect = w + x1 * _unit(0) + 2.0 * x2 * _unit(5)
    assert torch.allclose(u, expect, atol=1e-6)


def test_fedamp_uses_only_the_models_of_the_last_round():
    algo, gs = _algo(FedAMP)
    w = algo.flat(algo.init_client_state(0))
    gs["bank"][1] = w + _unit(0)
    gs["fresh"][:] = torch.tensor([0.0, 0.0, 1.0])  # client 1 did not train last round
    xi = algo.attention_weights(0, w)
    assert xi[1] == 0 and xi[0] == pytest.approx(1 - xi[2])


def test_fedamp_local_step_is_sgd_on_ce_plus_the_proximal_term_toward_u():
    algo, gs = _algo(FedAMP, fedamp_alpha_k=0.5, fedamp_lam=2.0, fedamp_sigma=1.0, lr=0.1, batch_size=8)
    data = _data(n=8)
    state = algo.init_client_state(0)
    w = algo.flat(state)
    gs["bank"][1] = w + 0.3 * _unit(2)
    gs["fresh"][1] = 1.0
    u = algo.aggregated_model(0, w)
    res = algo.local_train(state, data, _ctx())

    net = Tiny()
    load_module(net, state, "")
    (idx,) = list(batch_indices(8, 8, 1, True, torch.Generator().manual_seed(3)))
    x, y = data.train_batch(idx)
    grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    g = torch.cat([t.reshape(-1) for t in grads])
    expect = w - 0.1 * (g + (2.0 / 0.5) * (w - u))  # ∇ of (λ/(2α))‖w − u‖² is (λ/α)(w − u)
    assert torch.allclose(algo.flat(res.client_state), expect, atol=1e-6)
    assert res.upload == {} and torch.equal(res.extra["peer"], algo.flat(res.client_state))


def test_fedamp_first_round_is_local_training():
    algo, _ = _algo(FedAMP, fedamp_lam=5.0)
    w = algo.flat(algo.init_client_state(0))
    assert torch.equal(algo.aggregated_model(0, w), w)


def test_receive_peers_writes_the_bank_and_marks_only_this_rounds_models():
    algo, gs = _algo(FedAMP)
    gs["fresh"][0] = 1.0
    gs["seen"][0] = 1.0
    new = algo.receive_peers(0, gs, {2: torch.full((P,), 7.0)})
    assert torch.equal(new["bank"][2], torch.full((P,), 7.0))
    assert new["fresh"].tolist() == [0.0, 0.0, 1.0] and new["seen"].tolist() == [1.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------
# FedFomo


def test_fedfomo_validation_split_is_fixed_disjoint_and_sized():
    algo, _ = _algo(FedFomo, fedfomo_val_ratio=0.25)
    val, train = algo.split(1, 12)
    val2, train2 = algo.split(1, 12)
    assert torch.equal(val, val2) and torch.equal(train, train2)
    assert len(val) == 3 and len(train) == 9
    assert sorted(torch.cat([val, train]).tolist()) == list(range(12))
    assert not torch.equal(algo.split(2, 12)[0], val)  # another client, another split
    assert [len(v) for v in algo.split(0, 1)] == [0, 1]  # one sample: nothing held out


def test_fedfomo_choice_is_greedy_on_affinity_or_random_with_epsilon():
    algo, gs = _algo(FedFomo, n_clients=6, fedfomo_m=2, fedfomo_eps=0.3, fedfomo_eps_decay=0.05)
    gs["seen"][:] = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    gs["affinity"][0] = torch.tensor([9.0, 0.5, 2.0, 2.0, 8.0, -1.0])
    # round 6: ε = 0 → the two highest of the seen others (tie 2.0/2.0 → both), never itself or unseen 4
    assert algo.choose(0, 6, torch.Generator().manual_seed(0)) == [2, 3]
    algo.cfg.fedfomo_eps = 1.0
    algo.cfg.fedfomo_eps_decay = 0.0
    picks = {tuple(algo.choose(0, 0, torch.Generator().manual_seed(s))) for s in range(40)}
    assert len(picks) > 3  # random
    assert all(len(p) == 2 and 0 not in p and 4 not in p for p in picks)


def test_fedfomo_weights_merge_and_affinity_by_hand():
    algo, gs = _algo(FedFomo, n_clients=3, fedfomo_m=2, fedfomo_eps=0.0, lr=1e-12, batch_size=4)
    data = _data(n=10, labels=[0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    state = algo.init_client_state(0)
    theta = algo.flat(state)
    # two candidate models: one trained a little toward client 0's data, one pushed away
    net = Tiny()
    load_module(net, state, "")
    val, _ = algo.split(0, 10)
    x, y = data.train_batch(val)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))])
    better = theta - 0.05 * g  # a small step down the validation loss
    worse = theta + 0.05 * g
    gs["bank"][1], gs["bank"][2] = better, worse
    gs["seen"][:] = 1.0

    res = algo.local_train(state, data, _ctx(client=0))

    @torch.no_grad()
    def loss(vec):
        load_module(net, algo.unflat(vec), "")
        return float(F.cross_entropy(net(x), y))

    w1 = (loss(theta) - loss(better)) / float(torch.linalg.vector_norm(better - theta))
    w2 = (loss(theta) - loss(worse)) / float(torch.linalg.vector_norm(worse - theta))
    row = res.extra["peer"][P:]
    assert row.tolist() == pytest.approx([0.0, w1, w2], abs=1e-5)
    assert w1 > 0 > w2
    # only the positive weight counts, normalised to 1: θ moves all the way to the better model
    assert torch.allclose(algo.flat(res.client_state), better, atol=1e-6)
    # every rank adds the row into the affinity matrix
    new = algo.receive_peers(0, gs, {0: res.extra["peer"]})
    assert new["affinity"][0].tolist() == pytest.approx([0.0, w1, w2], abs=1e-5)
    assert torch.equal(new["bank"][0], algo.flat(res.client_state))


def test_fedfomo_without_candidates_trains_its_own_model_on_the_training_split_only():
    algo, _ = _algo(FedFomo, n_clients=3, fedfomo_val_ratio=0.5, batch_size=100, drop_last=False)
    data = _data(n=8)
    res = algo.local_train(algo.init_client_state(1), data, _ctx(client=1))
    assert res.samples == 4  # half held out for validation
    assert res.extra["peer"][P:].abs().sum() == 0


def test_fedfomo_reference_compat_weights_and_average_for_three_clients_by_hand():
    """fedfomo_reference_compat: the top M of P (itself included, ε ignored), weights against the
    model before the last training with a +1e-5 distance, the new model the weighted average."""
    algo, gs = _algo(FedFomo, n_clients=3, fedfomo_m=2, fedfomo_eps=1.0, fedfomo_eps_decay=0.0,
                     fedfomo_reference_compat=True, lr=1e-12)
    assert torch.equal(gs["affinity"], torch.eye(3))  # P starts as the identity
    data = _data(n=10)
    state = algo.init_client_state(0)
    old = algo.flat(state).clone()
    assert torch.equal(state["fomo_old"], old)  # before any training: the initial model
    theta = old + 2.0 * _unit(0)  # client 0's model after its last training: ‖θ − θ_old‖ = 2
    state.update(algo.unflat(theta.clone()))
    b1 = old + 3.0 * _unit(1) + 4.0 * _unit(2)  # ‖θ_1 − θ_old‖ = 5
    b2 = old - 1.0 * _unit(3)
    gs["bank"][0], gs["bank"][1], gs["bank"][2] = theta, b1, b2
    gs["seen"][:] = 1.0
    gs["fresh"][:] = 1.0
    gs["affinity"][0] = torch.tensor([1.0, 0.5, 0.2])  # top 2: itself and client 1, never 2
    losses = {0: 1.0, 1: 0.6, 2: 0.8, 3: 0.1}  # validation losses of θ_old, θ, θ_1, θ_2

    def fake_loss(s, data, idx):
        d = algo.flat(s) - old
        return losses[0 if not d.any() else 1 if d[0] else 2 if d[1] else 3]

    algo.batch_mean_loss = fake_loss
    res = algo.local_train(state, data, _ctx(client=0, rnd=4))
    w0 = (1.0 - 0.6) / (2.0 + 1e-5)  # its own trained model, against the one before training
    w1 = (1.0 - 0.8) / (5.0 + 1e-5)
    assert res.extra["peer"][P:].tolist() == pytest.approx([w0, w1, 0.0], rel=1e-6)
    mixed = (w0 * theta + w1 * b1) / (w0 + w1)  # ≈ 5/6·θ + 1/6·θ_1
    assert w0 / (w0 + w1) == pytest.approx(5 / 6, abs=1e-5)
    assert torch.allclose(res.client_state["fomo_old"], mixed, atol=1e-6)  # the next reference point
    assert torch.allclose(algo.flat(res.client_state), mixed, atol=1e-6)  # trained from it (lr ≈ 0)
    new = algo.receive_peers(4, gs, {0: res.extra["peer"]})
    assert new["affinity"][0].tolist() == pytest.approx([1.0 + w0, 0.5 + w1, 0.2], rel=1e-6)

    # no weight positive: the client keeps its current model
    losses.update({1: 1.5, 2: 1.2})
    res = algo.local_train(state, data, _ctx(client=0, rnd=4))
    assert torch.allclose(algo.flat(res.client_state), theta, atol=1e-6)
    assert torch.equal(res.client_state["fomo_old"], theta)
    # nothing arrived in the last round (the first round): no model is downloaded
    gs["fresh"][:] = 0.0
    assert algo.choose(0, 0, torch.Generator().manual_seed(0)) == []


def test_fedfomo_reference_compat_validation_loss_is_the_mean_of_batch_means():
    algo, _ = _algo(FedFomo, fedfomo_reference_compat=True, batch_size=2)
    data = _data(n=5, labels=[0, 1, 2, 2, 0])
    state = algo.init_client_state(0)
    net = Tiny()
    load_module(net, state, "")
    idx = torch.arange(5)
    with torch.no_grad():
        per = [float(F.cross_entropy(net(data.train_batch(idx[a:b])[0]), data.train_batch(idx[a:b])[1]))
               for a, b in ((0, 2), (2, 4), (4, 5))]
    assert algo.batch_mean_loss(state, data, idx) == pytest.approx(sum(per) / 3, rel=1e-6)
    assert algo.batch_mean_loss(state, data, idx) != pytest.approx(algo.mean_loss(state, data, idx), rel=1e-4)


# ----------------------------------------------------------------------------------------------
# the engine: runs, the memory budget


@pytest.mark.parametrize("method", ["fedamp", "fedfomo"])
def test_peer_methods_run_and_refuse_a_run_over_the_memory_budget(digits6, tmp_path, method):
    base = [sys.executable, "-m", "fedcp_dist.run", "--config", f"configs/digits_{method}.yaml",
            f"data.path={digits6}", "threads=1", "eval_every=2", "rounds=2"]
    r = run_cmd([*base, f"out_dir={tmp_path / 'ok'}"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    bank = torch.load(tmp_path / "ok" / "final_global.pt", weights_only=True)["bank"]
    assert bank.shape == (6, 582026) and bool((bank.abs().sum(1) > 0).all())  # every client's model arrived

    r = run_cmd([*base, f"out_dir={tmp_path / 'no'}", "peer_memory_mb=1"], timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "peer_memory_mb=1" in r.stderr and "MiB per rank" in r.stderr


class TinyBN(Tiny):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU())


@pytest.mark.parametrize("cls", [FedAMP, FedFomo])
def test_batchnorm_statistics_stay_out_of_the_bank(cls):
    cfg = Config(lr=0.1, batch_size=4, fedfomo_eps=0.0)
    torch.manual_seed(0)
    algo = cls(cfg, TinyBN(), CPU)
    algo.num_clients = 2
    gs = algo.init_global_state()
    algo.set_global(gs)
    assert algo.model_dim == P + 3 + 3  # parameters only: the BatchNorm's weight and bias, not its statistics
    state = algo.init_client_state(0)
    state["features.2.running_mean"] = torch.full((3,), 0.25)
    gs["bank"][1] = algo.flat(state) + 0.01
    gs["seen"][1] = gs["fresh"][1] = 1.0
    res = algo.local_train(state, _data(n=8), _ctx(client=0))
    assert res.extra["peer"].shape[0] == algo.peer_dim
    # the client's own running statistics went on from 0.25 (momentum 0.1 toward the batch means)
    assert not torch.equal(res.client_state["features.2.running_mean"], torch.full((3,), 0.25))


def test_peer_packing_round_trip_over_two_ranks():
    mine = pack_peers({3: torch.tensor([1.0, 2.0])}, rows=2, dim=2, device=CPU)
    assert mine.tolist() == [[4.0, 1.0, 2.0], [0.0, 0.0, 0.0]]  # client 3 tagged 4; an empty row
    theirs = pack_peers({2: torch.tensor([7.0, 8.0]), 0: torch.tensor([5.0, 6.0])}, rows=2, dim=2, device=CPU)
    peers = unpack_peers(FakeRuntime(2, others=[theirs]).all_gather(mine), dim=2)
    assert list(peers) == [0, 2, 3]
    assert [peers[c].tolist() for c in peers] == [[5.0, 6.0], [7.0, 8.0], [1.0, 2.0]]
