"""The probes of ``analysis: true``: PIR and s histograms against hand values, FedCP's training
tally and losses before/after against direct computations, and runs: analysis on leaves the results
bit-identical, analysis.jsonl holds what it says, survives a resume, and 1 and 2 ranks write the same."""
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_cmd
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import FedCP
from fedcp_dist.analysis.records import read_probes
from fedcp_dist.config import Config, load_config
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.fused.groups import train_group
from fedcp_dist.algorithms.fedcp.probing import S_BINS, PolicyProbeLayout, PolicyTally, s_histogram
from fedcp_dist.engine.probes import ProbeTable, RoundProbes, keep_before
from helpers import CPU, Tiny, nonfinite_at, quarters_shard, run, tiny_data

# ----------------------------------------------------------------------------- hand-made policies


def test_pir_and_histogram_of_a_known_policy():
    s = torch.tensor([[0.0, 0.5, 1.0, 0.25],
                      [0.75, 0.5, 0.5, 0.25]])
    t = PolicyTally()
    t.add(s[:1])
    t.add(s[1:])  # two test batches
    # PIR = (1/K) Σ_k s̄^k: s̄ = (0.375, 0.5, 0.75, 0.25) → (0.375 + 0.5 + 0.75 + 0.25) / 4
    assert t.samples == 2 and t.s_sum / t.samples == pytest.approx(0.46875, abs=1e-12)
    want = [0] * S_BINS
    for b in (0, 25, 25, 25, 49, 12, 12, 37):  # ⌊50·s⌋, s = 1 in the last bin
        want[b] += 1
    assert t.hist.tolist() == want
    assert s_histogram(torch.tensor([0.03, 0.0199, 0.98, 0.999])).nonzero().flatten().tolist() == [0, 1, 49]

    # rows: only the owner's row is non-zero, so the all-reduce sum is every client's row exactly
    layout = PolicyProbeLayout()

    class Result:
        def __init__(self, samples, s):
            self.samples, self.tallies = samples, {"s": s}

    a, b = ProbeTable(3, layout), ProbeTable(3, layout)
    a.eval[0] = torch.tensor(t.row(), dtype=torch.float64)
    a.train[0] = torch.tensor(layout.train_row(Result(8, 2.0), (16.0, 4.0), 10), dtype=torch.float64)
    b.train[2] = torch.tensor(layout.train_row(Result(4, 3.0), (5.0, 2.5), 5), dtype=torch.float64)
    summed = ProbeTable.from_flat(a.flat() + b.flat(), 3, layout)
    assert PolicyTally().row() is None  # a client without probed samples has no row
    assert layout.records(summed.train, summed.eval, round_idx=4, evaluated_after=4) == [
        {"kind": "eval", "evaluated_after": 4, "client": 0, "samples": 2, "pir": 0.46875, "s_hist": want},
        {"kind": "train", "round": 5, "client": 0, "samples": 8, "pir": 0.25, "loss_bef": 1.6, "loss_aft": 0.4},
        {"kind": "train", "round": 5, "client": 2, "samples": 4, "pir": 0.75, "loss_bef": 1.0, "loss_aft": 0.5},
    ]
    assert layout.records(summed.train, summed.eval, None, None) == []
    assert keep_before({"kind": "train", "round": 3}, 3) and not keep_before({"kind": "train", "round": 4}, 3)
    assert keep_before({"kind": "eval", "evaluated_after": 2}, 3) and not keep_before({"kind": "eval", "evaluated_after": 3}, 3)


def test_round_probes_in_one_call_out_in_one():
    """A round's probes on two ranks: each packs its rows (one call in), the sum turns into the
    round's analysis lines (one call out); off, a round without training probes, and the final one."""
    layout = PolicyProbeLayout()
    for off in (RoundProbes(0, 3, 0, evaluated=True, layout=layout), RoundProbes(2, 3, 0, evaluated=True)):
        assert (off.train, off.evals, off.pack(), off.records(torch.zeros(0))) == (False, None, None, [])
    assert RoundProbes.size(0, 3, layout) == 0 and RoundProbes.size(2, 3, None) == 0
    assert RoundProbes.size(2, 3, layout) == 3 * (6 + 3 + S_BINS)
    a, b = RoundProbes(2, 3, 4, evaluated=True, layout=layout), RoundProbes(2, 3, 4, evaluated=True, layout=layout)
    assert a.train and a.evals == {}  # round 5 of analysis_every: 2 trains with probes
    a.evals[1] = a.tally()
    a.evals[1].add(torch.tensor([[0.5, 1.0]]))
    a.evals[0] = a.tally()  # evaluated without a probed sample: no row

    class Result:
        samples, tallies = 8, {"s": 2.0}

    b.add_train(2, Result, (16.0, 4.0), 10)
    hist = [0] * S_BINS
    hist[25] = hist[49] = 1
    assert a.records(a.pack() + b.pack()) == [
        {"kind": "eval", "evaluated_after": 4, "client": 1, "samples": 1, "pir": 0.75, "s_hist": hist},
        {"kind": "train", "round": 5, "client": 2, "samples": 8, "pir": 0.25, "loss_bef": 1.6, "loss_aft": 0.4}]
    between = RoundProbes(2, 3, 5, evaluated=False, layout=layout)
    assert not between.train and between.evals is None and between.records(between.pack()) == []
    final = RoundProbes(2, 3, 6, evaluated=True, layout=layout, final=True)
    final.evals[0] = a.evals[1]
    assert not final.train and final.pack().numel() == RoundProbes.size(2, 3, layout)
    assert [r["evaluated_after"] for r in final.records(final.pack())] == [6]


# ----------------------------------------------------------------------------- FedCP's probes


def _fedcp(**kw):
    cfg = Config(lr=0.1, batch_size=8, lam=0.0, cpn_train_gumbel=False, **kw)
    torch.manual_seed(0)
    algo = FedCP(cfg, Tiny(), CPU)
    gs = algo.init_global_state()
    gs = {k: v + 0.3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(5)) for k, v in gs.items()}
    algo.set_global(gs)
    state = algo.init_client_state(0)
    state = {**state, "head.weight": state["head.weight"] + 0.5}  # a personal head apart from the global one
    return algo, gs, state


def _policy(gs, v, x):
    """s of the policy written out: h = ReLU(W x + b), C = v̂ ⊙ h, LayerNorm(Linear(C)), ReLU, pair softmax."""
    h = F.relu(x.flatten(1) @ gs["features.1.weight"].T + gs["features.1.bias"])
    z = (v / v.norm()) * h @ gs["cpn.net.0.weight"].T + gs["cpn.net.0.bias"]
    z = F.relu(F.layer_norm(z, (6,), gs["cpn.net.1.weight"], gs["cpn.net.1.bias"]))
    return torch.softmax(z.view(-1, 2, 3), dim=1)[:, 0, :]


def test_fedcp_training_tally_is_the_pir_of_the_samples_seen_and_changes_nothing():
    algo, gs, state = _fedcp()
    data = tiny_data(n=8)  # one batch of 8: s from the starting values
    off = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(1)))
    on = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(1), probe=True))
    assert off.tallies == {} and set(on.tallies) == {"s"}
    for k in off.upload:
        assert torch.equal(off.upload[k], on.upload[k]), k
    assert off.loss_sum == on.loss_sum
    x, _ = data.train_batch(torch.arange(8))
    s = _policy(gs, state["v"], x)
    assert on.tallies["s"] / on.samples == pytest.approx(float(s.mean()), abs=1e-6)

    # the fused path tallies the same (two clients of different sizes: padded rows left out)
    if algo.fused_reason() is None:
        d2 = tiny_data(n=5, seed=3)
        items = [(state, data, Context(0, 0, torch.Generator().manual_seed(1), probe=True)),
                 (state, d2, Context(0, 1, torch.Generator().manual_seed(2), probe=True))]
        seq = [algo.local_train(*it) for it in [(state, data, Context(0, 0, torch.Generator().manual_seed(1), True)),
                                                 (state, d2, Context(0, 1, torch.Generator().manual_seed(2), True))]]
        fused = train_group(algo, items)
        for a, b in zip(seq, fused):
            assert a.samples == b.samples and b.tallies["s"] == pytest.approx(a.tallies["s"], abs=1e-5)


def test_fedcp_losses_before_and_after_equal_a_direct_computation():
    algo, gs, state = _fedcp(eval_batch_size=3)  # three evaluation batches over 8 samples
    data = tiny_data(n=8)
    res = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(1), probe=True))
    bef, aft = algo.probe_losses(state, res, data, Context(0, 0, torch.Generator().manual_seed(9)))
    x, y = data.train_batch(torch.arange(8))
    ctx = Context(0, 0, torch.Generator().manual_seed(0))
    want_bef = float(F.cross_entropy(algo.predict(state, x, ctx), y, reduction="sum"))
    # after: the trained extractor and CPN with the new head and v, the received global head
    trained = res.extra["trained"]
    algo.set_global({**gs, **{k: trained[k] for k in gs if not k.startswith("head.")}})
    want_aft = float(F.cross_entropy(algo.predict(res.client_state, x, ctx), y, reduction="sum"))
    algo.set_global(gs)
    assert bef == pytest.approx(want_bef, rel=1e-6) and aft == pytest.approx(want_aft, rel=1e-6)
    assert aft < bef  # local learning lowered the client's training loss
    # and they changed nothing: the same training again gives the same result
    again = algo.local_train(state, data, Context(0, 0, torch.Generator().manual_seed(1), probe=True))
    for k in res.upload:
        assert torch.equal(res.upload[k], again.upload[k]), k


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, key", [
    (["analysis_every=-1"], "analysis_every"),
    (["method=fedavg", "analysis=true"], "analysis"),
    (["method=fedper", "analysis_every=2"], "analysis_every"),
    (["analysis=true", "fedcp_cpn=false"], "analysis"),
])
def test_bad_analysis_keys_are_named(overrides, key):
    # named before the data set is looked at
    with pytest.raises(UserError, match=f"config key '{key}'"):
        load_config(str(REPO / "configs" / "digits_fedcp.yaml"), [*overrides, "data.path=nowhere.h5"])


def test_probe_every():
    assert Config().probe_every == 0 and Config(analysis=True).probe_every == 1
    assert Config(analysis_every=3).probe_every == 3 and Config(analysis=True, analysis_every=2).probe_every == 2


# ----------------------------------------------------------------------------- runs

ROUNDS = 3


@pytest.fixture(scope="module")
def small_shard(tmp_path_factory):
    return quarters_shard(tmp_path_factory.mktemp("npz"))


def _args(shard, out, *extra):
    return ["method=fedcp", f"rounds={ROUNDS}", "eval_every=1", "lr=0.05", "batch_size=4", "lam=0.1",
            f"data.path={shard}", "data.source=", f"out_dir={out}", "threads=1", "checkpoint_every=1",
            "fused=false",  # the sequential path across world sizes (the fused one: test_multiprocess.py)
            *extra]


def _results(out):
    """What a run computed: final global state, checkpointed client states, metric records without timings."""
    from golden.record import UNSTABLE

    state = torch.load(out / "final_global.pt", weights_only=True)
    clients = torch.load(out / "checkpoints" / f"round_{ROUNDS:07d}" / "clients_0.pt", weights_only=True)["clients"]
    records = [{k: v for k, v in json.loads(line).items() if k not in UNSTABLE}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    return state, clients, records


@pytest.fixture(scope="module")
def probed(small_shard, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    config = str(REPO / "configs" / "digits_fedcp.yaml")
    run(config, _args(small_shard, root / "off"))
    run(config, _args(small_shard, root / "on", "analysis=true"))
    return root


def test_analysis_on_leaves_the_results_bit_identical(probed):
    off, on = _results(probed / "off"), _results(probed / "on")
    assert set(off[0]) == set(on[0])
    for k in off[0]:
        assert torch.equal(off[0][k], on[0][k]), k
    assert set(off[1]) == set(on[1]) == {0, 1, 2, 3}
    for c in off[1]:
        for k in off[1][c]:
            assert torch.equal(off[1][c][k], on[1][c][k]), (c, k)
    assert off[2] == on[2] and len(off[2]) == ROUNDS + 1
    assert not (probed / "off" / "analysis.jsonl").exists()


def test_analysis_jsonl_holds_every_client_every_round(probed):
    train, evals = read_probes(probed / "on" / "analysis.jsonl")
    # every client trains every round (participation 1); evaluations before rounds 1..3 and after the last
    assert [(p.round, p.client) for p in train] == [(r, c) for r in range(1, ROUNDS + 1) for c in range(4)]
    assert [(p.evaluated_after, p.client) for p in evals] == [(e, c) for e in range(ROUNDS + 1) for c in range(4)]
    sizes = {0: 24, 1: 16, 2: 20, 3: 18}
    seen = {0: 24, 1: 16, 2: 20, 3: 16}  # batches of 4, the last incomplete one dropped
    for p in train:
        assert p.samples == seen[p.client] and 0 < p.pir < 1 and p.loss_bef > 0 and p.loss_aft > 0
    for p in evals:
        assert p.samples == 6 and sum(p.s_hist) == 6 * 512 and 0 < p.pir < 1  # every feature's s of 6 samples
    # local learning lowers the clients' training loss (sample-weighted over clients, every round)
    for r in range(1, ROUNDS + 1):
        ps = [p for p in train if p.round == r]
        n = sum(sizes[p.client] for p in ps)
        assert sum(sizes[p.client] * p.loss_aft for p in ps) / n < sum(sizes[p.client] * p.loss_bef for p in ps) / n


def test_analysis_every_takes_the_training_probes_every_k_rounds(small_shard, probed, tmp_path):
    out = tmp_path / "every2"
    run(str(REPO / "configs" / "digits_fedcp.yaml"), _args(small_shard, out, "analysis_every=2"))
    train, evals = read_probes(out / "analysis.jsonl")
    assert sorted({p.round for p in train}) == [1, 3] and len(evals) == 4 * (ROUNDS + 1)
    full = [json.loads(l) for l in (probed / "on" / "analysis.jsonl").read_text().splitlines()]
    got = [json.loads(l) for l in (out / "analysis.jsonl").read_text().splitlines()]
    assert got == [r for r in full if r["kind"] == "eval" or r["round"] in (1, 3)]


def test_resume_keeps_analysis_jsonl_consistent(small_shard, probed, tmp_path):
    """A run that stopped in round 3 (after the checkpoint of round 2), with a stale and a torn line
    left at the end, resumes to the very file of a run that never stopped."""
    out = tmp_path / "resumed"
    config = str(REPO / "configs" / "digits_fedcp.yaml")
    with pytest.raises(RunFailure):
        run(config, _args(small_shard, out, "analysis=true"), wrap=nonfinite_at("3:1"))
    with open(out / "analysis.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "round": 3, "client": 0, "samples": 1, "pir": 0.5,
                            "loss_bef": 9.0, "loss_aft": 9.0}) + "\n")
        f.write('{"kind": "eval", "evaluated_aft')
    run(config, _args(small_shard, out, "analysis=true"))
    assert (out / "analysis.jsonl").read_text() == (probed / "on" / "analysis.jsonl").read_text()


@pytest.mark.slow
def test_two_ranks_write_the_same_analysis_jsonl(small_shard, probed, tmp_path):
    out = tmp_path / "two"
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml",
                 *_args(small_shard, out, "analysis=true")], timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert (out / "analysis.jsonl").read_text() == (probed / "on" / "analysis.jsonl").read_text()


def test_fedcp_analyze_draws_the_engines_probes(probed, tmp_path, capsys):
    """The figures from analysis.jsonl as the engine wrote it; a run without probes overlaid."""
    from fedcp_dist.cli.analyze import main

    out = tmp_path / "figures"
    main([str(probed / "on"), str(probed / "off"), "--labels", "probed,plain", "--out", str(out), "--clients", "0,3"])
    report = json.loads((out / "report.json").read_text())
    for name in ("accuracy", "pir", "s_distribution", "loss_before_after"):
        assert (out / report["figures"][name]["file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    on, off = report["runs"]
    train, evals = read_probes(probed / "on" / "analysis.jsonl")
    last = [p for p in evals if p.evaluated_after == ROUNDS]
    assert on["pir_eval"]["mean"] == pytest.approx(sum(p.pir for p in last) / 4)  # 6 test samples each
    assert on["loss_last_round"]["round"] == ROUNDS and "pir_eval" not in off


def test_analysis_key_errors_are_one_line(capsys):
    from fedcp_dist.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_fedcp.yaml", "method=fedavg", "analysis=true"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "'analysis'" in err


def test_fused_training_and_a_stochastic_evaluation_stay_bit_identical_too(small_shard, tmp_path):
    """The fused path tallies inside the grouped step, and cpn_eval_gumbel draws noise at evaluation
    (the probes' losses draw from a stream of their own): neither changes a result."""
    config = str(REPO / "configs" / "digits_fedcp.yaml")
    extra = ["rounds=2", "fused=true", "cpn_eval_gumbel=true", "checkpoint_every=0"]
    run(config, _args(small_shard, tmp_path / "off", *extra))
    run(config, _args(small_shard, tmp_path / "on", *extra, "analysis=true"))
    off, on = (torch.load(tmp_path / d / "final_global.pt", weights_only=True) for d in ("off", "on"))
    for k in off:
        assert torch.equal(off[k], on[k]), k
    metrics = [[json.loads(l)["acc"] for l in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
                if "acc" in json.loads(l)] for d in ("off", "on")]
    assert metrics[0] == metrics[1] and len(metrics[0]) == 3
    train, evals = read_probes(tmp_path / "on" / "analysis.jsonl")
    assert len(train) == 2 * 4 and len(evals) == 3 * 4
