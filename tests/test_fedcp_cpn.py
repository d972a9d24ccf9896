"""FedCP's policy network and its schedules on small hand-computed numbers: the default CPN, the
straight-through hard policy, the light CPN, the group-level policy, the annealed temperature and
the CPN's own learning rate and cosine schedule."""
import math
import pytest
import torch

from helpers import tiny_data, tiny_fedcp
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import CPN, annealed_tau, combine_group_logits, cpn_cost, cpn_rate, group_pool, policy
from fedcp_dist.config import Config
from fedcp_dist.errors import UserError
from fedcp_dist.local_train import Step

CPU = torch.device("cpu")


def _ctx(t, probe=False):
    return Context(t, 0, torch.Generator().manual_seed(3), probe)


def test_defaults_build_the_plain_policy():
    cfg = Config()
    assert (cfg.mmd_kernel, cfg.mmd_sigma, cfg.mmd_bandwidths, cfg.policy_entropy, cfg.cpn_warmup_rounds, cfg.cpn_lr,
            cfg.cpn_lr_schedule, cfg.cpn_lr_min, cfg.tau_final, cfg.tau_anneal, cfg.cpn_hard, cfg.cpn_hidden) == (
        "multi", "median", None, 0.0, 0, None, "constant", 0.0, None, "exponential", False, 0)


def test_hard_policy_is_zero_one_forward_and_soft_backward():
    z = torch.tensor([[0.3, -1.0, 2.0, 0.0, 0.5, 1.0]], requires_grad=True)  # K = 3
    w = torch.tensor([1.0, 2.0, 3.0])
    s, r, _ = policy(z, 3, 0.5, hard=True)
    # pairs (0.3, 0), (−1, 0.5), (2, 1): the personal part wins the first and the last feature
    assert s.tolist() == [[1.0, 0.0, 1.0]] and r.tolist() == [[0.0, 1.0, 0.0]]
    (g_hard,) = torch.autograd.grad((s * w).sum(), z)
    s_soft, _, _ = policy(z, 3, 0.5)
    (g_soft,) = torch.autograd.grad((s_soft * w).sum(), z)
    assert torch.equal(g_hard, g_soft) and g_hard.abs().sum() > 0


def test_hard_policy_in_training_and_evaluation():
    algo, _ = tiny_fedcp(cpn_hard=True, tau=0.5)
    d = tiny_data(n=8)
    state = algo.init_client_state(0)
    x, y = d.train_batch()
    out = algo.heads(Step(x, y, algo.train_phase.modules, {"v": state["v"]}, torch.Generator().manual_seed(0)), True)
    assert set(out.s.unique().tolist()) <= {0.0, 1.0}
    res = algo.local_train(state, d, Context(0, 0, torch.Generator().manual_seed(3)))
    assert all(torch.isfinite(t).all() for t in res.upload.values())
    personal, glob = algo.head_outputs(res.client_state, d.test_batch(0, 3)[0], Context(1, 0, torch.Generator()))
    assert torch.isfinite(personal).all() and torch.isfinite(glob).all()


def test_light_cpn_shape_cost_and_values():
    torch.manual_seed(0)
    cpn = CPN(3, hidden=4)
    assert [type(m).__name__ for m in cpn.net] == ["Linear", "ReLU", "Linear", "LayerNorm", "ReLU"]
    # params: 3·4 + 4 + 4·6 + 6 + 2·6 = 58; FLOPs: 2·(3·4 + 4·6) = 72
    assert cpn_cost(cpn) == (58, 72)
    assert cpn_cost(CPN(3)) == (3 * 6 + 6 + 12, 36)
    assert cpn_cost(CPN(512)) == (527360, 1048576)
    assert cpn_cost(CPN(512, hidden=64)) == (101440, 196608)
    c = torch.tensor([[1.0, -2.0, 0.5]])
    a = cpn.net
    by_hand = torch.relu(torch.nn.functional.layer_norm(a[2](torch.relu(a[0](c))), (6,), a[3].weight, a[3].bias))
    s, r, _ = policy(cpn.net(c), 3, 1.0)
    z = by_hand.view(1, 2, 3)
    assert torch.allclose(s, torch.softmax(z, dim=1)[:, 0], atol=1e-6) and torch.allclose(s + r, torch.ones_like(s))


def test_light_cpn_in_fedcp_and_its_start_line_note():
    algo, gs = tiny_fedcp(cpn_hidden=4)
    assert sorted(k for k in gs if k.startswith("cpn.")) == [
        "cpn.net.0.bias", "cpn.net.0.weight", "cpn.net.2.bias", "cpn.net.2.weight", "cpn.net.3.bias", "cpn.net.3.weight"]
    assert algo.describe() == "CPN (light, H=4, K=3): 58 parameters, 72 FLOPs/sample"
    assert tiny_fedcp()[0].describe() == "CPN (Linear(K, 2K), K=3): 36 parameters, 36 FLOPs/sample"
    res = algo.local_train(algo.init_client_state(0), tiny_data(), Context(0, 0, torch.Generator().manual_seed(3)))
    assert not torch.equal(res.upload["cpn.net.0.weight"], gs["cpn.net.0.weight"])


def test_group_combination_by_hand():
    # K = 2, G = 1. Feature-level pairs: feature 0 (ln 3, 0) → s = 3/4; feature 1 (0, 0) → s = 1/2.
    # Group pair (ln 2, 0) → s^group = 2/3. s_k = s·s^g / (s·s^g + r·r^g):
    # feature 0: (3/4·2/3) / (3/4·2/3 + 1/4·1/3) = 6/7; feature 1: (1/2·2/3) / (1/2·2/3 + 1/2·1/3) = 2/3
    logits = torch.tensor([[math.log(3.0), 0.0, 0.0, 0.0]])  # (B, 2K): the s-logits of both features, then r's
    group = torch.tensor([[math.log(2.0), 0.0]])
    s, r, _ = policy(combine_group_logits(logits, group, 2), 2, 1.0)
    assert torch.allclose(s, torch.tensor([[6 / 7, 2 / 3]]), atol=1e-6)
    assert torch.allclose(r, torch.tensor([[1 / 7, 1 / 3]]), atol=1e-6)
    # K = 4, G = 2: features 0, 1 in group 0 and 2, 3 in group 1 (contiguous blocks)
    z = torch.zeros(1, 8)
    zg = torch.tensor([[math.log(3.0), 0.0, 0.0, math.log(3.0)]])  # group 0: s 3/4; group 1: s 1/4
    s, r, _ = policy(combine_group_logits(z, zg, 4), 4, 1.0)
    assert torch.allclose(s, torch.tensor([[0.75, 0.75, 0.25, 0.25]]), atol=1e-6)
    # the pooled input: the mean of each block
    c = torch.tensor([[1.0, 3.0, -2.0, 6.0]])
    assert torch.equal(group_pool(c, 2), torch.tensor([[2.0, 2.0]]))


class Small4(torch.nn.Module):
    """features: 2x2 image → Linear(4, 4) → Tanh; head: Linear(4, 3) (K = 4)."""

    def __init__(self):
        super().__init__()
        self.feature_dim = 4
        self.features = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 3)


def _fedcp4(**kw):
    return tiny_fedcp(net=Small4, **kw)


@pytest.mark.parametrize("hard", [False, True])
def test_group_policy_keeps_s_plus_r_one_and_trains(hard):
    algo, gs = _fedcp4(cpn_groups=2, cpn_hard=hard, cpn_eval_gumbel=True)
    assert sorted(k for k in gs if k.startswith("cpng.")) == ["cpng.0.bias", "cpng.0.weight", "cpng.1.bias",
                                                              "cpng.1.weight"]
    d = tiny_data(n=16)
    state = algo.init_client_state(0)
    x = d.train_batch()[0]
    logits, s = algo.predict_probe(state, x, _ctx(1))
    out = algo._eval_heads(state, x, _ctx(1))
    r = out.policy_logits  # the combined pair logits; s + r = 1 per feature of every sample
    assert s.shape == (16, 4)
    s2, r2, _ = policy(r, 4, algo.cfg.tau)
    assert torch.allclose(s2 + r2, torch.ones(16, 4), atol=1e-6)
    assert ((s > 0) & (s < 1)).all() or hard
    if hard:
        assert set(s.unique().tolist()) <= {0.0, 1.0}
    # the group network's values are the ones combined: its s-logit shift moves every feature of a group
    with torch.no_grad():
        h = algo.fe_g(x)
        c = torch.nn.functional.normalize(state["v"], dim=-1) * h
        want = combine_group_logits(algo.cpn_g.net(c), algo.received["cpng"](group_pool(c, 2)), 4)
    assert torch.allclose(out.policy_logits, want, atol=1e-6)
    res = algo.local_train(state, d, _ctx(0))
    for k in gs:
        if k.startswith("cpng.") and k.endswith("weight"):
            assert not torch.equal(res.upload[k], gs[k]), k


def test_groups_must_divide_k_and_default_draws_nothing_more():
    with pytest.raises(UserError, match="'cpn_groups'"):
        _fedcp4(cpn_groups=3)
    a, ga = _fedcp4()
    b, gb = _fedcp4(cpn_groups=4)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)  # the group CPN is drawn after everything else
    # Linear(4, 8): 4·8 + 8, LayerNorm(8): 2·8; FLOPs 2·4·8
    assert "group policy (G=4): 56 parameters, 64 FLOPs/sample" in b.describe()


def test_tau_anneal_per_round():
    exp = [annealed_tau(1.0, 0.25, "exponential", t, 5) for t in range(5)]
    lin = [annealed_tau(1.0, 0.25, "linear", t, 5) for t in range(5)]
    assert exp == pytest.approx([1.0, 0.5 ** 0.5, 0.5, 0.5 ** 1.5, 0.25])
    assert lin == pytest.approx([1.0, 0.8125, 0.625, 0.4375, 0.25])
    assert annealed_tau(0.5, None, "exponential", 3, 5) == 0.5
    assert annealed_tau(1.0, 0.25, "linear", 9, 5) == 0.25  # past the last round: the final value


def test_round_temperature_reaches_training_and_evaluation(monkeypatch):
    algo, _ = tiny_fedcp(tau=1.0, tau_final=0.25, tau_anneal="linear", rounds=5)
    seen = []
    import fedcp_dist.algorithms.fedcp.cpn as policy_mod
    real = policy_mod.policy
    monkeypatch.setattr(policy_mod, "policy", lambda lg, k, tau, noise, **kw: seen.append(tau) or real(lg, k, tau, noise, **kw))
    d = tiny_data(n=8)
    state = algo.init_client_state(0)
    algo.local_train(state, d, Context(2, 0, torch.Generator().manual_seed(1)))
    assert set(seen) == {0.625}
    seen.clear()
    algo.predict(state, d.test_batch(0, 3)[0], Context(2, 0, torch.Generator().manual_seed(1)))
    assert seen == [0.8125]  # evaluation before round 2 sees the model trained in round 1


def test_cpn_rate_per_round():
    # lr 0.1, cpn_lr 0.2, W = 2 of T = 6 rounds, cosine to 0 over rounds 2..5: 0.2, 0.15, 0.05, 0
    got = [cpn_rate(0.1, 0.2, "cosine", 0.0, 2, t, 6) for t in range(6)]
    assert got[:2] == [None, None]
    assert got[2:] == pytest.approx([0.2, 0.15, 0.05, 0.0], abs=1e-12)
    assert [cpn_rate(0.1, 0.2, "cosine", 0.02, 0, t, 3) for t in range(3)] == pytest.approx([0.2, 0.11, 0.02])
    assert [cpn_rate(0.1, None, "constant", 0.0, 1, t, 3) for t in range(3)] == [None, 0.1, 0.1]
    assert cpn_rate(0.1, 0.3, "cosine", 0.0, 2, 2, 3) == 0.3  # one round after the warm-up: no anneal


def test_cpn_learning_rate_scales_only_the_cpn_step():
    # one batch, one step: Δ = −rate·∇, so twice the CPN's rate doubles the CPN's step only
    d = tiny_data(n=8)
    deltas = {}
    for rate in (None, 0.2):
        algo, gs = tiny_fedcp(cpn_lr=rate)
        res = algo.local_train(algo.init_client_state(0), d, Context(0, 0, torch.Generator().manual_seed(3)))
        deltas[rate] = {k: res.upload[k] - gs[k] for k in gs}
    for k in deltas[None]:
        if k.startswith("cpn."):
            assert deltas[None][k].abs().max() > 0
            # the steps are ~1e-4 on values ~1: float32 leaves them ~1e-7 (relative 1e-3) exact
            assert torch.allclose(deltas[0.2][k], 2 * deltas[None][k], atol=2e-7, rtol=2e-3), k
        else:
            assert torch.equal(deltas[0.2][k], deltas[None][k]), k


def test_cosine_rate_reaches_the_sequential_sgd_per_round():
    algo, gs = tiny_fedcp(cpn_lr=0.2, cpn_lr_schedule="cosine", cpn_lr_min=0.05, rounds=3)
    # the policy's networks: the CPN, (with an extended client vector) its projection and (cpn_groups) the group CPN
    assert algo.sgd_settings(Context(0, 0, None))["param_lr"] == {"cpn.": 0.2, "vproj.": 0.2, "cpng.": 0.2}
    assert algo.sgd_settings(Context(1, 0, None))["param_lr"]["cpn."] == pytest.approx(0.125)
    assert algo.sgd_settings(Context(2, 0, None))["param_lr"]["cpn."] == pytest.approx(0.05)
    assert "param_lr" not in tiny_fedcp()[0].sgd_settings(Context(0, 0, None))
