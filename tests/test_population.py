"""Cost that follows the cohort, not the population: the evaluated sample (eval_clients), the
per-client rows of the all-reduce sized by the cohort, the shard's per-class counts streamed, and
clients' data read from the shard as rounds need them (client_data) with the same bits."""
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from helpers import run
from fedcp_dist.comm.aggregate import ClientOrder, Sums
from fedcp_dist.data.resident import OnDemandData
from fedcp_dist.data.shards import ShardReader, layout_digest, read_info
from fedcp_dist.data.shards import read as shard_read
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import eval_sample, max_cohort_size


class _One(Sums):
    ORDERED = ("v",)
    v: float = 0.0


def test_eval_sample_is_every_client_or_a_seeded_sorted_sample():
    assert eval_sample(1, 7, 0).tolist() == list(range(7))
    assert eval_sample(1, 7, 7).tolist() == list(range(7))
    assert eval_sample(1, 7, 9).tolist() == list(range(7))
    a = eval_sample(1, 1000, 50)
    assert len(a) == 50 and len(set(a.tolist())) == 50 and (np.diff(a) > 0).all() and a.max() < 1000
    assert eval_sample(1, 1000, 50).tolist() == a.tolist()  # the same draw on every rank and on resume
    assert eval_sample(2, 1000, 50).tolist() != a.tolist()


def test_max_cohort_follows_rho_or_the_range_top():
    assert max_cohort_size(1000, 0.1) == 100
    assert max_cohort_size(1000, 0.1, [0.05, 0.25]) == 250
    assert max_cohort_size(10, 0.01) == 1  # at least one client


@pytest.mark.parametrize("n, q", [(100_000, 0.0005), (50_000, 0.001), (1_000, 0.1), (2_000, 0.5), (10**6, 1e-5)])
def test_a_poisson_cohort_is_sized_by_a_bound_it_passes_with_a_chance_below_1e_20(n, q):
    """Poisson cohorts were sized as N (any client may join): the pre-flight charged a round of
    50 expected clients of 10⁵ with 12,500 (a whole fused group) and refused it, asking for 1.8 TiB.
    The bound is checked against the binomial's exact tail."""
    from scipy.stats import binom

    from fedcp_dist.state.placement import POISSON_TAIL, poisson_cohort_bound

    bound = max_cohort_size(n, q, sampling="poisson")
    assert bound == poisson_cohort_bound(n, q) < n
    assert binom.sf(bound, n, q) <= POISSON_TAIL  # P(cohort > bound)
    assert bound <= 3 * n * q + 100  # on the cohort's scale, not the population's
    assert max_cohort_size(n, 1.0, sampling="poisson") == n


def test_a_poisson_cohort_past_its_bound_stops_the_run_in_one_line(digits6_16px, tmp_path, monkeypatch):
    from fedcp_dist.engine import startup
    from fedcp_dist.errors import RunFailure

    monkeypatch.setattr(startup, "max_cohort_size", lambda *a: 1)  # a bound far too small
    with pytest.raises(RunFailure, match=r"round 1 drew a Poisson cohort of [2-6] clients, more than the 1 its "
                                         r"per-client rows were sized for"):
        run("configs/digits_fedavg.yaml", [f"data.path={digits6_16px}", f"out_dir={tmp_path / 'r'}", "rounds=1",
                                           "participation=0.9", "participation_sampling=poisson", "threads=1"])


def test_client_order_by_id_sums_in_slot_order():
    # slots of clients 2, 5, 9; the sum runs from 0.0 slot by slot: (1e16 + 1) - 1e16 = 0 in float64,
    # where any other order (1e16 - 1e16 + 1) gives 1
    order = ClientOrder(_One, 3, ids=np.array([2, 5, 9]))
    for cid, v in ((9, -1e16), (2, 1e16), (5, 1.0)):
        s = _One()
        s.v = v
        order.add(cid, s)
    assert order.values.tolist() == [1e16, 1.0, -1e16]
    out = _One()
    order.apply(order.values.clone(), out)
    assert out.v == 0.0
    with pytest.raises(AssertionError):
        order.add(3, _One())  # not a client of the sample


def test_info_without_class_counts_and_the_streamed_digest(digits6, monkeypatch):
    full = read_info(digits6)
    light = read_info(digits6, label_counts=False)
    assert light.train_label_counts is None and light.test_label_counts is None
    assert light.train_counts.tolist() == full.train_counts.tolist()
    monkeypatch.setattr(shard_read, "LABEL_BLOCK", 4)  # 6 clients: two blocks of rows
    assert shard_read.layout_digest_of(digits6, light) == layout_digest(full)


def test_the_streamed_digest_checks_the_class_counts(digits6, tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(Path(digits6).read_bytes())
    with h5py.File(bad, "r+") as f:
        f["train_label_counts"][0, 0] += 1
    with pytest.raises(UserError, match="train_label_counts.*does not add up"):
        shard_read.layout_digest_of(bad, read_info(bad, label_counts=False))


def test_on_demand_data_holds_the_clients_a_round_asks_for(digits6):
    info = read_info(digits6, label_counts=False)
    clients = np.array([1, 3, 4], dtype=np.int64)  # run client k is shard client clients[k]
    with ShardReader(digits6) as reader:
        want = reader.read([3])[3]
    data = OnDemandData(ShardReader(digits6), clients, info.mean, info.std, "cpu")
    try:
        data.hold([1, 2])
        assert len(data) == 2 and data.reads == 1 and data.clients_read == 2
        d = data[1]  # shard client 3
        assert d.n_train == len(want["train_y"]) and d.n_test == len(want["test_y"])
        assert torch.equal(d.train_y.cpu(), torch.as_tensor(want["train_y"]).to(d.train_y.dtype))
        data.release()
        assert len(data) == 0
        data[0]  # asked for without being held: read alone
        assert data.reads == 2 and data.clients_read == 3
    finally:
        data.close()


def _args(shard, out, *extra):
    return [f"data.path={shard}", f"out_dir={out}", "rounds=2", "eval_every=1", "participation=0.5", "threads=1",
            "checkpoint_every=0", *extra]


def _lines(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_states(a: Path, b: Path):
    ga = torch.load(a / "final_global.pt", weights_only=True)
    gb = torch.load(b / "final_global.pt", weights_only=True)
    assert set(ga) == set(gb) and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("config", ["configs/digits_fedcp.yaml", "configs/digits_ditto.yaml"])
def test_data_read_on_demand_gives_the_same_bits(digits6, tmp_path, config):
    res, ond = tmp_path / "resident", tmp_path / "on_demand"
    run(config, _args(digits6, res, "client_data=resident"))
    said = []
    run(config, _args(digits6, ond, "client_data=on_demand"), echo=said.append)
    assert any("read from the shard as rounds need them" in line for line in said)
    _same_states(res, ond)
    strip = lambda rows: [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]  # noqa: E731
    assert strip(_lines(res)) == strip(_lines(ond))


def test_an_evaluated_sample_is_stated_and_leaves_training_alone(digits6, tmp_path):
    every, sample = tmp_path / "every", tmp_path / "sample"
    run("configs/digits_fedavg.yaml", _args(digits6, every))
    said = []
    run("configs/digits_fedavg.yaml", _args(digits6, sample, "eval_clients=2"), echo=said.append)
    assert any("evaluation: 2 of the 6 clients" in line for line in said)
    _same_states(every, sample)  # evaluation draws from streams of its own: training is unchanged
    evals = [r for r in _lines(sample) if "acc" in r]
    assert evals and all(r["eval_clients"] == 2 for r in evals)
    assert all("eval_clients" not in r for r in _lines(every))
    summary = json.loads((sample / "summary.json").read_text())
    assert summary["eval_clients"] == 2
    assert "eval_clients" not in json.loads((every / "summary.json").read_text())
    # accuracy is a fraction of the sample's test samples (the config's seed 1 draws the sample)
    want = int(read_info(digits6).test_counts[eval_sample(1, 6, 2)].sum())
    assert all(abs(r["acc"] * want - round(r["acc"] * want)) < 1e-9 for r in evals)


def test_a_rounds_groups_are_its_cohort_in_group_order():
    from fedcp_dist.fused.groups import GroupTrainer

    groups = GroupTrainer(None, None, None, None, [[5, 1, 7], [2], [9, 3]], "cpu")
    assert groups.round_groups([3, 7, 5, 2, 100]) == [[5, 7], [2], [3]]  # 100: another rank's
    assert groups.round_groups([9]) == [[9]]
    assert groups.round_groups([]) == []


@pytest.fixture(scope="module")
def sampled_world_runs(digits6, tmp_path_factory):
    """FedCP with the probes on, data read on demand and a sample of 4 of the 6 clients evaluated,
    at ρ = 0.5 (the probe rows sized by the cohort), on one rank and on two."""
    from helpers import runs_on_one_and_two_ranks

    root = tmp_path_factory.mktemp("sampled")
    runs_on_one_and_two_ranks(root, {"fedcp": ("configs/digits_fedcp.yaml", lambda out: [
        f"data.path={digits6}", f"out_dir={out}", "rounds=2", "eval_every=1", "participation=0.5", "threads=1",
        "fused=false", "checkpoint_every=0", "analysis=true", "analysis_every=1", "client_data=on_demand",
        "eval_clients=4"])})
    return root / "one" / "fedcp", root / "two" / "fedcp"


@pytest.mark.slow
def test_a_sampled_on_demand_run_is_the_same_on_two_ranks(sampled_world_runs):
    one, two = sampled_world_runs
    g1 = torch.load(one / "final_global.pt", weights_only=True)
    g2 = torch.load(two / "final_global.pt", weights_only=True)
    assert set(g1) == set(g2) and all(torch.allclose(g1[k], g2[k], atol=1e-5, rtol=0) for k in g1)
    e1 = [(r["acc"], r["eval_clients"]) for r in _lines(one) if "acc" in r]
    e2 = [(r["acc"], r["eval_clients"]) for r in _lines(two) if "acc" in r]
    assert e1 == e2 and len(e1) == 3 and all(k == 4 for _, k in e1)
    # the probes' lines name the cohort's and the sample's clients, the same on both worlds
    a1 = [json.loads(line) for line in (one / "analysis.jsonl").read_text().splitlines()]
    a2 = [json.loads(line) for line in (two / "analysis.jsonl").read_text().splitlines()]
    ids = lambda lines, kind: sorted((r.get("round", r.get("evaluated_after")), r["client"])  # noqa: E731
                                     for r in lines if r["kind"] == kind)
    assert ids(a1, "train") == ids(a2, "train") and ids(a1, "eval") == ids(a2, "eval")
    sample = set(eval_sample(1, 6, 4).tolist())
    assert {c for _, c in ids(a1, "eval")} <= sample and len({c for _, c in ids(a1, "eval")}) >= 1
    train = ids(a1, "train")
    assert len(train) == 2 * 3 and len(set(train)) == 6  # two rounds of ⌊0.5 × 6⌋ = 3 clients, rows by id
