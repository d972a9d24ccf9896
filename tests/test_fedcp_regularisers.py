"""FedCP's loss terms on small hand-computed numbers: the MMD kernels (multi, RBF with a given or
median σ), the policy entropy term, and the policy distillation term."""
import math
import pytest
import torch

from helpers import tiny_data, tiny_fedcp
from fedcp_dist.algorithms.fedcp import policy, policy_kl
from fedcp_dist.local_train import Step
from fedcp_dist.losses import grouped_mmd2, median_sq_dist, mmd2

CPU = torch.device("cpu")


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
    assert tiny_fedcp()[0].terms[0].bandwidths == (10.0, 15.0, 20.0, 50.0)
    assert tiny_fedcp(mmd_bandwidths=[1, 2.5])[0].terms[0].bandwidths == (1.0, 2.5)
    assert tiny_fedcp(mmd_kernel="rbf", mmd_sigma=2)[0].terms[0].bandwidths == (4.0,)
    assert tiny_fedcp(mmd_kernel="rbf")[0].terms[0].bandwidths == "median"
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


def test_policy_kl_by_hand():
    # K = 1: teacher (0.5, 0.5), student (0.75, 0.25): 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3)
    teacher, student = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    assert policy_kl(teacher, student, 1, 1.0).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-7)
    # τ = 2 halves the logits: student (√3/(√3+1), 1/(√3+1))
    q = math.sqrt(3) / (math.sqrt(3) + 1)
    want = 0.5 * math.log(0.5 / q) + 0.5 * math.log(0.5 / (1 - q))
    assert policy_kl(teacher, student, 1, 2.0).item() == pytest.approx(want, abs=1e-7)
    # K = 2, two samples, per sample the sum over features; equal policies: 0
    t2 = torch.tensor([[0.0, 1.0, 0.0, 1.0], [2.0, 0.0, 2.0, 0.0]])
    got = policy_kl(t2, t2.clone(), 2, 1.0)
    assert got.shape == (2,) and torch.allclose(got, torch.zeros(2), atol=1e-7)


def test_distillation_term_in_the_loss():
    from fedcp_dist.local_train import Step

    kappa = 0.7
    algo, gs = tiny_fedcp(cpn_distill=kappa, cpn_train_gumbel=False)
    plain, _ = tiny_fedcp(cpn_train_gumbel=False)
    d = tiny_data(n=8)
    x, y = d.train_batch()
    values = {"v": algo.init_client_state(0)["v"]}
    modules = algo.train_phase.modules
    # the working CPN differs from the received one (the teacher): the moved global state
    loss = algo.loss(Step(x, y, modules, values, torch.Generator().manual_seed(1)))
    base = plain.loss(Step(x, y, plain.train_phase.modules, values, torch.Generator().manual_seed(1)))
    with torch.no_grad():
        h = algo.fe(x)
        c = torch.nn.functional.normalize(values["v"], dim=-1) * h
        zt, zs = algo.cpn_g.net(c).view(-1, 2, 3), algo.cpn.net(c).view(-1, 2, 3)
        pt, ps = torch.softmax(zt, -2), torch.softmax(zs, -2)
        kl = (pt * (pt / ps).log()).sum((-2, -1)).mean()
    assert kl > 1e-4
    assert loss.item() == pytest.approx(base.item() + kappa * kl.item(), abs=1e-6)
    # the teacher equal to the own CPN: no term
    algo.set_global({**gs, **{"cpn." + n: p.detach().clone() for n, p in algo.cpn.named_parameters()}})
    plain.set_global(algo.gs)
    a = algo.loss(Step(x, y, modules, values, torch.Generator().manual_seed(1)))
    b = plain.loss(Step(x, y, plain.train_phase.modules, values, torch.Generator().manual_seed(1)))
    assert a.item() == pytest.approx(b.item(), abs=1e-7)
