"""The CPN's share of FedCP's upload (fedcp_dist.comm.compress.upload_parts, bench/upload_share.py): the
parameter counts against a hand derivation and against what a run's byte counts record."""
import importlib.util
import json

import pytest
import torch

from conftest import REPO
from fedcp_dist.algorithms import make_algorithm
from fedcp_dist.comm.compress import skipped_part_saving, upload_parts
from fedcp_dist.config import Config
from fedcp_dist.data.shards import read_info
from fedcp_dist.models import build_model
from helpers import run

#: Linear(512, 1024) + LayerNorm(1024): the paper's CPN for K = 512
CPN_512 = 512 * 1024 + 1024 + 2 * 1024


def _bench():
    spec = importlib.util.spec_from_file_location("bench_upload_share", REPO / "bench" / "upload_share.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parts(model, shape, classes, both=False):
    """The upload per part; with ``both`` also the one with BatchNorm statistics aggregated."""
    torch.manual_seed(0)
    algo = make_algorithm("fedcp", Config(), build_model(model, shape, classes), torch.device("cpu"))
    state = algo.init_global_state()
    parts = upload_parts(algo, state)
    return (parts, upload_parts(algo, state, aggregate_bn_stats=True)) if both else parts


def test_the_mnist_cnns_upload_is_half_cpn():
    """4-layer CNN on 28×28: conv 1→32 5×5, conv 32→64 5×5, Linear 1024→512, head 512→10."""
    features = (1 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (1024 * 512 + 512)
    assert _parts("cnn", (1, 28, 28), 10) == {"features": features, "head": 512 * 10 + 10, "cpn": CPN_512}
    r = _bench().cpn_share("cnn", (1, 28, 28), 10)
    assert r["upload"] == 1_109_386 and r["cpn"] == CPN_512 == 527_360
    assert round(100 * r["share"], 2) == 47.54
    # the README's digits savings: the CPN sent in 10 of 30 rounds (U = 3), in 6 of 30 (P = 5)
    assert round(100 * skipped_part_saving(r["share"], 10, 30), 1) == 31.7
    assert round(100 * skipped_part_saving(r["share"], 6, 30), 1) == 38.0


def test_the_cpn_is_under_five_percent_of_a_200_class_resnet18():
    """torchvision's ResNet-18 has 11,689,512 parameters with 1,000 classes; 200 classes: 513·800
    fewer. BatchNorm running statistics (2 × 4,800 channels) stay with the clients by default."""
    parts, with_bn = _parts("resnet18", (3, 64, 64), 200, both=True)
    rest = 11_689_512 - 800 * 513
    assert parts["cpn"] == CPN_512 and parts["features"] + parts["head"] == rest
    of_model = parts["cpn"] / rest
    assert int(10_000 * of_model) / 100 == 4.67  # the paper's figure (4.6755 %, cut to two places)
    assert round(100 * parts["cpn"] / sum(parts.values()), 2) == 4.47  # its share of the upload
    channels = 64 + 4 * 64 + (4 * 128 + 128) + (4 * 256 + 256) + (4 * 512 + 512)
    assert with_bn["features"] == parts["features"] + 2 * channels


def test_a_runs_dense_uplink_is_the_counted_upload(digits6, tmp_path):
    s = run(str(REPO / "configs" / "digits_fedcp.yaml"),
            [f"data.path={digits6}", "data.num_clients=6", "rounds=1", "eval_every=1", "threads=1",
             f"out_dir={tmp_path / 'r'}", "checkpoint_every=0"])
    info = read_info(digits6)
    parts = _parts("cnn", info.input_shape, info.num_classes)
    assert parts["cpn"] == CPN_512
    assert s["uplink_bytes_dense"] == 4 * 6 * sum(parts.values())


def test_saving_arguments_and_the_bench_table(tmp_path, capsys):
    with pytest.raises(ValueError):
        skipped_part_saving(0.5, 31, 30)
    assert skipped_part_saving(0.5, 30, 30) == 0.0 and skipped_part_saving(0.5, 0, 30) == 0.5
    bench = _bench()
    assert bench.sent_rounds(30, 3) == 10 and bench.sent_rounds(30, 5) == 6 and bench.sent_rounds(3, 2) == 2
    bench.main(["--settings", "mnist_cnn", "--every", "3", "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert "mnist_cnn" in out and "47.54%" in out and "31.7%" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["settings"][0]["cpn"] == CPN_512 and data["settings"][0]["saving_every"]["3"] == pytest.approx(
        0.4754 * 20 / 30, abs=1e-4)
