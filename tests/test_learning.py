"""FedCP learns, and beats FedAvg's accuracy on its clients' own test splits (digits, Dir(0.1))."""
import json

import pytest

from fedcp_dist.config import load_config
from fedcp_dist.runtime import init_runtime
from fedcp_dist.engine.simulator import Simulator

pytestmark = pytest.mark.slow


def _run(shard, out, method):
    cfg = load_config("configs/digits_fedcp.yaml", [f"method={method}", "rounds=10", "eval_every=5", f"data.path={shard}", f"out_dir={out}"])
    rt = init_runtime("cpu", 0, env={})
    try:
        return Simulator(cfg, rt, echo=lambda *_: None).run()
    finally:
        rt.close()


def test_fedcp_beats_fedavg_on_digits(digits20, tmp_path):
    fedcp = _run(digits20, tmp_path / "fedcp", "fedcp")
    fedavg = _run(digits20, tmp_path / "fedavg", "fedavg")
    assert fedcp["best_acc"] > 0.85, fedcp
    assert fedcp["best_acc"] > fedavg["best_acc"] + 0.10, (fedcp["best_acc"], fedavg["best_acc"])
    # the files a user reads agree with what the run returned
    on_disk = json.loads((tmp_path / "fedcp" / "summary.json").read_text())
    assert on_disk["best_acc"] == fedcp["best_acc"]
    lines = [json.loads(l) for l in (tmp_path / "fedcp" / "metrics.jsonl").read_text().splitlines()]
    rounds = [l for l in lines if l["kind"] == "round"]
    assert [l["round"] for l in rounds] == list(range(1, 11))
    assert [l["evaluated_after"] for l in lines if "acc" in l] == [0, 5, 10]
    assert max(l["acc"] for l in lines if "acc" in l) == fedcp["best_acc"]
    assert all(l["allreduce_bytes"] > 8 * 1_000_000 for l in rounds)
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]
