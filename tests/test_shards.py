"""Tests of the HDF5 shard format (fedcp_dist.data.shards) and the fedcp-partition CLI."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from fedcp_dist.cli.partition import main
from fedcp_dist.data import shards
from fedcp_dist.data.shards import (DESCRIBE_ROWS, FORMAT_VERSION, IMAGE_FORMAT_VERSION,
                                    TEXT_FORMAT_VERSION, WRITE_SAMPLES, describe_lines,
                                    load_clients, read_info, read_vocab, write_shard)
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import place_clients

REPO = Path(__file__).resolve().parents[1]
#: real MNIST: beside the main checkout (../shared) or, from a worktree in ../wt/, two levels up
MNIST_DIR = next((p for p in (REPO.parent / "shared" / "data" / "mnist",
                              REPO.parents[1] / "shared" / "data" / "mnist") if p.is_dir()),
                 REPO.parent / "shared" / "data" / "mnist")
SHAPE = (1, 8, 8)
C = 4


def make_clients(sizes, seed=0, shape=SHAPE, num_classes=C):
    """Random clients: ``sizes`` is a list of (n_train, n_test)."""
    rng = np.random.default_rng(seed)
    out = []
    for n_train, n_test in sizes:
        out.append((rng.integers(0, 256, (n_train,) + shape, dtype=np.uint8),
                    rng.integers(0, num_classes, n_train).astype(np.int64),
                    rng.integers(0, 256, (n_test,) + shape, dtype=np.uint8),
                    rng.integers(0, num_classes, n_test).astype(np.int64)))
    return out


def write(path, clients, **overrides):
    kw = dict(source="synthetic", num_classes=C, input_shape=SHAPE, mean=(0.5,), std=(0.5,),
              partition="dir", partition_params={"beta": 0.1, "train_ratio": 0.75}, seed=7)
    kw.update(overrides)
    write_shard(path, clients, **kw)


def leftovers(folder):
    return [p.name for p in Path(folder).iterdir() if ".tmp-" in p.name]


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("version", [FORMAT_VERSION, IMAGE_FORMAT_VERSION])
def test_round_trip(tmp_path, version):
    sizes = [(300, 100), (5, 2), (0, 3), (1, 0)]
    clients = make_clients(sizes)
    path = tmp_path / "sub" / "shard.h5"  # parent folder is created
    write(path, clients, format_version=version)
    assert path.exists() and leftovers(path.parent) == []

    info = read_info(path)
    assert info.format_version == version
    assert info.kind == "image" and info.source == "synthetic"
    assert info.num_classes == C and info.num_clients == len(sizes)
    assert info.input_shape == SHAPE
    assert info.mean == (0.5,) and info.std == (0.5,)
    assert info.partition == "dir"
    assert info.partition_params == {"beta": 0.1, "train_ratio": 0.75}
    assert info.seed == 7
    assert info.train_counts.tolist() == [s[0] for s in sizes]
    assert info.test_counts.tolist() == [s[1] for s in sizes]
    assert info.train_label_counts.shape == (len(sizes), C)
    for i, (_, train_y, _, test_y) in enumerate(clients):
        assert info.train_label_counts[i].tolist() == np.bincount(train_y, minlength=C).tolist()
        assert info.test_label_counts[i].tolist() == np.bincount(test_y, minlength=C).tolist()

    loaded = load_clients(path, [3, 0, 2, 0])  # any order, repeats
    assert sorted(loaded) == [0, 2, 3]
    for i in (0, 2, 3):
        for j, key in enumerate(["train_x", "train_y", "test_x", "test_y"]):
            arr = loaded[i][key]
            assert arr.dtype == (np.uint8 if key.endswith("_x") else np.int64)
            assert np.array_equal(arr, clients[i][j])
    assert loaded[2]["train_x"].shape == (0,) + SHAPE
    assert loaded[3]["test_x"].shape == (0,) + SHAPE

    with h5py.File(path, "r") as f:
        attrs = f.attrs
        assert attrs["input_shape"].dtype == np.int64
        assert attrs["mean"].dtype == np.float64
        if version == FORMAT_VERSION:
            # nothing that grows with the clients is an attribute
            assert not {"train_counts", "train_label_counts", "test_counts"} & set(attrs)
            assert "clients" not in f
            ds = f["train_x"]
            assert ds.shape == (306,) + SHAPE and f["test_y"].shape == (105,)
            assert f["train_offsets"][()].tolist() == [0, 300, 305, 305, 306]
            assert f["test_offsets"][()].tolist() == [0, 100, 102, 105, 105]
            assert f["train_label_counts"].dtype == np.int64
            assert f["train_y"].dtype == np.int64
        else:
            assert attrs["train_counts"].dtype == np.int64
            ds = f["clients/0/train_x"]
            assert f["clients/0/train_y"].dtype == np.int64
        assert ds.compression == "gzip" and ds.compression_opts == 4 and ds.shuffle
        assert ds.chunks[0] <= 256 and ds.chunks[1:] == SHAPE


def test_thousand_clients(tmp_path):
    """1,000 clients: the count arrays (80 KB each) no longer go into the 64 KiB attributes."""
    rng = np.random.default_rng(3)
    sizes = [(int(a), int(b)) for a, b in zip(rng.integers(0, 11, 1000), rng.integers(0, 4, 1000))]
    clients = make_clients(sizes, seed=4, shape=(1, 2, 2), num_classes=10)
    path = tmp_path / "n1000.h5"
    write(path, clients, num_classes=10, input_shape=(1, 2, 2))
    info = read_info(path)
    assert info.num_clients == 1000 and info.format_version == FORMAT_VERSION == 3
    assert info.train_counts.tolist() == [a for a, _ in sizes]
    assert info.test_counts.tolist() == [b for _, b in sizes]
    expected_train = np.stack([np.bincount(c[1], minlength=10) for c in clients])
    expected_test = np.stack([np.bincount(c[3], minlength=10) for c in clients])
    assert np.array_equal(info.train_label_counts, expected_train)
    assert np.array_equal(info.test_label_counts, expected_test)
    # one rank's clients of 8, scattered over the file; the rows cross a block boundary
    assert sum(a for a, _ in sizes) > WRITE_SAMPLES
    ids = list(range(3, 1000, 8)) + [999]
    loaded = load_clients(path, ids)
    for i in ids:
        for j, key in enumerate(["train_x", "train_y", "test_x", "test_y"]):
            assert np.array_equal(loaded[i][key], clients[i][j]), (i, key)
    # what failed before: versions 1 and 2 keep the counts in attributes
    with pytest.raises(ValueError, match="limits to 64 KiB: 1000 clients of 10 classes need "
                                         "80000 bytes; write format_version 3"):
        write(tmp_path / "v1.h5", clients, num_classes=10, input_shape=(1, 2, 2),
              format_version=IMAGE_FORMAT_VERSION)
    assert leftovers(tmp_path) == []


def test_load_all_clients_of_a_large_shard_is_exact(tmp_path):
    # 2,000 clients whose rows fill several read blocks: every client, then every other one
    sizes = [(i % 7, i % 3) for i in range(2000)]
    clients = make_clients(sizes, seed=5, shape=(1, 1, 3))
    path = tmp_path / "n2000.h5"
    write(path, clients, input_shape=(1, 1, 3))
    for ids in (range(2000), range(1, 2000, 2)):
        loaded = load_clients(path, ids)
        assert sorted(loaded) == list(ids)
        for i in ids:
            assert np.array_equal(loaded[i]["train_x"], clients[i][0])
            assert np.array_equal(loaded[i]["test_y"], clients[i][3])


def test_text_round_trip_version_3(tmp_path):
    vocab = ["<pad>", "<unk>", "a", "b", "c"]
    rng = np.random.default_rng(0)
    clients = []
    for n_train, n_test in [(3, 1), (0, 2), (5, 0)]:
        part = []
        for n in (n_train, n_test):
            part += [rng.integers(0, 5, (n, 4)).astype(np.int32), rng.integers(0, 3, n)]
        part += [rng.integers(0, 5, n_train).astype(np.int32),
                 rng.integers(0, 5, n_test).astype(np.int32)]
        clients.append(tuple(part))
    path = tmp_path / "t.h5"
    write(path, clients, kind="text", vocab=vocab, num_classes=3, input_shape=(4,), mean=(),
          std=())
    info = read_info(path)
    assert (info.format_version, info.kind, info.vocab_size) == (3, "text", 5)
    assert info.train_counts.tolist() == [3, 0, 5] and info.test_counts.tolist() == [1, 2, 0]
    assert read_vocab(path) == vocab
    loaded = load_clients(path, [0, 1, 2])
    keys = ["train_x", "train_y", "test_x", "test_y", "train_len", "test_len"]
    for i, client in enumerate(clients):
        for j, key in enumerate(keys):
            assert np.array_equal(loaded[i][key], client[j]), (i, key)
    assert loaded[0]["train_x"].dtype == np.int32 and loaded[2]["train_len"].dtype == np.int32
    with h5py.File(path, "r+") as f:
        f["train_x"][4, 1] = 7  # client 2's second row: a token id outside the vocabulary
    with pytest.raises(UserError, match=r"client 2 'train_x' holds token ids outside \[0, 5\)"):
        load_clients(path, [2])
    assert sorted(load_clients(path, [0, 1])) == [0, 1]


def test_write_version_matches_kind(tmp_path):
    with pytest.raises(ValueError, match="image shard is written as format_version 3 or 1, not 2"):
        write(tmp_path / "x.h5", make_clients([(1, 1)]), format_version=TEXT_FORMAT_VERSION)
    assert list(tmp_path.iterdir()) == []


def test_load_missing_client(tmp_path):
    path = tmp_path / "s.h5"
    write(path, make_clients([(3, 1), (2, 1)]))
    with pytest.raises(UserError, match=r"no client 5 \(it holds 2 clients\)"):
        load_clients(path, [0, 5])
    with pytest.raises(UserError, match=r"no client -1 \(it holds 2 clients\)"):
        load_clients(path, [-1])


@pytest.mark.parametrize("version, dataset", [(FORMAT_VERSION, "train_x"),
                                              (IMAGE_FORMAT_VERSION, "clients/0/train_x")])
def test_load_corrupt_dataset(tmp_path, version, dataset):
    path = tmp_path / "s.h5"
    write(path, make_clients([(600, 10)]), format_version=version)
    with h5py.File(path, "r") as f:
        chunk = f[dataset].id.get_chunk_info(0)
    with open(path, "r+b") as fh:  # overwrite the first compressed chunk with garbage
        fh.seek(chunk.byte_offset)
        fh.write(b"\xff" * chunk.size)
    with pytest.raises(UserError, match="corrupt"):
        load_clients(path, [0])


# ----------------------------------------------------------------------------- atomic writes


def test_failed_write_keeps_existing_file(tmp_path, monkeypatch):
    path = tmp_path / "s.h5"
    write(path, make_clients([(4, 2)] * 2))
    before = path.read_bytes()

    real_append = shards.write._Appender.append
    calls = []

    def failing_append(self, x):
        calls.append(self.ds.name)
        if len(calls) == 13:  # client 3's train_x
            raise RuntimeError("disk on fire")
        real_append(self, x)

    monkeypatch.setattr(shards.write._Appender, "append", failing_append)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write(path, make_clients([(5, 5)] * 6, seed=1))
    assert calls[-1] == "/train_x"
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []
    assert read_info(path).num_clients == 2


def test_failed_generator_leaves_nothing(tmp_path):
    def clients():
        yield from make_clients([(3, 1)] * 2)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        write(tmp_path / "new.h5", clients())
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- bad files


def test_read_info_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_info(tmp_path / "nope.h5")


def test_read_info_garbage_file(tmp_path):
    path = tmp_path / "garbage.h5"
    path.write_bytes(b"this is not hdf5\n" * 100)
    with pytest.raises(UserError, match="not a readable HDF5 file") as exc:
        read_info(path)
    assert "\n" not in str(exc.value)


def test_read_info_truncated_file(tmp_path):
    path = tmp_path / "s.h5"
    write(path, make_clients([(200, 50)] * 3))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated"):
        read_info(path)
    with pytest.raises(UserError, match="truncated"):
        load_clients(path, [0])


def test_read_info_wrong_version(tmp_path):
    path = tmp_path / "s.h5"
    write(path, make_clients([(3, 1)]))
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = np.int64(99)
    with pytest.raises(UserError, match=r"format_version 99.*reads format_version 1 \(images\), "
                                        r"2 \(images or text\) and 3"):
        read_info(path)
    with pytest.raises(UserError, match="format_version 99"):
        load_clients(path, [0])


def test_version_3_keeps_the_version_where_older_readers_look(tmp_path):
    # readers of versions 1 and 2 check the root attribute format_version against (1,) or
    # (1, 2) first, so they refuse this file by its number instead of misreading it
    path = tmp_path / "s.h5"
    write(path, make_clients([(3, 1)]))
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"].dtype == np.int64
        assert int(f.attrs["format_version"]) == 3


@pytest.mark.parametrize("version, attr", [(FORMAT_VERSION, "seed"),
                                           (IMAGE_FORMAT_VERSION, "train_label_counts")])
def test_read_info_missing_attribute(tmp_path, version, attr):
    path = tmp_path / "s.h5"
    write(path, make_clients([(3, 1)]), format_version=version)
    with h5py.File(path, "r+") as f:
        del f.attrs[attr]
    with pytest.raises(UserError, match=f"lacks the attribute '{attr}'"):
        read_info(path)


@pytest.mark.parametrize("damage, match", [
    ("no_offsets", "lacks the dataset 'train_offsets'"),
    ("no_label_counts", "lacks the dataset 'test_label_counts'"),
    ("no_test_y", "lacks the dataset 'test_y'"),
    ("offsets_shape", r"'train_offsets' is int64 of shape \(2,\), expected \(3,\)"),
    ("offsets_order", "'train_offsets' must start at 0 and never decrease"),
    ("offsets_end", r"'train_x' has \(5,\) rows but 'train_offsets' ends at 6"),
    ("label_counts", "'train_label_counts' does not add up"),
])
def test_read_info_damaged_version_3(tmp_path, damage, match):
    path = tmp_path / "s.h5"
    write(path, make_clients([(3, 1), (2, 2)]))
    with h5py.File(path, "r+") as f:
        if damage == "no_offsets":
            del f["train_offsets"]
        elif damage == "no_label_counts":
            del f["test_label_counts"]
        elif damage == "no_test_y":
            del f["test_y"]
        elif damage == "offsets_shape":
            del f["train_offsets"]
            f["train_offsets"] = np.array([0, 5])
        elif damage == "offsets_order":
            f["train_offsets"][1] = 6
        elif damage == "offsets_end":
            f["train_offsets"][2] = 6
        else:
            f["train_label_counts"][0, 0] += 1
    with pytest.raises(UserError, match=match):
        read_info(path)
    if damage.startswith("offsets") or damage.startswith("no_") and damage != "no_label_counts":
        with pytest.raises(UserError, match=match):
            load_clients(path, [0])


# ----------------------------------------------------------------------------- CLI


def run_cli(capsys, *argv):
    main(list(map(str, argv)))
    return capsys.readouterr()


def test_cli_digits_dir(tmp_path, capsys):
    out = tmp_path / "data" / "digits_dir.h5"
    res = run_cli(capsys, "--source", "digits", "--partition", "dir", "--num-clients", 10,
                  "--beta", 0.5, "--seed", 1, "--out", out)
    assert "loading" in res.out and "partitioning" in res.out and "writing 10 clients" in res.out
    assert str(out) in res.out.splitlines()[-1]
    info = read_info(out)
    assert info.num_clients == 10 and info.source == "digits" and info.partition == "dir"
    assert info.input_shape == (1, 28, 28) and info.num_classes == 10
    assert int(info.train_counts.sum() + info.test_counts.sum()) == 1797
    sizes = info.train_counts + info.test_counts
    assert sizes.min() >= 40  # least_samples
    assert info.partition_params["beta"] == 0.5 and info.seed == 1
    # what the redrawing did: in the output and in the file
    params = info.partition_params
    assert (params["least_samples"], params["topped_up_clients"], params["moved_samples"]) == \
        (40, 0, 0)
    i = int(np.argmin(sizes))
    assert (f"  dir: draw {params['draws']} gave every client >= 40 samples (least_samples); "
            f"smallest client {sizes[i]} samples ({info.train_counts[i]} train, "
            f"{info.test_counts[i]} test)") in res.out.splitlines()

    res = run_cli(capsys, "--describe", out)
    lines = res.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["client", "train", "test"])
    rows = lines[header + 1:header + 11]
    for i, row in enumerate(rows):
        fields = row.split()
        assert int(fields[0]) == i
        assert int(fields[1]) == info.train_counts[i] and int(fields[2]) == info.test_counts[i]
    assert lines[header + 11].split()[:3] == ["total", str(info.train_counts.sum()),
                                              str(info.test_counts.sum())]


def describe_shard(path):
    """60 clients: client i has i + 1 training samples of labels 0, 1, 2, 3, 0, ... and one
    test sample of label 0, except client 7, which has none."""
    clients = []
    for i in range(60):
        n_test = 0 if i == 7 else 1
        clients.append((np.zeros((i + 1,) + SHAPE, np.uint8), np.arange(i + 1) % 4,
                        np.zeros((n_test,) + SHAPE, np.uint8), np.zeros(n_test, np.int64)))
    write(path, clients)
    return path


def test_describe_summarises_many_clients(tmp_path, capsys):
    path = describe_shard(tmp_path / "d.h5")
    assert DESCRIBE_ROWS == 50
    lines = describe_lines(read_info(path))
    assert len(lines) == 24 and lines[6].startswith("fingerprint:      sha256:")
    at = next(k for k, line in enumerate(lines) if line.startswith("per client"))
    assert lines[at].split()[2:] == ["min", "5%", "25%", "median", "75%", "95%", "max", "mean"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[at + 1:at + 5]}
    # percentiles are sample values ("lower"): index floor(q / 100 * 59) of the sorted values
    assert rows["train"] == ["1", "3", "15", "30", "45", "57", "60", "30.50"]
    assert rows["test"] == ["0", "1", "1", "1", "1", "1", "1", "0.98"]
    # train + test: 2, 3, ..., 61 with client 7's 9 replaced by 8
    assert rows["samples"] == ["2", "4", "16", "31", "46", "58", "61", "31.48"]
    assert rows["classes"] == ["1", "3", "4", "4", "4", "4", "4", "3.90"]
    assert lines[at + 5] == "clients without train samples: 0, without test samples: 1"
    assert "--describe FILE --all" in lines[at + 7]
    assert [line.split()[:4] for line in lines[at + 9:at + 14]] == \
        [[str(i), str(i + 1), "1", str(min(i + 1, 4))] for i in range(5)]
    assert lines[-1].split() == ["total", "1830", "59", "4", "0-3"]

    res = run_cli(capsys, "--describe", path, "--all")
    lines = res.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["client", "train"])
    assert [line.split()[0] for line in lines[header + 1:]] == [str(i) for i in range(60)] + \
        ["total"]
    assert lines[header + 8].split()[:3] == ["7", "8", "0"]
    assert run_cli(capsys, "--describe", path).out.splitlines() == describe_lines(read_info(path))
    expect_user_error(capsys, ["--all", "--num-clients", 3, "--out", tmp_path / "x.h5"],
                      "--all applies to --describe only")


def test_cli_pat_iid_same_seed_reproducible(tmp_path, capsys):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for out in (a, b):
        run_cli(capsys, "--partition", "pat", "--num-clients", 20, "--classes-per-client", 2,
                "--seed", 3, "--out", out)
    la, lb = load_clients(a, range(20)), load_clients(b, range(20))
    for i in range(20):
        assert np.array_equal(la[i]["train_y"], lb[i]["train_y"])
        assert np.array_equal(la[i]["test_x"], lb[i]["test_x"])
    assert (read_info(a).train_label_counts + read_info(a).test_label_counts > 0).sum(1).max() == 2
    run_cli(capsys, "--partition", "iid", "--num-clients", 3, "--out", a, "--force")
    assert read_info(a).partition == "iid" and read_info(a).num_clients == 3


def expect_user_error(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(list(map(str, argv)))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err, err


def test_cli_bad_arguments(tmp_path, capsys):
    out = tmp_path / "x.h5"
    expect_user_error(capsys, ["--num-clients", -3, "--out", out], "--num-clients")
    expect_user_error(capsys, ["--source", "nope", "--num-clients", 3, "--out", out],
                      "unknown source 'nope'")
    # a misspelt source is said first (it said '--num-clients is required' of a source it did not know)
    expect_user_error(capsys, ["--source", "digitz", "--out", out], "unknown source 'digitz'")
    expect_user_error(capsys, ["--num-clients", "abc", "--out", out], "--num-clients")
    expect_user_error(capsys, ["--partition", "zipf", "--num-clients", 3, "--out", out],
                      "--partition")
    expect_user_error(capsys, ["--num-clients", 3], "--out")
    out.write_bytes(b"precious")
    expect_user_error(capsys, ["--num-clients", 3, "--out", out], "--force")
    assert out.read_bytes() == b"precious"
    expect_user_error(capsys, ["--describe", tmp_path / "missing.h5"], "does not exist")
    expect_user_error(capsys, ["--source", "mnist", "--root", tmp_path, "--num-clients", 3,
                               "--out", tmp_path / "m.h5"], "--download")


def test_cli_python_dash_m(tmp_path):
    path = tmp_path / "s.h5"
    write(path, make_clients([(3, 1), (2, 2)]))
    res = subprocess.run([sys.executable, "-m", "fedcp_dist.cli.partition", "--describe", path],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "synthetic" in res.stdout and "total" in res.stdout


# ----------------------------------------------------------------------------- npz import


def save_npz_clients(folder, clients, pickled):
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    for i, (train_x, train_y, test_x, test_y) in enumerate(clients):
        for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            path = folder / split / f"{i}.npz"
            if pickled:
                np.savez_compressed(path, data={"x": x, "y": y})
            else:
                np.savez_compressed(path, x=x, y=y)


def test_npz_import_direct_arrays(tmp_path, capsys):
    clients = make_clients([(6, 2), (4, 3), (5, 0)])
    save_npz_clients(tmp_path / "npz", clients, pickled=False)
    out = tmp_path / "imported.h5"
    run_cli(capsys, "--from-npz", tmp_path / "npz", "--out", out, "--source", "mine")
    info = read_info(out)
    assert info.partition == "npz" and info.source == "mine" and info.num_clients == 3
    assert info.partition_params == {"dir": str((tmp_path / "npz").resolve())}
    assert info.num_classes == max(int(c[1].max()) for c in clients) + 1
    assert info.input_shape == SHAPE and info.mean == (0.5,)
    loaded = load_clients(out, [0, 1, 2])
    for i, client in enumerate(clients):
        assert np.array_equal(loaded[i]["train_x"], client[0])
        assert np.array_equal(loaded[i]["test_y"], client[3])


def test_npz_import_pickled_float(tmp_path, capsys):
    # float images in [-1, 1] of shape (n, H, W), inside a pickled dict under 'data'
    raw = make_clients([(5, 2), (3, 3)], shape=(6, 6))
    floats = [(tx.astype(np.float32) / 255 * 2 - 1, ty, vx.astype(np.float32) / 255 * 2 - 1, vy)
              for tx, ty, vx, vy in raw]
    folder = tmp_path / "npz"
    save_npz_clients(folder, floats, pickled=True)
    out = tmp_path / "imported.h5"
    expect_user_error(capsys, ["--from-npz", folder, "--out", out], "--allow-pickle")
    assert not out.exists()

    run_cli(capsys, "--from-npz", folder, "--out", out, "--allow-pickle", "--num-classes", 10)
    info = read_info(out)
    assert info.num_classes == 10 and info.input_shape == (1, 6, 6)
    loaded = load_clients(out, [0, 1])
    for i, (tx, ty, vx, vy) in enumerate(raw):
        assert np.array_equal(loaded[i]["train_x"], tx[:, None])
        assert np.array_equal(loaded[i]["test_x"], vx[:, None])
        assert np.array_equal(loaded[i]["train_y"], ty)

    expect_user_error(capsys, ["--from-npz", folder, "--out", tmp_path / "o.h5",
                               "--allow-pickle", "--num-classes", 2], "--num-classes")


def test_npz_import_bad_layout(tmp_path, capsys):
    folder = tmp_path / "npz"
    save_npz_clients(folder, make_clients([(2, 1)] * 3), pickled=False)
    os.remove(folder / "train" / "1.npz")
    expect_user_error(capsys, ["--from-npz", folder, "--out", tmp_path / "o.h5"], "missing 1.npz")
    expect_user_error(capsys, ["--from-npz", tmp_path / "none", "--out", tmp_path / "o.h5"],
                      "does not exist")
    # float images holding NaN: named as such (it said "found values in [-1, 1]")
    nan_folder = tmp_path / "nan"
    clients = make_clients([(2, 1)] * 2)
    x = clients[1][0].astype(np.float32) / 255 * 2 - 1
    x[0, 0, 0, 0] = np.nan
    clients[1] = (x, *clients[1][1:])
    save_npz_clients(nan_folder, clients, pickled=False)
    expect_user_error(capsys, ["--from-npz", nan_folder, "--out", tmp_path / "o.h5"],
                      "x holds NaN (at index (0, 0, 0, 0))")


# ----------------------------------------------------------------------------- real MNIST


def test_cli_real_mnist_thousand_clients(tmp_path, capsys):
    if not MNIST_DIR.is_dir():
        pytest.skip(f"real MNIST not found at {MNIST_DIR}")
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in MNIST_DIR.glob("*-ubyte.gz"):
        with gzip.open(gz, "rb") as src, open(raw / gz.name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst)
    out = tmp_path / "mnist.h5"
    res = run_cli(capsys, "--source", "mnist", "--root", tmp_path / "root", "--partition", "dir",
                  "--beta", 1.0, "--num-clients", 1000, "--out", out)
    info = read_info(out)
    assert info.source == "mnist" and info.num_clients == 1000
    assert info.input_shape == (1, 28, 28) and info.num_classes == 10
    assert int(info.train_counts.sum() + info.test_counts.sum()) == 70_000
    assert info.train_label_counts.sum() + info.test_label_counts.sum() == 70_000
    # least_samples = int(min(10 / 0.25, 70,000 / 1,000 / 2)) = 35, reached by a top-up
    assert (info.train_counts + info.test_counts).min() == 35
    assert info.train_counts.min() >= 1 and info.test_counts.min() >= 1
    params = info.partition_params
    assert params["least_samples"] == 35 and params["moved_samples"] > 0
    assert f"topped up with {params['moved_samples']} samples" in res.out
    clients = load_clients(out, range(0, 1000, 8))
    for cid, client in clients.items():
        assert client["train_x"].shape == (info.train_counts[cid], 1, 28, 28)
        assert client["train_x"].dtype == np.uint8
        assert np.bincount(client["test_y"], minlength=10).tolist() == \
            info.test_label_counts[cid].tolist()


# ----------------------------------------------------------------------------- bench/scale.py


def test_scale_bench_runs(tmp_path):
    out = tmp_path / "scale.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--source", "digits",
                          "--clients", "300", "--world-sizes", "1", "2", "--json", out,
                          "--work", tmp_path / "work", "--keep"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["partition"], r["num_clients"]) for r in rows] == [("iid", 300), ("dir", 300)]
    assert len(res.stdout.splitlines()) == 2 + len(rows)
    for r in rows:
        info = read_info(tmp_path / "work" / f"digits_{r['partition']}_n300.h5")
        sizes = info.train_counts + info.test_counts
        assert r["smallest_client"] == sizes.min() and sizes.sum() == 1797
        assert (r["min_train"], r["min_test"]) == (info.train_counts.min(), info.test_counts.min())
        one, two = r["loads"]
        assert (one["world_size"], one["clients"], one["samples"]) == (1, 300, 1797)
        owned = place_clients(info.train_counts, 2) == 0
        assert (two["clients"], two["samples"]) == (owned.sum(), sizes[owned].sum())
        assert r["file_mb"] > 0 and one["peak_rss_mb"] >= one["rss_before_mb"] > 0 and r["digest_seconds"] > 0
    assert rows[0]["draws"] is None and rows[1]["draws"] >= 1
    assert rows[1]["moved_samples"] == read_info(
        tmp_path / "work" / "digits_dir_n300.h5").partition_params["moved_samples"]
