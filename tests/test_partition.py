"""Tests of the partition schemes (fedcp_dist.data.partition) and the data sources."""
from __future__ import annotations

import time

import numpy as np
import pytest

from fedcp_dist.data.partition import (PROBE_DRAWS, _top_up, least_samples,
                                       min_split_samples, partition_clients, partition_dir,
                                       partition_iid, partition_pat, split_train_test)
from fedcp_dist.data.sources import SOURCE_NAMES, load_source
from fedcp_dist.errors import UserError
from helpers import partition_shares


def synthetic_labels(n=5000, num_classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, num_classes, size=n)


def assert_exact_cover(parts, n):
    """Every index in range(n) appears exactly once across ``parts``."""
    flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    assert len(flat) == n
    assert np.array_equal(np.sort(flat), np.arange(n))


def flatten_pairs(pairs):
    return [np.concatenate([tr, te]) for tr, te in pairs]


# ----------------------------------------------------------------------------- basic pieces


def test_least_samples_formula():
    assert least_samples(10, 0.75, 1797, 20) == 40
    assert least_samples(10, 0.75, 300_000, 10_000) == 15
    assert least_samples(64, 0.75, 10**6, 2) == 256


@pytest.mark.parametrize("n, ratio, n_train, n_test", [
    (7, 0.75, 5, 2), (4, 0.75, 3, 1), (10, 0.7, 7, 3), (100, 0.75, 75, 25), (1, 0.75, 0, 1),
    (0, 0.75, 0, 0),
])
def test_split_train_test_sizes(n, ratio, n_train, n_test):
    idx = np.arange(100, 100 + n)
    tr, te = split_train_test(idx, ratio, np.random.default_rng(0))
    assert (len(tr), len(te)) == (n_train, n_test)
    assert np.array_equal(np.sort(np.concatenate([tr, te])), idx)
    assert tr.dtype == np.int64 and te.dtype == np.int64


@pytest.mark.parametrize("ratio, n", [(0.75, 2), (0.5, 2), (0.9, 2), (0.3, 4), (0.25, 4),
                                      (0.1, 10)])
def test_min_split_samples(ratio, n):
    # 0.3: 3 samples cut into 0 train + ceil(2.1) = 3 test; 4 into 1 + ceil(2.8) = 3
    assert min_split_samples(ratio) == n
    rng = np.random.default_rng(0)
    tr, te = split_train_test(np.arange(n), ratio, rng)
    assert len(tr) >= 1 and len(te) >= 1
    tr, te = split_train_test(np.arange(n - 1), ratio, rng)
    assert len(tr) == 0 or len(te) == 0


# ----------------------------------------------------------------------------- exact cover


@pytest.mark.parametrize("kind", ["dir", "pat", "iid"])
def test_every_sample_assigned_exactly_once(kind):
    labels = synthetic_labels()
    pairs = partition_shares(labels, 10, kind, 20, seed=3, beta=0.5)
    assert len(pairs) == 20
    assert_exact_cover(flatten_pairs(pairs), len(labels))


def test_pat_unbalanced_covers_and_limits_classes():
    labels = synthetic_labels()
    pairs = partition_shares(labels, 10, "pat", 20, seed=5, classes_per_client=2, balance=False)
    shares = flatten_pairs(pairs)
    assert_exact_cover(shares, len(labels))
    sizes = [len(s) for s in shares]
    assert len(set(sizes)) > 2  # unbalanced really varies the share sizes
    for share in shares:
        assert len(np.unique(labels[share])) <= 2


def test_pat_balanced_gives_exactly_k_classes():
    labels = synthetic_labels()
    shares = partition_pat(labels, 20, 10, 2, True, 40, np.random.default_rng(0))
    assert_exact_cover(shares, len(labels))
    for share in shares:
        assert len(np.unique(labels[share])) == 2
    # balanced: shares of one class differ by less than the number of clients sharing it
    for k in range(10):
        counts = [int((labels[s] == k).sum()) for s in shares if (labels[s] == k).any()]
        assert len(counts) == 4
        assert max(counts[:-1]) == min(counts[:-1])


@pytest.mark.parametrize("num_clients, num_classes, per_client", [(23, 10, 2), (5, 4, 3)])
def test_pat_at_most_k_classes_when_not_divisible(num_clients, num_classes, per_client):
    labels = synthetic_labels(num_classes=num_classes)
    shares = partition_pat(labels, num_clients, num_classes, per_client, True, 10,
                           np.random.default_rng(0))
    assert_exact_cover(shares, len(labels))
    counts = [len(np.unique(labels[s])) for s in shares]
    assert max(counts) <= per_client
    if num_clients == 5:  # classes go to the first clients with budget left: the last gets one
        assert counts == [3, 3, 3, 3, 1]


def test_pat_too_few_clients_raises():
    labels = synthetic_labels()
    with pytest.raises(UserError, match="classes_per_client|classes-per-client"):
        partition_pat(labels, 2, 10, 2, True, 10, np.random.default_rng(0))


def test_pat_that_would_leave_clients_empty_is_refused_with_the_count():
    """1,000 clients × 2 classes over 1,797 samples dealt each class's ~180 samples to 200 clients at
    int(0.9) = 0 each, the last taking the rest: 995 clients held nothing, and the run went on."""
    labels = np.repeat(np.arange(10), 180)
    with pytest.raises(UserError) as exc:
        partition_clients(labels, 10, "pat", 1000, seed=0, classes_per_client=2)
    assert str(exc.value) == ("the pat partition leaves 995 of 1000 clients without a training or a test sample "
                              "(each class's samples are dealt to about 200 clients, 180 samples a class on "
                              "average); use fewer clients (--num-clients) or a smaller --classes-per-client")
    # 900 clients: one sample of each of its two classes a client, one to train and one to test on
    part = partition_clients(labels, 10, "pat", 900, seed=0, classes_per_client=2)
    assert part.report.min_train >= 1 and part.report.min_test >= 1
    assert "no train" not in part.report.summary()


def test_iid_near_equal():
    shares = partition_iid(1003, 10, np.random.default_rng(0))
    assert_exact_cover(shares, 1003)
    assert {len(s) for s in shares} == {100, 101}


# ----------------------------------------------------------------------------- dir specifics


def test_dir_honours_least_samples():
    labels = synthetic_labels()
    least = least_samples(10, 0.75, len(labels), 20)
    shares, draws = partition_dir(labels, 20, 10, 0.3, least, np.random.default_rng(1))
    assert_exact_cover(shares, len(labels))
    assert min(len(s) for s in shares) >= least == 40
    assert draws.stop == "met" and draws.moved_samples == 0 and draws.short_clients == 0
    assert draws.smallest_drawn == min(len(s) for s in shares)


def test_dir_is_label_skewed_for_small_beta():
    labels = synthetic_labels()
    shares, _ = partition_dir(labels, 10, 10, 0.1, 1, np.random.default_rng(2))
    per_client = [len(np.unique(labels[s])) for s in shares if len(s)]
    assert np.mean(per_client) < 9


def test_dir_impossible_least_names_the_option():
    labels = synthetic_labels(n=100)
    with pytest.raises(UserError, match=r"each of 20 clients 10 samples .* at most 10 clients "
                                        r"\(--num-clients\)"):
        partition_dir(labels, 20, 10, 0.1, 10, np.random.default_rng(0), max_tries=5)
    # iid and dir need 2 samples per client (one train, one test) at train_ratio 0.75
    for kind in ("iid", "dir"):
        with pytest.raises(UserError, match=r"at most 50 clients \(--num-clients\)"):
            partition_shares(labels, 10, kind, 51, seed=0)


def test_dir_tops_up_after_max_tries():
    labels = synthetic_labels(n=100)
    # least_samples = int(min(100 / 0.25, 100 / 20 / 2)) = 2: Dir(0.01) leaves clients empty
    part = partition_clients(labels, 10, "dir", 20, seed=0, beta=0.01, batch_size=100,
                             max_tries=3)
    d = part.report.draws
    assert (d.least, d.draws, d.stop) == (2, 3, "max_tries")
    assert d.short_clients > 0 and d.moved_samples >= d.short_clients and d.smallest_drawn < 2
    assert_exact_cover(flatten_pairs(part.shares), 100)
    assert min(len(tr) for tr, _ in part.shares) >= 1 and min(len(te) for _, te in part.shares) >= 1
    assert part.report.smallest == 2 and (part.report.min_train, part.report.min_test) == (1, 1)
    assert part.report.params() == {"least_samples": 2, "draws": 3,
                                    "topped_up_clients": d.short_clients,
                                    "moved_samples": d.moved_samples}
    summary = part.report.summary()
    assert "none of 3 draws" in summary and "--max-tries reached" in summary
    assert f"topped up with {d.moved_samples} samples" in summary
    again = partition_shares(labels, 10, "dir", 20, seed=0, beta=0.01, batch_size=100, max_tries=3)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(part.shares, again))


def test_top_up_takes_from_the_largest():
    # sizes 5, 0, 1, 4 and least 2: client 1 needs 2, client 2 needs 1; the largest gives first
    # (5 -> 4, then 4 and 4 tie: the lower id, 0 -> 3, then client 3: 4 -> 3)
    owner = np.array([0, 0, 0, 0, 0, 2, 3, 3, 3, 3])
    new = _top_up(owner, np.bincount(owner, minlength=4), 2, np.random.default_rng(0))
    assert np.bincount(new, minlength=4).tolist() == [3, 2, 2, 3]
    moved = np.flatnonzero(new != owner)
    assert len(moved) == 3
    assert sorted(owner[moved].tolist()) == [0, 0, 3]  # from the donors only
    assert sorted(new[moved].tolist()) == [1, 1, 2]


def test_dir_gives_up_early_at_ten_thousand_clients():
    # MNIST-sized: 70,000 labels; least_samples = int(min(40, 3.5)) = 3; Dir(1.0) leaves dozens
    # of clients short in every draw, so after PROBE_DRAWS draws the rest are judged hopeless
    labels = synthetic_labels(n=70_000)
    start = time.perf_counter()
    part = partition_clients(labels, 10, "dir", 10_000, seed=1, beta=1.0)
    elapsed = time.perf_counter() - start
    d = part.report.draws
    assert (d.least, d.draws, d.stop) == (3, PROBE_DRAWS, "unlikely")
    assert d.short_clients > 10
    assert_exact_cover(flatten_pairs(part.shares), 70_000)
    sizes = [len(tr) + len(te) for tr, te in part.shares]
    assert min(sizes) == 3 and part.report.smallest == 3
    assert part.report.min_train >= 2 and part.report.min_test >= 1
    assert "the rest were judged unlikely" in part.report.summary()
    assert elapsed < 20, f"took {elapsed:.1f} s"


def test_dir_keeps_drawing_while_success_is_likely():
    # the embedded digits, 40 clients, Dir(0.3), seed 2: least_samples = int(min(40, 22.46)) = 22,
    # met at draw 77 (as the unbounded redrawing finds it), well past the PROBE_DRAWS first ones
    labels = load_source("digits").y
    part = partition_clients(labels, 10, "dir", 40, seed=2, beta=0.3)
    d = part.report.draws
    assert (d.least, d.draws, d.stop, d.moved_samples) == (22, 77, "met", 0)
    assert part.report.smallest >= 22
    assert part.report.summary().startswith("dir: draw 77 gave every client >= 22 samples")


def test_dir_redrawing_never_depends_on_the_clock(capsys):
    # no draw meets the rule (Dir(0.1), 100 samples each): a progress line after every draw changes
    # nothing of what comes out, where a time limit used to fail the partition on a loaded machine
    labels = synthetic_labels()
    quiet, d_quiet = partition_dir(labels, 20, 10, 0.1, 100, np.random.default_rng(0), max_tries=30,
                                   progress_every=1e9)
    assert capsys.readouterr().err == ""
    noisy, d_noisy = partition_dir(labels, 20, 10, 0.1, 100, np.random.default_rng(0), max_tries=30,
                                   progress_every=0)
    assert d_noisy == d_quiet and d_quiet.stop in ("max_tries", "unlikely") and d_quiet.moved_samples > 0
    assert all(np.array_equal(a, b) for a, b in zip(quiet, noisy))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == d_quiet.draws - 1  # one after each draw but the last
    assert err[0].startswith("dir partition: 1 of at most 30 draws, none yet gives each of 20 clients 100")
    assert "--max-tries 30" in err[0]


def test_iid_and_pat_reports():
    labels = synthetic_labels(n=1003)
    part = partition_clients(labels, 10, "iid", 10, seed=0)
    # 100 samples: 75 train + 25 test
    assert (part.report.smallest, part.report.smallest_train, part.report.smallest_test) == \
        (100, 75, 25)
    assert part.report.summary() == "iid: smallest client 100 samples (75 train, 25 test)"
    assert part.report.params() == {} and part.report.draws is None
    assert part.report.least_samples == 0


def test_no_global_rng_use():
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    partition_shares(synthetic_labels(), 10, "dir", 10, seed=1, beta=0.5)
    partition_shares(synthetic_labels(), 10, "pat", 10, seed=1, balance=False)
    assert np.array_equal(np.random.get_state()[1], before)


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("kind", ["dir", "pat", "iid"])
def test_same_seed_same_partition_different_seed_differs(kind):
    labels = synthetic_labels()
    kw = dict(beta=0.5, balance=False)
    a = partition_shares(labels, 10, kind, 20, seed=7, **kw)
    b = partition_shares(labels, 10, kind, 20, seed=7, **kw)
    c = partition_shares(labels, 10, kind, 20, seed=8, **kw)
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a, c))


# ----------------------------------------------------------------------------- scale


@pytest.mark.parametrize("kind, beta", [("iid", 0.1), ("dir", 100.0)])
def test_ten_thousand_clients_fast(kind, beta):
    labels = synthetic_labels(n=300_000)
    start = time.perf_counter()
    pairs = partition_shares(labels, 10, kind, 10_000, seed=1, beta=beta)
    elapsed = time.perf_counter() - start
    assert len(pairs) == 10_000
    assert_exact_cover(flatten_pairs(pairs), 300_000)
    assert min(len(tr) + len(te) for tr, te in pairs) >= 15
    assert elapsed < 20, f"{kind} partition of 10,000 clients took {elapsed:.1f} s"


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_clients=0), "num_clients"),
    (dict(num_clients=-3), "num_clients"),
    (dict(beta=0.0), "beta"),
    (dict(train_ratio=1.0), "train_ratio"),
    (dict(train_ratio=0.0), "train_ratio"),
    (dict(kind="foo"), "unknown partition 'foo'"),
    (dict(num_clients=101), "101 clients"),
    (dict(kind="pat", classes_per_client=11), "classes_per_client"),
    (dict(max_tries=0), "max_tries"),
])
def test_make_partition_validation(kwargs, match):
    args = dict(labels=synthetic_labels(n=100), num_classes=10, kind="dir", num_clients=5, seed=0)
    args.update(kwargs)
    with pytest.raises(UserError, match=match):
        partition_shares(**args)


def test_labels_out_of_range():
    with pytest.raises(UserError, match="labels"):
        partition_shares(np.array([0, 1, 2, 12]), 10, "iid", 2, seed=0)


# ----------------------------------------------------------------------------- sources


def test_digits_source():
    src = load_source("digits")
    assert src.name == "digits"
    assert src.x.shape == (1797, 1, 28, 28) and src.x.dtype == np.uint8
    assert src.y.shape == (1797,) and src.y.dtype == np.int64
    assert src.num_classes == 10 and set(np.unique(src.y)) == set(range(10))
    assert src.mean == (0.5,) and src.std == (0.5,)
    assert src.x.max() > 200 and src.x.min() == 0


def test_unknown_source_lists_names():
    with pytest.raises(UserError, match="known sources: " + ", ".join(SOURCE_NAMES) + ", leaf, synthetic$"):
        load_source("imagenet")


def test_missing_torchvision_source(tmp_path):
    with pytest.raises(UserError, match=r"'mnist'.*" + str(tmp_path) + r".*--download"):
        load_source("mnist", root=tmp_path)
    with pytest.raises(UserError, match=r"'cifar10'.*--download"):
        load_source("cifar10", root=tmp_path)


def test_partition_arguments_refused_before_any_work(tmp_path, capsys):
    """Found by a probe: an --out under a file failed with os.makedirs' traceback after the source
    was partitioned, --beta inf gave NaN Dirichlet draws and a degenerate shard (and a non-JSON
    Infinity in its partition_params), and --to-npz naming --out failed after the shard was written."""
    from helpers import expect_user_error

    (tmp_path / "file").write_text("x")
    base = ["--source", "digits", "--partition", "dir", "--num-clients", 3]
    expect_user_error(capsys, [*base, "--out", tmp_path / "file" / "x.h5"],
                      f"--out {tmp_path / 'file' / 'x.h5'}: {tmp_path / 'file'} is a file, not a folder")
    expect_user_error(capsys, [*base, "--beta", "inf", "--out", tmp_path / "b.h5"],
                      "--beta must be a finite number > 0, got inf")
    expect_user_error(capsys, [*base, "--out", tmp_path / "n.h5", "--to-npz", tmp_path / "n.h5"],
                      "--to-npz", "and --out", "overlap")
    expect_user_error(capsys, [*base, "--out", tmp_path / "n.h5", "--to-npz", tmp_path / "n.h5" / "npz"], "overlap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
