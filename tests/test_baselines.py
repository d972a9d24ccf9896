"""The baselines and FedCP's ablations: each method's distinguishing mechanism on small
hand-checkable numbers, then one world-size check for all of them (1 rank vs 2 ranks)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO
from helpers import Tiny, runs_on_one_and_two_ranks
from helpers import tiny_data as _data
from fedcp_dist.algorithms import ALGORITHMS, make_algorithm
from fedcp_dist.algorithms.base import Context, load_module, module_state
from fedcp_dist.algorithms.ditto import Ditto
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.algorithms.fedcp import CPN, FedCP, policy
from fedcp_dist.algorithms.fedper import FedPer
from fedcp_dist.algorithms.fedphp import FedPHP, hpm_momentum
from fedcp_dist.algorithms.fedprox import FedProx
from fedcp_dist.algorithms.fedrep import FedRep
from fedcp_dist.algorithms.fedrod import FedRoD, balanced_softmax_loss, label_log_prior
from fedcp_dist.algorithms.perfedavg import PerFedAvg
from fedcp_dist.algorithms.pfedme import PFedMe
from fedcp_dist.config import METHODS, Config, load_config
from fedcp_dist.errors import UserError
from fedcp_dist.local_train import Step, batch_indices
from fedcp_dist.models import build_model

CPU = torch.device("cpu")
#: the methods whose 1-vs-2-rank agreement another test holds (every other registered method's is
#: checked here, a new one's too)
ELSEWHERE = {"fedcp": "tests/test_multiprocess.py and the golden digests' two-rank cases",
             "fedavg": "tests/test_multiprocess.py"}
BASELINES = tuple(m for m in ALGORITHMS if m not in ELSEWHERE)


# ----------------------------------------------------------------------------------------------
# helpers


def _algo(cls, model="tiny", **kw):
    kw.setdefault("lr", 0.1)
    kw.setdefault("batch_size", 4)
    cfg = Config(**kw)
    torch.manual_seed(0)
    net = Tiny() if model == "tiny" else build_model("cnn", (1, 28, 28), 3)
    algo = cls(cfg, net, CPU)
    gs = algo.init_global_state()
    algo.set_global(gs)
    return algo, gs


def _ctx(seed=3, rnd=0):
    return Context(rnd, 0, torch.Generator().manual_seed(seed))


def _batches(data, cfg, seed, epochs=None):
    return list(batch_indices(data.n_train, cfg.batch_size, epochs or cfg.local_epochs, cfg.drop_last,
                              torch.Generator().manual_seed(seed)))


def _grads(model, data, idx):
    """∇f(w; batch) for the model's parameters, in parameter order."""
    x, y = data.train_batch(idx)
    return torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))


def _net(state):
    """A Tiny network holding ``state`` (keys as module_state("", model))."""
    net = Tiny()
    load_module(net, state, "")
    return net


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _state_of(names, tensors):
    return dict(zip(names, tensors))


def _close(a: dict, b: dict, atol=1e-6):
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k}: {(a[k] - b[k]).abs().max()}"


def _equal(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


NAMES = [n for n, _ in Tiny().named_parameters()]


# ----------------------------------------------------------------------------------------------
# registry and config


def test_every_method_is_registered_and_configurable():
    assert set(ALGORITHMS) == set(METHODS)
    for m in BASELINES:
        assert m in METHODS
        cfg = load_config(str(REPO / "configs" / f"digits_{m}.yaml"), validate=False)
        assert cfg.method == m


@pytest.mark.parametrize(
    "key,value",
    [
        ("prox_mu", -0.1), ("perfedavg_alpha", 0.0), ("perfedavg_beta", -1.0), ("pfedme_lam", -1.0),
        ("pfedme_k", 0), ("pfedme_lr", 0.0), ("pfedme_beta", 0.0), ("ditto_lam", -1.0), ("ditto_epochs", 0),
        ("fedrep_head_epochs", 0), ("fedphp_lam", 1.5), ("fedphp_mu", 1.0), ("cpn_input", "hv"),
        ("cpn_layers", 5), ("cpn_norm", "instancenorm"), ("cpn_act", "gelu"), ("prox_mu", float("nan")),
    ],
)
def test_impossible_values_are_refused_naming_the_key(digits6, key, value):
    with pytest.raises(UserError, match=f"'{key}'"):
        Config(**{key: value, "data": Config().data.__class__(path=str(digits6))}).validate()


def test_global_head_ablation_needs_the_cpn_ablation(digits6):
    data = Config().data.__class__(path=str(digits6))
    with pytest.raises(UserError, match="'fedcp_global_head'"):
        Config(fedcp_global_head=False, data=data).validate()
    Config(fedcp_global_head=False, fedcp_cpn=False, data=data).validate()


# ----------------------------------------------------------------------------------------------
# FedProx


def test_fedprox_mu_zero_is_fedavg_bit_for_bit():
    data = _data(n=12, shape=(1, 28, 28))
    avg, _ = _algo(FedAvg, model="cnn", lr=0.05)
    prox, _ = _algo(FedProx, model="cnn", lr=0.05, prox_mu=0.0)
    ra = avg.local_train(None, data, _ctx(7))
    rp = prox.local_train(None, data, _ctx(7))
    _equal(ra.upload, rp.upload)
    assert ra.loss_sum == rp.loss_sum and ra.samples == rp.samples


def test_fedprox_pulls_toward_the_global_weights_by_exactly_mu_times_the_gap():
    # two batches: at step 1 w = w_g (no pull), at step 2 the pull is μ·(w1 − w_g)
    mu, lr = 0.7, 0.1
    data = _data(n=8)
    prox, gs = _algo(FedProx, prox_mu=mu, lr=lr)
    res = prox.local_train(None, data, _ctx(5))
    b1, b2 = _batches(data, prox.cfg, 5)
    net = _net(gs)
    w0 = _params(net)
    g1 = _grads(net, data, b1)
    with torch.no_grad():
        for p, g in zip(net.parameters(), g1):
            p -= lr * g
    w1 = _params(net)
    g2 = _grads(net, data, b2)
    expected = [a - lr * (g + mu * (a - z)) for a, g, z in zip(w1, g2, w0)]
    _close(res.upload, _state_of(NAMES, expected))
    plain = [a - lr * g for a, g in zip(w1, g2)]  # FedAvg's step from w1 differs by −lr·μ·(w1 − w0)
    assert not torch.allclose(res.upload["head.weight"], plain[2], atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Per-FedAvg


def test_perfedavg_local_step_is_first_order_maml_on_two_batches():
    alpha, beta = 0.3, 0.2
    data = _data(n=8)
    algo, gs = _algo(PerFedAvg, perfedavg_alpha=alpha, perfedavg_beta=beta)
    res = algo.local_train(None, data, _ctx(4))
    d_in, d_out = _batches(data, algo.cfg, 4)
    net = _net(gs)
    w0 = _params(net)
    g_in = _grads(net, data, d_in)
    with torch.no_grad():
        for p, g in zip(net.parameters(), g_in):
            p -= alpha * g  # w̃
    g_out = _grads(net, data, d_out)  # ∇f(w̃; D'), no Hessian term
    _close(res.upload, _state_of(NAMES, [w - beta * g for w, g in zip(w0, g_out)]))
    assert res.samples == 4 and res.client_state is None


def test_perfedavg_evaluates_after_one_adaptation_step_on_a_train_batch():
    alpha = 0.5
    data = _data(n=8)
    algo, gs = _algo(PerFedAvg, perfedavg_alpha=alpha)
    with torch.no_grad():  # the engine evaluates under no_grad
        adapted = algo.prepare_eval(None, data, _ctx(9))
    idx = torch.randperm(8, generator=torch.Generator().manual_seed(9))[:4]
    net = _net(gs)
    expected = [w - alpha * g for w, g in zip(_params(net), _grads(net, data, idx))]
    _close(adapted, _state_of(NAMES, expected))
    x, _ = data.test_batch(0, 3)
    ctx = _ctx(9)
    assert torch.allclose(algo.predict(adapted, x, ctx), _net(adapted)(x).detach(), atol=1e-6)
    assert not torch.allclose(algo.predict(adapted, x, ctx), algo.predict(None, x, ctx))
    _equal(module_state("", algo.global_model), gs)  # the global model itself did not move


# ----------------------------------------------------------------------------------------------
# pFedMe


def test_pfedme_inner_steps_local_step_and_personal_state():
    lam, plr, eta = 2.0, 0.1, 0.05
    data = _data(n=4)
    algo, gs = _algo(PFedMe, pfedme_lam=lam, pfedme_lr=plr, pfedme_k=2, lr=eta)
    res = algo.local_train(algo.init_client_state(0), data, _ctx(2))
    (idx,) = _batches(data, algo.cfg, 2)
    net = _net(gs)
    w0 = _params(net)
    for _ in range(2):  # θ ← θ − η_p (∇f(θ) + λ(θ − w)), θ from w
        g = _grads(net, data, idx)
        with torch.no_grad():
            for p, gi, w in zip(net.parameters(), g, w0):
                p -= plr * (gi + lam * (p - w))
    theta = _params(net)
    _close(res.client_state, _state_of(NAMES, theta))
    _close(res.upload, _state_of(NAMES, [w - eta * lam * (w - t) for w, t in zip(w0, theta)]))
    # θ is what is evaluated
    x, _ = data.test_batch(0, 3)
    assert torch.allclose(algo.predict(res.client_state, x, _ctx()), _net(res.client_state)(x).detach(), atol=1e-6)


def test_pfedme_server_mixes_with_beta():
    algo, _ = _algo(PFedMe, pfedme_beta=0.5)
    old, avg = {"w": torch.tensor([1.0, -2.0]), "kept": torch.tensor(7.0)}, {"w": torch.tensor([3.0, 2.0])}
    new = algo.server_update(old, avg)
    assert new["w"].tolist() == [2.0, 0.0] and new["kept"].item() == 7.0
    algo.cfg.pfedme_beta = 2.0  # β > 1: the paper's extrapolation
    assert algo.server_update(old, avg)["w"].tolist() == [5.0, 6.0]
    algo.cfg.pfedme_beta = 1.0
    assert torch.equal(algo.server_update(old, avg)["w"], avg["w"])


# ----------------------------------------------------------------------------------------------
# Ditto


def test_ditto_global_update_is_fedavg_and_the_personal_model_stays_personal():
    lam, lr = 0.5, 0.1
    data = _data(n=4)
    ditto, gs = _algo(Ditto, ditto_lam=lam, lr=lr)
    avg, _ = _algo(FedAvg, lr=lr)
    # a received global model away from the client's v, so that the pull λ(v − w^t) shows
    moved = {k: v + 0.1 for k, v in gs.items()}
    ditto.set_global(moved)
    avg.set_global(moved)
    v0 = ditto.init_client_state(0)
    res = ditto.local_train(v0, data, _ctx(6))
    _equal(res.upload, avg.local_train(None, data, _ctx(6)).upload)  # the upload is FedAvg's
    gen = torch.Generator().manual_seed(6)
    list(batch_indices(4, 4, 1, True, gen))  # the global model's batch
    (idx,) = list(batch_indices(4, 4, 1, True, gen))  # then the personal model's
    net = _net(v0)
    g = _grads(net, data, idx)
    wt = [moved[n] for n in NAMES]
    expected = [v - lr * (gi + lam * (v - w)) for v, gi, w in zip(_params(net), g, wt)]
    _close(res.client_state, _state_of(NAMES, expected))
    assert not any(torch.allclose(res.client_state[k], res.upload[k]) for k in NAMES)
    x, _ = data.test_batch(0, 3)
    assert torch.allclose(ditto.predict(res.client_state, x, _ctx()), _net(res.client_state)(x).detach(), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# FedPer and FedRep


def test_fedper_never_uploads_its_head():
    data = _data(n=8)
    algo, gs = _algo(FedPer)
    assert algo.upload_keys(gs) == ["features.1.weight", "features.1.bias"]
    state = algo.init_client_state(0)
    _equal(state, {"head.weight": gs["head.weight"], "head.bias": gs["head.bias"]})
    res = algo.local_train(state, data, _ctx())
    assert set(res.upload) == {"features.1.weight", "features.1.bias"}
    assert not torch.equal(res.client_state["head.weight"], state["head.weight"])
    new = algo.server_update(gs, res.upload)
    assert torch.equal(new["head.weight"], gs["head.weight"])  # the global head never moves
    algo.set_global(new)
    x, _ = data.test_batch(0, 3)
    p = algo.predict(res.client_state, x, _ctx())
    shifted = dict(res.client_state, **{"head.bias": res.client_state["head.bias"] + 1.0})
    assert torch.allclose(algo.predict(shifted, x, _ctx()), p + 1.0, atol=1e-6)


def test_fedrep_extractor_frozen_during_head_epochs_head_frozen_after():
    data = _data(n=8)
    algo, gs = _algo(FedRep, fedrep_head_epochs=3)
    state = algo.init_client_state(0)
    load_module(algo.model, {**algo.gs, **state}, "")
    fe0, hd0 = module_state("", algo.model.features), module_state("", algo.model.head)
    loss, seen = algo._train_head(data, _ctx())
    assert seen == 3 * 8
    _equal(module_state("", algo.model.features), fe0)
    assert not torch.equal(algo.model.head.weight, hd0["weight"])
    hd1 = module_state("", algo.model.head)
    loss, seen = algo._train_extractor(data, _ctx())
    assert seen == 8
    _equal(module_state("", algo.model.head), hd1)
    assert not torch.equal(algo.model.features[1].weight, fe0["1.weight"])
    # the cached features of the head epochs are the extractor's
    load_module(algo.model, {**algo.gs, **state}, "")
    x, _ = data.train_batch()
    assert torch.allclose(algo._features(data), algo.model.features(x), atol=1e-6)
    res = algo.local_train(state, data, _ctx())
    assert set(res.upload) == {"features.1.weight", "features.1.bias"} and res.samples == 4 * 8


# ----------------------------------------------------------------------------------------------
# FedRoD


def test_balanced_softmax_on_a_hand_example():
    z = torch.tensor([[1.0, 2.0, 0.0]])
    log_prior = label_log_prior(torch.tensor([0, 0, 1, 2]), 3)
    assert torch.allclose(log_prior.exp(), torch.tensor([0.5, 0.25, 0.25]))
    e = math.e
    expected = -math.log(0.5 * e / (0.5 * e + 0.25 * e**2 + 0.25))
    step = Step(None, torch.tensor([0]), {}, {}, None)
    assert balanced_softmax_loss(step, z, log_prior).item() == pytest.approx(expected, rel=1e-6)
    # a class the client lacks (π = 0) drops out of the softmax; gradients stay finite
    log_prior = label_log_prior(torch.tensor([0, 1, 1]), 3)
    zz = z.clone().requires_grad_(True)
    loss = balanced_softmax_loss(step, zz, log_prior)
    expected = -math.log((1 / 3) * e / ((1 / 3) * e + (2 / 3) * e**2))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.isfinite(zz.grad).all() and zz.grad[0, 2].item() == 0.0


def test_fedrod_personal_head_sits_on_detached_generic_logits():
    data = _data(n=8, labels=[0, 0, 0, 1, 0, 0, 1, 0])
    algo, gs = _algo(FedRoD)
    zero = algo.init_client_state(0)
    assert all(float(t.abs().sum()) == 0.0 for t in zero.values())
    other = {k: torch.randn_like(t) for k, t in zero.items()}
    ra, rb = algo.local_train(zero, data, _ctx()), algo.local_train(other, data, _ctx())
    _equal(ra.upload, rb.upload)  # P never reaches the shared extractor or the generic head
    assert set(ra.upload) == set(gs) and set(ra.client_state) == {"phead.weight", "phead.bias"}
    assert not torch.equal(ra.client_state["phead.weight"], zero["phead.weight"])
    # evaluation: generic logits + P(h)
    x, _ = data.test_batch(0, 3)
    generic = algo.global_model(x)
    assert torch.allclose(algo.predict(zero, x, _ctx()), generic)
    shifted = dict(zero, **{"phead.bias": zero["phead.bias"] + 1.0})
    assert torch.allclose(algo.predict(shifted, x, _ctx()), generic + 1.0)


# ----------------------------------------------------------------------------------------------
# FedPHP


def test_fedphp_momentum_schedule():
    assert hpm_momentum(0.9, 0, 1.0, 10) == 0.0
    assert hpm_momentum(0.9, 5, 1.0, 10) == pytest.approx(0.45)
    assert hpm_momentum(0.9, 1, 0.5, 10) == pytest.approx(0.18)  # ⌊ρT⌋ = 5 expected participations
    assert hpm_momentum(0.9, 20, 1.0, 10) == pytest.approx(0.9)  # capped at μ̄


def test_fedphp_inherited_model_is_a_moving_average_of_the_local_models():
    data = _data(n=8)
    algo, gs = _algo(FedPHP, rounds=10, fedphp_mu=0.9, fedphp_lam=0.3)
    s0 = algo.init_client_state(0)
    _equal({k[4:]: v for k, v in s0.items() if k.startswith("hpm.")}, gs)
    r1 = algo.local_train(s0, data, _ctx(1))
    hpm1 = {k[4:]: v for k, v in r1.client_state.items() if k.startswith("hpm.")}
    _equal(hpm1, r1.upload)  # first participation: μ = 0, the HPM is the trained local model
    assert r1.client_state["participations"].item() == 1
    algo.set_global(r1.upload)
    r2 = algo.local_train(r1.client_state, data, _ctx(2))
    mu = 0.9 * 1 / 10
    hpm2 = {k[4:]: v for k, v in r2.client_state.items() if k.startswith("hpm.")}
    _close(hpm2, {k: mu * hpm1[k] + (1 - mu) * r2.upload[k] for k in hpm1})
    assert r2.client_state["participations"].item() == 2
    x, _ = data.test_batch(0, 3)  # the HPM is what is evaluated
    assert torch.allclose(algo.predict(r2.client_state, x, _ctx()), _net(hpm2)(x).detach(), atol=1e-6)


def test_fedphp_mmd_term_weights_the_loss():
    data = _data(n=4)
    a, _ = _algo(FedPHP, fedphp_lam=0.0)
    b, _ = _algo(FedPHP, fedphp_lam=0.25)
    s = a.init_client_state(0)
    # the HPM equals the received model at the first step: MMD² = 0, so the loss is (1 − λ)·CE
    ra, rb = a.local_train(s, data, _ctx()), b.local_train(s, data, _ctx())
    assert rb.loss_sum == pytest.approx(0.75 * ra.loss_sum, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# FedCP ablations and CPN variants


def _cnn_data():
    return _data(n=8, shape=(1, 28, 28), labels=[0, 1, 2, 0, 1, 2, 0, 1])


def test_fedcp_design_keys_at_their_defaults_build_the_papers_cpn():
    model = build_model("cnn", (1, 28, 28), 3)
    algo = make_algorithm("fedcp", Config(), model, CPU)
    assert type(algo) is FedCP
    assert [type(m) for m in algo.cpn.net] == [nn.Linear, nn.LayerNorm, nn.ReLU]
    assert (algo.cpn.net[0].in_features, algo.cpn.net[0].out_features) == (algo.K, 2 * algo.K)
    two = make_algorithm("fedcp", Config(cpn_layers=2), build_model("cnn", (1, 28, 28), 3), CPU)
    assert type(two) is FedCP and sum(isinstance(m, nn.Linear) for m in two.cpn.net) == 2


def test_fedcp_without_gfm_is_fedcp_with_lambda_zero():
    data = _cnn_data()
    a, _ = _algo(FedCP, model="cnn", lr=0.05, lam=0.0)
    b, _ = _algo(FedCP, model="cnn", lr=0.05, lam=5.0, fedcp_gfm=False)
    _equal(a.local_train(a.init_client_state(0), data, _ctx()).upload,
           b.local_train(b.init_client_state(0), data, _ctx()).upload)


def test_fedcp_without_cpn_sends_the_whole_feature_to_both_heads():
    data = _cnn_data()
    algo, gs = _algo(FedCP, model="cnn", lr=0.05, fedcp_cpn=False)
    assert not any(k.startswith("cpn.") for k in gs)
    state = algo.init_client_state(0)
    x, _ = data.test_batch(0, 3)
    h = algo.fe_g(x)
    head_p = nn.Linear(algo.K, 3)
    load_module(head_p, state, "head.")
    assert torch.allclose(algo.predict(state, x, _ctx()), head_p(h) + algo.head_g(h), atol=1e-5)
    res = algo.local_train(state, data, _ctx())
    assert set(res.upload) == set(gs)


def test_fedcp_without_cpn_gfm_and_global_head_is_fedper():
    data = _cnn_data()
    a, ga = _algo(FedCP, model="cnn", lr=0.05, fedcp_cpn=False, fedcp_gfm=False, fedcp_global_head=False)
    b, gb = _algo(FedPer, model="cnn", lr=0.05)
    assert a.upload_keys(ga) == b.upload_keys(gb)
    ra = a.local_train(a.init_client_state(0), data, _ctx())
    rb = b.local_train(b.init_client_state(0), data, _ctx())
    _equal(ra.upload, rb.upload)
    _equal({k: v for k, v in ra.client_state.items() if k != "v"}, rb.client_state)


@pytest.mark.parametrize("mode", ["client", "none"])
def test_cpn_input_without_the_sample_gives_one_policy_for_all_samples(mode):
    algo, _ = _algo(FedCP, model="cnn", cpn_input=mode)
    h = torch.rand(5, algo.K)
    v = torch.rand(algo.K)
    step = Step(None, None, {"cpn.": algo.cpn}, {"v": v}, None)
    c = algo.vector.policy_input(step, h)
    s, r, _ = algo.policy.split(algo.policy.logits(step, c), 1.0, None, entropy=False)
    assert torch.allclose(s, s[:1].expand_as(s)) and torch.allclose(s + r, torch.ones_like(s))
    expected = F.normalize(v, dim=0) if mode == "client" else algo.vector.fixed_input
    assert torch.allclose(c, expected.expand_as(h))
    algo_sample, _ = _algo(FedCP, model="cnn", cpn_input="sample")
    assert torch.equal(algo_sample.vector.policy_input(step, h), h)


@pytest.mark.parametrize("layers,norm,act", [(1, "none", "sigmoid"), (2, "batchnorm", "tanh"), (4, "groupnorm", "relu")])
def test_cpn_designs(layers, norm, act):
    cpn = CPN(6, 0, layers, norm, act)
    linears = [m for m in cpn.net if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(6, 12)] + [(12, 12)] * (layers - 1)
    kinds = {"none": nn.Identity, "batchnorm": nn.BatchNorm1d, "groupnorm": nn.GroupNorm}
    assert sum(isinstance(m, kinds[norm]) for m in cpn.net) == layers
    if norm == "groupnorm":
        assert cpn.net[1].num_groups == 2
    s, r, _ = policy(cpn.net(torch.randn(4, 6)), 6, 1.0)
    assert torch.allclose(s + r, torch.ones_like(s))


def test_batchnorm_cpn_evaluates_with_running_statistics():
    data = _cnn_data()
    algo, gs = _algo(FedCP, model="cnn", lr=0.05, cpn_norm="batchnorm")
    assert "cpn.net.1.running_mean" in gs and not algo.cpn_g.training
    res = algo.local_train(algo.init_client_state(0), data, _ctx())
    assert not torch.equal(res.upload["cpn.net.1.running_mean"], gs["cpn.net.1.running_mean"])
    x, _ = data.test_batch(0, 3)
    before = algo.cpn_g.net[1].running_mean.clone()
    p1 = algo.predict(res.client_state, x, _ctx())
    assert torch.equal(algo.cpn_g.net[1].running_mean, before)
    assert torch.allclose(algo.predict(res.client_state, x[:1], _ctx()), p1[:1], atol=1e-5)


# ----------------------------------------------------------------------------------------------
# world size: 1 rank vs 2 ranks (torchrun), every method, 2 rounds

ROUNDS = 2
#: (label, config, extra overrides): every baseline on its digits config, and FedCP ablations
WORLD_CASES = [(m, f"configs/digits_{m}.yaml", []) for m in BASELINES] + [
    ("fedcp-no-cpn", "configs/digits_fedcp.yaml", ["fedcp_cpn=false"]),
    ("fedcp-fedper-like", "configs/digits_fedcp.yaml", ["fedcp_cpn=false", "fedcp_gfm=false", "fedcp_global_head=false"]),
    ("fedcp-cpn-2bn-sample", "configs/digits_fedcp.yaml", ["cpn_layers=2", "cpn_norm=batchnorm", "cpn_input=sample"]),
]
#: cheaper local work for the check (the invariance does not depend on it): the digits clients at 16 x 16
#: pixels, 6 of the 20 a round (about 67 training samples each); clients one by one: the sequential path
#: of every baseline across world sizes (the default fused path is checked on 1, 2 and 3 ranks in
#: tests/test_multiprocess.py)
CHEAP = ["pfedme_k=2", "fedrep_head_epochs=2", "participation=0.3", "fused=false"]

def _overrides(shard, out, extra):
    return [f"rounds={ROUNDS}", f"eval_every={ROUNDS}", f"data.path={shard}", f"out_dir={out}",
            "threads=1", "overwrite=true", *CHEAP, *extra]


def _load(out):
    state = torch.load(out / "final_global.pt", weights_only=True)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return state, [l["acc"] for l in lines if "acc" in l], summary


@pytest.fixture(scope="module")
def world_runs(digits20_16px, tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    runs_on_one_and_two_ranks(root, {name: (cfg, lambda out, extra=extra: _overrides(digits20_16px, out, extra))
                                     for name, cfg, extra in WORLD_CASES})
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in WORLD_CASES])
def test_one_and_two_ranks_agree(world_runs, name):
    s1, acc1, sum1 = _load(world_runs / "one" / name)
    s2, acc2, sum2 = _load(world_runs / "two" / name)
    assert sum1["world_size"] == 1 and sum2["world_size"] == 2 and sum2["launcher"] == "torchrun"
    assert set(s1) == set(s2)
    for k in s1:
        assert torch.allclose(s1[k], s2[k], atol=1e-5, rtol=0), f"{name}: {k} differs by {(s1[k] - s2[k]).abs().max()}"
    assert len(acc1) == len(acc2) == 2  # before round 1, and the final evaluation
    assert acc1 == pytest.approx(acc2, abs=1e-9)
    assert acc1[-1] > acc1[0], f"{name} did not learn in {ROUNDS} rounds: {acc1}"  # a real trajectory
