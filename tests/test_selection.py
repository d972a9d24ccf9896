"""Feature-difference client selection: the probabilities for given vectors and sizes (worked out
by hand), the fall-backs, the floor, and the draw."""
import math

import numpy as np
import pytest

from helpers import FakeRuntime
from fedcp_dist.config import load_config
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import sample_cohort
from fedcp_dist.comm.selection import sample_cohort_weighted, selection_probabilities, selection_weights


def test_weights_are_size_times_one_minus_cosine_to_the_mean():
    # mean v̄ = [2/3, 2/3]: cos = 1/√2 for the two axes, 1 for [1, 1]
    w = selection_weights([10, 20, 30], [[1, 0], [0, 1], [1, 1]])
    c = 1 - 1 / math.sqrt(2)
    assert w.tolist() == pytest.approx([10 * c, 20 * c, 0.0], abs=1e-12)
    # p ∝ w: [1/3, 2/3, 0]; the floor 0.05 lifts the third, then all are renormalised by 1.05
    p = selection_probabilities([10, 20, 30], [[1, 0], [0, 1], [1, 1]], 0.05)
    assert p.tolist() == pytest.approx([(1 / 3) / 1.05, (2 / 3) / 1.05, 0.05 / 1.05], abs=1e-12)


def test_parallel_vectors_fall_back_to_sizes():
    # every cos is 1 (as before anyone trained: every client has the same initial vector)
    p = selection_probabilities([10, 20, 30], [[1, 0], [2, 0], [3, 0]], 0.01)
    assert p.tolist() == pytest.approx([1 / 6, 1 / 3, 1 / 2], abs=1e-12)
    # and sizes of zero too: everyone the same
    assert selection_probabilities([0, 0], [[1, 1], [1, 1]], 0.01).tolist() == [0.5, 0.5]


def test_a_zero_vector_counts_as_orthogonal_and_the_floor_keeps_everyone_reachable():
    # v̄ = [0.5, 0]: client 0 (zero vector) has cos 0, client 1 cos 1 → w = [4, 0]
    p = selection_probabilities([4, 6], [[0, 0], [1, 0]], 0.01)
    assert p.tolist() == pytest.approx([1 / 1.01, 0.01 / 1.01], abs=1e-12)
    assert (p > 0).all()


def test_the_draw_prefers_the_heavy_client_and_depends_on_seed_round_and_probabilities_only():
    probs = np.full(10, 0.01)
    probs[3] = 0.91
    cohorts = [sample_cohort_weighted(7, t, probs, 0.1) for t in range(50)]
    assert all(len(c) == 1 for c in cohorts)  # ⌊0.1 · 10⌋
    assert sum(int(c[0]) == 3 for c in cohorts) >= 40  # expected 45.5
    assert all(np.array_equal(c, sample_cohort_weighted(7, t, probs.copy(), 0.1)) for t, c in enumerate(cohorts))
    half = sample_cohort_weighted(7, 0, np.full(10, 0.1), 0.5)
    assert len(half) == 5 and list(half) == sorted(set(half.tolist()))
    # with participation_range the round's ρ (so the size) is the one uniform sampling draws
    for t in range(5):
        a = sample_cohort_weighted(1, t, np.full(20, 0.05), 1.0, [0.2, 0.9])
        assert len(a) == len(sample_cohort(1, t, 20, 1.0, [0.2, 0.9]))


@pytest.mark.parametrize("overrides, key", [
    (["client_selection=feature_difference", "method=fedavg"], "client_selection"),
    (["client_selection=best"], "client_selection"),
    (["client_selection=feature_difference", "selection_min_prob=0"], "selection_min_prob"),
    (["selection_min_prob=0.1"], "selection_min_prob"),  # uniform selection has no floor
    (["selection_vector=features"], "selection_vector"),  # uniform selection compares no vectors
    (["client_selection=feature_difference", "selection_vector=head"], "selection_vector"),
])
def test_bad_selection_settings_name_the_key(overrides, key):
    with pytest.raises(UserError, match=f"config key '{key}'"):
        load_config(None, overrides)


def test_fedcp_client_vector_is_the_initial_vector_then_the_heads_column_sums_which_sgd_keeps():
    """What the selection sees of FedCP (docs/results.md: cross-entropy's logit gradient sums to zero over
    the classes, so training leaves the head's column sums where they started)."""
    import torch

    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.fedcp import FedCP
    from fedcp_dist.capabilities import ClientVectors, supports
    from helpers import Tiny, algo_with_moved_global, tiny_data

    # the model's and the moved global's draws come from torch's global generator: seeded here, or the
    # test order decides them (some draws move the head by under 0.01 in one epoch; seed 1: 0.033)
    torch.manual_seed(1)
    algo, _ = algo_with_moved_global(FedCP, Tiny(), shape=(1, 2, 2), lr=0.5, batch_size=4, lam=0.0)
    assert supports(algo, ClientVectors) and algo.client_vector_dim == 3
    assert torch.equal(algo.client_vector(None), algo.init_client_state(0)["v"])  # untrained: the initial vector
    state = algo.init_client_state(0)
    res = algo.local_train(state, tiny_data(8), Context(0, 0, torch.Generator().manual_seed(1)))
    head = res.client_state["head.weight"]
    assert (head - state["head.weight"]).abs().max() > 1e-2  # the head trained
    assert torch.equal(algo.client_vector(res.client_state), head.sum(dim=0))
    assert torch.allclose(head.sum(dim=0), state["head.weight"].sum(dim=0), atol=1e-6)


def test_feature_means_as_the_selection_vector_and_their_probabilities():
    """selection_vector=features: v_i is the mean of the client's features h over its local
    training (zero before it trained), gathered like the client vectors; p_i worked out by hand."""
    import torch

    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.algorithms.fedcp import FedCP
    from fedcp_dist.comm.selection import gather_client_vectors
    from helpers import Tiny, algo_with_moved_global, tiny_data

    # one batch of all 8 samples, one epoch: every h comes from the received (global) extractor
    algo, _ = algo_with_moved_global(FedCP, Tiny(), shape=(1, 2, 2), lr=0.5, batch_size=8, lam=0.0,
                                     client_selection="feature_difference", selection_vector="features")
    assert torch.equal(algo.client_vector(None), torch.zeros(3))
    data = tiny_data(8)
    res = algo.local_train(algo.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(1)))
    with torch.no_grad():
        expected = algo.fe_g(data.train_batch(torch.arange(8))[0]).mean(dim=0)
    assert expected.abs().sum() > 0
    assert torch.allclose(algo.client_vector(res.client_state), expected, atol=1e-6)
    # the CPN's v_i is still the head's column sums
    assert torch.equal(res.client_state["v"], res.client_state["head.weight"].sum(dim=0))

    # given feature means [2, 0, 0], [0, 2, 0] and an untrained client (zero), sizes 10, 20, 30:
    # v̄ = [2/3, 2/3, 0], cos = 1/√2, 1/√2, 0 → w = [10c, 20c, 30] with c = 1 − 1/√2
    states = {0: {"fmean": torch.tensor([2.0, 0, 0])}, 1: {"fmean": torch.tensor([0, 2.0, 0])}}

    class Store:
        @staticmethod
        def peek(c):
            return states.get(c)

    vectors = gather_client_vectors(FakeRuntime(), algo, Store, [0, 1, 2], 3)
    assert vectors.tolist() == [[2, 0, 0], [0, 2, 0], [0, 0, 0]]
    c = 1 - 1 / math.sqrt(2)
    w = [10 * c, 20 * c, 30]
    p = selection_probabilities([10, 20, 30], vectors, 0.01)
    assert p.tolist() == pytest.approx([x / sum(w) for x in w], abs=1e-12)
    assert p.tolist() == pytest.approx([0.075514, 0.151028, 0.773459], abs=1e-6)


def test_report_plots_how_often_each_client_was_chosen(tmp_path):
    """fedcp-report --selection: counts from summary.json, from the rounds' cohorts, or (uniform
    sampling) drawn again from the config; one bar per client and mode in selection_counts.png."""
    import json

    from fedcp_dist.cli import report, report_plots
    from fedcp_dist.config import Config, dump_config

    def fake(name, selection, summary_extra, cohorts=None):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        cfg = Config(method="fedcp", seed=3, rounds=3, eval_every=3, participation=0.5, client_selection=selection,
                     out_dir=str(folder))
        cfg.data.path, cfg.data.num_clients = "missing.h5", 4
        (folder / "config.yaml").write_text(dump_config(cfg))
        with open(folder / "metrics.jsonl", "w") as f:
            for t in range(3):
                f.write(json.dumps({"kind": "round", "round": t + 1, **({"cohort": cohorts[t]} if cohorts else {}),
                                    **({"evaluated_after": 2, "acc": 0.5} if t == 2 else {})}) + "\n")
        (folder / "summary.json").write_text(json.dumps({"method": "fedcp", "best_acc": 0.5, "final_acc": 0.5,
                                                         "num_clients": 4, **summary_extra}))
        return folder

    fake("u", "uniform", {})
    fake("f", "feature_difference", {"selection_counts": [3, 1, 2, 0]})
    col = report.collect(tmp_path / "runs")
    by_name = {r.path.name: r for r in col.runs}
    uniform = report_plots.client_rounds(by_name["u"])
    expected = [0] * 4
    for t in range(3):  # ⌊0.5 · 4⌋ = 2 clients a round, the engine's own draw
        for c in sample_cohort(3, t, 4, 0.5):
            expected[int(c)] += 1
    assert uniform == expected and sum(uniform) == 6
    assert report_plots.client_rounds(by_name["f"]) == [3, 1, 2, 0]
    # without the summary's counts they come from the cohorts the rounds record
    g = fake("g", "feature_difference", {}, cohorts=[[0, 1], [0, 2], [0, 2]])
    col = report.collect(tmp_path / "runs")
    assert report_plots.client_rounds(next(r for r in col.runs if r.path == g.resolve())) == [3, 1, 2, 0]
    table = report.build_table(col, report.setting_keys(col, None), "best_acc")
    png = tmp_path / "selection_counts.png"
    assert report_plots.plot_selection(table, png)  # what `fedcp-report --selection` adds to the plots
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
