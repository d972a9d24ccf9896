"""BatchNorm running statistics: each client keeps its own (the default), or they are averaged
(aggregate_bn_stats=true); either way they are checkpointed and survive a resume exactly."""
import pytest
import torch

from helpers import run

pytestmark = pytest.mark.slow

BN_KEY = "cpn.net.1.running_mean"  # FedCP with cpn_norm=batchnorm: a BatchNorm in the shared CPN


def _run(shard, out, *extra):
    """A one-rank run in this process, as fedcp-run; its final global state."""
    run("configs/digits_fedcp.yaml", [f"data.path={shard}", f"out_dir={out}", "threads=1", "eval_every=1",
                                      "cpn_layers=2", "cpn_norm=batchnorm", *extra])
    return torch.load(out / "final_global.pt", weights_only=True)


def _latest_clients(out):
    d = sorted((out / "checkpoints").glob("round_*"))[-1]
    parts = [torch.load(p, weights_only=True)["clients"] for p in sorted(d.glob("clients_*.pt"))]
    return {c: s for part in parts for c, s in part.items()}


def test_bn_statistics_stay_with_each_client_by_default(digits6_16px, tmp_path):
    own = _run(digits6_16px, tmp_path / "own", "rounds=3", "checkpoint_every=2")
    avg = _run(digits6_16px, tmp_path / "avg", "rounds=3", "aggregate_bn_stats=true")
    # not aggregated: the global copy keeps its initial statistics (zeros), while averaging moves them
    assert torch.equal(own[BN_KEY], torch.zeros_like(own[BN_KEY]))
    assert avg[BN_KEY].abs().sum() > 0
    clients = _latest_clients(tmp_path / "own")
    stats = [s[f"__bn__/{BN_KEY}"] for s in clients.values()]
    assert len(stats) == 6 and all(t.abs().sum() > 0 for t in stats)
    assert not torch.equal(stats[0], stats[1])  # each client's own


def test_per_client_bn_statistics_resume_exactly(digits6_16px, tmp_path):
    straight = _run(digits6_16px, tmp_path / "straight", "rounds=3")
    out = tmp_path / "resumed"
    _run(digits6_16px, out, "rounds=2", "checkpoint_every=1")  # leaves a checkpoint after round 1
    for name in ("summary.json", "final_global.pt"):
        (out / name).unlink()
    resumed = _run(digits6_16px, out, "rounds=3", "checkpoint_every=1")
    assert set(straight) == set(resumed)
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
