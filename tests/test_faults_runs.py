"""A run that learned nothing does not look finished: with on_nonfinite=skip and every client's
update non-finite in every round, the run is marked diverged in summary.json and its directory's
status, exits 1 with one line, is not run again by a sweep and is shown apart by fedcp-report;
a run in which only some updates were left out is a result like any other."""
import json

import pytest
import yaml

from conftest import BIN, REPO, run_cmd
from fedcp_dist.cli import report
from fedcp_dist.cli import sweep as sweep_cli
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.engine.round_record import learned_nothing
from fedcp_dist.rundir.directory import DIVERGED, FINISHED, RunDir
from fedcp_dist.rundir.out_dir import prepare_out_dir
from helpers import documented, nonfinite_at, run

CONFIG = str(REPO / "configs" / "digits_fedavg.yaml")
#: a step this long sends every client's weights to inf within its first batches
DIVERGING = ["lr=1e30", "on_nonfinite=skip"]


def _rounds(*pairs):
    return [{"kind": "round", "round": k + 1, "participants": p, "nonfinite_skipped": s} for k, (p, s) in enumerate(pairs)]


def test_learned_nothing_means_no_round_kept_a_single_update():
    assert learned_nothing(_rounds((6, 6), (3, 3)))
    assert not learned_nothing(_rounds((6, 6), (3, 2)))  # one client's update was averaged in
    assert not learned_nothing(_rounds((6, 0)))
    assert not learned_nothing([])  # no round run: nothing to judge
    # rounds without participants (empty Poisson cohorts) judge nothing: only the rounds that trained count
    assert learned_nothing(_rounds((0, 0), (4, 4), (0, 0)))
    assert not learned_nothing(_rounds((0, 0), (0, 0)))
    assert learned_nothing([{"kind": "round", "participants": 2, "nonfinite_skipped": 2},
                            {"kind": "final_eval", "acc": 0.1}])


def test_a_run_whose_every_update_diverged_is_marked_and_exits_1(digits6_16px, tmp_path, capsys):
    from fedcp_dist.run import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--config", CONFIG, f"data.path={digits6_16px}", f"out_dir={out}", "rounds=2", "threads=1", *DIVERGING])
    captured = capsys.readouterr()
    assert exc.value.code == 1 and captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith("error: the run learned nothing: every client's update was non-finite in each of "
                                   "its 2 rounds and on_nonfinite=skip left them all out")
    assert f"{out}/summary.json marks it diverged" in captured.err
    documented("checkpoints.md", "error: the run learned nothing: every client's update was non-finite in each of its … "
               "rounds and on_nonfinite=skip left them all out, so its model is the untrained one (accuracy …); "
               "…/summary.json marks it diverged (a lower lr?)", captured.err)
    assert "DIVERGED: no round aggregated a finite update" in captured.out  # the result table says so too
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r["kind"] == "round"]
    assert summary["status"] == DIVERGED and RunDir(out).status() == DIVERGED
    assert [(r["participants"], r["nonfinite_skipped"]) for r in rounds] == [(6, 6), (6, 6)]
    assert summary["final_acc"] == records[0]["acc"]  # the untrained model's accuracy, as before round 1
    # not run again in its directory (it would learn nothing again), and said why
    with pytest.raises(UserError, match=r"holds a run that diverged \(it learned nothing; summary.json\); choose "
                                        r"another out_dir or pass overwrite=true") as refused:
        prepare_out_dir(out, overwrite=False, resume="auto")
    documented("checkpoints.md", "error: out_dir … holds a run that diverged (it learned nothing; summary.json); …",
               f"error: {refused.value}")


def test_a_run_that_left_out_some_updates_is_a_result(digits6_16px, tmp_path):
    out = tmp_path / "run"
    s = run(CONFIG, [f"data.path={digits6_16px}", f"out_dir={out}", "rounds=2", "threads=1", "on_nonfinite=skip"],
            wrap=nonfinite_at("1:2"))
    assert "status" not in s and RunDir(out).status() == FINISHED
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["nonfinite_skipped"] == 1
    documented("checkpoints.md", "`on_nonfinite: skip`: that client is left out of the round (its state unchanged), a "
               "line is printed and `nonfinite_skipped` counted in metrics.jsonl")


def test_a_diverged_run_is_a_run_failure_in_process(digits6_16px, tmp_path):
    with pytest.raises(RunFailure, match="the run learned nothing"):
        run(CONFIG, [f"data.path={digits6_16px}", f"out_dir={tmp_path}", "rounds=1", "threads=1", *DIVERGING])
    assert RunDir(tmp_path).status() == DIVERGED


@pytest.mark.slow
def test_a_sweep_and_its_report_keep_a_diverged_point_apart(digits6_16px, tmp_path, capsys):
    doc = {"name": "lr", "root": str(tmp_path / "sweeps"), "base": CONFIG,
           "overrides": {"rounds": 1, "eval_every": 1, "threads": 1, "on_nonfinite": "skip",
                         "data": {"path": str(digits6_16px)}},
           "grid": {"lr": [0.05, 1e30], "seed": [1]}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    first = run_cmd([str(BIN / "fedcp-sweep"), str(path)], timeout=600)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "DIVERGED" in first.stdout and "learned nothing: error: the run learned nothing" in first.stdout
    assert "lr: 1/2 finished, 1 diverged, 0 failed" in first.stdout
    documented("checkpoints.md", "`… finished, 1 diverged, 0 failed`", first.stdout)
    assert "diverged: lr=1e+30,seed=1: learned nothing, not a result" in first.stdout
    # run again: the diverged point is not run again (it would diverge again), and still not a result
    with pytest.raises(SystemExit) as exc:
        sweep_cli.main([str(path)])
    again = capsys.readouterr().out
    assert exc.value.code == 1 and "running" not in again
    assert "diverged   " in again and "(skipped: it learned nothing)" in again
    sweep_cli.main([str(path), "--dry-run"])
    dry = capsys.readouterr().out
    assert "1 finished, 1 diverged, 0 to run" in dry
    # the report: the diverged run is listed apart and never averaged in
    sweep_dir = tmp_path / "sweeps" / "lr"
    report.main([str(sweep_dir), "--no-plots"])
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| fedavg |"))
    header = next(line for line in text.splitlines() if line.startswith("| method |"))
    cells = dict(zip(header.split("|")[2:-1], row.split("|")[2:-1]))
    assert cells[" lr=1e+30 "].strip() == "diverged (1/1)" and "±" in cells[" lr=0.05 "]
    documented("checkpoints.md", "its cell reads `diverged (1/1)`", f"its cell reads {cells[' lr=1e+30 '].strip()}")
    assert "diverged: 1 run(s) that ran every round but learned nothing" in text
    assert "1/2 runs finished, 1 diverged" in text
    rows = (sweep_dir / "report.csv").read_text().splitlines()
    assert rows[0].endswith(",n_diverged") and sorted(r.rsplit(",", 1)[1] for r in rows[1:]) == ["0", "1"]
