"""FedCP's policy modules, registered by name: a variant adds a module from its own file, and FedCP
gives it its place (the global or the client state, the upload, the policy's synchronisation and
rate, the received copy, the draws' order) without a line of its own."""
import pytest
import torch
from torch import nn

from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import modules
from fedcp_dist.algorithms.fedcp.modules import PolicyModule, policy_prefixes, register, registered
from fedcp_dist.local_train import Step
from helpers import tiny_data, tiny_fedcp


def test_the_registered_modules_their_kinds_and_their_draws():
    assert [(m.name, m.draw, m.shared) for m in registered()] == [("vproj", 1, True), ("cpng", 2, True),
                                                                   ("emb", 3, False)]
    assert policy_prefixes() == ("cpn.", "vproj.", "cpng.")
    with pytest.raises(ValueError, match="takes draw 2 of 'cpng'"):
        register(PolicyModule("other", draw=2, shared=True, build=lambda algo: None))
    with pytest.raises(ValueError, match="'head' is the model's"):
        register(PolicyModule("head", draw=9, shared=True, build=lambda algo: None))


def _zero_linear(k_in: int, k_out: int, bias: float) -> nn.Linear:
    m = nn.Linear(k_in, k_out)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.fill_(bias)
    return m


@pytest.fixture
def variant(monkeypatch):
    """What a variant's file registers: a shared module whose output adds to the pair logits, and a
    module of each client's own (both Linear(K, 2K) starting at a constant)."""
    monkeypatch.setattr(modules, "_REGISTERED", dict(modules._REGISTERED))
    register(PolicyModule("pbias", draw=4, shared=True, build=lambda algo: _zero_linear(algo.K, 2 * algo.K, 0.5),
                          logits=lambda policy, c, logits, apply: logits + apply(c)))
    register(PolicyModule("cbias", draw=5, shared=False, build=lambda algo: _zero_linear(algo.K, 2 * algo.K, 0.0),
                          logits=lambda policy, c, logits, apply: logits + apply(c)))


def test_a_registered_module_takes_its_place_in_fedcp(variant):
    algo, gs = tiny_fedcp(lam=0.0, cpn_train_gumbel=False)
    assert set(algo.own) == {"pbias", "cbias"} and algo.sync.prefixes == ("cpn.", "vproj.", "cpng.", "pbias.")
    assert {"pbias.weight", "pbias.bias"} <= set(gs) and not any(k.startswith("cbias.") for k in gs)
    assert [m.name for m in algo.policy.extra] == ["pbias", "cbias"] and set(algo.received) == {"pbias"}
    state = algo.init_client_state(0)
    assert torch.equal(state["cbias.bias"], torch.zeros(6))  # a client's own module starts as built

    # the policy's pair logits: the CPN's plus the module's share (received values, as evaluated)
    data = tiny_data()
    x, _ = data.train_batch(torch.arange(4))
    step = Step(x, None, algo.eval_modules, {"v": state["v"]}, torch.Generator().manual_seed(0))
    h = step.run("features", x)
    c = algo.vector.policy_input(step, h)
    want = algo.cpn_g.net(c) + (c @ gs["pbias.weight"].T + gs["pbias.bias"])  # + the client's, zero at first
    assert torch.allclose(algo.policy.logits(step, c), want, atol=1e-6)

    # trained with the CPN and uploaded with it; the client's own module trained and kept, never sent
    res = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(1)))
    assert {"pbias.weight", "pbias.bias"} <= set(res.upload) and not any(k.startswith("cbias.") for k in res.upload)
    assert not torch.equal(res.upload["pbias.bias"], gs["pbias.bias"])
    assert not torch.equal(res.client_state["cbias.bias"], state["cbias.bias"])


def test_a_registered_shared_module_is_frozen_and_kept_home_with_the_policy(variant):
    """A warm-up round trains the policy frozen: the shared module neither moves nor travels."""
    algo, gs = tiny_fedcp(lam=0.0, cpn_train_gumbel=False, cpn_warmup_rounds=1)
    assert algo.skipped_groups(0) == ("policy",) and algo.aggregation_groups(list(gs))["pbias.bias"] == "policy"
    res = algo.local_train(algo.init_client_state(0), tiny_data(), Context(0, 0, torch.Generator().manual_seed(1)))
    assert "pbias.bias" not in res.upload and res.skipped == ()
    assert "pbias.bias" not in algo.frozen_phase.trainable and "pbias.bias" in algo.train_phase.trainable
