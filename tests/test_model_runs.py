"""A 3-round FedCP run of every model through the run CLI on CPU, on fabricated miniatures of the
data sets they are meant for (CIFAR-10 pickles for the CNN and ResNet-18, AG News CSV for fastText)."""
import json
import sys

import pytest
import torch

from conftest import run_cmd
from fedcp_dist.cli.partition import main as partition
from helpers import agnews_rows, make_cifar10, write_agnews

#: model -> (source, the first layer's weight in the global state, overrides: the paper's η and λ)
CASES = {
    "cnn": ("cifar10", "features.0.weight", []),
    "resnet18": ("cifar10", "features.0.weight", ["lr=0.1", "lam=1.0"]),
    "fasttext": ("agnews", "features.0.embedding.weight", ["lr=0.1", "lam=1.0"]),
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_runs")
    make_cifar10(root / "cifar", per_file=12)
    write_agnews(root / "ag", agnews_rows(10, 0), agnews_rows(3, 100))
    partition(["--source", "cifar10", "--root", str(root / "cifar"), "--partition", "dir", "--beta", "0.5",
          "--num-clients", "3", "--out", str(root / "cifar10.h5")])
    partition(["--source", "agnews", "--root", str(root / "ag"), "--max-len", "16", "--partition", "iid",
          "--num-clients", "2", "--out", str(root / "agnews.h5")])
    return root


@pytest.mark.parametrize("model", list(CASES))
def test_three_fedcp_rounds_of_each_model(shards, tmp_path, model):
    source, first_key, extra = CASES[model]
    out = tmp_path / model
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", f"model={model}",
                 "rounds=3", "eval_every=1", "eval_batch_size=8", "threads=1", "checkpoint_every=2",
                 f"data.path={shards / (source + '.h5')}", f"data.source={source}", f"out_dir={out}", *extra],
                timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["source"] == source
    rounds = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["round"] for l in rounds if l["kind"] == "round"] == [1, 2, 3]
    final = torch.load(out / "final_global.pt", weights_only=True)
    assert final[first_key].dtype == torch.float32 and torch.isfinite(final[first_key]).all()
    if model == "resnet18":  # BatchNorm statistics per client: the global copy keeps its initial ones
        assert torch.equal(final["features.1.running_var"], torch.ones(64))
    if model == "fasttext":
        assert final[first_key].shape[1] == 32  # Embedding(V, 32)
