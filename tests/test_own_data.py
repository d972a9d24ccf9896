"""Users' own data: image folders (PNG, JPEG through Pillow) and CSV tables, written here in their
real on-disk formats and partitioned through ``fedcp-partition`` in-process; the table path's
standardisation, the mlp model, the binary metrics, FedCP's extended client vector, and the two
presets run end to end."""
import csv
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, run_cmd
from fedcp_dist.cli.partition import main
from fedcp_dist.data.owndata import train_statistics
from fedcp_dist.data.resident import to_device
from fedcp_dist.data.shards import load_clients, read_info
from fedcp_dist.errors import UserError
from fedcp_dist.engine.evaluation import EvalSums, binary_metrics
from helpers import expect_user_error, run

CPU = torch.device("cpu")


def cli(capsys, *argv):
    main([str(a) for a in argv])
    return capsys.readouterr()


def solid(path, rgb, size=(12, 10)):
    """A solid-colour RGB image of ``size`` (width, height), saved in the format of its suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, tuple(rgb)).save(path)


def all_rows(path):
    info = read_info(path)
    data = load_clients(path, range(info.num_clients))
    return info, data


# ---------------------------------------------------------------------------------------------
# image folders


def test_a_class_folder_without_images_is_refused(tmp_path, capsys):
    """An empty class folder became a class of 0 samples: a model output nobody is labelled with."""
    root = tmp_path / "imgs"
    for c in ("a", "c"):
        for i in range(4):
            solid(root / c / f"{i}.png", (100, 200, 50))
    (root / "b").mkdir()
    (root / "b" / "readme.txt").write_text("no image")
    expect_user_error(capsys, ["--source", "imagefolder", "--root", root, "--partition", "iid", "--num-clients", 2,
                               "--out", tmp_path / "g.h5"], f"class folder 'b' under {root} holds no image")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]


def test_imagefolder_reads_png_and_jpeg_resizes_and_converts(tmp_path, capsys):
    root = tmp_path / "imgs"
    # class folders in sorted order: "a" = 0, "b" = 1; a non-image file is skipped
    for i in range(6):
        solid(root / "a" / f"{i}.png", (100, 200, 50))
        solid(root / "b" / f"{i}.jpg", (0, 0, 0), size=(20, 30))
    (root / "b" / "notes.txt").write_text("not an image")
    out = cli(capsys, "--source", "imagefolder", "--root", root, "--partition", "iid", "--num-clients", 2,
              "--image-size", "6x8", "--channels", 1, "--out", tmp_path / "g.h5")
    assert "12 images in 2 classes" in out.out and "1 other files skipped" in out.out
    info, data = all_rows(tmp_path / "g.h5")
    assert info.input_shape == (1, 6, 8) and info.num_classes == 2 and info.format_version == 3
    assert info.partition_params["classes"] == ["a", "b"]
    assert int(info.train_counts.sum() + info.test_counts.sum()) == 12
    for arrays in data.values():
        for split in ("train", "test"):
            x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
            # Pillow's L = (299 R + 587 G + 114 B) / 1000: (29900 + 117400 + 5700) / 1000 = 153
            assert np.all(x[y == 0] == 153) and np.all(x[y == 1] == 0)

    # defaults: the first image's size (10 high, 12 wide) and its mode (RGB: 3 channels)
    cli(capsys, "--source", "imagefolder", "--root", root, "--partition", "iid", "--num-clients", 1,
        "--out", tmp_path / "d.h5")
    info, data = all_rows(tmp_path / "d.h5")
    assert info.input_shape == (3, 10, 12)
    x, y = data[0]["train_x"], data[0]["train_y"]
    assert np.all(x[y == 0][:, 0] == 100) and np.all(x[y == 0][:, 1] == 200) and np.all(x[y == 0][:, 2] == 50)


def test_a_class_folders_sub_folders_are_read_in_order_and_a_folder_link_once(tmp_path):
    """Images in ROOT/<class>/<sub>/ were skipped (counted as one "other file"), where torchvision's
    ImageFolder reads them as the class's; so were images behind a link to a folder (stored on
    another disk, say), which torchvision follows. A link back to a folder already read (a loop) is
    not read again."""
    from fedcp_dist.data.owndata import _class_files, _image_suffixes

    root = tmp_path / "imgs"
    for rel in ("a/1.png", "a/z/2.png", "a/b/3.png", "a/b/c/4.png", "a/.hidden/5.png", "b/6.png"):
        solid(root / rel, (9, 9, 9))
    solid(tmp_path / "elsewhere" / "7.png", (9, 9, 9))
    (root / "a" / "b" / "loop").symlink_to(root / "a", target_is_directory=True)  # would never end
    (root / "a" / "b" / "far").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "b" / "notes.txt").write_text("x")
    (root / "a" / "up").symlink_to(root, target_is_directory=True)  # b's images would be a's too
    (root / "a" / "other").symlink_to(root / "b", target_is_directory=True)
    classes, skipped = _class_files(root, _image_suffixes())
    # a folder's files first, then its sub-folders in sorted order, depth first; hidden ones left out
    assert [str(p.relative_to(root)) for p in classes["a"]] == [
        "a/1.png", "a/b/3.png", "a/b/c/4.png", "a/b/far/7.png", "a/z/2.png"]
    assert [p.name for p in classes["b"]] == ["6.png"]
    assert skipped == 3  # notes.txt, and the links into ROOT outside class a's folder


def test_folders_partition_makes_each_hospital_a_client_with_its_own_split(tmp_path, capsys):
    root = tmp_path / "ct"
    sizes = {"hospA": {"covid": 4, "normal": 4}, "hospB": {"normal": 6, "pneumonia": 6}, "hospC": {"covid": 4}}
    for h, classes in sizes.items():
        for c, n in classes.items():
            for i in range(n):
                solid(root / h / c / f"{i}.png", (10 * i, 0, 0), size=(8, 8))
    out = cli(capsys, "--source", "imagefolder", "--root", root, "--partition", "folders", "--out", tmp_path / "f.h5")
    assert "3 client folders" in out.out
    info, data = all_rows(tmp_path / "f.h5")
    assert info.num_clients == 3 and info.partition == "folders"
    assert info.partition_params["clients"] == ["hospA", "hospB", "hospC"]
    assert info.partition_params["classes"] == ["covid", "normal", "pneumonia"]
    # each client's own 75/25 split: n_test = ceil(0.25 n): 8 -> 2, 12 -> 3, 4 -> 1
    assert info.train_counts.tolist() == [6, 9, 3] and info.test_counts.tolist() == [2, 3, 1]
    labels = info.train_label_counts + info.test_label_counts
    assert labels.tolist() == [[4, 4, 0], [0, 6, 6], [4, 0, 0]]
    expect_user_error(capsys, ["--source", "imagefolder", "--root", root, "--partition", "folders",
                               "--num-clients", 5, "--out", tmp_path / "x.h5"], "--num-clients is 5", "3 clients")
    expect_user_error(capsys, ["--source", "digits", "--partition", "folders", "--out", tmp_path / "x.h5"],
                      "--partition folders applies to --source imagefolder only")


def test_an_unreadable_image_is_a_one_line_error_naming_it(tmp_path, capsys):
    root = tmp_path / "imgs"
    for i in range(3):
        solid(root / "a" / f"{i}.png", (1, 2, 3))
    bad = root / "a" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not a PNG body")
    expect_user_error(capsys, ["--source", "imagefolder", "--root", root, "--partition", "iid", "--num-clients", 1,
                               "--out", tmp_path / "x.h5"], str(bad), "is not a readable image")
    assert not (tmp_path / "x.h5").exists()
    expect_user_error(capsys, ["--source", "imagefolder", "--root", tmp_path / "nowhere", "--partition", "iid",
                               "--num-clients", 1, "--out", tmp_path / "x.h5"], "is not a directory")
    expect_user_error(capsys, ["--source", "imagefolder", "--root", root, "--image-size", "0x3", "--num-clients", 1,
                               "--out", tmp_path / "x.h5"], "--image-size")


# ---------------------------------------------------------------------------------------------
# CSV tables


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_standardisation_statistics_by_hand():
    x = np.array([[1.0, 7.0], [3.0, 7.0], [5.0, 7.0], [100.0, -50.0]], dtype=np.float32)
    # the test row (100, -50) is left out: mean (1 + 3 + 5) / 3 = 3, variance (4 + 0 + 4) / 3;
    # the constant second feature gets std 1
    mean, std = train_statistics(x, [(np.array([0, 2]), np.array([3])), (np.array([1]), np.array([], dtype=np.int64))])
    assert mean.tolist() == [3.0, 7.0]
    assert std[0] == pytest.approx(math.sqrt(8 / 3)) and std[1] == 1.0


def test_csv_shard_stores_train_only_statistics_and_the_engine_standardises(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        bank = f"bank{i % 2}"
        rows.append([f"{rng.normal(10, 3):.4f}", f"{rng.normal(-5, 0.5):.4f}", "yes" if i % 4 == 0 else "no", bank, i])
    path = write_csv(tmp_path / "t.csv", ["amount", "age", "fraud", "bank", "id"], rows)
    out = cli(capsys, "--source", "csv", "--root", path, "--label-col", "fraud", "--client-col", "bank",
              "--partition", "column", "--drop-cols", "id", "--out", tmp_path / "t.h5")
    assert "2 feature columns, 2 classes (no, yes)" in out.out
    info, data = all_rows(tmp_path / "t.h5")
    assert info.kind == "table" and info.input_shape == (2,) and info.num_clients == 2
    assert info.partition_params["clients"] == ["bank0", "bank1"] and info.partition_params["classes"] == ["no", "yes"]
    assert info.train_counts.tolist() == [15, 15] and info.test_counts.tolist() == [5, 5]
    train = np.concatenate([d["train_x"] for d in data.values()]).astype(np.float64)
    test = np.concatenate([d["test_x"] for d in data.values()]).astype(np.float64)
    everything = np.concatenate([train, test])
    assert np.allclose(info.mean, train.mean(0)) and np.allclose(info.std, train.std(0))
    assert not np.allclose(info.mean, everything.mean(0))  # the test rows are not in it
    # the raw rows are kept: the first row of the CSV is in some client exactly as written
    first = np.array([float(rows[0][0]), float(rows[0][1])], dtype=np.float32)
    assert any((d[s] == first).all(1).any() for d in data.values() for s in ("train_x", "test_x"))
    # labels: "no" = 0, "yes" = 1 (every fourth row)
    assert int((info.train_label_counts + info.test_label_counts)[:, 1].sum()) == 10
    # the engine standardises every batch: over all training rows, mean 0 and std 1
    cds = [to_device(c, d, info.mean, info.std, CPU) for c, d in data.items()]
    z = torch.cat([cd.train_batch()[0] for cd in cds]).double()
    assert torch.allclose(z.mean(0), torch.zeros(2, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(z.std(0, unbiased=False), torch.ones(2, dtype=torch.float64), atol=1e-5)
    described = cli(capsys, "--describe", tmp_path / "t.h5").out
    assert "csv (table, input (2,), 2 classes)" in described
    assert f"train-row mean/std {info.mean[0]:.4g}/{info.std[0]:.4g}" in described
    # integer labels sort numerically, not as text
    write_csv(tmp_path / "n.csv", ["f", "y"], [[i, 10 if i % 2 else 2] for i in range(8)])
    cli(capsys, "--source", "csv", "--root", tmp_path / "n.csv", "--label-col", "y", "--partition", "iid",
        "--num-clients", 2, "--out", tmp_path / "n.h5")
    assert read_info(tmp_path / "n.h5").partition_params["classes"] == [2, 10]


def test_csv_bad_inputs_are_one_line_errors(tmp_path, capsys):
    path = write_csv(tmp_path / "t.csv", ["a", "b", "label"], [[1, 2, 0], [3, "x7", 1], [5, 6, 0]])
    base = ["--source", "csv", "--root", path, "--partition", "iid", "--num-clients", 1, "--out", tmp_path / "x.h5"]
    expect_user_error(capsys, base + ["--label-col", "target"], str(path), "no column 'target' (--label-col)",
                      "a, b, label")
    expect_user_error(capsys, base + ["--label-col", "label"], f"{path} line 3", "column 'b'", "'x7'",
                      "--drop-cols")
    expect_user_error(capsys, base, "--label-col")
    expect_user_error(capsys, base + ["--label-col", "label", "--client-col", "a"], "--client-col needs --partition column")
    # without --num-clients too: the missing partition is what is wrong, not the missing count
    no_count = ["--source", "csv", "--root", path, "--label-col", "label", "--client-col", "a", "--out", tmp_path / "x.h5"]
    expect_user_error(capsys, no_count, "--client-col needs --partition column", "got --partition dir")
    expect_user_error(capsys, ["--source", "digits", "--label-col", "y", "--num-clients", 2, "--out", tmp_path / "x.h5"],
                      "--label-col applies to --source csv only")
    assert not (tmp_path / "x.h5").exists()


def test_integer_labels_written_two_ways_are_one_class():
    """Labels 1, 01 and 2 made three classes named [1, 1, 2] (two classes called 1)."""
    from fedcp_dist.data.owndata import _label_values

    labels, names = _label_values(["1", "01", "2", "+1", " 2", "10"])
    assert names == [1, 2, 10] and labels.tolist() == [0, 0, 1, 0, 1, 2]
    labels, names = _label_values(["b", "a", "b"])  # text labels: their sorted distinct values, as before
    assert names == ["a", "b"] and labels.tolist() == [1, 0, 1]


def test_data_of_one_class_is_refused_by_the_partition_the_writer_and_a_run(tmp_path, capsys):
    """A label column holding one class made a shard whose AUC was NaN (bare in metrics.jsonl) and
    whose accuracy was 100 % untrained."""
    path = write_csv(tmp_path / "t.csv", ["a", "b", "label"], [[i, i % 3, "cat"] for i in range(40)])
    expect_user_error(capsys, ["--source", "csv", "--root", path, "--label-col", "label", "--partition", "iid",
                               "--num-clients", 2, "--out", tmp_path / "x.h5"],
                      "source csv: its label column 'label' holds 1 class; a classifier needs at least two")
    assert not (tmp_path / "x.h5").exists()
    from fedcp_dist.data.shards import write_shard

    x, y = np.zeros((4, 2), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="at least two classes, got num_classes=1"):
        write_shard(tmp_path / "w.h5", [(x, y, x, y)], source="t", num_classes=1, input_shape=(2,), mean=(0.0, 0.0),
                    std=(1.0, 1.0), partition="iid", partition_params={}, seed=0, kind="table")
    assert not (tmp_path / "w.h5").exists()
    # a shard written before the writer refused it: the run names it
    import h5py

    two = tmp_path / "two.h5"
    write_shard(two, [(x, y, x, y)], source="t", num_classes=2, input_shape=(2,), mean=(0.0, 0.0),
                std=(1.0, 1.0), partition="iid", partition_params={}, seed=0, kind="table")
    with h5py.File(two, "r+") as f:
        f.attrs["num_classes"] = np.int64(1)
    with pytest.raises(UserError) as exc:
        read_info(two)
    assert str(exc.value) == f"shard file {two}: it holds 1 class; a classifier needs at least two"


# ---------------------------------------------------------------------------------------------
# client vector extension, binary metrics


def test_client_stats_by_hand():
    from fedcp_dist.algorithms.fedcp import client_stats

    arrays = {"train_x": np.array([[1, 2], [3, 6], [5, 10]], dtype=np.float32), "train_y": np.array([0, 1, 1]),
              "test_x": np.zeros((0, 2), dtype=np.float32), "test_y": np.zeros(0, dtype=np.int64)}
    d = to_device(0, arrays, mean=[1.0, 0.0], std=[2.0, 2.0], device=CPU)
    # standardised rows (0, 1), (1, 3), (2, 5): means 1 and 3; label prior 1/3, 2/3
    assert torch.allclose(client_stats(d, 2), torch.tensor([1 / 3, 2 / 3, 1.0, 3.0]))


def test_binary_metrics_by_hand():
    # 3 of 4 positives found, 5 of 6 negatives: recall 0.75, balanced accuracy (0.75 + 5/6) / 2
    m = binary_metrics(3, 4, 5, 6)
    assert m["pos_recall"] == 0.75 and m["balanced_acc"] == pytest.approx((0.75 + 5 / 6) / 2)
    s = EvalSums(8, 10, 0.8, 1, 9.0, 2.0, 3, 4, 5, 6).summary()
    assert s["balanced_acc"] == pytest.approx(19 / 24) and s["pos_recall"] == 0.75
    assert "balanced_acc" not in EvalSums(8, 10, 0.8, 1, 9.0, 2.0).summary()  # not a binary task


# ---------------------------------------------------------------------------------------------
# the presets, end to end on files in the real formats


@pytest.fixture(scope="module")
def fraud_shard(tmp_path_factory):
    """4 banks, 800 rows, 20 % fraud, two informative features and one noise feature."""
    tmp = tmp_path_factory.mktemp("fraud")
    rng = np.random.default_rng(3)
    rows = []
    for i in range(800):
        fraud = int(rng.random() < 0.2)
        bank = f"bank{i % 4}"
        shift = 0.3 * (i % 4)  # banks differ
        rows.append([f"{rng.normal(2.0 * fraud + shift, 1):.5f}", f"{rng.normal(-1.5 * fraud, 1):.5f}",
                     f"{rng.normal(0, 1):.5f}", fraud, bank])
    path = write_csv(tmp / "fraud.csv", ["amount", "velocity", "noise", "Class", "bank"], rows)
    from fedcp_dist.cli.partition import main as partition

    partition(["--source", "csv", "--root", str(path), "--label-col", "Class", "--client-col", "bank",
               "--partition", "column", "--out", str(tmp / "fraud.h5")])
    return tmp / "fraud.h5"


def test_fraud_preset_runs_end_to_end_and_reports_binary_metrics(fraud_shard, tmp_path):
    out = tmp_path / "run"
    s = run(str(REPO / "configs" / "fraud_mlp_fedcp.yaml"),
            [f"data.path={fraud_shard}", f"out_dir={out}", "rounds=20", "eval_every=10", "threads=1",
             "checkpoint_every=20"])
    # learnt (the untrained model's AUC is below 0.1 here, its balanced accuracy 0.46)
    assert s["final_auc"] > 0.9 and 0.3 < s["final_pos_recall"] <= 1
    assert s["final_balanced_acc"] > 0.65
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "acc" in r]
    assert evals and all("balanced_acc" in r and "pos_recall" in r for r in evals)
    # head+stats: P maps [v̂ (64) ; prior (2) ; 3 feature means] to K = 64
    g = torch.load(out / "final_global.pt", weights_only=True)
    assert g["vproj.weight"].shape == (64, 64 + 2 + 3)


def test_learned_client_embedding_is_per_client_and_persistent(fraud_shard, tmp_path):
    out = tmp_path / "run"
    over = [f"data.path={fraud_shard}", f"out_dir={out}", "rounds=2", "eval_every=2", "threads=1",
            "checkpoint_every=1", "cpn_client_vector=head+embed", "cpn_embed_dim=5",
            "participation=1.0", "client_selection=uniform", "selection_vector=client"]  # every bank trains in both rounds
    run(str(REPO / "configs" / "fraud_mlp_fedcp.yaml"), over)
    states = {}
    for r in (1, 2):
        part = torch.load(out / "checkpoints" / f"round_{r:07d}" / "clients_0.pt", weights_only=True)["clients"]
        states[r] = {int(c): st["emb.e"] for c, st in part.items()}
    assert sorted(states[2]) == [0, 1, 2, 3] and all(e.shape == (5,) for e in states[2].values())
    # trained away from zero, differently per client, and carried from round 1 into round 2
    assert all(e.abs().sum() > 0 for e in states[1].values())
    assert not torch.allclose(states[2][0], states[2][1])
    assert all(not torch.equal(states[1][c], states[2][c]) for c in range(4))
    g = torch.load(out / "final_global.pt", weights_only=True)
    assert g["vproj.weight"].shape == (64, 64 + 5) and not any(k.startswith("emb.") for k in g)
    with pytest.raises(UserError, match="config key 'cpn_client_vector'.*fused=false"):
        run(str(REPO / "configs" / "fraud_mlp_fedcp.yaml"), over + ["fused=true", "overwrite=true"])


@pytest.mark.slow
def test_table_runs_with_the_extended_client_vector_do_not_depend_on_the_world_size(fraud_shard, tmp_path):
    """One rank in-process and two under torchrun: the same global state bit for bit (head+embed
    keeps e_i on the owning rank; P is averaged with the CPN)."""
    import sys

    over = [f"data.path={fraud_shard}", "rounds=3", "eval_every=3", "threads=1", "cpn_client_vector=head+embed"]
    one = run(str(REPO / "configs" / "fraud_mlp_fedcp.yaml"), over + [f"out_dir={tmp_path / 'one'}"])
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                 "fedcp_dist.run", "--config", str(REPO / "configs" / "fraud_mlp_fedcp.yaml"), *over,
                 f"out_dir={tmp_path / 'two'}"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    a = torch.load(tmp_path / "one" / "final_global.pt", weights_only=True)
    b = torch.load(tmp_path / "two" / "final_global.pt", weights_only=True)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["final_balanced_acc"] == one["final_balanced_acc"]


def test_a_model_for_another_kind_of_shard_is_a_config_error(fraud_shard, tmp_path):
    with pytest.raises(UserError, match="config key 'model': 'cnn' reads image shards .* holds table data"):
        run(str(REPO / "configs" / "fraud_mlp_fedcp.yaml"),
            [f"data.path={fraud_shard}", f"out_dir={tmp_path / 'r'}", "model=cnn", "rounds=1"])


def test_medical_preset_runs_end_to_end_on_png_folders(tmp_path, capsys):
    root = tmp_path / "CT"
    rng = np.random.default_rng(0)
    for h in ("hospA", "hospB", "hospC"):
        for k, c in enumerate(("covid", "normal", "pneumonia")):
            for i in range(8):
                a = np.clip(rng.normal(60 + 70 * k, 20, (16, 16)), 0, 255).astype(np.uint8)
                (root / h / c).mkdir(parents=True, exist_ok=True)
                Image.fromarray(a, mode="L").save(root / h / c / f"{i}.png")
    cli(capsys, "--source", "imagefolder", "--root", root, "--partition", "folders", "--channels", 3,
        "--out", tmp_path / "ct.h5")
    info = read_info(tmp_path / "ct.h5")
    assert info.input_shape == (3, 16, 16) and info.num_clients == 3 and info.num_classes == 3
    s = run(str(REPO / "configs" / "medical_resnet18_fedcp.yaml"),
            [f"data.path={tmp_path / 'ct.h5'}", "data.num_clients=3", f"out_dir={tmp_path / 'run'}", "rounds=1",
             "eval_every=1", "threads=1", "local_epochs=1"])
    assert s["rounds"] == 1 and s["num_clients"] == 3 and 0 <= s["final_acc"] <= 1
    assert "final_balanced_acc" not in s  # three classes: not a binary task
