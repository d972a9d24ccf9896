"""An evaluation rounds as the fused training does, on one intra-op thread per computation.

A fused run on one rank of 2 threads and on 2 ranks of 1 trained the same models, but its
evaluation ran on the rank's threads and its sums rounded with them: the test loss of Ditto on
Synthetic(1, 1) differed in its last bits between the two (and so did a run resumed on another
world size, without a note)."""
import json

import pytest

from conftest import partition
from helpers import run


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return partition(tmp_path_factory.mktemp("shards") / "synthetic.h5", "--source", "synthetic",
                     "--synthetic-alpha", "1", "--synthetic-beta", "1", "--num-clients", "2000",
                     "--synthetic-min-samples", "10", "--synthetic-max-samples", "20", "--seed", "1")


def records(out):
    return [{k: v for k, v in json.loads(ln).items() if "seconds" not in k}
            for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_metrics_do_not_depend_on_the_ranks_threads(synthetic, tmp_path):
    got = []
    for threads in (2, 1):
        out = tmp_path / f"t{threads}"
        run("configs/synthetic_fedcp.yaml", [f"data.path={synthetic}", "data.num_clients=2000", f"out_dir={out}", "method=ditto", "rounds=2",
                                              "eval_every=1", "participation=0.01", "eval_clients=500",
                                              f"threads={threads}", "fused=true"])
        got.append(records(out))
    assert got[0] == got[1]
    assert all("test_loss" in r for r in got[0])
