"""``logger: tensorboard``: the event files, read back with TensorBoard's own reader, hold the values of
metrics.jsonl and the means of analysis.jsonl, one per step; a resumed run appends to them and hides
what the stopped run wrote past its checkpoint; overwrite removes them; a bad value or a missing
package is a one-line error naming the key."""
import json
import sys

import numpy as np
import pytest

from conftest import REPO
from fedcp_dist.analysis.records import loss_by_round, pir_by_round, read_probes
from fedcp_dist.config import load_config
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.algorithms.fedcp.probing import PolicyProbeLayout
from fedcp_dist.rundir.directory import RunWriter
from fedcp_dist.rundir.out_dir import prepare_out_dir
from helpers import nonfinite_at, quarters_shard, run

CONFIG = str(REPO / "configs" / "digits_fedcp.yaml")
ROUNDS = 3
EVAL = ("acc", "acc_client_mean", "auc", "test_loss")


def _accumulator():
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pytest.skip("tensorboard is not installed (pip install -e '.[test]' installs it)")
    return EventAccumulator


def read_events(run_dir) -> dict:
    """{tag: [(step, value), ...]} of the run's event files as TensorBoard reads them (purges applied)."""
    acc = _accumulator()(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(v) -> float:
    """A value as TensorBoard stores it (float32)."""
    return float(np.float32(v))


def expected(run_dir) -> dict:
    """{tag: [(step, value)]} from metrics.jsonl and analysis.jsonl, the means by fedcp-analyze's functions."""
    out: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        for k, v in r.items():
            if k in EVAL:
                out.setdefault(f"eval/{k}", {})[r["evaluated_after"]] = v
            elif r["kind"] == "round" and k not in ("kind", "round", "evaluated_after"):
                out.setdefault(f"round/{k}", {})[r["round"]] = v
    train, evals = read_probes(run_dir / "analysis.jsonl")
    for r, (bef, aft) in loss_by_round(train).items():
        out.setdefault("analysis/loss_bef", {})[r] = bef
        out.setdefault("analysis/loss_aft", {})[r] = aft
    out["analysis/pir_train"] = pir_by_round(train)
    out["analysis/pir_test"] = pir_by_round(evals, key="evaluated_after")
    return {tag: [(s, f32(v)) for s, v in sorted(steps.items())] for tag, steps in out.items()}


def _args(shard, out, *extra):
    return ["method=fedcp", f"rounds={ROUNDS}", "eval_every=1", "lr=0.05", "batch_size=4", "lam=0.1",
            f"data.path={shard}", "data.source=", f"out_dir={out}", "threads=1", "checkpoint_every=1",
            "analysis=true", "logger=tensorboard", *extra]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    _accumulator()
    return quarters_shard(tmp_path_factory.mktemp("npz"))


@pytest.fixture(scope="module")
def logged(shard, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tb"
    run(CONFIG, _args(shard, out))
    return out


def test_events_hold_the_values_of_metrics_jsonl_and_the_analysis_means(logged):
    events, want = read_events(logged), expected(logged)
    assert events == want
    # evaluations before rounds 1..3 and after the last; training scalars of rounds 1..3
    assert [s for s, _ in events["eval/acc"]] == [0, 1, 2, 3] == [s for s, _ in events["analysis/pir_test"]]
    assert [s for s, _ in events["round/train_loss"]] == [1, 2, 3] == [s for s, _ in events["analysis/loss_aft"]]
    assert {"round/seconds", "round/allreduce_bytes", "round/participants", "eval/auc"} <= set(events)
    final = json.loads((logged / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["kind"] == "final_eval" and events["eval/acc"][-1] == (ROUNDS, f32(final["acc"]))
    assert all(v == 4.0 for _, v in events["round/participants"])


def test_resume_appends_and_hides_what_the_stopped_run_wrote_past_its_checkpoint(shard, logged, tmp_path):
    """Stopped in round 3 (checkpoint after round 2), with events of a round it never checkpointed left
    behind: the resumed run's events are its metrics.jsonl, one value per step, the same as the
    uninterrupted run's wherever timings play no part."""
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "resumed"
    with pytest.raises(RunFailure):
        run(CONFIG, _args(shard, out), wrap=nonfinite_at("3:1"))
    stale = SummaryWriter(str(out / "tensorboard"))  # as if round 3's record had been logged, then a kill
    stale.add_scalar("round/train_loss", 99.0, 3)
    stale.add_scalar("eval/acc", 0.0, 2)
    stale.add_scalar("analysis/pir_train", 0.0, 3)
    stale.close()
    before = set((out / "tensorboard").iterdir())
    run(CONFIG, _args(shard, out))
    assert before < set((out / "tensorboard").iterdir())  # appended: the earlier files are kept
    events = read_events(out)
    assert events == expected(out)
    full = read_events(logged)
    for tag in ("eval/acc", "eval/test_loss", "round/train_loss", "analysis/pir_train", "analysis/pir_test",
                "analysis/loss_bef", "analysis/loss_aft"):
        assert events[tag] == full[tag], tag


def test_rounds_run_with_the_logger_off_are_in_the_events_once_it_is_on_again(shard, tmp_path):
    """logger=tensorboard for rounds 1-2, none for 3-4, tensorboard again for 5-6: rounds 3 and 4,
    in metrics.jsonl, were missing from TensorBoard (only the resumed round on was written)."""
    out = tmp_path / "toggled"
    for rounds, logger in ((2, "tensorboard"), (4, "none"), (6, "tensorboard")):
        run(CONFIG, [a for a in _args(shard, out) if not a.startswith(("rounds=", "logger="))]
            + [f"rounds={rounds}", f"logger={logger}"])
        (out / "summary.json").unlink()  # a finished run is extended by running it again without its summary
    events = read_events(out)
    assert events == expected(out)
    assert [step for step, _ in events["round/train_loss"]] == [1, 2, 3, 4, 5, 6]


def test_analysis_means_are_weighted_by_samples():
    lines = [{"kind": "train", "round": 2, "client": 0, "samples": 10, "pir": 0.2, "loss_bef": 1.0, "loss_aft": 0.5},
             {"kind": "train", "round": 2, "client": 1, "samples": 30, "pir": 0.6, "loss_bef": 2.0, "loss_aft": 0.1},
             {"kind": "eval", "evaluated_after": 1, "client": 1, "samples": 6, "pir": 0.25, "s_hist": [0] * 50},
             {"kind": "eval", "evaluated_after": 1, "client": 0, "samples": 2, "pir": 0.75, "s_hist": [0] * 50}]
    got = {tag: (step, round(v, 12)) for tag, step, v in PolicyProbeLayout().scalars(lines)}
    assert got == {"analysis/pir_train": (2, 0.5), "analysis/loss_bef": (2, 1.75), "analysis/loss_aft": (2, 0.2),
                   "analysis/pir_test": (1, 0.375)}


def test_logger_none_writes_no_events_and_overwrite_removes_them(tmp_path):
    w = RunWriter(tmp_path, True)
    w.start_metrics([])
    w.log({"kind": "round", "round": 1, "train_loss": 1.0})
    w.close()
    assert not (tmp_path / "tensorboard").exists()
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    prepare_out_dir(tmp_path, overwrite=True, resume="auto").close()
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_bad_logger_and_missing_package_are_one_line_errors(monkeypatch, capsys):
    from fedcp_dist.run import main

    with pytest.raises(UserError, match="config key 'logger': must be one of none, tensorboard, got 'wandb'"):
        load_config(CONFIG, ["logger=wandb", "data.path=nowhere.h5"])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(SystemExit) as exc:
        main(["--config", CONFIG, "logger=tensorboard"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: config key 'logger'")
    assert "pip install tensorboard" in err
