"""The paper's settings: a run on a fixed subset of a shard's clients (data.clients) and the
drop-out study's participant counts (participation_draw)."""
import json
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, run_cmd
from helpers import FakeRuntime
from fedcp_dist.engine import startup
from fedcp_dist.config import load_config
from fedcp_dist.data.shards import read_info
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import STREAM_SUBSET, client_subset, sample_cohort, stream_seed
from fedcp_dist.run import main
from fedcp_dist.runtime import init_runtime
from fedcp_dist.engine.simulator import Simulator

CONFIG = str(REPO / "configs" / "digits_fedcp.yaml")


# ----------------------------------------------------------------------------- the subset


def test_client_subset_is_seeded_sorted_and_of_its_size():
    a = client_subset(10, 1, 50)
    assert a.tolist() == sorted(set(a.tolist())) and len(a) == 10 and 0 <= a.min() and a.max() < 50
    assert np.array_equal(a, client_subset(10, 1, 50))  # drawn once from the seed: the same every time
    assert not np.array_equal(a, client_subset(10, 2, 50))
    # its own stream of the run seed: numpy's choice on that stream, sorted
    rng = np.random.default_rng(stream_seed(1, STREAM_SUBSET))
    assert a.tolist() == sorted(rng.choice(50, size=10, replace=False).tolist())
    assert client_subset(None, 1, 4).tolist() == [0, 1, 2, 3]
    assert client_subset([7, 2, 5], 1, 9).tolist() == [2, 5, 7]
    assert client_subset(50, 3, 50).tolist() == list(range(50))


@pytest.mark.parametrize("value, fragment", [
    ("0", "must be a client count >= 1"),
    ("[]", "must be a non-empty list"),
    ("[1, -2]", "must be a non-empty list of client ids >= 0"),
    ("[1, 3, 1]", "lists client 1 twice"),
    ("[1, x]", "must be a non-empty list"),
    ("true", "expected int or list or null"),
    ("1.5", "expected int or list or null"),
])
def test_bad_subsets_name_the_key(value, fragment, digits6, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", CONFIG, f"data.path={digits6}", f"data.clients={value}", "--print-config"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "'data.clients'" in err and fragment in err, err


def test_a_subset_beyond_the_shard_is_refused(digits6):
    info = read_info(digits6)
    for value, fragment in ((7, "asks for 7 clients but"), ([0, 6], "lists client 6 but")):
        cfg = load_config(CONFIG, [f"data.path={digits6}"])
        cfg.data.clients = value
        with pytest.raises(UserError, match=fragment):
            startup.run_clients(cfg, info)


def test_every_rank_places_the_same_subset(digits20):
    """Start-up on each rank of 1 and 2 ranks: the same 5 of the 20 clients, each loaded by exactly
    one rank, with the shard's data of the client it stands for."""
    cfg = load_config(CONFIG, [f"data.path={digits20}", "data.clients=5", "seed=3"])
    info = read_info(digits20)
    subset = client_subset(5, 3, 20)
    def loaded(rt):
        s = startup.load(cfg, rt)
        startup.load_data(cfg, rt, s, states_on_disk=False)
        return s

    setups = {(w, r): loaded(FakeRuntime(w, r)) for w in (1, 2) for r in range(w)}
    for (w, r), s in setups.items():
        assert s.data_mode == "resident"
        assert s.clients.tolist() == subset.tolist() and s.num_clients == 5
        assert len(s.owner) == 5 and set(s.owner.tolist()) <= set(range(w))
        for k, d in s.data.items():
            shard_id = int(subset[k])
            assert (d.n_train, d.n_test) == (info.train_counts[shard_id], info.test_counts[shard_id])
            assert torch.equal(torch.bincount(d.train_y, minlength=10),
                               torch.as_tensor(info.train_label_counts[shard_id]))
    assert sorted(setups[(1, 0)].owned) == [0, 1, 2, 3, 4]
    assert sorted(setups[(2, 0)].owned + setups[(2, 1)].owned) == [0, 1, 2, 3, 4]
    assert not set(setups[(2, 0)].owned) & set(setups[(2, 1)].owned)


def test_only_the_subset_trains_and_is_evaluated(digits20, tmp_path):
    info = read_info(digits20)
    cfg = load_config(CONFIG, [f"data.path={digits20}", "data.clients=[3, 11, 17]", "rounds=1",
                               "checkpoint_every=0", f"out_dir={tmp_path}", "threads=1"])
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, env={})
    try:
        sim = Simulator(cfg, rt, echo=lambda *_: None)
        ev = sim.evaluate(0)
        # the evaluated clients are the three, with their test samples and none other
        assert ev.clients == 3 and ev.test_samples == sum(int(info.test_counts[c]) for c in (3, 11, 17))
        summary = sim.run()
    finally:
        rt.close()
    assert summary["num_clients"] == 3 and summary["shard_clients"] == [3, 11, 17]
    rounds = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds[0]["participants"] == 3


@pytest.mark.slow
def test_two_ranks_run_the_same_subset(digits20, tmp_path):
    """One torchrun run on 2 ranks against one run on 1 rank: the same subset, trajectory and summary."""
    args = ["--config", CONFIG, f"data.path={digits20}", "data.clients=4", "rounds=2", "threads=1", "fused=false",
            "checkpoint_every=0"]
    r1 = run_cmd([sys.executable, "-m", "fedcp_dist.run", *args, f"out_dir={tmp_path / 'one'}"])
    r2 = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  "-m", "fedcp_dist.run", *args, f"out_dir={tmp_path / 'two'}"])
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr[-2000:] + r2.stderr[-2000:]
    one, two = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert two["world_size"] == 2 and one["shard_clients"] == two["shard_clients"] == client_subset(4, 1, 20).tolist()
    assert one["num_clients"] == two["num_clients"] == 4
    assert one["final_acc"] == pytest.approx(two["final_acc"], abs=1e-9)
    assert "on 4 of the shard's 20 clients" in r1.stdout


# ----------------------------------------------------------------------------- drop-out draws


def test_count_draw_reaches_full_participation():
    """N = 50, ρ ∈ [0.1, 1]: counts uniform over {5 … 50}; every count appears in 2,000 rounds,
    50 (all clients) included, while drawing ρ and flooring never reaches 50."""
    counts = [len(sample_cohort(7, t, 50, 1.0, [0.1, 1.0], "count")) for t in range(2000)]
    assert set(counts) == set(range(5, 51))
    assert sample_cohort(7, next(t for t, c in enumerate(counts) if c == 50), 50, 1.0, [0.1, 1.0],
                         "count").tolist() == list(range(50))
    rho = [len(sample_cohort(7, t, 50, 1.0, [0.1, 1.0])) for t in range(2000)]
    assert max(rho) == 49 and min(rho) == 5
    # N = 10, [0.25, 0.5]: ⌊2.5⌋ = 2 … ⌊5⌋ = 5
    assert {len(sample_cohort(1, t, 10, 1.0, [0.25, 0.5], "count")) for t in range(300)} == {2, 3, 4, 5}
    # a tiny ρ_min still trains one client
    assert min(len(sample_cohort(1, t, 10, 1.0, [0.01, 0.2], "count")) for t in range(300)) == 1


def test_rho_draw_is_todays_draw():
    """The default keeps the stream as it was: ρ ~ U[a, b] from the round's stream, then the choice."""
    for t in range(5):
        rng = np.random.default_rng(stream_seed(3, 1, t))
        m = int(np.floor(rng.uniform(0.3, 0.8) * 20 + 1e-9))
        assert sample_cohort(3, t, 20, 1.0, [0.3, 0.8]).tolist() == sorted(rng.choice(20, size=m, replace=False).tolist())


@pytest.mark.parametrize("overrides, fragment", [
    (["participation_draw=count"], "'participation_draw': count draws from participation_range, which is not set"),
    (["participation_draw=poisson", "participation_range=[0.1, 1.0]"], "'participation_draw': must be one of rho, count"),
])
def test_bad_draws_name_the_key(overrides, fragment, digits6):
    with pytest.raises(UserError) as exc:
        load_config(CONFIG, [f"data.path={digits6}", *overrides])
    assert fragment in str(exc.value)


# ----------------------------------------------------------------------------- baselines: reference variants


def _tiny_algo(cls, **kw):
    from fedcp_dist.config import Config
    from helpers import CPU, Tiny

    cfg = Config(**{"lr": 0.1, "batch_size": 4, **kw})
    torch.manual_seed(0)
    algo = cls(cfg, Tiny(), CPU)
    gs = algo.init_global_state()
    algo.set_global(gs)
    return algo, gs


def _grads_at(state, data, idx):
    """(parameters, ∇f(w; batch)) of a Tiny network holding ``state``, in parameter order."""
    import torch.nn.functional as F

    from fedcp_dist.algorithms.base import load_module
    from helpers import Tiny

    net = Tiny()
    load_module(net, state, "")
    x, y = data.train_batch(idx)
    params = list(net.parameters())
    return [p.detach().clone() for p in params], torch.autograd.grad(F.cross_entropy(net(x), y), params)


def test_perfedavg_reference_compat_steps_with_lr_twice():
    """8 samples, batches of 4: one meta step per pass; the reference variant makes two passes
    (batch orders drawn one after the other from the client's stream) with β = lr = 0.1."""
    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.perfedavg import PerFedAvg
    from fedcp_dist.local_train import batch_indices
    from helpers import tiny_data

    alpha = 0.3
    data = tiny_data(n=8)
    algo, gs = _tiny_algo(PerFedAvg, perfedavg_alpha=alpha, perfedavg_beta=0.001, perfedavg_reference_compat=True)
    res = algo.local_train(None, data, Context(0, 0, torch.Generator().manual_seed(4)))
    g = torch.Generator().manual_seed(4)
    state = dict(gs)
    names = list(gs)
    for _ in range(2):
        d_in, d_out = list(batch_indices(8, 4, 1, True, g))
        w, g_in = _grads_at(state, data, d_in)
        _, g_out = _grads_at({n: wi - alpha * gi for n, wi, gi in zip(names, w, g_in)}, data, d_out)
        state = {n: wi - 0.1 * go for n, wi, go in zip(names, w, g_out)}  # β = lr
    for k in names:
        assert torch.allclose(res.upload[k], state[k], atol=1e-6, rtol=0), k
    assert res.samples == 8
    # the default is the paper's: one pass, β = perfedavg_beta
    default, _ = _tiny_algo(PerFedAvg, perfedavg_alpha=alpha, perfedavg_beta=0.001)
    one = default.local_train(None, data, Context(0, 0, torch.Generator().manual_seed(4)))
    assert one.samples == 4 and not torch.allclose(one.upload["head.weight"], res.upload["head.weight"])


def test_fedrod_reference_compat_starts_the_personal_head_at_the_initial_head():
    """With P = G₀ and the global model still the initial one, the personalised logits z + P(h) are
    exactly twice the generic ones; the default P = 0 gives the generic logits."""
    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.fedrod import FedRoD
    from helpers import tiny_data

    algo, gs = _tiny_algo(FedRoD, fedrod_reference_compat=True)
    state = algo.init_client_state(0)
    assert torch.equal(state["phead.weight"], gs["head.weight"]) and torch.equal(state["phead.bias"], gs["head.bias"])
    x, _ = tiny_data(n=8).test_batch(0, 3)
    ctx = Context(0, 0, torch.Generator().manual_seed(0))
    generic = algo.global_model(x)
    assert torch.allclose(algo.predict(state, x, ctx), 2 * generic, atol=1e-6)
    state["phead.weight"] += 1.0  # a copy: the initial head itself is unchanged
    assert torch.equal(algo.init_client_state(1)["phead.weight"], gs["head.weight"])
    default, _ = _tiny_algo(FedRoD)
    zero = default.init_client_state(0)
    assert all(float(t.abs().sum()) == 0.0 for t in zero.values())
    assert torch.allclose(default.predict(zero, x, ctx), generic, atol=1e-6)


def test_analysis_numbers_the_subset_as_the_run_did(digits6, tmp_path):
    """fedcp-analyze's rebuilt run: client k is the subset's k-th shard client."""
    from fedcp_dist.analysis.runstate import load_run_state
    from helpers import run

    run(CONFIG, [f"data.path={digits6}", "data.clients=[1, 4]", "rounds=1", "checkpoint_every=1",
                 f"out_dir={tmp_path}", "threads=1", "method=fedavg"])
    state = load_run_state(tmp_path)
    info = read_info(digits6)
    assert state.num_clients == 2 and state.clients.tolist() == [1, 4]
    d = state.load_data([1])[1]
    assert (d.n_train, d.n_test) == (info.train_counts[4], info.test_counts[4])
    with pytest.raises(UserError, match="client 2 is not in"):
        state.load_data([2])


def test_pfedme_reference_compat_keeps_the_local_w():
    """One batch of 4, K = 2: θ takes two inner steps, then w ← w − ηλ(w − θ). The paper's pFedMe
    keeps θ for evaluation; the reference variant keeps w (the upload), computed here by hand."""

    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.pfedme import PFedMe
    from fedcp_dist.local_train import batch_indices
    from helpers import tiny_data

    lam, plr, eta = 2.0, 0.1, 0.05
    data = tiny_data(n=4)
    kw = dict(pfedme_lam=lam, pfedme_lr=plr, pfedme_k=2, lr=eta)
    (idx,) = list(batch_indices(4, 4, 1, True, torch.Generator().manual_seed(2)))
    algo, gs = _tiny_algo(PFedMe, pfedme_reference_compat=True, **kw)
    res = algo.local_train(algo.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(2)))
    names = list(gs)
    w = [gs[n].clone() for n in names]
    th = [t.clone() for t in w]
    for _ in range(2):
        _, g = _grads_at(dict(zip(names, th)), data, idx)
        th = [t - plr * (gi + lam * (t - wi)) for t, gi, wi in zip(th, g, w)]
    w = [wi - eta * lam * (wi - t) for wi, t in zip(w, th)]
    for n, wi, t in zip(names, w, th):
        assert torch.allclose(res.upload[n], wi, atol=1e-6, rtol=0), n
        assert torch.allclose(res.client_state[n], wi, atol=1e-6, rtol=0), n  # w is kept
    paper, _ = _tiny_algo(PFedMe, **kw)
    kept = paper.local_train(paper.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(2)))
    for n, t in zip(names, th):
        assert torch.allclose(kept.client_state[n], t, atol=1e-6, rtol=0), n  # θ is kept
        assert torch.equal(kept.upload[n], res.upload[n])  # training and upload unchanged
    assert not torch.allclose(kept.client_state["head.weight"], res.client_state["head.weight"])


def test_a_sweep_partition_with_the_val_images_gets_its_own_file():
    from fedcp_dist.data.make import PartitionSpec
    from fedcp_dist.sweep.names import partition_file_name
    from fedcp_dist.sweep.spec import PARTITION_KEYS

    assert PARTITION_KEYS["include_val"] is bool
    train = partition_file_name(PartitionSpec(source="tinyimagenet", num_clients=20))
    both = partition_file_name(PartitionSpec(source="tinyimagenet", num_clients=20, include_val=True))
    assert train == "tinyimagenet_dir0.1_n20_s1.h5" and both.startswith("tinyimagenet_dir0.1_n20_s1_") and both != train


def test_feature_difference_selection_draws_the_same_sizes_and_weighs_the_subset(digits20, tmp_path):
    """Weighted cohorts take their size from the same draw as uniform ones (count draws too), and a
    subset run weighs its own clients' sample counts (K of them, not the shard's 20)."""
    from fedcp_dist.comm.selection import sample_cohort_weighted

    probs = np.full(50, 1 / 50)
    for t in range(30):
        for r, draw in (([0.1, 1.0], "count"), ([0.3, 0.8], "rho")):
            assert len(sample_cohort_weighted(5, t, probs, 1.0, r, draw)) == len(sample_cohort(5, t, 50, 1.0, r, draw))
    cfg = load_config(CONFIG, [f"data.path={digits20}", "data.clients=6", "participation=0.5", "rounds=2",
                               "client_selection=feature_difference", "checkpoint_every=0", f"out_dir={tmp_path}",
                               "threads=1"])
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, env={})
    try:
        summary = Simulator(cfg, rt, echo=lambda *_: None).run()
    finally:
        rt.close()
    assert len(summary["selection_counts"]) == 6 and sum(summary["selection_counts"]) == 2 * 3


def test_a_sweep_refuses_the_val_images_of_another_source(tmp_path):
    import yaml

    from fedcp_dist.sweep import load_sweep

    doc = {"name": "v", "root": str(tmp_path), "base": str(REPO / "configs" / "digits_fedcp.yaml"),
           "grid": {"seed": [1]}, "partition": {"source": "digits", "num_clients": 4, "include_val": True}}
    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(UserError, match="--include-val applies to --source tinyimagenet only, not to 'digits'"):
        load_sweep(path)


def test_fedphp_reference_compat_mixes_by_round_and_distils_from_the_global_model():
    """T = 10, μ̄ = 0.5, round 4: μ_t = 0.5·4/10 = 0.2, the client's model is 0.8·global + 0.2·its
    last local model, evaluated as is and trained from (λ = 0: one plain SGD step on the one batch);
    the trained model becomes its last local model. Round 0 with λ = 0.3: the start is the global
    model, the MMD target too, so the MMD term has zero gradient there and the step is
    −lr·(1 − λ)·∇CE (the paper's variant distils from the HPM instead and moves otherwise)."""
    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.fedphp import FedPHP
    from helpers import tiny_data

    data = tiny_data(n=4)
    algo, gs = _tiny_algo(FedPHP, rounds=10, fedphp_mu=0.5, fedphp_lam=0.0, fedphp_reference_compat=True)
    names = list(gs)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in gs.items()}
    algo.set_global(moved)
    state = algo.init_client_state(0)
    last = {k: state["hpm." + k] + 0.1 * torch.randn(state["hpm." + k].shape, generator=torch.Generator().manual_seed(2))
            for k in names}
    state.update({"hpm." + k: v for k, v in last.items()})
    ctx = Context(4, 0, torch.Generator().manual_seed(3))
    mixed = {k: 0.8 * moved[k] + 0.2 * last[k] for k in names}
    shown = algo.prepare_eval(state, data, ctx)
    for k in names:
        assert torch.allclose(shown["hpm." + k], mixed[k], atol=1e-6, rtol=0), k
    res = algo.local_train(state, data, ctx)
    w, g = _grads_at(mixed, data, torch.arange(4))
    for n, wi, gi in zip(names, w, g):
        assert torch.allclose(res.upload[n], wi - 0.1 * gi, atol=1e-6, rtol=0), n
        assert torch.equal(res.client_state["hpm." + n], res.upload[n])
    assert int(res.client_state["participations"]) == 1

    algo, gs = _tiny_algo(FedPHP, rounds=10, fedphp_mu=0.5, fedphp_lam=0.3, fedphp_reference_compat=True)
    algo.set_global(moved)
    res = algo.local_train(algo.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(3)))
    w, g = _grads_at(moved, data, torch.arange(4))
    for n, wi, gi in zip(names, w, g):
        assert torch.allclose(res.upload[n], wi - 0.1 * 0.7 * gi, atol=1e-6, rtol=0), n
    paper, _ = _tiny_algo(FedPHP, rounds=10, fedphp_mu=0.5, fedphp_lam=0.3)
    paper.set_global(moved)
    other = paper.local_train(paper.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(3)))
    assert not torch.allclose(other.upload["features.1.weight"], res.upload["features.1.weight"], atol=1e-6)
