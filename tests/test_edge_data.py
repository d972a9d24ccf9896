"""Edge data: clients with one training sample under BatchNorm, clients without test samples,
more ranks than clients, unusual images in an image folder (16-bit greyscale, palettes,
transparency, EXIF orientation) and broken CSV tables. Each case runs correctly or is refused in
one line; files are written here in their real formats and read through the real loaders."""
import copy
import json
import math
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from conftest import REPO, partition, run_cmd
from fedcp_dist.cli.partition import main
from fedcp_dist.data.resident import to_device
from fedcp_dist.data.shards import load_clients, read_info
from fedcp_dist.data.sources import load_source
from fedcp_dist.errors import UserError
from fedcp_dist.engine.evaluation import evaluate_clients
from fedcp_dist.models.batchnorm import one_value_batches
from helpers import expect_user_error, run

CPU = torch.device("cpu")


def npz_shard(folder, sizes, shape, classes=3, seed=0):
    """A shard of ``len(sizes)`` clients of random images, client i holding sizes[i] = (train,
    test) samples, imported with ``fedcp-partition --from-npz`` (source name ``edge``)."""
    rng = np.random.default_rng(seed)
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True)
    for i, sizes_i in enumerate(sizes):
        for split, m in zip(("train", "test"), sizes_i):
            np.savez(folder / split / f"{i}.npz", x=rng.integers(0, 256, (m, *shape)).astype(np.uint8),
                     y=rng.integers(0, classes, m))
    out = folder / "edge.h5"
    main(["--from-npz", str(folder), "--out", str(out), "--source", "edge", "--num-classes", str(classes)])
    return out


def run_on(shard, out, method="fedcp", *extra):
    return run(str(REPO / "configs" / f"digits_{method}.yaml"),
               [f"data.path={shard}", "data.source=edge", f"out_dir={out}", "rounds=1", "eval_every=1",
                "threads=1", *extra])


# ---------------------------------------------------------------------------------------------
# one training sample under BatchNorm


@pytest.mark.parametrize("cls, shape", [(nn.BatchNorm1d, (1, 6)), (nn.BatchNorm2d, (1, 6, 1, 1))])
def test_a_batch_of_one_value_per_channel_is_normalised_by_the_running_statistics(cls, shape):
    torch.manual_seed(0)
    plain = cls(6)
    with torch.no_grad():
        plain.running_mean.uniform_(-1, 1)
        plain.running_var.uniform_(0.5, 2)
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    safe = one_value_batches(copy.deepcopy(plain)).train()
    assert isinstance(safe, cls) and type(safe) is not cls and type(safe).__name__ == cls.__name__
    x = torch.randn(shape, requires_grad=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        copy.deepcopy(plain).train()(x)

    out = safe(x)
    view = (1, 6) + (1,) * (len(shape) - 2)
    scale = (plain.weight / torch.sqrt(plain.running_var + plain.eps)).detach().view(view)
    expect = (x.detach() - plain.running_mean.view(view)) * scale + plain.bias.detach().view(view)
    assert torch.allclose(out, expect, atol=1e-6)
    # the statistics stay as they were; the gradient reaches the input, the weight and the bias
    assert torch.equal(safe.running_mean, plain.running_mean) and torch.equal(safe.running_var, plain.running_var)
    assert int(safe.num_batches_tracked) == 0
    out.sum().backward()
    assert torch.allclose(x.grad, scale.expand(shape), atol=1e-6)
    assert torch.allclose(safe.bias.grad, torch.ones(6)) and safe.weight.grad.abs().sum() > 0

    # a batch of two: torch's own computation bit for bit, the statistics move as torch moves them
    x2 = torch.randn((2,) + shape[1:])
    a, b = copy.deepcopy(plain).train(), one_value_batches(copy.deepcopy(plain)).train()
    assert torch.equal(a(x2), b(x2))
    assert torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
    assert not torch.equal(b.running_mean, plain.running_mean)


@pytest.mark.parametrize("method, extra", [
    ("fedcp", ["cpn_layers=2", "cpn_norm=batchnorm"]),
    ("fedrep", []), ("perfedavg", []), ("pfedme", []),
])
def test_resnet18_trains_a_client_with_one_sample_and_a_last_batch_of_one(tmp_path, method, extra):
    """ResNet-18 on 8x8 images has 1x1 maps in its last blocks: client 0's one sample and client
    1's last batch (6 samples, batch 5, drop_last=false) each hold one value per channel there
    (and in FedCP's CPN BatchNorm); torch's BatchNorm refuses such a batch in training mode."""
    shard = npz_shard(tmp_path / "npz", [(1, 2), (6, 2), (5, 2)], (3, 8, 8))
    s = run_on(shard, tmp_path / "run", method, "model=resnet18", "batch_size=5", "drop_last=false",
               "data.num_clients=3", *extra)
    assert s["rounds"] == 1 and 0 <= s["final_acc"] <= 1
    state = torch.load(tmp_path / "run" / "final_global.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    if method == "fedcp":  # the CPN's second block has a BatchNorm, and it trained
        assert state["cpn.net.4.weight"].shape == (2 * 512,) and not torch.equal(state["cpn.net.4.weight"],
                                                                               torch.ones(2 * 512))


# ---------------------------------------------------------------------------------------------
# clients without test samples


class _Scores:
    """A method whose model scores a table row by its own features (3 features: 3 classes)."""

    def prepare_eval(self, state, data, ctx):
        return state

    def predict(self, state, x, ctx):
        return x


class _Store:
    def activate(self, cid):
        return None


def _table_client(cid, train_rows, test_rows):
    arrays = {"train_x": np.asarray(train_rows, dtype=np.float32).reshape(-1, 3),
              "train_y": np.zeros(len(train_rows), dtype=np.int64),
              "test_x": np.asarray([r for r, _ in test_rows], dtype=np.float32).reshape(-1, 3),
              "test_y": np.asarray([y for _, y in test_rows], dtype=np.int64)}
    return to_device(cid, arrays, mean=[0.0] * 3, std=[1.0] * 3, device=CPU)


def test_a_client_without_test_samples_weighs_nothing_in_the_evaluation():
    datas = {
        0: _table_client(0, [[1, 0, 0]], []),  # trains, nothing to test
        1: _table_client(1, [], [([5, 0, 0], 0), ([0, 5, 0], 0)]),  # 1 of 2 right
        2: _table_client(2, [[0, 1, 0]], [([0, 0, 5], 2), ([0, 0, 5], 2), ([0, 5, 0], 1), ([5, 0, 0], 2)]),  # 3 of 4
    }
    sums = evaluate_clients(_Scores(), _Store(), datas, [0, 1, 2], 0,
                            lambda r, c: torch.Generator().manual_seed(c), batch_size=3)
    assert sums.test_samples == 6 and sums.clients == 2 and sums.correct == 4
    out = sums.summary()
    assert out["acc"] == pytest.approx(4 / 6) and out["acc_client_mean"] == pytest.approx((1 / 2 + 3 / 4) / 2)
    assert all(math.isfinite(v) for v in out.values())


def test_a_run_with_clients_without_test_samples_counts_only_the_others(tmp_path):
    shard = npz_shard(tmp_path / "npz", [(1, 0), (12, 4), (7, 3), (0, 3)], (1, 28, 28))
    s = run_on(shard, tmp_path / "run", "fedcp", "data.num_clients=4")
    # Σ correct / Σ test samples over the 10 test samples of clients 1-3
    assert s["final_acc"] * 10 == pytest.approx(round(s["final_acc"] * 10), abs=1e-9)
    assert all(math.isfinite(s[k]) for k in ("final_acc", "final_acc_client_mean", "final_auc"))


def test_a_run_whose_clients_hold_no_test_sample_is_refused_in_one_line(tmp_path):
    shard = npz_shard(tmp_path / "npz", [(5, 0), (12, 0)], (1, 28, 28))
    with pytest.raises(UserError, match=f"the clients of {shard} hold no test sample: there is nothing to evaluate"):
        run_on(shard, tmp_path / "run", "fedcp")
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedavg.yaml",
                 f"data.path={shard}", "data.source=edge", f"out_dir={tmp_path / 'cli'}"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no test sample" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# more ranks than clients


@pytest.fixture(scope="module")
def one_client_runs(tmp_path_factory):
    """FedCP (with the probes) and FedAMP on a one-client shard, on one rank and on two."""
    from helpers import runs_on_one_and_two_ranks

    root = tmp_path_factory.mktemp("one-client")
    shard = partition(root / "one.h5", "--source", "digits", "--partition", "iid", "--num-clients", "1")

    def job(method):
        extra = ["analysis=true"] if method == "fedcp" else []
        return (f"configs/digits_{method}.yaml", lambda out: [f"data.path={shard}", "rounds=1", "eval_every=1",
                                                              "checkpoint_every=1", "threads=1", "fused=false",
                                                              f"out_dir={out}", *extra])

    runs_on_one_and_two_ranks(root, {m: job(m) for m in ("fedcp", "fedamp")})
    return root


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedcp", "fedamp"])
def test_ranks_without_a_client_take_part_in_every_collective(one_client_runs, method):
    """Two ranks on a one-client shard: rank 1 owns nothing and still joins every all-reduce
    (training, evaluation, probes, the peer exchange, checkpoints); same run as on one rank."""
    runs = {}
    for world in ("one", "two"):
        out = one_client_runs / world / method
        summary = json.loads((out / "summary.json").read_text())
        lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        runs[world] = (torch.load(out / "final_global.pt", weights_only=True), summary,
                       [l["acc"] for l in lines if "acc" in l])
    (s1, sum1, acc1), (s2, sum2, acc2) = runs["one"], runs["two"]
    assert sum1["world_size"] == 1 and sum2["world_size"] == 2 and len(acc1) == len(acc2) == 2
    assert acc1 == pytest.approx(acc2, abs=1e-9) and acc1[-1] > acc1[0]
    assert set(s1) == set(s2) and all(torch.allclose(s1[k], s2[k], atol=1e-6, rtol=0) for k in s1)


# ---------------------------------------------------------------------------------------------
# image folders


def load_folder(root, **options):
    return load_source("imagefolder", root, own_options=options)


def test_16_bit_greyscale_is_scaled_to_8_bits_not_clipped(tmp_path, capsys):
    root = tmp_path / "imgs"
    values = {"a": 0, "b": 1000, "c": 40000, "d": 65535}
    for c, v in values.items():
        (root / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((4, 5), v, dtype=np.uint16)).save(root / c / f"{i}.png")
    assert Image.open(root / "c" / "0.png").mode == "I;16"
    src = load_folder(root)
    assert src.x.shape == (12, 1, 4, 5)
    # v / 257 rounded: 1000 -> 4, 40000 -> 156 (Pillow's own conversion clips both to 255)
    assert [int(src.x[src.y == k].min()) for k in range(4)] == [0, 4, 156, 255]
    assert all(len(np.unique(src.x[src.y == k])) == 1 for k in range(4))
    main(["--source", "imagefolder", "--root", str(root), "--partition", "iid", "--num-clients", "1",
          "--out", str(tmp_path / "g.h5")])
    arrays = load_clients(tmp_path / "g.h5", [0])[0]
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        assert all(np.all(x[y == k] == [0, 4, 156, 255][k]) for k in range(4))


def test_palette_images_load_through_their_colours(tmp_path):
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    p = Image.new("P", (3, 1))
    p.putpalette([200, 10, 10, 0, 255, 0, 30, 30, 30])
    for x, k in enumerate((0, 1, 2)):
        p.putpixel((x, 0), k)
    p.save(root / "a" / "0.png")
    rgb = load_folder(root).x[0]
    assert rgb.shape == (3, 1, 3) and rgb[:, 0].T.tolist() == [[200, 10, 10], [0, 255, 0], [30, 30, 30]]
    # index 1 transparent: white, as on a white page
    p.info["transparency"] = 1
    p.save(root / "a" / "0.png")
    assert load_folder(root).x[0][:, 0].T.tolist() == [[200, 10, 10], [255, 255, 255], [30, 30, 30]]
    # a palette of greys is a greyscale image: one channel by default
    g = Image.new("P", (2, 1))
    g.putpalette([0, 0, 0, 90, 90, 90, 255, 0, 0])
    g.putpixel((1, 0), 1)
    g.save(root / "a" / "0.png")
    src = load_folder(root)
    assert src.x.shape == (1, 1, 1, 2) and src.x[0, 0, 0].tolist() == [0, 90]


def test_transparent_images_are_composited_onto_white(tmp_path):
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    rgba = np.zeros((1, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red
    rgba[0, 1] = (255, 0, 0, 128)  # half-transparent red
    rgba[0, 2] = (0, 0, 0, 0)  # fully transparent (stored black)
    Image.fromarray(rgba, "RGBA").save(root / "a" / "0.png")
    x = load_folder(root).x[0][:, 0].T.astype(int)
    assert x[0].tolist() == [255, 0, 0] and x[2].tolist() == [255, 255, 255]
    assert x[1][0] == 255 and abs(x[1][1] - 127) <= 1 and abs(x[1][2] - 127) <= 1
    # greyscale with alpha: a transparent black pixel is white, an opaque one stays black
    la = np.array([[[0, 0], [0, 255]]], dtype=np.uint8)
    (root / "a" / "0.png").unlink()
    Image.fromarray(la, "LA").save(root / "a" / "0.png")
    src = load_folder(root)
    assert src.x.shape == (1, 1, 1, 2) and src.x[0, 0, 0].tolist() == [255, 0]


def test_exif_rotated_jpegs_are_turned_upright(tmp_path):
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    stored = Image.new("RGB", (16, 8), (0, 0, 0))  # 16 wide, 8 high: dark left half, bright right half
    stored.paste((255, 255, 255), (8, 0, 16, 8))
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: show the stored image rotated 90° clockwise
    stored.save(root / "a" / "0.jpg", exif=exif, quality=95)
    src = load_folder(root)
    # upright: 8 wide, 16 high, the dark half on top
    assert src.x.shape == (1, 3, 16, 8)
    assert src.x[0, :, :6].max() < 40 and src.x[0, :, 10:].min() > 215
    src = load_folder(root, image_size="4x4", channels=1)
    assert src.x.shape == (1, 1, 4, 4) and src.x[0, 0, 0].max() < 40 and src.x[0, 0, 3].min() > 215


# ---------------------------------------------------------------------------------------------
# CSV tables


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("content, extra, fragments", [
    (b"a,b,label\n1,2,0\n3,,1\n5,6,0\n", [], ["line 3", "column 'b' is empty", "--drop-cols"]),
    (b"a,b,label\n1,2,0\n3,4\n5,6,0\n", [], ["line 3", "2 fields, the header has 3"]),
    (b"a,b,label\n1,2,0\n3,4,1,9\n", [], ["line 3", "4 fields, the header has 3"]),
    # finite, but inf as a float32 feature (the shard was written with inf and NaN mean/std)
    (b"a,b,label\n1,2,0\n3,1e39,1\n", [], ["line 3", "column 'b' holds '1e39', outside float32's range"]),
    (b"a,b,label\n1,2,0\n-4e38,4,1\n", [], ["line 3", "column 'a' holds '-4e38', outside float32's range"]),
    (b"a,b,label,\n1,2,0,\n3,4,1,\n", [], ["line 1", "column 4 of the header has no name"]),
    (b"a,b,label,site\n1,2,0,x\n3,4,1,\n5,6,0,y\n", ["--partition", "column", "--client-col", "site"],
     ["line 3", "the client column 'site' is empty"]),
    (b"a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,\xe98,1\n9,10,0\n", [], ["line 5", "not UTF-8", "0xe9"]),
    # past the text decoder's first block: still the line of the bad byte
    (b"a,b,label\n" + b"1,2,0\n" * 3000 + b"3,4\xff,1\n", [], ["line 3002", "not UTF-8", "0xff"]),
])
def test_csv_edge_cells_are_one_line_errors_naming_file_and_line(tmp_path, capsys, content, extra, fragments):
    path = write_bytes(tmp_path / "t.csv", content)
    partition_args = extra or ["--partition", "iid", "--num-clients", 1]
    expect_user_error(capsys, ["--source", "csv", "--root", path, "--label-col", "label", *partition_args,
                               "--out", tmp_path / "x.h5"], str(path), *fragments)
    assert not (tmp_path / "x.h5").exists()


def test_csv_with_a_bom_and_crlf_line_ends_reads(tmp_path, capsys):
    """The accepted side of the same reader: CRLF line ends and a UTF-8 BOM are read as text."""
    path = write_bytes(tmp_path / "t.csv", b"\xef\xbb\xbfa,b,label\r\n" + b"".join(
        f"{i},{2 * i},{i % 2}\r\n".encode() for i in range(8)))
    main(["--source", "csv", "--root", str(path), "--label-col", "label", "--partition", "iid", "--num-clients", "1",
          "--out", str(tmp_path / "t.h5")])
    info = read_info(tmp_path / "t.h5")
    assert info.input_shape == (2,) and int(info.train_counts.sum() + info.test_counts.sum()) == 8


def test_ag_news_csv_names_the_line_of_a_non_utf8_byte(tmp_path):
    from fedcp_dist.data.sources import read_agnews_csv

    rows = b"".join(b'"%d","title %d","text %d"\n' % (1 + i % 4, i, i) for i in range(600))
    path = write_bytes(tmp_path / "train.csv", rows + b'"2","caf\xe9","text"\n')
    with pytest.raises(UserError, match=r"train.csv line 601: not UTF-8 text \(byte 9 of the line is 0xe9\)"):
        read_agnews_csv(path)
