"""Named sweep variants (``variants:``, sets of config keys crossed with the grid) and the report's
``--rows`` and several ``--metric`` columns. No run trains: the points are expanded in this process and
the report reads hand-written summaries in the points' run directories."""
import csv
import json

import pytest

from fedcp_dist import sweep
from fedcp_dist.cli import report
from fedcp_dist.cli import sweep as sweep_cli
from fedcp_dist.config import dump_config, parse_overrides

from test_sweep_report import DIGITS6, cli_error
from test_sweep_report import write_sweep as write_report_sweep

VARIANTS = {"plain": {}, "hard": {"cpn_hard": True, "tau": 0.5}, "cache": {"policy_refresh_every": 5}}


def write_sweep(folder, **fields):
    """The report tests' sweep file, with this file's name, rounds, variants and partition."""
    return write_report_sweep(folder, **{"name": "v", "overrides": {"rounds": 10}, "variants": VARIANTS,
                                         "partition": DIGITS6, **fields})


def test_variants_are_one_more_dimension_varying_fastest(tmp_path):
    sw = sweep.load_sweep(write_sweep(tmp_path))
    assert sw.dimensions == ["seed", "variant"]
    assert [p.name for p in sw.points] == ["seed=1,variant=plain", "seed=1,variant=hard", "seed=1,variant=cache",
                                           "seed=2,variant=plain", "seed=2,variant=hard", "seed=2,variant=cache"]
    hard = sw.points[4]
    assert hard.params == {"seed": 2, "variant": "hard"}
    got = parse_overrides(hard.overrides)
    assert got["cpn_hard"] is True and got["tau"] == 0.5 and got["seed"] == 2 and got["rounds"] == 10
    assert "variant" not in got  # a name, not a config key
    assert "cpn_hard" not in parse_overrides(sw.points[3].overrides)  # the plain variant sets nothing
    cfg = sweep.points.point_config(sw, hard)
    assert cfg.tau == 0.5 and cfg.cpn_hard is True and cfg.policy_refresh_every == 1
    # no grid at all: the variants alone
    sw = sweep.load_sweep(write_sweep(tmp_path, grid=None, overrides={"rounds": 10, "seed": 3}))
    assert [p.name for p in sw.points] == ["variant=plain", "variant=hard", "variant=cache"]
    manifest = json.loads(sweep.write_manifest(sw).read_text())
    assert manifest["grid_keys"] == ["variant"] and manifest["variants"]["cache"] == {"policy_refresh_every": 5}
    assert [p["params"] for p in manifest["points"]] == [{"variant": v} for v in VARIANTS]


@pytest.mark.parametrize("fields, words", [
    ({"variants": {"a": {"lamb": 1}}}, ["sweep variant 'a'", "'lamb'"]),
    ({"variants": {"a": {"tau": -1}}}, ["sweep point", "'tau'"]),
    ({"variants": {"a": {"seed": 4}}}, ["sweep grid key 'seed'", "variant 'a'"]),
    ({"variants": {"a": {"rounds": 4}}}, ["sweep variant 'a'", "'rounds'", "overrides"]),
    ({"variants": {"a": {"out_dir": "x"}}}, ["sweep variant 'a'", "out_dir"]),
    ({"variants": {"a/b": {}}}, ["'variants'", "'a/b'"]),
    ({"variants": {"a": 3}}, ["sweep variant 'a'", "mapping"]),
    ({"variants": []}, ["'variants'"]),
    # two names for one run config would run each point twice
    ({"variants": {"a": {}, "b": None}}, ["variants 'a' and 'b'", "same run config"]),
    ({"variants": {"a": {"lam": 1}, "b": {"lam": 1.0}, "c": {}}}, ["variants 'a' and 'b'", "same run config"]),
    ({"grid": None, "variants": None}, ["'grid' is required"]),
])
def test_bad_variants_name_the_key(fields, words, tmp_path, capsys):
    err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path, **fields)), "--dry-run"])
    assert all(w in err for w in words), err
    assert not (tmp_path / "sweeps").exists()


def test_dry_run_lists_the_variants(tmp_path, capsys):
    sweep_cli.main([str(write_sweep(tmp_path)), "--dry-run"])
    out = capsys.readouterr().out
    assert "6 points over seed × variant" in out
    line = next(ln for ln in out.splitlines() if "seed=1,variant=hard" in ln)
    assert "cpn_hard=true tau=0.5" in line


def _fake_runs(tmp_path):
    """The sweep's manifest and a finished run in every point's directory, with hand-set results."""
    sw = sweep.load_sweep(write_sweep(tmp_path))
    sweep.write_manifest(sw)
    best = {("plain", 1): 0.90, ("plain", 2): 0.94, ("hard", 1): 0.80, ("hard", 2): 0.86,
            ("cache", 1): 0.92, ("cache", 2): 0.92}
    for p in sw.points:
        v, seed = p.params["variant"], p.params["seed"]
        p.run_dir.mkdir(parents=True)
        cfg = sweep.points.point_config(sw, p)  # as the point's run writes it
        assert cfg.seed == seed and cfg.rounds == 10
        (p.run_dir / "config.yaml").write_text(dump_config(cfg))
        summary = {"method": "fedcp", "rounds": 10, "best_acc": best[v, seed], "final_acc": best[v, seed] - 0.01}
        if v == "cache":  # runs saved before every run counted its bytes (here plain and hard) have none
            summary.update(uplink_bytes=1000 * seed, uplink_bytes_sent=1000 * seed, uplink_bytes_saved=500,
                           uplink_saved_fraction=0.25 * seed)
        (p.run_dir / "summary.json").write_text(json.dumps(summary))
    return sw


def test_report_rows_by_variant_with_several_metrics(tmp_path, capsys):
    sw = _fake_runs(tmp_path)
    out = tmp_path / "rep"
    report.main([str(sw.dir), "--rows", "variant", "--metric", "best_acc,final_acc,uplink_bytes_per_round,"
                 "uplink_saved_fraction", "--out", str(out), "--no-plots"])
    md = (out / "report.md").read_text()
    assert "| variant | best_acc | final_acc | uplink_bytes_per_round | uplink_saved_fraction |" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["plain", "hard", "cache"]  # the sweep file's order
    # plain: best 90, 94 -> 92 ± 2; final 89, 93; bytes: n/a (not recorded), not missing
    assert "| plain | 92.00 ± 2.00 | 91.00 ± 2.00 | n/a | n/a |" in md
    assert "| hard | 83.00 ± 3.00 | 82.00 ± 3.00 | n/a | n/a |" in md
    # cache: 1000/10 and 2000/10 bytes a round -> 150 ± 50; fractions 0.25, 0.5 -> 0.375 ± 0.125
    assert "| cache | 92.00 ± 0.00 | 91.00 ± 0.00 | 150 ± 50 | 0.375 ± 0.125 |" in md
    assert "missing" not in md and "n/a: the runs do not record the metric" in md
    with open(out / "report.csv", newline="") as f:
        table = {(r["variant"], r["metric"]): r for r in csv.DictReader(f)}
    assert float(table["cache", "uplink_bytes_per_round"]["mean"]) == 150.0
    assert table["plain", "uplink_bytes_per_round"]["n_seeds"] == "0"
    assert float(table["hard", "best_acc"]["std"]) == pytest.approx(3.0)
    capsys.readouterr()
    # without --rows, the variants are the columns of the method's row
    report.main([str(sw.dir), "--out", str(tmp_path / "rep2"), "--no-plots"])
    md = (tmp_path / "rep2" / "report.md").read_text()
    assert "| method | variant=cache | variant=hard | variant=plain |" in md
    assert "| fedcp | 92.00 ± 0.00 | 83.00 ± 3.00 | 92.00 ± 2.00 |" in md
    # byte counts no run records (nothing skipped): n/a, where a misspelt key stops
    for p in sw.points:
        if p.params["variant"] == "cache" or p.name == "seed=2,variant=hard":
            (p.run_dir / "summary.json").unlink()
    report.main([str(sw.dir), "--rows", "variant", "--metric", "best_acc,uplink_bytes_per_round,uplink_bytes_sent",
                 "--out", str(tmp_path / "rep3"), "--no-plots"])
    md = (tmp_path / "rep3" / "report.md").read_text()
    assert "| plain | 92.00 ± 2.00 | n/a | n/a |" in md and "| cache | – (0/2) | – (0/2) | – (0/2) |" in md
    assert "| hard | 80.00 ± 0.00 (1/2) | n/a (1/2) | n/a (1/2) |" in md  # 1 of 2 finished, without bytes
    capsys.readouterr()
    assert "'variants'" in cli_error(capsys, report.main, [str(sw.dir), "--rows", "variants"])
    assert "'uplink'" in cli_error(capsys, report.main, [str(sw.dir), "--metric", "best_acc,uplink"])
