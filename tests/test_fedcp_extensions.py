"""FedCP's practitioner switches on small hand-computed numbers: the MMD
kernel, the policy entropy term, the CPN warm-up and its own rate and schedule, the annealed and
the straight-through hard Gumbel policy, the light CPN; fused training equals sequential training
with all of them on; one 1-vs-2-rank run with all of them, which also resumes bit-exactly."""
import math

import pytest
import torch

from helpers import (algo_with_moved_global, assert_states_close, load_run, one_vs_two_ranks, random_client,
                     resume_before_last_checkpoint, tiny_data, tiny_fedcp)
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import CPN, FedCP, annealed_tau, cpn_cost, cpn_rate, policy
from fedcp_dist.config import Config, load_config
from fedcp_dist.errors import UserError
from fedcp_dist.fused_groups import train_group
from fedcp_dist.local_train import Step
from fedcp_dist.losses import grouped_mmd2, median_sq_dist, mmd2

CPU = torch.device("cpu")


# ---------------------------------------------------------------- 1. the MMD kernel


def test_rbf_kernel_with_a_given_sigma():
    # one point each at squared distance 1: MMD² = 1 + 1 − 2·exp(−1/(2σ²)); σ = 1 → 2 − 2e^(−1/2)
    x, y = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    assert mmd2(x, y, (1.0,)).item() == pytest.approx(0.7869386, rel=1e-6)
    # σ = 2: a = σ² = 4
    assert mmd2(x, y, (4.0,)).item() == pytest.approx(2 - 2 * math.exp(-1 / 8), rel=1e-6)


def test_median_heuristic_by_hand():
    # pooled rows {0, 2, 1, 1}: the squared distances of distinct pairs are 4, 1, 1, 1, 1, 0 (each
    # twice as ordered pairs); their lower median is 1, so σ² = 1 and k(d) = exp(−d/2)
    x, y = torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0], [1.0]])
    assert median_sq_dist(x, y).item() == 1.0
    k = lambda d: math.exp(-d / 2)  # noqa: E731
    expected = (2 * k(0) + 2 * k(4)) / 4 + k(0) - 2 * k(1)
    assert expected == pytest.approx(0.3546, abs=1e-4)
    assert mmd2(x, y, "median").item() == pytest.approx(expected, rel=1e-6)
    # scaling the points by 3 scales σ with them: the same MMD²
    assert mmd2(3 * x, 3 * y, "median").item() == pytest.approx(expected, rel=1e-5)


def test_grouped_median_mmd_uses_each_slots_real_rows():
    x0, y0 = torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0], [1.0]])
    x1, y1 = torch.tensor([[0.0], [1.0], [5.0]]), torch.tensor([[2.0], [0.5], [1.0]])
    # slot 0 holds 2 real rows and a padded one (garbage that must not count)
    x = torch.stack([torch.cat([x0, torch.tensor([[100.0]])]), x1])
    y = torch.stack([torch.cat([y0, torch.tensor([[-50.0]])]), y1])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = grouped_mmd2(x, y, mask, mask.sum(1), "median")
    assert got[0].item() == pytest.approx(mmd2(x0, y0, "median").item(), rel=1e-6)
    assert got[1].item() == pytest.approx(mmd2(x1, y1, "median").item(), rel=1e-6)


def test_kernel_switches_pick_the_bandwidths():
    assert tiny_fedcp()[0]._bandwidths == (10.0, 15.0, 20.0, 50.0)
    assert tiny_fedcp(mmd_bandwidths=[1, 2.5])[0]._bandwidths == (1.0, 2.5)
    assert tiny_fedcp(mmd_kernel="rbf", mmd_sigma=2)[0]._bandwidths == (4.0,)
    assert tiny_fedcp(mmd_kernel="rbf")[0]._bandwidths == "median"
    # the loss's MMD term is λ·MMD² with that kernel: λ = 1, no other difference than the kernel
    algo, _ = tiny_fedcp(mmd_kernel="rbf", mmd_sigma=1.0, lam=1.0, cpn_train_gumbel=False)
    ref, _ = tiny_fedcp(lam=0.0, cpn_train_gumbel=False)
    d = tiny_data()
    x, y = d.train_batch()
    v = {"v": algo.init_client_state(0)["v"]}
    loss = algo.loss(Step(x, y, algo.train_phase.modules, v, None))
    ce = ref.loss(Step(x, y, ref.train_phase.modules, v, None))
    with torch.no_grad():
        h = algo.fe(x)
        mmd = mmd2(h, algo.fe_g(x), (1.0,))
    assert mmd.item() > 0 and loss.item() == pytest.approx(ce.item() + mmd.item(), rel=1e-6)


# ---------------------------------------------------------------- 2. the policy entropy


def test_policy_entropy_values():
    # pair logits (0, 0) → s = r = 1/2 per feature: H = K·log 2; (log 3, 0) → s = 3/4: H = −(¾ ln ¾ + ¼ ln ¼)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0, 0.0]])  # K = 2, rows (s-logits, r-logits)
    s, r, h = policy(logits, 2, 1.0, entropy=True)
    assert torch.allclose(s + r, torch.ones_like(s))
    assert h[0].item() == pytest.approx(2 * math.log(2), rel=1e-6)
    assert s[1, 0].item() == pytest.approx(0.75, rel=1e-6)
    assert h[1].item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) + math.log(2), rel=1e-6)


@pytest.mark.parametrize("beta", [0.5, -0.5])
def test_entropy_sign_pushes_to_decisive_or_to_half(beta):
    # plain gradient descent on β·H alone: β > 0 drives s away from 1/2, β < 0 towards it
    z = torch.tensor([[0.4, -0.3, 0.0, 0.0]], requires_grad=True)
    s0 = policy(z.detach(), 2, 1.0)[0]
    for _ in range(50):
        _, _, h = policy(z, 2, 1.0, entropy=True)
        (g,) = torch.autograd.grad(beta * h.mean(), z)
        z = (z - 1.0 * g).detach().requires_grad_(True)
    s1 = policy(z.detach(), 2, 1.0)[0]
    d0, d1 = (s0 - 0.5).abs(), (s1 - 0.5).abs()
    assert ((d1 > d0 + 0.1) if beta > 0 else (d1 < d0 / 2)).all()


def test_entropy_term_in_the_loss():
    algo, _ = tiny_fedcp(policy_entropy=0.3, cpn_train_gumbel=False)
    ref, _ = tiny_fedcp(cpn_train_gumbel=False)
    d = tiny_data()
    x, y = d.train_batch()
    v = {"v": algo.init_client_state(0)["v"]}
    out = algo.heads(Step(x, y, algo.train_phase.modules, v, None), gumbel=False)
    by_hand = -(out.s * out.s.log() + (1 - out.s) * (1 - out.s).log()).sum(1).mean()
    assert out.entropy.mean().item() == pytest.approx(by_hand.item(), rel=1e-5)
    got = algo.loss(Step(x, y, algo.train_phase.modules, v, None))
    base = ref.loss(Step(x, y, ref.train_phase.modules, v, None))
    assert got.item() == pytest.approx(base.item() + 0.3 * by_hand.item(), rel=1e-6)


# ---------------------------------------------------------------- 3. CPN warm-up and schedule


def test_cpn_rate_per_round():
    # lr 0.1, cpn_lr 0.2, W = 2 of T = 6 rounds, cosine to 0 over rounds 2..5: 0.2, 0.15, 0.05, 0
    got = [cpn_rate(0.1, 0.2, "cosine", 0.0, 2, t, 6) for t in range(6)]
    assert got[:2] == [None, None]
    assert got[2:] == pytest.approx([0.2, 0.15, 0.05, 0.0], abs=1e-12)
    assert [cpn_rate(0.1, 0.2, "cosine", 0.02, 0, t, 3) for t in range(3)] == pytest.approx([0.2, 0.11, 0.02])
    assert [cpn_rate(0.1, None, "constant", 0.0, 1, t, 3) for t in range(3)] == [None, 0.1, 0.1]
    assert cpn_rate(0.1, 0.3, "cosine", 0.0, 2, 2, 3) == 0.3  # one round after the warm-up: no anneal


@pytest.mark.parametrize("vector", ["head", "head+embed"])
def test_warmup_freezes_the_cpn_and_its_upload(vector):
    algo, gs = tiny_fedcp(cpn_warmup_rounds=2, cpn_client_vector=vector)
    assert any(k.startswith("vproj.") for k in gs) == (vector != "head")
    d = tiny_data(n=16)
    for t, frozen in ((0, True), (1, True), (2, False)):
        res = algo.local_train(algo.init_client_state(0), d, Context(t, 0, torch.Generator().manual_seed(3), True))
        assert algo.skipped_groups(t) == (("policy",) if frozen else ())  # nobody sends the CPN in a warm-up round
        for k in gs:
            if k.startswith(("cpn.", "vproj.")):
                assert torch.equal(res.extra["trained"][k], gs[k]) == frozen, (t, k)
                assert (k in res.upload) != frozen, (t, k)
        assert not torch.equal(res.upload["features.1.weight"], gs["features.1.weight"])
        assert not torch.equal(res.client_state["head.weight"], gs["head.weight"])


class _OneRank:
    def all_reduce_sum_(self, t):
        return t


def test_warmup_round_keeps_the_cpn_out_of_the_all_reduce():
    """A warm-up round's all-reduce holds no CPN: the global CPN after it is the one before, bit for
    bit, and its bytes count as saved; the first round after the warm-up sends and averages it."""
    from fedcp_dist.aggregate import FlatAggregator
    from fedcp_dist.compress import Compressor, uplink_record

    algo, gs = tiny_fedcp(cpn_warmup_rounds=1)
    upload = algo.upload_keys(gs)
    agg = FlatAggregator({k: gs[k].shape for k in upload}, 1, CPU, groups=algo.aggregation_groups(upload))
    # parameters: extractor Linear(4, 3) 15, head Linear(3, 3) 12, CPN Linear(3, 6) 24 + LayerNorm(6) 12 = 36
    assert agg.num_params == 63 and agg.group_numel("policy") == 36 and agg.groups == ["policy"]
    off = Compressor("none", 1.0, 32, False, agg.shapes)
    datas = [tiny_data(n=16, seed=1), tiny_data(n=8, seed=2)]
    for t in (0, 1):
        algo.begin_round(t)
        agg.begin_round(algo.skipped_groups(t))
        # the buffer: the sent values, Σ n, Σ n and count of the policy group, one metric
        assert agg.buffer.numel() == (63 - 36 if t == 0 else 63) + 3 + 1
        for i, d in enumerate(datas):
            res = algo.local_train(algo.init_client_state(i), d, Context(t, i, torch.Generator().manual_seed(i)))
            agg.add(res.upload, d.n_train, skip=res.skipped)
        agg.add_metrics([0.0])
        mean, total, _ = agg.reduce(_OneRank())
        new = algo.server_update(gs, mean)
        cpn = [k for k in gs if k.startswith("cpn.")]
        assert total == 24 and all(torch.equal(new[k], gs[k]) == (t == 0) for k in cpn), t
        assert not torch.equal(new["features.1.weight"], gs["features.1.weight"])
        # two uploaders: 4 bytes per parameter sent, the CPN's 36 saved in the warm-up round
        sent = 4 * 2 * (27 if t == 0 else 63)
        assert uplink_record(off, agg, 2, 2) == {"uplink_bytes": sent, "uplink_bytes_dense": sent,
                                                 "downlink_bytes": 4 * 2 * 63, "downlink_bytes_dense": 4 * 2 * 63,
                                                 "uplink_bytes_sent": sent,
                                                 "uplink_bytes_saved": 4 * 2 * 36 if t == 0 else 0}


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
    assert algo._sgd_kwargs(Context(0, 0, None))["param_lr"] == {"cpn.": 0.2, "vproj.": 0.2, "cpng.": 0.2}
    assert algo._sgd_kwargs(Context(1, 0, None))["param_lr"]["cpn."] == pytest.approx(0.125)
    assert algo._sgd_kwargs(Context(2, 0, None))["param_lr"]["cpn."] == pytest.approx(0.05)
    assert "param_lr" not in tiny_fedcp()[0]._sgd_kwargs(Context(0, 0, None))


# ---------------------------------------------------------------- 4. the Gumbel temperature


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
    import fedcp_dist.algorithms.fedcp as fedcp_mod
    real = fedcp_mod.split_policy
    monkeypatch.setattr(fedcp_mod, "split_policy", lambda lg, k, tau, noise: seen.append(tau) or real(lg, k, tau, noise))
    d = tiny_data(n=8)
    state = algo.init_client_state(0)
    algo.local_train(state, d, Context(2, 0, torch.Generator().manual_seed(1)))
    assert set(seen) == {0.625}
    seen.clear()
    algo.predict(state, d.test_batch(0, 3)[0], Context(2, 0, torch.Generator().manual_seed(1)))
    assert seen == [0.8125]  # evaluation before round 2 sees the model trained in round 1


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


# ---------------------------------------------------------------- 5. the light CPN


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
    s, r = cpn(c)
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


# ---------------------------------------------------------------- config, fused, ranks, resume


@pytest.mark.parametrize("override, key", [
    ("mmd_kernel=gauss", "mmd_kernel"), ("mmd_sigma=-1", "mmd_sigma"), ("mmd_sigma=mean", "mmd_sigma"),
    ("mmd_bandwidths=[1,-2]", "mmd_bandwidths"), ("mmd_bandwidths=[]", "mmd_bandwidths"),
    ("mmd_kernel=multi mmd_sigma=2", "mmd_sigma"), ("mmd_kernel=rbf mmd_bandwidths=[1]", "mmd_bandwidths"),
    ("cpn_warmup_rounds=-1", "cpn_warmup_rounds"), ("cpn_warmup_rounds=30", "cpn_warmup_rounds"),
    ("cpn_lr=0", "cpn_lr"), ("cpn_lr_schedule=step", "cpn_lr_schedule"), ("cpn_lr_min=0.001", "cpn_lr_min"),
    ("cpn_lr_schedule=cosine cpn_lr_min=1", "cpn_lr_min"), ("tau_final=0", "tau_final"),
    ("tau_anneal=linear", "tau_anneal"), ("tau_anneal=cubic tau_final=0.1", "tau_anneal"),
    ("cpn_hidden=-4", "cpn_hidden"), ("cpn_hidden=8 cpn_layers=2", "cpn_hidden"),
    ("fedcp_cpn=false cpn_hard=true", "cpn_hard"), ("policy_entropy=x", "policy_entropy"),
])
def test_bad_values_name_their_key(tmp_path, override, key):
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"")
    with pytest.raises(UserError, match=f"'{key}'"):
        load_config("configs/digits_fedcp.yaml", [f"data.path={shard}", "rounds=30", *override.split()])


def test_defaults_build_the_plain_policy():
    cfg = Config()
    assert (cfg.mmd_kernel, cfg.mmd_sigma, cfg.mmd_bandwidths, cfg.policy_entropy, cfg.cpn_warmup_rounds, cfg.cpn_lr,
            cfg.cpn_lr_schedule, cfg.cpn_lr_min, cfg.tau_final, cfg.tau_anneal, cfg.cpn_hard, cfg.cpn_hidden) == (
        "multi", "median", None, 0.0, 0, None, "constant", 0.0, None, "exponential", False, 0)


ALL = dict(mmd_kernel="rbf", mmd_sigma="median", policy_entropy=0.05, cpn_warmup_rounds=1, cpn_lr=0.02,
           cpn_lr_schedule="cosine", cpn_lr_min=0.005, tau=0.5, tau_final=0.2, tau_anneal="linear", cpn_hard=False,
           cpn_hidden=16, rounds=5)


@pytest.mark.parametrize("hard", [False, True])
def test_all_switches_train_fused_as_sequentially(float64, hard):
    algo, gs = algo_with_moved_global(FedCP, shape=(1, 16, 16), lam=1.0, lr=0.01, drop_last=False,
                                      **{**ALL, "cpn_hard": hard})
    assert algo.fused_reason() is None
    datas = [random_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate((23, 7, 31))]
    for t in (0, 3):  # a warm-up round and a round with the CPN's own cosine rate
        items = [({**algo.init_client_state(d.cid), "v": algo.init_client_state(d.cid)["v"] + 0.1 * d.cid}, d,
                  Context(t, d.cid, torch.Generator().manual_seed(11 + d.cid))) for d in datas]
        fus = train_group(algo, items)
        seq = [algo.local_train(s, d, Context(t, c.client, torch.Generator().manual_seed(11 + c.client)))
               for s, d, c in items]
        for a, b in zip(seq, fus):
            assert a.samples == b.samples and b.loss_sum == pytest.approx(a.loss_sum, rel=1e-9)
            assert set(a.upload) == set(b.upload)
            for k in a.upload:
                assert torch.allclose(a.upload[k], b.upload[k], atol=1e-10, rtol=0), (t, k)
            moved = {k for k in a.upload if not torch.equal(a.upload[k], gs[k])}
            assert any(k.startswith("features.") for k in moved)
            assert any(k.startswith("cpn.") for k in moved) == (t >= 1)  # the warm-up sends no CPN


ROUNDS = 4
SWITCHES = ["mmd_kernel=rbf", "mmd_sigma=median", "policy_entropy=0.01", "cpn_warmup_rounds=1", "cpn_lr=0.1",
            "cpn_lr_schedule=cosine", "cpn_lr_min=0.01", "tau=0.5", "tau_final=0.3", "tau_anneal=linear",
            "cpn_hard=true", "cpn_hidden=32"]


def _overrides(shard):
    return lambda out: [f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=2", "keep_checkpoints=2",
                        f"data.path={shard}", f"out_dir={out}", "threads=1", "fused=false", *SWITCHES]


@pytest.mark.slow
def test_all_switches_one_vs_two_ranks_and_exact_resume(digits6, tmp_path):
    """One short run with every switch on (τ = 0.5, hard policy): one rank and two ranks give the
    same trajectory; it learns; the warm-up round sends no CPN (its bytes saved, the all-reduce
    shorter by it); a resume from the round-2 checkpoint ends bit-identically."""
    config, overrides, lines = "configs/digits_fedcp.yaml", _overrides(digits6), []
    one_vs_two_ranks(config, overrides, tmp_path / "one", tmp_path / "two", echo=lines.append)
    cpn = 52256  # the light CPN as the start line counts it: Linear(512, 32), Linear(32, 1024), LayerNorm(1024)
    assert any(f"CPN (light, H=32, K=512): {cpn} parameters, 98304 FLOPs/sample" in l for l in lines), lines[:1]
    (s1, acc1, rec1), (s2, acc2, rec2) = load_run(tmp_path / "one"), load_run(tmp_path / "two")
    assert any(k.startswith("cpn.net.2.") for k in s1)
    assert_states_close(s1, s2)
    assert len(acc1) == ROUNDS + 1 and acc1 == pytest.approx(acc2, abs=1e-9)
    assert acc1[-1] > acc1[0] + 0.2  # τ = 0.5 with the hard policy learns
    # round 1 (W = 1) leaves the CPN out: 4 bytes a parameter per uploader saved, 8 (float64) out of the all-reduce
    n = rec1[0]["participants"]
    assert [r["uplink_bytes_saved"] for r in rec1] == [4 * n * cpn] + [0] * (ROUNDS - 1)
    assert rec1[0]["uplink_bytes_sent"] == rec1[1]["uplink_bytes_sent"] - 4 * n * cpn
    assert rec1[0]["allreduce_bytes"] == rec1[1]["allreduce_bytes"] - 8 * cpn
    assert [r["uplink_bytes_saved"] for r in rec2] == [r["uplink_bytes_saved"] for r in rec1]
    s3, acc3, _ = resume_before_last_checkpoint(config, overrides, tmp_path / "one", tmp_path / "resumed", ROUNDS)
    assert all(torch.equal(s1[k], s3[k]) for k in s1) and acc3[-ROUNDS - 1:] == acc1


@pytest.mark.parametrize("switch, refused", [
    ({}, False), ({"tau_final": 0.1}, True), ({"cpn_lr_schedule": "cosine"}, True), ({"cpn_warmup_rounds": 2}, False)])
def test_resume_refuses_a_new_round_count_under_a_round_schedule(tmp_path, switch, refused):
    from fedcp_dist.rundir import check_resume_config

    old = {**Config().to_dict(), "rounds": 10, **switch}
    new = {**old, "rounds": 20}
    if refused:
        with pytest.raises(UserError, match="'rounds'.*anneal over the total number of rounds"):
            check_resume_config(old, new, tmp_path)
    else:
        check_resume_config(old, new, tmp_path)
