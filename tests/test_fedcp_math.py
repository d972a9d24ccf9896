"""FedCP's pieces on small hand-computed numbers."""
import math

import pytest
import torch

from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import CPN, FedCP, policy
from fedcp_dist.local_train import Step
from fedcp_dist.losses import mmd2
from fedcp_dist.config import Config
from fedcp_dist.data.resident import to_device
from fedcp_dist.models import build_model


def test_mmd_hand_computed_single_points():
    # one point each, distance² = 1: MMD² = Σ_a (1 + 1 − 2·exp(−1/(2a)))
    x, y = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    expected = sum(2 - 2 * math.exp(-1 / (2 * a)) for a in (10, 15, 20, 50))
    assert mmd2(x, y).item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(0.232389, abs=1e-5)


def test_mmd_hand_computed_two_points():
    # x = {0, 2} and y = {1, 1} on a line: the diagonal of xx is included (biased estimate)
    x, y = torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0], [1.0]])
    k = lambda d: sum(math.exp(-d / (2 * a)) for a in (10, 15, 20, 50))  # noqa: E731
    kxx = (k(0) + k(4) + k(4) + k(0)) / 4
    kyy = k(0)
    kxy = k(1)
    assert mmd2(x, y).item() == pytest.approx(kxx + kyy - 2 * kxy, rel=1e-5)


def test_mmd_zero_iff_same():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    assert mmd2(x, x.clone()).item() == 0.0
    assert mmd2(x, x + 0.5).item() > 1e-4


def _split(cpn, c, gumbel=False):
    """(s, r) as training computes them: the CPN's net through a Step, Gumbel noise from its stream."""
    step = Step(None, None, {"cpn.": cpn}, {}, torch.Generator().manual_seed(1))
    s, r, _ = policy(step.run("cpn.net", c), cpn.feature_dim, 1.0, step.gumbel_like if gumbel else None)
    return s, r


def test_policy_is_a_split():
    torch.manual_seed(0)
    cpn = CPN(6)
    c = torch.randn(5, 6)
    for gumbel in (False, True):
        s, r = _split(cpn, c, gumbel)
        assert s.shape == r.shape == (5, 6)
        assert torch.allclose(s + r, torch.ones_like(s))
        assert (s > 0).all() and (s < 1).all() and (r > 0).all() and (r < 1).all()


def test_policy_plain_softmax_values():
    cpn = CPN(2)
    with torch.no_grad():
        cpn.net[0].weight.zero_()
        cpn.net[0].bias.copy_(torch.tensor([0.0, 1.0, 2.0, 0.0]))
        cpn.net[1].weight.fill_(1.0)
        cpn.net[1].bias.zero_()
    # LayerNorm of (0, 1, 2, 0): mean 0.75, var 0.6875 → ReLU → pairs (feature 0: 0 vs 1.5076)
    z = torch.tensor([0.0, 1.0, 2.0, 0.0])
    z = torch.relu((z - z.mean()) / torch.sqrt(z.var(unbiased=False) + 1e-5))
    s, r = _split(cpn, torch.zeros(1, 2))
    assert s[0, 0].item() == pytest.approx(1 / (1 + math.exp(z[2] - z[0])), rel=1e-5)
    assert r[0, 1].item() == pytest.approx(1 / (1 + math.exp(z[1] - z[3])), rel=1e-5)


def _fedcp(lam=5.0, lr=0.05):
    cfg = Config(lam=lam, lr=lr, batch_size=4, data=Config().data)
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 3)
    algo = FedCP(cfg, model, torch.device("cpu"))
    gs = algo.init_global_state()
    algo.set_global(gs)
    g = torch.Generator().manual_seed(0)
    arrays = {
        "train_x": torch.randint(0, 256, (8, 1, 28, 28), generator=g, dtype=torch.uint8).numpy(),
        "train_y": torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]).numpy(),
        "test_x": torch.randint(0, 256, (3, 1, 28, 28), generator=g, dtype=torch.uint8).numpy(),
        "test_y": torch.tensor([0, 1, 2]).numpy(),
    }
    data = to_device(0, arrays, (0.5,), (0.5,), torch.device("cpu"))
    return algo, gs, data


def test_gradients_reach_only_the_trainable_parts():
    algo, gs, data = _fedcp()
    state = algo.init_client_state(0)
    x, y = data.train_batch()
    step = Step(x, y, algo.train_phase.modules, {"v": state["v"]}, torch.Generator().manual_seed(0))
    heads = algo.heads(step, gumbel=True)
    out, h = heads.logits, heads.h
    assert heads.s.shape == h.shape and ((heads.s > 0) & (heads.s < 1)).all()
    with torch.no_grad():
        h_g = algo.fe_g(x)
    loss = torch.nn.functional.cross_entropy(out, y) + 5.0 * mmd2(h, h_g + 0.1)
    loss.backward()
    for mod in (algo.fe, algo.head_p, algo.cpn):
        grads = [p.grad for p in mod.parameters()]
        assert all(g is not None for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0
    for mod in (algo.fe_g, algo.head_g, algo.cpn_g):
        assert all(not p.requires_grad and p.grad is None for p in mod.parameters())


def test_local_train_upload_and_client_state():
    algo, gs, data = _fedcp()
    state = algo.init_client_state(0)
    res = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(3)))
    new = res.client_state
    assert res.samples == 8
    # the personal head moved, the frozen global parts did not
    assert not torch.equal(new["head.weight"], state["head.weight"])
    assert torch.equal(algo.head_g.weight, gs["head.weight"])
    assert torch.equal(algo.fe_g[0].weight, gs["features.0.weight"])
    # upload head = (global head + trained personal head) / 2
    assert torch.allclose(res.upload["head.weight"], 0.5 * (gs["head.weight"] + new["head.weight"]))
    assert torch.allclose(res.upload["head.bias"], 0.5 * (gs["head.bias"] + new["head.bias"]))
    # the uploaded extractor and CPN are the trained ones
    assert not torch.equal(res.upload["features.0.weight"], gs["features.0.weight"])
    assert not torch.equal(res.upload["cpn.net.0.weight"], gs["cpn.net.0.weight"])
    # client vector = column sums of the personal head's weight
    assert torch.allclose(new["v"], new["head.weight"].sum(0))
    assert set(res.upload) == set(gs)


def test_local_train_is_deterministic_in_its_generator():
    a = _fedcp()
    b = _fedcp()
    ra = a[0].local_train(a[0].init_client_state(0), a[2], Context(0, 0, torch.Generator().manual_seed(7)))
    rb = b[0].local_train(b[0].init_client_state(0), b[2], Context(0, 0, torch.Generator().manual_seed(7)))
    rc = b[0].local_train(b[0].init_client_state(0), b[2], Context(0, 0, torch.Generator().manual_seed(8)))
    assert all(torch.equal(ra.upload[k], rb.upload[k]) for k in ra.upload)
    assert not all(torch.equal(ra.upload[k], rc.upload[k]) for k in ra.upload)


def test_initial_client_state_is_global_head_and_one_random_vector():
    algo, gs, _ = _fedcp()
    s0, s1 = algo.init_client_state(0), algo.init_client_state(1)
    assert torch.equal(s0["head.weight"], gs["head.weight"])
    assert torch.equal(s0["v"], s1["v"])
    assert (s0["v"] >= 0).all() and (s0["v"] < 1).all() and s0["v"].std() > 0


def test_eval_is_deterministic_and_uses_the_personal_head():
    algo, gs, data = _fedcp()
    state = algo.init_client_state(0)
    x, _ = data.test_batch(0, 3)
    ctx = Context(0, 0, torch.Generator().manual_seed(0))
    p1, p2 = algo.predict(state, x, ctx), algo.predict(state, x, ctx)
    assert torch.equal(p1, p2)
    other = dict(state, **{"head.bias": state["head.bias"] + 1.0})
    # s + r = 1 and both heads see parts of h: shifting only the personal bias by 1 shifts logits by 1
    assert torch.allclose(algo.predict(other, x, ctx), p1 + 1.0, atol=1e-5)


def test_lambda_zero_skips_mmd_but_trains(monkeypatch):
    """λ = 0: the MMD term is not built (no MMD, no forward of the frozen extractor) and the loss
    is exactly the cross-entropy; with λ > 0 the same batches give a larger loss."""
    calls = {"mmd": 0, "fe_g": 0}
    real_mmd = Step.mmd2
    monkeypatch.setattr(Step, "mmd2", lambda self, *a, **k: calls.__setitem__("mmd", calls["mmd"] + 1) or real_mmd(self, *a, **k))
    algo, gs, data = _fedcp(lam=0.0)
    algo.fe_g.register_forward_hook(lambda *_: calls.__setitem__("fe_g", calls["fe_g"] + 1))
    state = algo.init_client_state(0)
    res = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(3)))
    assert calls == {"mmd": 0, "fe_g": 0} and res.samples == 8
    # the loss is the plain cross-entropy of the personalized model, batch by batch
    ce = FedCP.loss
    monkeypatch.setattr(FedCP, "loss", lambda self, step: torch.nn.functional.cross_entropy(
        self.heads(step, self.cfg.cpn_train_gumbel).logits, step.y))
    ref = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(3)))
    assert res.loss_sum == ref.loss_sum and torch.equal(res.upload["cpn.net.0.weight"], ref.upload["cpn.net.0.weight"])
    monkeypatch.setattr(FedCP, "loss", ce)
    with_mmd, _, _ = _fedcp(lam=5.0)
    res5 = with_mmd.local_train(with_mmd.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(3)))
    assert calls["mmd"] == 2 and res5.loss_sum > res.loss_sum  # two batches of 4, each with its MMD term


def test_head_outputs_add_up_to_the_prediction():
    algo, gs, data = _fedcp()
    res = algo.local_train(algo.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(3)))
    x, _ = data.test_batch(0, 3)
    ctx = Context(0, 0, torch.Generator().manual_seed(0))
    personal, glob = algo.head_outputs(res.client_state, x, ctx)
    assert torch.allclose(personal + glob, algo.predict(res.client_state, x, ctx), atol=1e-6)
    # the global head's logits do not depend on the client's personal head
    other = dict(res.client_state, **{"head.bias": res.client_state["head.bias"] + 1.0})
    p2, g2 = algo.head_outputs(other, x, ctx)
    assert torch.allclose(p2, personal + 1.0, atol=1e-5) and torch.equal(g2, glob)
