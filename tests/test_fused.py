"""Fused multi-client training (fused=true) gives what training each client alone gives.

Clients of unequal sizes: one smaller than a batch, one with a ragged last batch, one an exact
multiple of B, trained with fewer slots than clients too (slots are refilled and compacted).

In float64 the fused and sequential paths agree to ~1e-14: the same batches, noise, masking and
updates. In float32 they differ by rounding (other kernels: grouped, channels-last), and a
rounding difference can now and then put a pre-activation on the other side of a ReLU's kink,
after which the trajectories drift apart by more than rounding; the float32 checks therefore use
well-conditioned settings, and the end-to-end run a relative tolerance.
"""
import json

import pytest
import torch
from torch import nn

from fedcp_dist.fused import slots as fused
from fedcp_dist.fused import step as fused_step
from fedcp_dist.fused import memory as fused_memory
from fedcp_dist.algorithms import ALGORITHMS
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.algorithms.ditto import Ditto
from fedcp_dist.algorithms.fedamp import FedAMP
from fedcp_dist.algorithms.fedcp import FedCP
from fedcp_dist.algorithms.fedfomo import FedFomo
from fedcp_dist.algorithms.fedper import FedPer
from fedcp_dist.algorithms.fedphp import FedPHP
from fedcp_dist.algorithms.fedprox import FedProx
from fedcp_dist.algorithms.fedrod import FedRoD
from fedcp_dist.config import Config, load_config
from fedcp_dist.fused import groups as fused_groups
from fedcp_dist.fused.groups import train_group
from fedcp_dist.local_train import batch_indices, num_batches
from fedcp_dist.losses import grouped_mmd2, mmd2
from fedcp_dist.models import build_model
from fedcp_dist.runtime import init_runtime
from fedcp_dist.engine.simulator import Simulator
from helpers import algo_with_moved_global as _algo
from helpers import random_client as _client

CPU = torch.device("cpu")
ATOL = 1e-5
#: train sizes with B = 10: a ragged last batch (23 = 2·10 + 3), fewer than one batch (7),
#: an exact multiple (40), ragged again (31)
SIZES = (23, 7, 40, 31)


@pytest.fixture
def fused_calls(monkeypatch):
    """How many clients fused.train_fused trained, per phase name: proof that the fused path ran."""
    calls = {}
    real = fused.train_fused

    def spy(clients, phase, **kw):
        calls[phase.name] = calls.get(phase.name, 0) + len(clients)
        return real(clients, phase, **kw)

    monkeypatch.setattr(fused, "train_fused", spy)
    return calls


def _items(algo, datas, seed=11):
    """(client_state, data, ctx) per client, each with a fresh generator seeded per client."""
    items = []
    for d in datas:
        state = algo.init_client_state(d.cid)
        if state is not None and "v" in state:  # FedCP: a different client vector per client
            state = {**state, "v": state["v"] + 0.1 * d.cid}
        items.append((state, d, Context(3, d.cid, torch.Generator().manual_seed(seed + d.cid))))
    return items


def _sequential(algo, items):
    return [algo.local_train(s, d, Context(c.round, c.client, torch.Generator().manual_seed(c.generator.initial_seed())))
            for s, d, c in items]


def _assert_close(a: dict, b: dict, atol=ATOL):
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert b[k].is_contiguous(), k
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k}: {(a[k] - b[k]).abs().max():.3g}"


def _assert_same_results(seq, fus, gs=None, atol=ATOL):
    assert len(seq) == len(fus)
    for s, f in zip(seq, fus):
        assert f.samples == s.samples
        assert f.loss_sum == pytest.approx(s.loss_sum, rel=1e-5, abs=1e-6)
        _assert_close(s.upload, f.upload, atol)
        if s.client_state is None:
            assert f.client_state is None
        else:
            _assert_close(s.client_state, f.client_state, atol)
        if gs is not None and s.samples:
            # training moved the model: the comparison is not between two untouched copies
            assert any((s.upload[k] - gs[k]).abs().max() > 1e-3 for k in s.upload)


def test_step_counts_match_batch_indices():
    for n in (0, 1, 7, 10, 23, 40):
        for drop_last in (False, True):
            for epochs in (1, 2):
                got = list(batch_indices(n, 10, epochs, drop_last, torch.Generator().manual_seed(0)))
                assert num_batches(n, 10, epochs, drop_last) == len(got)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 8])
def test_fedavg_fused_equals_sequential_in_float64(monkeypatch, float64, drop_last, slots, fused_calls):
    monkeypatch.setattr(fused_memory, "CPU_SLOTS", slots)
    algo, gs = _algo(FedAvg, shape=(1, 16, 16), drop_last=drop_last, local_epochs=2)
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES)]
    items = _items(algo, datas)
    fus = train_group(algo, items)
    assert fused_calls == {"train": len(SIZES)}
    seq = _sequential(algo, items)
    _assert_same_results(seq, fus, gs, atol=1e-12)
    assert [r.samples for r in seq] == [2 * (n - n % 10 if drop_last and n >= 10 else n) for n in SIZES]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("slots,features", [(1, False), (2, False), (8, False), (2, True)])
def test_fedcp_fused_equals_sequential_in_float64(monkeypatch, float64, drop_last, slots, features, fused_calls):
    """Gumbel noise, MMD and two epochs: each client's generator is consumed as in the sequential
    loop. With selection_vector=features, each client's mean feature over every sample it trained
    on (ragged and padded batches, a client of 7 samples) is the same fused as alone too, and an
    unprobed round's results carry no tallies."""
    monkeypatch.setattr(fused_memory, "CPU_SLOTS", slots)
    select = {"client_selection": "feature_difference", "selection_vector": "features"} if features else {}
    algo, gs = _algo(FedCP, shape=(1, 16, 16), drop_last=drop_last, local_epochs=2, lam=5.0, lr=0.01,
                     cpn_train_gumbel=True, **select)
    assert algo.fused_reason() is None
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES)]
    items = _items(algo, datas)
    fus = train_group(algo, items)
    assert fused_calls == {"train": len(SIZES)}
    seq = _sequential(algo, items)
    _assert_same_results(seq, fus, gs, atol=1e-12)
    for r in fus:
        assert set(r.client_state) == {"head.weight", "head.bias", "v"} | ({"fmean"} if features else set())
        assert torch.equal(r.client_state["v"], r.client_state["head.weight"].sum(0))
        if features:
            assert r.client_state["fmean"].shape == (algo.K,) and r.client_state["fmean"].abs().sum() > 0
    if features:  # not probed: neither the feature sums nor the probe's Σ s̄ reach the results
        assert all(r.tallies == {} for r in fus + seq)


@pytest.mark.parametrize("drop_last", [False, True])
def test_fedavg_fused_equals_sequential_in_float32(drop_last):
    algo, gs = _algo(FedAvg, drop_last=drop_last, local_epochs=2)
    items = _items(algo, [_client(i, n) for i, n in enumerate(SIZES)])
    _assert_same_results(_sequential(algo, items), train_group(algo, items), gs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_fedcp_fused_equals_sequential_in_float32(drop_last):
    algo, gs = _algo(FedCP, drop_last=drop_last, local_epochs=2, lam=0.5, cpn_train_gumbel=True)
    items = _items(algo, [_client(i, n) for i, n in enumerate(SIZES)])
    _assert_same_results(_sequential(algo, items), train_group(algo, items), gs)


def test_fedcp_fused_uses_each_clients_own_noise():
    """Swapping two clients' generators changes both results (the equality checks above are not
    blind to the noise): each client's Gumbel noise and batches come from its own stream."""
    algo, _ = _algo(FedCP, lam=0.0, cpn_train_gumbel=True)
    datas = [_client(i, 20) for i in range(2)]
    items = _items(algo, datas)
    fus = train_group(algo, items)
    swapped = [(s, d, Context(3, d.cid, torch.Generator().manual_seed(11 + 1 - d.cid))) for s, d, _ in items]
    other = train_group(algo, swapped)
    for a, b in zip(fus, other):
        assert abs(a.loss_sum - b.loss_sum) > 1e-3
        assert max((a.upload[k] - b.upload[k]).abs().max() for k in a.upload) > 1e-5


def test_grouped_mmd_is_the_mmd_of_the_real_rows():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 6, 5, generator=g), torch.randn(3, 6, 5, generator=g)
    counts = [6, 2, 4]
    mask = torch.tensor([[1.0] * c + [0.0] * (6 - c) for c in counts])
    got = grouped_mmd2(x, y, mask, mask.sum(1))
    want = torch.stack([mmd2(x[i, :c], y[i, :c]) for i, c in enumerate(counts)])
    assert torch.allclose(got, want, atol=1e-6)
    assert got[1] != pytest.approx(float(mmd2(x[1], y[1])), abs=1e-3)  # the padding is really left out


@pytest.mark.parametrize("cls, kw, phases", [
    (FedProx, {"prox_mu": 1.0}, {"prox"}),
    (Ditto, {"ditto_lam": 0.5, "ditto_epochs": 2}, {"train", "personal"}),
    (FedPer, {}, {"train"}),
    (FedRoD, {}, {"rod"}),
    (FedPHP, {"fedphp_lam": 0.5}, {"php"}),
    (FedCP, {"cpn_input": "sample"}, {"train"}),
    (FedCP, {"fedcp_cpn": False, "fedcp_global_head": False}, {"train"}),
])
def test_every_sgd_method_trains_fused_as_sequentially(float64, cls, kw, phases, fused_calls):
    """Methods whose objective adds terms (proximal, balanced softmax, MMD to a per-client frozen
    model, policy variants) train through the fused path and give the sequential results."""
    algo, gs = _algo(cls, shape=(1, 16, 16), local_epochs=2, **kw)
    assert algo.fused_reason() is None
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES[:3])]
    items = _items(algo, datas)
    got = train_group(algo, items)
    assert set(fused_calls) == phases and all(n == 3 for n in fused_calls.values())
    _assert_same_results(_sequential(algo, items), got, gs, atol=1e-12)


def test_fedprox_term_changes_the_fused_result(fused_calls):
    algo, gs = _algo(FedProx, prox_mu=1.0)
    datas = [_client(i, n) for i, n in enumerate(SIZES[:3])]
    got = train_group(algo, _items(algo, datas))
    plain, _ = _algo(FedAvg)
    fedavg = train_group(plain, _items(plain, datas))
    # the proximal term changes the result: FedProx's own objective was trained fused
    assert any((got[0].upload[k] - fedavg[0].upload[k]).abs().max() > 1e-4 for k in got[0].upload)
    assert fused_calls == {"prox": 3, "train": 3}


def test_peer_methods_train_fused_as_sequentially(float64, fused_calls):
    """FedAMP's anchor u_i and FedFomo's mixed start and held-out rows are per client."""
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES[:3])]
    for cls in (FedAMP, FedFomo):
        torch.manual_seed(0)
        cfg = Config(lr=0.05, batch_size=10, fedamp_sigma=50.0, fedfomo_eps=0.0)
        cfg.data.num_clients = len(datas)
        algo = cls(cfg, build_model("cnn", (1, 16, 16), 10), CPU)
        algo.num_clients = len(datas)
        gs = algo.init_global_state()
        peers = {c: algo.flat(algo.init_client_state(c)) + 0.01 * (c + 1) for c in range(len(datas))}
        gs = algo.receive_peers(0, gs, {c: torch.cat([p, torch.zeros(algo.peer_dim - p.numel())]) for c, p in peers.items()})
        algo.set_global(gs)
        items = _items(algo, datas)
        got = train_group(algo, items)
        seq = _sequential(algo, items)
        for s_, f in zip(seq, got):
            _assert_close(s_.client_state, f.client_state, 1e-12)
            assert torch.allclose(s_.extra["peer"], f.extra["peer"], atol=1e-12, rtol=0)
    assert fused_calls == {"attentive": 3, "train": 3}


def test_fedcp_variant_trains_its_own_objective_fused():
    algo, gs = _algo(FedCP, cpn_input="sample")
    datas = [_client(i, n) for i, n in enumerate(SIZES[:3])]
    items = _items(algo, datas)
    got = train_group(algo, items)
    _assert_same_results(_sequential(algo, items), got, gs)
    plain, _ = _algo(FedCP)
    fedcp = train_group(plain, _items(plain, datas))
    assert (got[0].upload["cpn.net.0.weight"] - fedcp[0].upload["cpn.net.0.weight"]).abs().max() > 1e-4


class Scale(nn.Module):
    """A layer the grouped interpreter does not know: it runs through vmap."""

    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x * self.gain


class Odd(nn.Module):
    """A model whose forward is not head(features(x)) (a skip connection around the head)."""

    def __init__(self, with_bn=False):
        super().__init__()
        self.feature_dim = 6
        norm = nn.BatchNorm1d(6) if with_bn else nn.Identity()
        self.features = nn.Sequential(nn.Conv2d(1, 3, 3, stride=2), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten(),
                                      nn.Linear(3 * 6 * 6, 6), norm, Scale(6), nn.LayerNorm(6))
        self.head = nn.Linear(6, 6)

    def forward(self, x):
        h = self.features(x)
        return self.head(h) + h


def test_vmapped_modules_and_unsplit_models_match_sequential():
    algo, gs = _algo(FedAvg, net=Odd(), fused=True)
    datas = [_client(i, n, classes=6) for i, n in enumerate(SIZES)]
    items = _items(algo, datas)
    got = train_group(algo, items)
    assert fused_step._SPLIT_CACHE[algo.model] is False  # the whole model ran through vmap
    _assert_same_results(_sequential(algo, items), got, gs)
    algo.cfg.fused_workers = 2  # two threads sharing the module that functional_call reparametrises
    _assert_same_results(_sequential(algo, items), train_group(algo, _items(algo, datas)), gs)

    algo, gs = _algo(FedCP, net=Odd(), fused=True)  # FedCP uses features and head separately
    items = _items(algo, datas)
    _assert_same_results(_sequential(algo, items), train_group(algo, items), gs)


def test_batchnorm_is_not_fused_and_says_why():
    algo, _ = _algo(FedAvg, net=Odd(with_bn=True), fused=True)
    assert algo.fused_reason() == "BatchNorm1d layers are not fused"
    plain, _ = _algo(FedAvg, net=Odd(), fused=True)
    assert plain.fused_reason() is None


def test_memory_plan_and_slots_follow_the_device_not_its_free_memory(monkeypatch, fused_calls):
    algo, _ = _algo(FedCP)
    datas = [_client(i, n) for i, n in enumerate(SIZES)]
    items = _items(algo, datas)
    plan = fused_groups.memory_plan(algo, algo.phases(*items[0]), datas)
    params = fused_step.param_count(algo.fe, algo.cpn, algo.head_p)
    act = fused_groups.activation_counts(algo)["train"]
    # stacked parameters and their gradients, the client vector, and the activations of B samples
    assert plan.per_slot == 4 * (2 * params + algo.K) + fused_memory.ACTIVATION_COPIES * 4 * algo.cfg.batch_size * act
    assert plan.per_result == 4 * (params + algo.K)
    # one sample through the CNN, the CPN and the head: conv 32·24·24, relu, pool 32·12·12, conv 64·8·8,
    # relu, pool 64·4·4, flatten 1024, linear 512, relu 512 | linear 1024, layernorm 1024, relu 1024 | head 10
    assert act == 2 * 32 * 24 * 24 + 32 * 12 * 12 + 2 * 64 * 8 * 8 + 64 * 4 * 4 + 1024 + 2 * 512 + 3 * 1024 + 10
    monkeypatch.setattr(fused_memory, "total_memory", lambda device: 1 << 40)
    assert fused_groups.group_slots(plan, CPU) == fused_memory.CPU_SLOTS
    # the free memory of the moment does not change the slots (they change a client's rounding)
    monkeypatch.setattr(fused_memory, "available_memory", lambda device: 1024)
    assert fused_groups.group_slots(plan, CPU) == fused_memory.CPU_SLOTS
    tight = int((3 * plan.per_slot + 3 * plan.per_result) / fused_memory.MEMORY_FRACTION) + 16
    monkeypatch.setattr(fused_memory, "total_memory", lambda device: tight)
    assert fused_groups.group_slots(plan, CPU) == 3
    got = train_group(algo, items)  # 3 slots for 4 clients: one waits for a free slot
    assert fused_calls == {"train": len(datas)}
    _assert_same_results(_sequential(algo, items), got)
    monkeypatch.setattr(fused_memory, "total_memory", lambda device: 1024)
    assert fused_groups.group_slots(plan, CPU) == 1


def test_group_size_is_a_function_of_the_config():
    """fused_group=auto: about the device kind's slot cap over the mean participation rate of
    participants a group, in a power-of-two number of groups of ⌈N / G⌉; the free memory of a rank
    and the world size play no part."""
    cuda, size = torch.device("cuda"), fused_groups.group_size
    assert fused_memory.CPU_SLOTS == 8
    # ρ = 1 on a CPU: ⌈N / 8⌉ groups rounded up to a power of two
    assert [size(Config(), CPU, n) for n in (1, 6, 8, 9, 16, 17, 20, 1000)] == [1, 6, 8, 5, 8, 5, 5, 8]
    # on a GPU at least GPU_SPREAD = 8 groups: the paper's 20 clients in groups of 3
    assert fused_groups.GPU_SPREAD == 8
    assert [size(Config(), cuda, n) for n in (1, 6, 20, 64, 2048, 2049)] == [1, 1, 3, 8, 256, 129]
    assert size(Config(participation=0.5), CPU, 20) == 10  # 16 a group: 2 groups
    assert size(Config(participation=0.3), CPU, 100) == 25  # ⌈1/0.3⌉ = 4: 32 a group, ⌈100/32⌉ = 4 groups
    assert size(Config(participation_range=[0.2, 0.6]), CPU, 100) == 13  # mean 0.4: 24 a group, 5 → 8 groups
    assert size(Config(fused_group=5, participation=0.1), cuda, 1000) == 5


def test_auto_groups_on_a_gpu_keep_a_node_of_8_busy():
    """fused_group=auto under the GPU rule: the paper's 20 clients (MNIST Dir(0.1) step counts) form
    7 groups, which whole-group placement spreads over 7 of 8 ranks; on 1 rank all 7 are its own.
    The groups are the same for every world size (a function of the config and the shard)."""
    from fedcp_dist.state.placement import form_groups, place_groups

    steps = [68, 500, 120, 90, 310, 75, 410, 150, 200, 95, 88, 260, 130, 70, 99, 180, 77, 240, 110, 86]
    groups = form_groups(steps, fused_groups.group_size(Config(), torch.device("cuda"), len(steps)))
    assert len(groups) == 7 and max(len(g) for g in groups) == 3
    assert sorted(int(c) for g in groups for c in g) == list(range(20))
    busy = {int(r) for r in place_groups(steps, groups, 8)}
    assert len(busy) >= 7
    assert set(place_groups(steps, groups, 1).tolist()) == {0}
    assert fused_groups.trains_jointly(Config(), torch.device("cuda"))
    assert not fused_groups.trains_jointly(Config(), CPU)
    assert fused_groups.trains_jointly(Config(fused_join=True), CPU)


def test_joint_training_of_a_ranks_groups(float64, monkeypatch):
    """fused_join=true: a rank's groups of a round train as one set of slots (one fused call for
    both groups, where each group alone takes one), each client's result the one its group alone
    gives (float64: to 1e-12; on a GPU bit for bit, which bench/gpu.sh checks) and the sequential
    result."""
    algo, gs = _algo(FedCP, shape=(1, 16, 16), drop_last=False, local_epochs=2, lam=0.5, cpn_train_gumbel=True)
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES)]
    groups = [[0, 2], [1, 3]]
    calls = []
    real = fused.train_fused
    monkeypatch.setattr(fused, "train_fused", lambda clients, phase, **kw: calls.append(len(clients)) or real(clients, phase, **kw))
    apart = _group_results(algo, gs, datas, groups)
    assert calls == [2, 2]
    calls.clear()
    algo.cfg.fused_join = True
    joint = _group_results(algo, gs, datas, groups)
    assert calls == [4]
    seq = dict(zip(range(len(SIZES)), _sequential(algo, _items(algo, datas))))
    order = sorted(joint)
    _assert_same_results([apart[c] for c in order], [joint[c] for c in order], atol=1e-12)
    _assert_same_results([seq[c] for c in order], [joint[c] for c in order], gs, atol=1e-12)


@pytest.mark.parametrize("cls", [FedAvg, FedCP, FedProx])
def test_amp_bf16_on_cpu(cls, capsys):
    """amp=bf16 autocasts on a CPU too: results move by bf16 rounding (not bit-equal to float32,
    but close), parameters stay float32, fused and sequential agree to the same tolerance, and a
    CPU without bf16 units gets one notice."""
    import fedcp_dist.local_train as lt

    lt._amp_cpu_noted = False
    datas = [_client(i, n) for i, n in enumerate(SIZES)]
    a16, _ = _algo(cls, amp="bf16")
    a32, gs = _algo(cls)
    fused16 = train_group(a16, _items(a16, datas))
    seq16 = _sequential(a16, _items(a16, datas))
    fused32 = train_group(a32, _items(a32, datas))
    out = capsys.readouterr().out

    def flat(upload):
        return torch.cat([upload[k].flatten() for k in gs])

    assert out.count("amp=bf16 on a CPU without native bf16 units") == (0 if lt.cpu_has_native_bf16() else 1)
    for f16, s16, f32 in zip(fused16, seq16, fused32):
        assert f16.samples == f32.samples
        assert f16.loss_sum != f32.loss_sum  # bf16 products really ran
        assert f16.loss_sum == pytest.approx(f32.loss_sum, rel=2e-2)
        assert s16.loss_sum == pytest.approx(f16.loss_sum, rel=2e-2)
        assert all(t.dtype == torch.float32 for t in f16.upload.values())
        moved = (flat(f32.upload) - flat(gs)).norm()  # how far training moved the model
        # bf16 products perturb the few steps here by about a tenth of what they move the model
        assert (flat(f16.upload) - flat(f32.upload)).norm() < 0.25 * moved
        assert (flat(f16.upload) - flat(s16.upload)).norm() < 0.25 * moved


def _run(shard, out, fused_on, method="fedcp", said=None):
    """One round; ``fused_on`` None leaves ``fused`` at its default (auto)."""
    cfg = load_config("configs/digits_fedcp.yaml", [
        f"method={method}", "rounds=1", "eval_every=1", "lr=0.005", f"data.path={shard}", "data.num_clients=0",
        f"out_dir={out}", "fused_group=4", "checkpoint_every=0",
        *([] if fused_on is None else [f"fused={'true' if fused_on else 'false'}"])])
    rt = init_runtime("cpu", 0, env={})
    try:
        return Simulator(cfg, rt, echo=said.append if said is not None else lambda *_: None).run()
    finally:
        rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedcp", "fedavg", "ditto"])
def test_end_to_end_fused_run_equals_sequential_run(digits6, tmp_path, method):
    """One round, 6 clients in fused groups of 4 and 2 (the default, fused=auto): the same model
    within float32 drift (measured: 2e-4 (FedAvg) and 5e-4 (FedCP) of each tensor's largest entry,
    the same as a 2-ulp random perturbation of the initial model gives FedCP)."""
    seq = _run(digits6, tmp_path / "seq", False, method)
    said = []
    fus = _run(digits6, tmp_path / "fus", None, method, said)
    assert any("training: fused (fused=auto, groups of 4" in line for line in said), said
    a = torch.load(tmp_path / "seq" / "final_global.pt")
    b = torch.load(tmp_path / "fus" / "final_global.pt")
    assert list(a) == list(b)
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 5e-3 * a[k].abs().max(), k
    assert any(not torch.equal(a[k], b[k]) for k in a)  # other kernels ran: the fused path was taken
    rounds = [[json.loads(l) for l in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("seq", "fus")]
    assert len(rounds[0]) == len(rounds[1]) == 2  # the round and the final evaluation
    for ra, rb in zip(*rounds):
        if "train_loss" in ra:
            assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-3)
        if "acc" in ra:
            assert rb["acc"] == pytest.approx(ra["acc"], abs=0.01)
    assert fus["final_acc"] == pytest.approx(seq["final_acc"], abs=0.01)


@pytest.mark.parametrize("name", ["perfedavg", "pfedme", "fedrep"])
def test_amp_bf16_reaches_the_methods_with_their_own_loop(name):
    """Per-FedAvg's meta step, pFedMe's inner steps and FedRep's two phases run under amp too:
    bf16 moves the result by rounding, not by a different computation."""
    from fedcp_dist.algorithms import ALGORITHMS

    datas = [_client(i, n) for i, n in enumerate(SIZES[:2])]
    a16, _ = _algo(ALGORITHMS[name], amp="bf16", pfedme_k=2, fedrep_head_epochs=1)
    a32, gs = _algo(ALGORITHMS[name], pfedme_k=2, fedrep_head_epochs=1)
    assert a16.fused_reason() == a16.own_loop and a16.own_loop
    for r16, r32 in zip(_sequential(a16, _items(a16, datas)), _sequential(a32, _items(a32, datas))):
        assert r16.loss_sum != r32.loss_sum
        assert r16.loss_sum == pytest.approx(r32.loss_sum, rel=2e-2)
        moved = max((r32.upload[k] - gs[k]).abs().max() for k in r32.upload)
        assert max((r16.upload[k] - r32.upload[k]).abs().max() for k in r32.upload) < 0.5 * moved


# -- fused=auto, the default ------------------------------------------------------------------------

#: every method that trains fused, and the test above that checks it against the sequential path
#: (float64, to ~1e-12): a method that starts to fuse must be added to one of them
def _registered_algo(name: str, clients: int):
    """The registered method ``name`` at its declared defaults (and its digits preset's departures) on
    a 16 x 16 CNN, with a received global state that differs from its initial one (a peer-exchanging
    method: every client's model in its bank, moved alike)."""
    from fedcp_dist.capabilities import PeerExchange, supports

    cls = ALGORITHMS[name]
    cfg = Config(method=name, lr=0.05, batch_size=10, local_epochs=2,
                 **{k: v for k, (v, _) in cls.digits_preset.items()})
    cfg.data.num_clients = clients
    torch.manual_seed(0)
    algo = cls(cfg, build_model("cnn", (1, 16, 16), 10), CPU)
    algo.num_clients = clients
    g = torch.Generator().manual_seed(7)
    gs = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in algo.init_global_state().items()}
    if supports(algo, PeerExchange):
        gs = algo.receive_peers(0, gs, {c: 0.01 * torch.randn(algo.peer_dim, generator=g) for c in range(clients)})
    algo.set_global(gs)
    return algo, gs


@pytest.mark.parametrize("name", [m for m in ALGORITHMS if ALGORITHMS[m].own_loop is None])
def test_every_registered_method_trains_fused_as_sequentially_at_its_defaults(float64, name, fused_calls):
    """Every method that fuses (a new one too, with nothing to add here) gives the sequential
    results on the fused path at its declared defaults: float64, unequal clients, two epochs."""
    algo, gs = _registered_algo(name, 3)
    assert algo.fused_reason() is None
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES[:3])]
    items = _items(algo, datas)
    got = train_group(algo, items)
    assert fused_calls and all(n == 3 for n in fused_calls.values())  # every phase trained fused
    seq = _sequential(algo, items)
    _assert_same_results(seq, got, gs if seq[0].upload else None, atol=1e-12)
    for s, f in zip(seq, got):  # what a peer exchange shares
        for k in set(s.extra) & {"peer"}:
            assert torch.allclose(s.extra[k], f.extra[k], atol=1e-12, rtol=0)


@pytest.fixture
def one_thread():
    """A rank of one thread (an in-process run before may have left the process with more)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_fused_auto_is_the_default_and_falls_back_where_it_cannot(one_thread):
    from fedcp_dist.algorithms import ALGORITHMS, make_algorithm
    from fedcp_dist.errors import UserError
    from fedcp_dist.engine.startup import training_path

    assert Config().fused == "auto"
    fusing = set()
    for name in ALGORITHMS:
        torch.manual_seed(0)
        cfg = Config(method=name)
        cfg.data.num_clients = 2
        algo = make_algorithm(name, cfg, build_model("cnn", (1, 16, 16), 10), CPU)
        why = algo.fused_reason()
        if why is None:
            fusing.add(name)
            assert training_path(cfg, algo, False) == (True, "fused (fused=auto, groups of 2 "
                                                              "(fused_group=auto))")
            cfg.fused_group = 3
            assert training_path(cfg, algo, False) == (True, "fused (fused=auto, groups of 3)")
        else:
            assert training_path(cfg, algo, False) == (False, f"sequential (fused=auto: {why})")
            cfg.fused = True
            assert training_path(cfg, algo, False) == (False, f"sequential (fused=true not used: {why})")
        cfg.fused = "auto"  # per-client BatchNorm statistics keep every method sequential
        assert training_path(cfg, algo, True) == (False, "sequential (fused=auto: per-client BatchNorm statistics)")
        cfg.fused = False
        assert training_path(cfg, algo, False) == (False, "sequential (fused=false)")
    # a method that does not fuse says why (its own loop); every one that does is held to the
    # sequential path by test_every_registered_method_trains_fused_as_sequentially_at_its_defaults
    assert all(ALGORITHMS[m].own_loop for m in set(ALGORITHMS) - fusing)
    # a BatchNorm model falls back for every method
    algo, _ = _algo(FedAvg, net=Odd(with_bn=True))
    assert training_path(algo.cfg, algo, False) == (False, "sequential (fused=auto: BatchNorm1d layers are not fused)")
    for value, ok in [("auto", True), (True, True), (False, True), ("yes please", False), ("true", False)]:
        if ok:
            assert load_config(None, [f"fused={str(value).lower()}"], validate=False).fused == value
        else:
            with pytest.raises(UserError, match="config key 'fused': must be auto, true or false"):
                Config(fused=value).validate()


@pytest.mark.slow
def test_fused_default_resumes_bit_for_bit(digits6, tmp_path):
    """The default path (fused groups) is deterministic on one world size: 2 rounds straight equal
    1 round, a checkpoint, and a resumed second round, bit for bit."""
    from fedcp_dist.errors import RunFailure
    from helpers import nonfinite_at

    def run(out, said=None, wrap=None):
        cfg = load_config("configs/digits_fedcp.yaml", [
            f"data.path={digits6}", f"out_dir={out}", "rounds=2", "eval_every=2", "checkpoint_every=1", "threads=1"])
        rt = init_runtime("cpu", 1, env={})
        try:
            Simulator(cfg, rt, echo=said.append if said is not None else lambda *_: None, wrap=wrap).run()
        finally:
            rt.close()
        return torch.load(out / "final_global.pt", weights_only=True)

    said = []
    straight = run(tmp_path / "straight", said)
    assert any("training: fused (fused=auto" in line for line in said), said
    with pytest.raises(RunFailure, match="round 2: client 1 produced a non-finite"):
        run(tmp_path / "resumed", wrap=nonfinite_at("2:1"))  # stops in round 2, the checkpoint of round 1 kept
    said = []
    resumed = run(tmp_path / "resumed", said)
    assert any("resuming from" in line for line in said)
    assert list(straight) == list(resumed)
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_workers_for_counts_groups():
    assert fused_groups.workers_for("auto", CPU, 2, 20) == 2
    assert fused_groups.workers_for("auto", CPU, 4, 3) == 3  # never more workers than groups
    assert fused_groups.workers_for("auto", CPU, 2, 1) == 1
    assert fused_groups.workers_for(1, CPU, 2, 20) == 1
    assert fused_groups.workers_for(3, CPU, 1, 20) == 3
    assert fused_groups.workers_for("auto", torch.device("cuda"), 8, 20) == 1


def _group_results(algo, gs, datas, groups):
    """{client: LocalResult} of the engine's GroupTrainer over ``groups`` (one round, all taking
    part) with the global state ``gs``."""
    from fedcp_dist.state.client_store import ClientStore

    store = ClientStore(algo, gs)
    items = {d.cid: it for d, it in zip(datas, _items(algo, datas))}
    trainer = fused_groups.GroupTrainer(algo.cfg, algo, store, {d.cid: d for d in datas}, groups, CPU)
    ctx = {c: it[2] for c, it in items.items()}
    for c, it in items.items():
        store.states[c] = it[0]
    return dict(trainer.results(trainer.round_groups(sorted(items)), lambda c: ctx[c]))


@pytest.mark.parametrize("cls, kw", [(FedCP, {"lam": 0.5, "cpn_train_gumbel": True}), (FedProx, {"prox_mu": 0.1})])
def test_fused_workers_train_whole_groups_side_by_side(float64, monkeypatch, cls, kw, fused_calls):
    """fused_workers=2: the rank's groups train two at a time in two threads; each group is the
    same fused group as with one worker (float64: equal to 1e-13, and to the sequential result to
    1e-12), the threads' count is restored, and with too little free memory for two groups at
    once they train one after the other, with the same results."""
    algo, gs = _algo(cls, shape=(1, 16, 16), drop_last=False, local_epochs=2, **kw)
    datas = [_client(i, n, shape=(1, 16, 16), double=True) for i, n in enumerate(SIZES)]
    groups = [[0, 2], [1, 3]]
    seen = []
    real = fused_groups.run_in_workers
    monkeypatch.setattr(fused_groups, "run_in_workers", lambda jobs, *a: seen.append(len(jobs)) or real(jobs, *a))
    threads = torch.get_num_threads()
    algo.cfg.fused_workers = 1
    one = _group_results(algo, gs, datas, groups)
    assert seen == [1, 1]
    algo.cfg.fused_workers = 2
    seen.clear()
    two = _group_results(algo, gs, datas, groups)
    assert seen == [2] and torch.get_num_threads() == threads
    assert list(fused_calls.values()) == [2 * len(SIZES)]  # both runs fused every client
    seq = dict(zip(range(len(SIZES)), _sequential(algo, _items(algo, datas))))
    order = sorted(two)
    _assert_same_results([seq[c] for c in order], [two[c] for c in order], gs, atol=1e-12)
    _assert_same_results([one[c] for c in order], [two[c] for c in order], atol=1e-13)
    seen.clear()
    monkeypatch.setattr(fused_memory, "available_memory", lambda device: 1024)
    short = _group_results(algo, gs, datas, groups)
    assert seen == [1, 1]
    _assert_same_results([two[c] for c in order], [short[c] for c in order], atol=0)


def test_a_clients_result_depends_only_on_its_group(monkeypatch):
    """The groups fix what a client is trained with: the same group gives the same bits whether the
    rank holds other groups or not, and whichever order the rank's groups train in."""
    algo, gs = _algo(FedCP, lam=0.5, cpn_train_gumbel=True)
    sizes = (23, 7, 40, 31, 15, 52)
    datas = [_client(i, n) for i, n in enumerate(sizes)]
    alone = _group_results(algo, gs, datas[:3], [[0, 1, 2]])
    with_others = _group_results(algo, gs, datas, [[3, 4, 5], [0, 1, 2]])
    for c in (0, 1, 2):
        for k in alone[c].upload:
            assert torch.equal(alone[c].upload[k], with_others[c].upload[k]), (c, k)


@pytest.mark.parametrize("group, shard", [("0", "digits20"), ("2", "digits6"), ("2", "digits20")])
def test_disk_store_holds_the_states_of_a_group_not_of_the_cohort(monkeypatch, request, tmp_path, group, shard):
    """client_state=disk on the default (fused) path: a group's states are read when it trains and
    written back before the next group's are read, so the states held for training at once (read,
    not yet written back: count and MiB) are bounded by the group size, whatever the cohort: groups
    of 2 hold 2 of the 6 and of the 20 clients; auto (4 groups of 5 for 20 clients) holds 5 of 20."""
    from fedcp_dist.state.disk_store import DiskClientStore
    from fedcp_dist.state.process_memory import state_bytes
    from fedcp_dist.engine.training import CohortTrainer

    held, peak, training = {}, {"states": 0, "bytes": 0}, []
    get, put, train = DiskClientStore.get, DiskClientStore.put, CohortTrainer.train

    def spy_get(self, cid):
        state = get(self, cid)
        if training:  # (evaluation reads a state and lets it go)
            held[cid] = state_bytes(state)
            peak["states"] = max(peak["states"], len(held))
            peak["bytes"] = max(peak["bytes"], sum(held.values()))
        return state

    def spy_put(self, cid, *args, **kw):
        held.pop(cid, None)
        return put(self, cid, *args, **kw)

    def spy_train(self, *args):
        training.append(1)
        try:
            return train(self, *args)
        finally:
            training.clear()
            assert not held  # every state read for training was written back

    monkeypatch.setattr(DiskClientStore, "get", spy_get)
    monkeypatch.setattr(DiskClientStore, "put", spy_put)
    monkeypatch.setattr(CohortTrainer, "train", spy_train)
    path = request.getfixturevalue(shard)
    said = []
    cfg = load_config("configs/digits_fedcp.yaml", [
        "rounds=2", "eval_every=2", f"data.path={path}", f"out_dir={tmp_path}", "client_state=disk", "threads=1",
        "checkpoint_every=0", "record_memory=true", f"fused_group={group}"])
    rt = init_runtime("cpu", 1, env={})
    try:
        Simulator(cfg, rt, echo=said.append).run()
    finally:
        rt.close()
    assert "training: fused (fused=auto" in said[0] and "client states: disk" in said[0], said[0]
    cohort = 6 if shard == "digits6" else 20
    size = int(group) or fused_groups.group_size(cfg, CPU, cohort)
    assert size == (int(group) or 5)
    one = state_bytes(FedCP(cfg, build_model("cnn", (1, 28, 28), 10), CPU).init_client_state(0))
    assert peak["states"] == min(size, cohort)
    assert peak["bytes"] == min(size, cohort) * one
    rounds = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"round"' in l]
    assert all("client_state_held_mb" in r for r in rounds if r.get("kind") == "round")


def test_a_group_trains_on_one_thread_whatever_its_ranks_thread_count():
    """fused_workers=auto: a rank of 2 threads trains even a lone group on one intra-op thread
    (the thread count changes a kernel's rounding), so the group's results are the bits a rank of
    1 thread gets; the rank's thread count is restored."""
    algo, gs = _algo(FedCP, lam=0.5, cpn_train_gumbel=True)
    datas = [_client(i, n) for i, n in enumerate((23, 7, 40))]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _group_results(algo, gs, datas, [[0, 1, 2]])
        torch.set_num_threads(2)
        assert fused_groups.one_thread_each(algo.cfg, CPU, 2)
        two = _group_results(algo, gs, datas, [[0, 1, 2]])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
    for c in one:
        for k in one[c].upload:
            assert torch.equal(one[c].upload[k], two[c].upload[k]), (c, k)
    algo.cfg.fused_workers = 1  # one group at a time on every thread of the rank
    assert not fused_groups.one_thread_each(algo.cfg, CPU, 2)
    assert not fused_groups.one_thread_each(Config(), torch.device("cuda"), 8)


def test_host_memory_without_psutil_reads_proc_meminfo(monkeypatch):
    """Without psutil the host's memory comes from /proc/meminfo (kB there, bytes here)."""
    import sys

    meminfo = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/meminfo")}
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    assert fused_memory.total_memory(CPU) == meminfo["MemTotal"]
    assert abs(fused_memory.available_memory(CPU) - meminfo["MemAvailable"]) < meminfo["MemTotal"] // 20


def test_slot_occupancy_is_the_active_slots_of_every_fused_step(monkeypatch):
    """slot_occupancy gives, step by step, the active slots train_fused runs: by hand for clients
    of 3, 1, 5 and 0 steps with 2 slots (5 and 3 enter; after step 3 the 1-step client takes the
    freed slot), and against a real fused FedAvg group with fewer slots than clients."""
    assert fused.slot_occupancy([3, 1, 5, 0], 2) == [2, 2, 2, 2, 1]
    assert fused.slot_occupancy([3, 1, 5, 0], 8) == [3, 2, 2, 1, 1]
    assert fused.slot_occupancy([0, 0], 4) == []
    seen = []
    real = fused.sgd_step

    def spy(phase, views, batch, *a, **kw):
        seen.append(batch.k)
        return real(phase, views, batch, *a, **kw)

    monkeypatch.setattr(fused, "sgd_step", spy)
    algo, _ = _algo(FedAvg, shape=(1, 16, 16), drop_last=False)
    sizes = (23, 7, 40, 31, 12)  # 3, 1, 4, 4, 2 steps at B = 10
    datas = [_client(c, n, shape=(1, 16, 16)) for c, n in enumerate(sizes)]
    train_group(algo, _items(algo, datas), slots=3)
    steps = [num_batches(n, 10, 1, False) for n in sizes]
    assert seen == fused.slot_occupancy(steps, 3) == [3, 3, 3, 3, 2]
    assert sum(seen) == sum(steps)
