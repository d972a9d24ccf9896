"""Synthetic(α, β) (fedcp-partition --source synthetic): the benchmark as FedProx defines it, checked
against its definition; deterministic by (seed, client); streamed to the shard one client at a
time; bad arguments refused in one line; a two-round FedCP run learns on it."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import expect_user_error, run
from fedcp_dist.cli.partition import main
from fedcp_dist.data import synthetic
from fedcp_dist.data.make import PartitionSpec
from fedcp_dist.data.shards import load_clients, read_info, write as shard_write
from fedcp_dist.data.synthetic import (COV_DIAG, SyntheticSpec, client_generator, client_model, client_samples,
                                       client_size, shared_model, write_synthetic_shard)
from fedcp_dist.sweep.names import partition_file_name


def generate(capsys, out, *extra, n=10):
    main(["--source", "synthetic", "--num-clients", str(n), "--out", str(out), *map(str, extra)])
    return capsys.readouterr().out


def test_same_seed_same_bytes_and_client_k_is_the_same_for_any_number_of_clients(tmp_path, capsys):
    args = ("--synthetic-alpha", 1, "--synthetic-beta", 1, "--synthetic-max-samples", 200)
    generate(capsys, tmp_path / "a.h5", *args)
    generate(capsys, tmp_path / "b.h5", *args)
    assert (tmp_path / "a.h5").read_bytes() == (tmp_path / "b.h5").read_bytes()
    generate(capsys, tmp_path / "c.h5", *args, "--seed", 2)
    assert read_info(tmp_path / "c.h5").fingerprint != read_info(tmp_path / "a.h5").fingerprint
    generate(capsys, tmp_path / "n20.h5", *args, n=20)
    small = load_clients(tmp_path / "a.h5", range(10))
    large = load_clients(tmp_path / "n20.h5", range(20))
    for k in range(10):
        for key, value in small[k].items():
            assert np.array_equal(value, large[k][key]), (k, key)
    info = read_info(tmp_path / "n20.h5")
    assert (info.source, info.kind, info.input_shape, info.num_classes, info.partition) == \
        ("synthetic", "table", (60,), 10, "synthetic")
    assert info.mean == (0.0,) * 60 and info.std == (1.0,) * 60  # the engine's standardisation is the identity
    assert info.partition_params["alpha"] == 1.0 and info.partition_params["max_samples"] == 200


def test_a_clients_samples_follow_the_definition():
    """x ~ N(v_k, Σ) with Σ = diag(j^-1.2), y = argmax(W_k x + b_k) on the stored rows."""
    n = 20_000
    spec = SyntheticSpec(alpha=0.5, beta=2.0, num_clients=3, seed=4, min_samples=n, max_samples=n)
    model, _ = client_model(spec, 2)
    x, y = client_samples(spec, 2)
    assert x.dtype == np.float32 and x.shape == (n, 60) and y.dtype == np.int64
    assert COV_DIAG[0] == 1.0 and COV_DIAG[1] == pytest.approx(2 ** -1.2) and COV_DIAG[59] == pytest.approx(60 ** -1.2)
    # each feature's mean is v_kj to within 5 standard errors sqrt(Σ_jj / n)
    assert np.all(np.abs(x.mean(0, dtype=np.float64) - model.v) <= 5 * np.sqrt(COV_DIAG / n))
    # each feature's variance is Σ_jj (relative standard error sqrt(2 / n) = 1 %)
    assert np.allclose(x.var(0, dtype=np.float64) / COV_DIAG, 1.0, atol=0.05)
    assert np.array_equal(y, np.argmax(x.astype(np.float64) @ model.W.T + model.b, axis=1))
    assert model.W.shape == (10, 60) and model.b.shape == (10,) and model.v.shape == (60,)


def test_models_spread_by_alpha_and_inputs_by_beta():
    """Over 3,000 clients: mean(W_k, b_k) ≈ u_k ~ N(0, α²), mean(v_k) ≈ B_k ~ N(0, β²), each entry
    1 from its client's mean; W_k and b_k share u_k; u_k and B_k are independent."""
    spec = SyntheticSpec(alpha=0.5, beta=2.0, num_clients=3000, seed=1)
    models = [client_model(spec, k)[0] for k in range(spec.num_clients)]
    mw = np.array([np.concatenate([m.W.ravel(), m.b]).mean() for m in models])
    mv = np.array([m.v.mean() for m in models])
    # 610 and 60 entries of unit variance around u_k and B_k; sample std's relative error ~1.3 %
    assert mw.std() == pytest.approx(math.sqrt(0.5 ** 2 + 1 / 610), rel=0.06)
    assert mv.std() == pytest.approx(math.sqrt(2.0 ** 2 + 1 / 60), rel=0.06)
    within = np.concatenate([m.W.ravel() - m.W.mean() for m in models[:200]])
    assert within.std() == pytest.approx(1.0, rel=0.02)
    assert np.corrcoef(mw, mv)[0, 1] == pytest.approx(0.0, abs=0.08)
    mb = np.array([m.b.mean() for m in models])
    mW = np.array([m.W.mean() for m in models])
    # corr(mean W, mean b) = α² / sqrt((α² + 1/600)(α² + 1/10)) = 0.84 when they share u_k
    assert np.corrcoef(mW, mb)[0, 1] == pytest.approx(0.25 / math.sqrt((0.25 + 1 / 600) * 0.35), abs=0.04)


def test_synthetic_iid_shares_one_model_and_centres_the_inputs():
    spec = SyntheticSpec(alpha=0.0, beta=0.0, num_clients=5, seed=3, iid=True)
    W, b = shared_model(3)
    for k in range(5):
        model, _ = client_model(spec, k)
        assert np.array_equal(model.W, W) and np.array_equal(model.b, b) and not model.v.any()
    assert not np.array_equal(shared_model(4)[0], W)


def _p_at_least(t: float) -> float:
    """P(L ≥ t) for L ~ lognormal(4, 2)."""
    return 0.5 * math.erfc((math.log(t) - 4.0) / (2.0 * math.sqrt(2.0)))


def test_sizes_follow_fedprox_lognormal_law():
    """n_k − 50 = floor(L_k), L_k ~ lognormal(4, 2): the fraction of clients with n_k − 50 ≥ t
    is P(L ≥ t) (floor(L) ≥ t ⟺ L ≥ t for whole t), within 4.5 binomial standard errors."""
    spec = SyntheticSpec(alpha=1.0, beta=1.0, num_clients=20_000, seed=5)
    sizes = np.array([client_size(client_generator(5, k), spec) for k in range(spec.num_clients)])
    assert sizes.min() >= 50
    for t in (1, 20, 55, 148, 403, 3000):
        p = _p_at_least(t)
        assert abs(np.mean(sizes - 50 >= t) - p) <= 4.5 * math.sqrt(p * (1 - p) / len(sizes)), t
    assert _p_at_least(math.exp(4)) == pytest.approx(0.5)  # the median of L is e^4 ≈ 55
    capped = SyntheticSpec(alpha=1.0, beta=1.0, num_clients=1, seed=5, min_samples=10, max_samples=80)
    raw = np.array([client_size(client_generator(5, k), SyntheticSpec(1.0, 1.0, 1, 5, min_samples=10))
                    for k in range(500)])
    assert np.array_equal([client_size(client_generator(5, k), capped) for k in range(500)], np.minimum(raw, 80))


def test_shard_sizes_and_split_are_the_laws(tmp_path, capsys):
    generate(capsys, tmp_path / "s.h5", "--synthetic-alpha", 0, "--synthetic-beta", 0, "--synthetic-max-samples", 300,
             "--train-ratio", 0.9, "--seed", 7, n=30)
    info = read_info(tmp_path / "s.h5")
    spec = SyntheticSpec(0.0, 0.0, 30, 7, train_ratio=0.9, max_samples=300)
    n = np.array([client_size(client_generator(7, k), spec) for k in range(30)])
    assert np.array_equal(info.train_counts + info.test_counts, n)
    assert np.array_equal(info.test_counts, np.ceil(np.round(0.1 * n, 9)).astype(int))  # n_test = ceil(0.1 n)


def test_the_writer_takes_one_client_at_a_time_as_it_is_generated(monkeypatch, tmp_path):
    """With blocks of 64 rows, rows reach the file while later clients are still to be generated,
    and no client is generated before the writer took the one before it."""
    events = []
    monkeypatch.setattr(shard_write, "WRITE_SAMPLES", 64)
    monkeypatch.setattr(shard_write, "CHUNK_SAMPLES", 16)
    real_samples, real_check, real_close = synthetic.client_samples, shard_write._check_client, shard_write._Appender.close

    def samples(spec, k, shared=None):
        events.append(("generate", k))
        return real_samples(spec, k, shared)

    def check(i, *a, **kw):
        events.append(("take", i))
        return real_check(i, *a, **kw)

    def close(self):
        if self.fill:
            events.append(("write", self.ds.name))
        real_close(self)

    monkeypatch.setattr(synthetic, "client_samples", samples)
    monkeypatch.setattr(shard_write, "_check_client", check)
    monkeypatch.setattr(shard_write._Appender, "close", close)
    spec = SyntheticSpec(alpha=1.0, beta=1.0, num_clients=12, seed=2, min_samples=20, max_samples=40)
    write_synthetic_shard(spec, tmp_path / "s.h5", say=lambda *_: None)
    steps = [e for e in events if e[0] != "write"]
    assert steps == [(kind, k) for k in range(12) for kind in ("generate", "take")]
    last = events.index(("generate", 11))
    assert ("write", "/train_x") in events[:last]  # rows written before the last client exists
    clients = load_clients(tmp_path / "s.h5", range(12))
    for k in (0, 11):
        x, y = real_samples(spec, k)
        assert np.array_equal(np.concatenate([clients[k]["train_x"], clients[k]["test_x"]]), x)
        assert np.array_equal(np.concatenate([clients[k]["train_y"], clients[k]["test_y"]]), y)


@pytest.mark.parametrize("argv, fragments", [
    (["--synthetic-alpha", -1, "--synthetic-beta", 1, "--num-clients", 5], ["--synthetic-alpha must be a finite number >= 0, got -1.0"]),
    (["--synthetic-alpha", 1, "--synthetic-beta", -0.5, "--num-clients", 5], ["--synthetic-beta must be a finite number >= 0"]),
    (["--synthetic-alpha", "nan", "--synthetic-beta", 1, "--num-clients", 5], ["--synthetic-alpha must be a finite number"]),
    (["--synthetic-alpha", 1, "--synthetic-beta", 1, "--num-clients", 0], ["--num-clients must be >= 1, got 0"]),
    (["--synthetic-alpha", 1, "--synthetic-beta", 1], ["--num-clients is required"]),
    (["--synthetic-beta", 1, "--num-clients", 5], ["needs --synthetic-alpha", "--synthetic-iid"]),
    (["--synthetic-iid", "--synthetic-beta", 1, "--num-clients", 5], ["--synthetic-beta does not apply to --synthetic-iid"]),
    (["--synthetic-iid", "--num-clients", 5, "--synthetic-min-samples", 1], ["--synthetic-min-samples must be >= 2"]),
    (["--synthetic-iid", "--num-clients", 5, "--synthetic-max-samples", 10], ["--synthetic-max-samples (10) must be >= --synthetic-min-samples (50)"]),
    # beyond any machine: refused at once (10**13 clients ran on for a million hours; a huge smallest
    # client was numpy's MemoryError or "Maximum allowed dimension exceeded" traceback)
    (["--synthetic-iid", "--num-clients", 10**13], ["--num-clients must be at most 100,000,000 with --source synthetic",
                                                    "got 10,000,000,000,000"]),
    (["--synthetic-iid", "--num-clients", 1, "--synthetic-min-samples", 10**12],
     ["--synthetic-min-samples must be at most 10,000,000", "got 1,000,000,000,000"]),
    (["--synthetic-iid", "--num-clients", 1, "--synthetic-min-samples", 2**63 - 1],
     ["--synthetic-min-samples must be at most 10,000,000"]),
    (["--synthetic-iid", "--num-clients", 5, "--beta", 0.5], ["--beta applies to sources split among clients"]),
    (["--synthetic-iid", "--num-clients", 5, "--partition", "pat"], ["--partition applies to sources split among clients"]),
    (["--synthetic-iid", "--num-clients", 5, "--root", "data"], ["--root: --source synthetic generates its data"]),
    (["--synthetic-iid", "--num-clients", 5, "--leaf-task", "femnist"], ["--leaf-task applies to --source leaf only"]),
    # before the smallest client's split is worked out from it (which never ends for a ratio <= 0)
    (["--synthetic-iid", "--num-clients", 1, "--train-ratio", 0], ["--train-ratio must be between 0 and 1"]),
    (["--synthetic-alpha", 1, "--synthetic-beta", 1, "--num-clients", 1, "--train-ratio", -0.5],
     ["--train-ratio must be between 0 and 1 (exclusive), got -0.5"]),
    (["--synthetic-iid", "--num-clients", 5, "--seed", -1], ["--seed must be an integer in [0, 9223372036854775807]"]),
    (["--synthetic-iid", "--num-clients", 5, "--seed", 2**63], ["--seed must be an integer in [0,", f"got {2**63}"]),
    # finite, but what they generate is not: refused while generating, nothing written
    (["--synthetic-alpha", 1e308, "--synthetic-beta", 1e308, "--num-clients", 5],
     ["--synthetic-alpha 1e+308 and --synthetic-beta 1e+308 make client 0's features overflow"]),
])
def test_bad_arguments_are_refused_in_one_line(tmp_path, capsys, argv, fragments):
    expect_user_error(capsys, ["--source", "synthetic", "--out", tmp_path / "o.h5", *argv], *fragments)
    assert not (tmp_path / "o.h5").exists()


def test_synthetic_options_belong_to_the_synthetic_source(tmp_path, capsys):
    expect_user_error(capsys, ["--source", "digits", "--num-clients", 4, "--synthetic-beta", 1, "--out", tmp_path / "o.h5"],
                      "--synthetic-beta applies to --source synthetic only, not to 'digits'")
    expect_user_error(capsys, ["--describe", tmp_path / "x.h5", "--synthetic-iid"], "--synthetic-iid applies to --source synthetic only")


def test_sweep_shards_are_named_by_alpha_and_beta():
    spec = PartitionSpec(source="synthetic", synthetic_alpha=1, synthetic_beta=0.5, num_clients=1000)
    assert partition_file_name(spec) == "synthetic_a1.0_b0.5_n1000_s1.h5"
    capped = PartitionSpec(source="synthetic", synthetic_alpha=1, synthetic_beta=0.5, num_clients=1000,
                           synthetic_max_samples=100)
    assert partition_file_name(capped).startswith("synthetic_a1.0_b0.5_n1000_s1_") and partition_file_name(capped) != \
        partition_file_name(spec)
    assert partition_file_name(PartitionSpec(source="synthetic", synthetic_iid=True, num_clients=10)) == "synthetic_iid_n10_s1.h5"


def test_fedcp_learns_synthetic_in_two_rounds(tmp_path, capsys):
    generate(capsys, tmp_path / "s.h5", "--synthetic-alpha", 0.5, "--synthetic-beta", 0.5, "--synthetic-max-samples", 120,
             n=12)
    summary = run("configs/digits_fedcp.yaml",
                  ["rounds=2", "eval_every=1", "eval_batch_size=16", "threads=1", "local_epochs=2", "model=mlp",
                   f"data.path={tmp_path / 's.h5'}", "data.source=synthetic", f"out_dir={tmp_path / 'run'}"])
    rounds = [json.loads(line) for line in (Path(tmp_path / "run") / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rounds if r["kind"] == "round"]
    assert rounds[1]["train_loss"] < rounds[0]["train_loss"]
    assert summary["final_acc"] >= rounds[0]["acc"] + 0.3, (rounds[0]["acc"], summary["final_acc"])
