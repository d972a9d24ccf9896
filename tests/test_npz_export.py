"""``fedcp-partition --to-npz``: a shard's clients in the reference library's per-client npz layout,
read back with numpy as the library reads them and compared with the shard's samples."""
import csv
import json

import numpy as np
import torch

from fedcp_dist.cli.partition import main
from fedcp_dist.data.npz_export import client_arrays
from fedcp_dist.data.resident import to_device
from fedcp_dist.data.shards import load_clients, read_info
from helpers import expect_user_error


def read_npz(path):
    """As the library's read_data: np.load(f, allow_pickle=True)['data'].tolist()."""
    with open(path, "rb") as f:
        return np.load(f, allow_pickle=True)["data"].tolist()


def test_export_round_trip_on_a_tiny_shard(digits6, tmp_path, capsys):
    out = tmp_path / "DIGITS"
    main(["--to-npz", str(out), "--shard", str(digits6)])
    assert "wrote" in capsys.readouterr().out
    info = read_info(digits6)
    clients = load_clients(digits6, range(info.num_clients))
    assert sorted(p.name for p in (out / "train").iterdir()) == sorted(f"{i}.npz" for i in range(6))
    for i, a in clients.items():
        for split in ("train", "test"):
            data = read_npz(out / split / f"{i}.npz")
            assert set(data) == {"x", "y"}
            x, y = data["x"], data["y"]
            raw = a[f"{split}_x"]
            assert x.dtype == np.float32 and x.shape == raw.shape == (len(raw), 1, 28, 28)
            assert y.dtype == np.int64 and np.array_equal(y, a[f"{split}_y"])
            # ToTensor then Normalize(0.5, 0.5), as the library's MNIST generator
            assert np.array_equal(x, (raw.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5))
            assert x.min() >= -1 and x.max() <= 1 and (x == -1).any()
            # the values the engine trains on, up to the last bit
            dev = to_device(i, a, info.mean, info.std, torch.device("cpu"))
            engine = dev.train_batch()[0] if split == "train" else dev.test_batch(0, len(raw))[0]
            assert np.allclose(engine.contiguous().numpy(), x, atol=1e-6, rtol=0)
    cfg = json.loads((out / "config.json").read_text())
    labels = info.train_label_counts + info.test_label_counts
    assert cfg["num_clients"] == 6 and cfg["num_classes"] == info.num_classes == 10
    assert (cfg["non_iid"], cfg["balance"], cfg["partition"], cfg["alpha"], cfg["batch_size"]) == (True, False, "dir", 0.5, 10)
    assert cfg["Size of samples for labels in clients"][2] == [[c, int(n)] for c, n in enumerate(labels[2]) if n]
    assert (cfg["source"], cfg["seed"], cfg["mean"], cfg["std"]) == ("digits", 2, [0.5], [0.5])
    # and back: the import of that layout gives the shard's samples again, bit for bit
    back = tmp_path / "back.h5"
    main(["--from-npz", str(out), "--allow-pickle", "--out", str(back), "--num-classes", "10"])
    again = load_clients(back, range(6))
    for i in range(6):
        for key in ("train_x", "train_y", "test_x", "test_y"):
            assert np.array_equal(again[i][key], clients[i][key]), (i, key)


def test_the_import_of_an_export_keeps_classes_no_sample_holds(digits6, tmp_path, capsys):
    """An export's config.json says num_classes; the import used the largest label + 1, so a shard
    whose last classes hold no sample came back with fewer classes (another head, another
    fingerprint). --num-classes still wins, and a config.json that says too few is refused."""
    from fedcp_dist.data.shards import write_shard

    rng = np.random.default_rng(3)
    clients = [(rng.integers(0, 256, (5, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, 5),
                rng.integers(0, 256, (2, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, 2)) for _ in range(3)]
    shard = tmp_path / "s.h5"
    write_shard(shard, clients, source="mine", num_classes=7, input_shape=(1, 8, 8), mean=[0.5], std=[0.5],
                partition="iid", partition_params={}, seed=0)
    main(["--to-npz", str(tmp_path / "E"), "--shard", str(shard)])
    main(["--from-npz", str(tmp_path / "E"), "--allow-pickle", "--out", str(tmp_path / "b.h5")])
    assert read_info(tmp_path / "b.h5").num_classes == 7
    main(["--from-npz", str(tmp_path / "E"), "--allow-pickle", "--out", str(tmp_path / "c.h5"), "--num-classes", "9"])
    assert read_info(tmp_path / "c.h5").num_classes == 9
    cfg = json.loads((tmp_path / "E" / "config.json").read_text())
    (tmp_path / "E" / "config.json").write_text(json.dumps({**cfg, "num_classes": 2}))
    expect_user_error(capsys, ["--from-npz", tmp_path / "E", "--allow-pickle", "--out", tmp_path / "d.h5"],
                      "config.json's num_classes 2 is too small: labels go up to 2")
    # more classes than any shard takes (2,000,000 asked numpy for 61 GiB, 10**20 overflowed h5py: tracebacks)
    (tmp_path / "E" / "config.json").write_text(json.dumps({**cfg, "num_classes": 10**20}))
    expect_user_error(capsys, ["--from-npz", tmp_path / "E", "--allow-pickle", "--out", tmp_path / "d.h5"],
                      "config.json's num_classes 100000000000000000000 is more than the 100,000 classes a shard takes")
    expect_user_error(capsys, ["--from-npz", tmp_path / "E", "--allow-pickle", "--out", tmp_path / "d.h5",
                               "--num-classes", "2000000"], "--num-classes 2000000 is more than the 100,000 classes")
    assert not (tmp_path / "d.h5").exists()


def test_partition_and_export_in_one_command(tmp_path, capsys):
    shard, out = tmp_path / "p.h5", tmp_path / "P"
    main(["--source", "digits", "--partition", "pat", "--classes-per-client", "2", "--unbalanced",
          "--num-clients", "5", "--seed", "3", "--out", str(shard), "--to-npz", str(out)])
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["partition"], cfg["balance"], cfg["non_iid"], cfg["alpha"], cfg["seed"]) == ("pat", False, True, None, 3)
    assert all(len(row) <= 2 for row in cfg["Size of samples for labels in clients"])
    a = load_clients(shard, [3])[3]
    assert np.array_equal(read_npz(out / "test" / "3.npz")["y"], a["test_y"])
    # --force replaces an earlier export whole: nothing of it is left, and no temporary folder
    (out / "stale.txt").write_text("x")
    main(["--to-npz", str(out), "--shard", str(shard), "--force"])
    assert not (out / "stale.txt").exists() and (out / "train" / "0.npz").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P", "p.h5"]


def test_export_refusals_name_the_problem(digits6, tmp_path, capsys):
    out = tmp_path / "E"
    out.mkdir()
    expect_user_error(capsys, ["--to-npz", out, "--shard", digits6], "exists", "--force")
    # refused before the shard is made, so nothing is written
    expect_user_error(capsys, ["--source", "digits", "--num-clients", 4, "--out", tmp_path / "n.h5", "--to-npz", out],
                      "exists")
    assert not (tmp_path / "n.h5").exists()
    (tmp_path / "file").write_text("x")
    expect_user_error(capsys, ["--source", "digits", "--num-clients", 4, "--out", tmp_path / "n.h5", "--to-npz",
                               tmp_path / "file" / "no" / "F"], "is a file, not a folder")
    assert not (tmp_path / "n.h5").exists()
    expect_user_error(capsys, ["--shard", digits6], "--shard", "--to-npz")
    expect_user_error(capsys, ["--to-npz", tmp_path / "F"], "--shard FILE", "--out FILE")
    expect_user_error(capsys, ["--to-npz", tmp_path / "F", "--shard", digits6, "--source", "digits"], "--source")
    expect_user_error(capsys, ["--to-npz", tmp_path / "F", "--shard", tmp_path / "none.h5"], "no such file")
    expect_user_error(capsys, ["--to-npz", tmp_path / "F", "--describe", digits6], "--describe")
    expect_user_error(capsys, ["--to-npz", tmp_path / "F", "--shard", digits6, "--max-len", 5], "--max-len")
    expect_user_error(capsys, ["--to-npz", tmp_path / "file" / "F", "--shard", digits6], "is a file")
    assert not (tmp_path / "F").exists() and list(out.iterdir()) == []
    # missing folders above DIR are made, as --out makes the shard's
    main(["--to-npz", str(tmp_path / "no" / "such" / "F"), "--shard", str(digits6)])
    assert sorted(p.name for p in (tmp_path / "no" / "such").iterdir()) == ["F"]
    assert (tmp_path / "no" / "such" / "F" / "test" / "0.npz").is_file()


def test_table_and_text_clients_in_the_library_layout(tmp_path, capsys):
    # a table: standardised with the shard's per-feature statistics
    rows = [[float(i), float(i % 3), i % 2, f"b{i % 2}"] for i in range(40)]
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "y", "bank"])
        w.writerows(rows)
    shard = tmp_path / "t.h5"
    main(["--source", "csv", "--root", str(tmp_path / "t.csv"), "--label-col", "y", "--client-col", "bank",
          "--partition", "column", "--out", str(shard), "--to-npz", str(tmp_path / "T")])
    info, a = read_info(shard), load_clients(shard, [1])[1]
    x = read_npz(tmp_path / "T" / "train" / "1.npz")["x"]
    want = (a["train_x"] - np.asarray(info.mean, np.float32)) / np.asarray(info.std, np.float32)
    assert x.dtype == np.float32 and x.shape == a["train_x"].shape and np.array_equal(x, want)
    assert abs(float(x[:, 0].mean())) < 1.0  # standardised, not raw (raw column a runs 0..39)
    assert json.loads((tmp_path / "T" / "config.json").read_text())["partition"] is None
    # --from-npz reads images only: a table's export is refused by name (it failed on the first client's shape)
    expect_user_error(capsys, ["--from-npz", tmp_path / "T", "--allow-pickle", "--out", tmp_path / "b.h5"],
                      "is the export of a table shard")
    assert not (tmp_path / "b.h5").exists()
    # text: (token ids, real length) pairs, as the library's AG News generator stores them
    ids = np.array([[5, 6, 0, 0], [7, 0, 0, 0]], dtype=np.int32)
    d = client_arrays("text", ids, np.array([1, 3]), np.array([2, 1], dtype=np.int32), (), ())
    assert d["x"].shape == (2, 2) and d["x"].dtype == object and d["y"].dtype == np.int64
    X, lens = zip(*d["x"])  # the library's process_text
    assert np.array_equal(np.stack(X), ids.astype(np.int64)) and list(lens) == [2, 1]


def test_partition_options_that_would_be_ignored_are_refused(digits6, tmp_path, capsys):
    """Each of these exited 0 and wrote a shard as if the option were not there."""
    main(["--to-npz", str(tmp_path / "E"), "--shard", str(digits6)])
    out = ["--out", tmp_path / "x.h5"]
    npz = ["--from-npz", tmp_path / "E", "--allow-pickle", *out]
    digits = ["--source", "digits", "--num-clients", 5, *out]
    for argv, said in (
            ([*npz, "--num-clients", 3], "--num-clients does not apply to --from-npz, which keeps the clients as stored"),
            ([*npz, "--beta", 0.5], "--beta does not apply to --from-npz, which keeps the clients as stored"),
            ([*npz, "--seed", 4], "--seed does not apply to --from-npz, which keeps the clients as stored"),
            ([*digits, "--classes-per-client", 3], "--classes-per-client applies to --partition pat only, not to "
                                                   "--partition dir"),
            ([*digits, "--partition", "iid", "--beta", 0.5], "--beta applies to --partition dir only, not to "
                                                             "--partition iid"),
            ([*digits, "--partition", "iid", "--unbalanced"], "--unbalanced applies to --partition pat only, not to "
                                                              "--partition iid"),
            ([*digits, "--partition", "pat", "--max-tries", 3], "--max-tries applies to --partition dir only, not to "
                                                                "--partition pat"),
            ([*digits, "--num-classes", 3], "--num-classes applies to --from-npz only"),
            ([*digits, "--allow-pickle"], "--allow-pickle applies to --from-npz only"),
            ([*digits, "--root", tmp_path], "--root: --source digits is embedded (scikit-learn's) and reads no files"),
            # given at their default values, they would be ignored all the same
            ([*npz, "--seed", 1], "--seed does not apply to --from-npz, which keeps the clients as stored"),
            ([*npz, "--train-ratio=0.75"], "--train-ratio does not apply to --from-npz, which keeps the clients as "
                                           "stored"),
            ([*digits, "--partition", "iid", "--beta", 0.1], "--beta applies to --partition dir only, not to "
                                                             "--partition iid"),
            ([*digits, "--classes-per-client", 2], "--classes-per-client applies to --partition pat only, not to "
                                                   "--partition dir"),
            ([*digits, "--synthetic-min-samples", 50], "--synthetic-min-samples applies to --source synthetic only, "
                                                       "not to 'digits'")):
        expect_user_error(capsys, argv, said)
    assert not (tmp_path / "x.h5").exists()
    main([str(a) for a in (*digits, "--partition", "pat", "--classes-per-client", 4, "--unbalanced")])  # its own scheme
    assert read_info(tmp_path / "x.h5").num_clients == 5


def test_options_that_describe_an_export_or_an_import_would_ignore_are_refused(digits6, tmp_path, capsys):
    """`--describe FILE` with `--out`, `--force`, `--source` or an own-data option (`--image-size`,
    `--label-col` …), and `--from-npz` or `--shard` with an own-data option, exited 0 as if the
    option were not there (the same options are refused beside a built-in source)."""
    main(["--to-npz", str(tmp_path / "E"), "--shard", str(digits6)])
    describe = ["--describe", digits6]
    npz = ["--from-npz", tmp_path / "E", "--allow-pickle", "--out", tmp_path / "x.h5"]
    export = ["--shard", digits6, "--to-npz", tmp_path / "F"]
    for argv, said in (
            ([*describe, "--out", tmp_path / "y.h5"], "--out does not apply to --describe, which only reads FILE"),
            ([*describe, "--force"], "--force does not apply to --describe, which only reads FILE"),
            ([*describe, "--source", "mnist"], "--source does not apply to --describe, which only reads FILE"),
            ([*describe, "--image-size", 32], "--image-size applies to --source imagefolder only"),
            ([*describe, "--label-col", "y"], "--label-col applies to --source csv only"),
            ([*npz, "--channels", 3], "--channels applies to --source imagefolder only"),
            ([*export, "--drop-cols", "a"], "--drop-cols applies to --source csv only")):
        expect_user_error(capsys, argv, said)
    assert not (tmp_path / "x.h5").exists() and not (tmp_path / "F").exists() and not (tmp_path / "y.h5").exists()
