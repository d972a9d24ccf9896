"""Compressed uploads with error feedback and feature-difference selection (by the clients' mean
features, selection_vector=features, whose vectors differ from client to client) together: 1 and 2 ranks
give the same run, and a run resumed (on another world size) from a checkpoint continues it bit
for bit — one short run of each, checked several ways."""
import json
import shutil
import sys

import pytest
import torch

from conftest import REPO, run_cmd
from helpers import run

pytestmark = pytest.mark.slow

ROUNDS = 3
SWITCHES = ["compress=topk", "compress_ratio=0.05", "compress_bits=8", "compress_error_feedback=true",
            "client_selection=feature_difference", "selection_vector=features", "participation=0.5"]


def _overrides(shard, out):
    return [f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=1", "keep_checkpoints=5", f"data.path={shard}",
            f"out_dir={out}", "threads=1",
            "fused=false", *SWITCHES]  # the sequential path across world sizes (the fused one: test_multiprocess.py)


def _load(out):
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [{k: v for k, v in r.items() if "seconds" not in k} for r in records if r["kind"] == "round"]
    return (torch.load(out / "final_global.pt", weights_only=True), rounds,
            json.loads((out / "summary.json").read_text()))


def test_one_and_two_ranks_and_a_resumed_run_agree(digits6_16px, tmp_path):
    config = str(REPO / "configs" / "digits_fedcp.yaml")
    one, two = tmp_path / "one", tmp_path / "two"
    run(config, _overrides(digits6_16px, one))
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "fedcp_dist.run", "--config", config, *_overrides(digits6_16px, two)])
    assert r.returncode == 0, r.stderr[-3000:]
    g1, rounds1, s1 = _load(one)
    g2, rounds2, s2 = _load(two)
    assert s2["world_size"] == 2

    # the same cohorts, drawn from the gathered client vectors, and the same bytes
    cohorts = [r["cohort"] for r in rounds1]
    assert cohorts == [r["cohort"] for r in rounds2]
    assert all(len(c) == 3 for c in cohorts)  # ρ = 0.5 of 6 clients
    assert s1["selection_counts"] == s2["selection_counts"] and sum(s1["selection_counts"]) == 3 * ROUNDS
    for key in ("uplink_bytes", "uplink_bytes_dense", "downlink_bytes", "downlink_bytes_dense"):
        assert [r[key] for r in rounds1] == [r[key] for r in rounds2]
        assert s1[key] == s2[key] == sum(r[key] for r in rounds1)
    # 5 % of each tensor at one byte, plus positions and two floats per tensor: far below dense
    assert s1["uplink_bytes"] < 0.1 * s1["uplink_bytes_dense"]
    assert s1["downlink_bytes"] == s1["downlink_bytes_dense"] == s1["uplink_bytes_dense"]
    # the same model, bit for bit (the sums are float64: the order of ranks does not show)
    assert set(g1) == set(g2)
    for k in g1:
        assert torch.equal(g1[k], g2[k]), f"{k} differs by {(g1[k] - g2[k]).abs().max()}"
    assert s1["final_acc"] == pytest.approx(s2["final_acc"], abs=1e-12)

    # the residuals of error feedback are in the clients' checkpointed states
    ck = two / "checkpoints" / f"round_{ROUNDS:07d}"
    states = {}
    for part in ck.glob("clients_*.pt"):
        states.update(torch.load(part, weights_only=True)["clients"])
    trained = {c for cohort in cohorts for c in cohort}
    assert {c for c, s in states.items() if any(k.startswith("__ef__/") for k in s)} == trained
    assert any(s["__ef__/features.0.weight"].abs().sum() > 0 for c, s in states.items() if c in trained)
    # so are the mean features the selection compares: one per trained client, and they differ
    means = {c: s["fmean"] for c, s in states.items() if c in trained}
    assert len(means) == len(trained) and all(m.shape == (512,) and m.abs().sum() > 0 for m in means.values())
    assert len({tuple(m.tolist()) for m in means.values()}) == len(means)

    # resume the 2-rank run after round 1 on 1 rank: the same cohorts and model as both straight runs
    for d in sorted((two / "checkpoints").iterdir())[1:]:
        shutil.rmtree(d)
    (two / "summary.json").unlink()
    run(config, _overrides(digits6_16px, two))
    g3, rounds3, _ = _load(two)
    assert [r["cohort"] for r in rounds3] == cohorts
    for k in g1:
        assert torch.equal(g1[k], g3[k]), f"resumed: {k} differs by {(g1[k] - g3[k]).abs().max()}"
