"""A sweep's ``exclude`` rules: points of the grid that are not run, each with the reason the dry run,
``sweep.json`` and ``fedcp-report`` give. No run trains: the points are expanded in this process and
the report reads hand-written summaries in the points' run directories."""
import csv
import json

import pytest

from conftest import REPO
from fedcp_dist import sweep
from fedcp_dist.cli import report
from fedcp_dist.cli import sweep as sweep_cli
from fedcp_dist.config import dump_config

from test_sweep_report import DIGITS6, cli_error, write_sweep

GRID = {"num_clients": [4, 6], "method": ["fedavg", "perfedavg", "fedcp"], "seed": [1, 2]}
RULE = {"where": {"method": "perfedavg", "num_clients": [6]}, "reason": "invalid at N >= 6 in the study"}


def exclude_sweep(folder, **fields):
    return write_sweep(folder, **{"grid": GRID, "partition": {k: v for k, v in DIGITS6.items() if k != "num_clients"},
                                  "exclude": [RULE], **fields})


def test_excluded_points_are_not_run_and_keep_their_reason(tmp_path):
    sw = sweep.load_sweep(exclude_sweep(tmp_path))
    assert len(sw.points) == 2 * 3 * 2 - 2
    assert [e.name for e in sw.excluded] == ["method=perfedavg,num_clients=6,seed=1",
                                             "method=perfedavg,num_clients=6,seed=2"]
    assert {e.reason for e in sw.excluded} == {RULE["reason"]}
    names = {p.name for p in sw.points}
    assert "method=perfedavg,num_clients=4,seed=2" in names and not names & {e.name for e in sw.excluded}
    # the points keep the names (and run directories) they had without the rule
    full = sweep.load_sweep(exclude_sweep(tmp_path, exclude=None))
    assert {p.name: p.run_dir for p in full.points if p.name in names} == {p.name: p.run_dir for p in sw.points}
    # one value instead of a list; several rules; 4 == 4.0 as the config reads it
    rules = [{"where": {"seed": 2, "method": ["fedavg", "fedcp"]}, "reason": "a"},
             {"where": {"num_clients": 4.0, "method": "fedavg"}, "reason": "b"}]
    sw = sweep.load_sweep(exclude_sweep(tmp_path, exclude=rules))
    assert sorted((e.name, e.reason) for e in sw.excluded) == [
        ("method=fedavg,num_clients=4,seed=1", "b"), ("method=fedavg,num_clients=4,seed=2", "a"),
        ("method=fedavg,num_clients=6,seed=2", "a"), ("method=fedcp,num_clients=4,seed=2", "a"),
        ("method=fedcp,num_clients=6,seed=2", "a")]


@pytest.mark.parametrize("exclude, words", [
    ({"where": {"method": "fedcp"}, "reason": "x"}, "non-empty list"),
    ([{"where": {"method": "fedcp"}}], "'reason' is required"),
    ([{"where": {"method": "fedcp"}, "reason": "  "}], "'reason' is required"),
    ([{"where": {}, "reason": "x"}], "'where' must be"),
    ([{"where": {"lam": 1}, "reason": "x"}], "'where.lam' is not a grid key"),
    ([{"where": {"method": "fedprox"}, "reason": "x"}], "value 'fedprox' is not in the grid"),
    ([{"where": {"method": "fedcp"}, "reason": "x", "why": 1}], "unknown key 'why'"),
    ([{"where": {"method": "fedcp"}, "reason": "x"}, {"where": {"method": "fedcp", "seed": 1}, "reason": "y"}],
     "rule 2 excludes no point"),
    ([{"where": {"seed": [1, 2]}, "reason": "x"}], "leaves no point to run"),
])
def test_bad_exclude_rules_are_refused_in_one_line(exclude, words, tmp_path, capsys):
    err = cli_error(capsys, sweep_cli.main, [str(exclude_sweep(tmp_path, exclude=exclude)), "--dry-run"])
    assert words in err, err


def test_dry_run_and_manifest_list_the_excluded_points(tmp_path, capsys):
    path = exclude_sweep(tmp_path)
    sweep_cli.main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert "sweep t: 10 points over num_clients × method × seed;" in out and "; 2 excluded" in out
    assert f"excluded   method=perfedavg,num_clients=6,seed=1: {RULE['reason']}" in out
    assert "[10/10]" in out and "[11/" not in out and "perfedavg,num_clients=6,seed=1  " not in out
    sw = sweep.load_sweep(path)
    manifest = json.loads(sweep.write_manifest(sw).read_text())
    assert manifest["excluded"] == [{"name": e.name, "params": e.params, "reason": RULE["reason"]}
                                    for e in sw.excluded]
    assert len(manifest["points"]) == 10


def test_report_marks_excluded_cells_with_the_reason(tmp_path, capsys):
    sw = sweep.load_sweep(exclude_sweep(tmp_path))
    sweep.write_manifest(sw)
    for p in sw.points:
        p.run_dir.mkdir(parents=True)
        (p.run_dir / "config.yaml").write_text(dump_config(sweep.points.point_config(sw, p)))  # as its run writes it
        best = 0.5 + 0.1 * p.params["seed"] + 0.01 * p.params["num_clients"]
        (p.run_dir / "summary.json").write_text(json.dumps({"method": p.params["method"], "best_acc": best,
                                                            "final_acc": best, "rounds": 2}))
    # every point finished: the local executor runs nothing and says what it left out
    sweep_cli.main([str(exclude_sweep(tmp_path))])
    said = capsys.readouterr().out
    assert "10 points, 10 finished, 0 to run" in said and "; 2 excluded" in said
    out = tmp_path / "rep"
    report.main([str(sw.dir), "--out", str(out), "--no-plots"])
    md = (out / "report.md").read_text()
    assert "| method | num_clients=4 | num_clients=6 |" in md
    # seeds 1, 2 at N = 4: 64 and 74 -> 69 ± 5; the excluded cell says so instead of a missing count
    assert "| perfedavg | 69.00 ± 5.00 | excluded |" in md
    assert "| fedcp | 69.00 ± 5.00 | 71.00 ± 5.00 |" in md
    assert "missing" not in md
    assert f"- perfedavg num_clients=6: 2 point(s); {RULE['reason']}" in md
    with open(out / "report.csv", newline="") as f:
        rows = {(r["method"], r["setting"]): r for r in csv.DictReader(f)}
    assert rows["perfedavg", "num_clients=6"]["excluded"] == RULE["reason"] and rows["perfedavg", "num_clients=6"]["n_seeds"] == "0"
    assert rows["fedcp", "num_clients=6"]["excluded"] == "" and rows["fedcp", "num_clients=6"]["n_seeds"] == "2"
    assert "69.00 ± 5.00" in capsys.readouterr().out


def test_the_client_count_study_excludes_per_fedavg_at_200_and_500_clients():
    sw = sweep.load_sweep(REPO / "configs" / "sweeps" / "client_count.yaml")
    assert sorted({(e.params["method"], e.params["num_clients"]) for e in sw.excluded}) == [
        ("perfedavg", 200), ("perfedavg", 500)]
    assert len(sw.excluded) == 10 and all("Per-FedAvg" in e.reason for e in sw.excluded)
    assert not any(p.params["method"] == "perfedavg" and p.params["num_clients"] >= 200 for p in sw.points)
    assert sum(p.params["method"] == "perfedavg" for p in sw.points) == 4 * 5


def test_an_excluded_setting_of_a_grid_without_the_rows_key_is_marked_in_its_row(tmp_path):
    """The method fixed for every point (not a grid key): the excluded points carry no method, and
    their cell was left blank and their report.csv row out, though the docs promise `excluded`."""
    rule = {"where": {"num_clients": [6]}, "reason": "too few"}
    path = write_sweep(tmp_path, grid={"num_clients": [4, 6, 8], "seed": [1, 2]},
                       overrides={"rounds": 2, "eval_every": 1, "method": "fedcp"},
                       partition={k: v for k, v in DIGITS6.items() if k != "num_clients"}, exclude=[rule])
    sw = sweep.load_sweep(path)
    sweep.write_manifest(sw)
    for p in sw.points:
        p.run_dir.mkdir(parents=True)
        (p.run_dir / "config.yaml").write_text(dump_config(sweep.points.point_config(sw, p)))
        (p.run_dir / "summary.json").write_text(json.dumps({"method": "fedcp", "best_acc": 0.5, "final_acc": 0.5,
                                                            "rounds": 2}))
    out = tmp_path / "rep"
    report.main([str(sw.dir), "--out", str(out), "--no-plots"])
    md = (out / "report.md").read_text()
    assert "| fedcp | 50.00 ± 0.00 | excluded | 50.00 ± 0.00 |" in md, md
    with open(out / "report.csv", newline="") as f:
        rows = {(r["method"], r["setting"]): r for r in csv.DictReader(f)}
    assert rows["fedcp", "num_clients=6"]["excluded"] == "too few" and rows["fedcp", "num_clients=6"]["n_seeds"] == "0"
