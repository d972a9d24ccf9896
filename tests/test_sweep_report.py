"""fedcp-sweep and fedcp-report: grid expansion, refusals, the local executor, shared partitions, the table.

One real sweep (FedCP and FedAvg × 2 seeds, 2 rounds of 3 out of 6 digits clients, about 6 s a run on
an idle 2-core machine) runs once for the module through the fedcp-sweep command; everything else reads its
directory or hand-written runs, or calls the library in this process (one more 1-round run).
"""
import csv
import json
import os
import pickle
import shutil
import signal
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, run_cmd
from fedcp_dist import run as fedcp_run
from fedcp_dist import sweep
from fedcp_dist.cli import report
from fedcp_dist.cli import sweep as sweep_cli
from fedcp_dist.cli.partition import main as partition_main
from fedcp_dist.config import Config, dump_config, parse_overrides
from fedcp_dist.data.make import PartitionSpec, make_shard
from fedcp_dist.data.shards import read_info
from fedcp_dist.errors import Preempted, UserError
from fedcp_dist.sweep.names import display_path

BASE = str(REPO / "configs" / "digits_fedcp.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DIGITS6 = {"source": "digits", "partition": "dir", "beta": 0.5, "num_clients": 6, "seed": 2}


def write_sweep(folder: Path, **fields) -> Path:
    doc = {"name": "t", "root": str(folder / "sweeps"), "base": BASE, "overrides": {"rounds": 2, "eval_every": 1},
           "grid": {"seed": [1, 2]}}
    doc.update(fields)
    doc = {k: v for k, v in doc.items() if v is not None}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cli_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC, path


# ----------------------------------------------------------------------------- expansion and names


def test_grid_expansion_and_stable_names(tmp_path, digits6):
    path = write_sweep(tmp_path, overrides={"rounds": 2, "data": {"path": str(digits6)}},
                       grid={"seed": [1, 2], "method": ["fedcp", "fedavg"], "lam": [0.1]})
    sw = sweep.load_sweep(path)
    names = [p.name for p in sw.points]
    assert names == ["lam=0.1,method=fedcp,seed=1", "lam=0.1,method=fedavg,seed=1",
                     "lam=0.1,method=fedcp,seed=2", "lam=0.1,method=fedavg,seed=2"]
    assert all(p.run_dir == (tmp_path / "sweeps" / "t" / "runs" / p.name).resolve() for p in sw.points)
    p = sw.points[2]
    assert p.params == {"seed": 2, "method": "fedcp", "lam": 0.1}
    assert parse_overrides(p.overrides) == {"rounds": 2, "data": {"path": str(digits6)}, "seed": 2, "method": "fedcp",
                                            "lam": 0.1, "out_dir": str(p.run_dir)}
    # the names do not depend on the order of the grid's keys, nor on the run
    path = write_sweep(tmp_path, overrides={"rounds": 2, "data": {"path": str(digits6)}},
                       grid={"lam": [0.1], "method": ["fedcp", "fedavg"], "seed": [1, 2]})
    assert sorted(p.name for p in sweep.load_sweep(path).points) == sorted(names)
    assert sweep.point_name({"participation_range": [0.1, 0.2], "x": "a/b c", "on": True}) == \
        "on=true,participation_range=0.1-0.2,x=a_b_c"
    assert len(sweep.point_name({f"key{i}": "v" * 20 for i in range(10)})) <= 150
    for value in (1e-5, 0.1, 5, "fedcp", [0.1, 0.2], True, None):
        assert parse_overrides([f"k={sweep.yaml_value(value)}"])["k"] == value


@pytest.mark.parametrize("fields, key", [
    ({"grid": {"lamb": [1]}}, "'lamb'"),
    ({"grid": {"seed": []}}, "'seed'"),
    ({"grid": {"seed": 3}}, "'seed'"),
    ({"grid": {"seed": [1, 1]}}, "'seed'"),
    ({"grid": {"lr": [0.1, "1e-1"]}}, "'lr': 0.1 and '1e-1' are the same value"),  # written apart, run alike
    ({"base": "configs"}, "is a directory"),
    ({"grid": {"rounds": ["abc"]}}, "'rounds'"),
    ({"grid": {"lam": [-1]}}, "'lam'"),
    ({"grid": {"beta": [0.1]}}, "'beta'"),
    ({"grids": {"seed": [1]}}, "'grids'"),
    ({"overrides": {"out_dir": "x"}}, "out_dir"),
    ({"overrides": {"lr": "fast"}}, "'lr'"),
    ({"executor": {"kind": "cloud"}}, "executor.kind"),
    ({"executor": {"slurm": {"gpus": 1}}}, "executor.slurm.gpus"),
    ({"partition": {"betaa": 0.1, "num_clients": 6}}, "partition.betaa"),
    ({"partition": {"beta": "x", "num_clients": 6}}, "partition.beta"),
    ({"partition": {"beta": 0, "num_clients": 6}}, "--beta must be a finite number > 0"),  # refused before anything is made
    ({"base": "configs/none.yaml"}, "'base'"),
    ({"name": "a/b"}, "'name'"),
])
def test_bad_sweeps_name_the_key(fields, key, tmp_path, capsys):
    err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path, **fields)), "--dry-run"])
    assert key in err
    assert not (tmp_path / "sweeps").exists()


def test_a_sweep_folder_or_root_that_is_a_file_and_a_damaged_summary_are_refused(digits6, tmp_path, capsys):
    (tmp_path / "sweeps").write_text("not a folder")
    for argv in ([], ["--dry-run"]):
        err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path)), *argv])
        assert f"{tmp_path / 'sweeps'} (a folder above the sweep's directory) is a file" in err
    (tmp_path / "sweeps").unlink()
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "t").write_text("")
    assert "(the sweep's directory) is a file" in cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path))])
    # a point whose summary.json is cut short: neither finished nor to run, said so, nothing run
    (tmp_path / "sweeps" / "t").unlink()
    path = write_sweep(tmp_path, overrides={"rounds": 2, "data.path": str(digits6)})
    sweep_cli.main([str(path), "--dry-run"])
    assert "runs/seed=1" in capsys.readouterr().out
    run_dir = tmp_path / "sweeps" / "t" / "runs" / "seed=1"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text('{"best_acc": 0.8,')
    err = cli_error(capsys, sweep_cli.main, [str(path), "--dry-run"])
    assert f"{run_dir / 'summary.json'} is damaged (not a JSON object)" in err
    assert (run_dir / "summary.json").read_text() == '{"best_acc": 0.8,'


@pytest.mark.parametrize("where, key", [
    ("base", "overwrite"), ("base", "resume"), ("overrides", "overwrite"), ("overrides", "resume"),
    ("grid", "overwrite"), ("grid", "resume"), ("variants", "overwrite"),
])
@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_a_sweep_never_clears_or_refuses_its_points_checkpoints(where, key, executor, tmp_path, capsys):
    """A point is launched again after a requeue or a re-run: overwrite=true would clear its
    checkpoints every time (resume=never would refuse them), so a sweep that sets either is refused
    before anything is made or submitted, by both executors, in one line naming the key."""
    value = {"overwrite": True, "resume": "never"}[key]
    fields = {}
    if where == "base":
        base = tmp_path / "base.yaml"
        base.write_text(Path(BASE).read_text() + f"\n{key}: {value if key == 'resume' else 'true'}\n")
        fields["base"] = str(base)
    elif where == "overrides":
        fields["overrides"] = {"rounds": 2, key: value}
    elif where == "grid":
        fields["grid"] = {"seed": [1, 2], key: [RERUN_SAFE[key], value]}
    else:
        fields["variants"] = {"a": {}, "b": {key: value}}
    err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path, **fields)), "--executor", executor])
    assert f"{key}=" in err and "resume from its checkpoint" in err, err
    assert not (tmp_path / "sweeps").exists()
    # the values every point runs under are accepted wherever they are written
    sw = sweep.load_sweep(write_sweep(tmp_path, overrides={"rounds": 2, **RERUN_SAFE}, partition=DIGITS6), kind=executor)
    assert all(sweep.points.point_config(sw, p).overwrite is False for p in sw.points)


RERUN_SAFE = {"overwrite": False, "resume": "auto"}


def test_unknown_grid_key_suggests(tmp_path, capsys):
    err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path, grid={"lamb": [1, 5]}))])
    assert "sweep grid key 'lamb'" in err and "did you mean 'lam'" in err


def test_a_mistyped_partition_grid_key_suggests_the_partition_option(tmp_path, capsys):
    err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path, grid={"num_client": [4, 5]}, partition=DIGITS6))])
    assert "sweep grid key 'num_client'" in err and "did you mean 'num_clients'" in err


def test_dry_run_prints_every_point_and_runs_nothing(tmp_path, capsys):
    path = write_sweep(tmp_path, grid={"method": ["fedcp", "fedavg"], "seed": [1, 2, 3]}, partition=DIGITS6)
    sweep_cli.main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert len(lines) == 6 and all(" pending " in ln and "-m fedcp_dist.run --config" in ln for ln in lines)
    assert "method=fedavg,seed=3" in out and "digits_dir0.5_n6_s2.h5: to be made" in out
    assert not (tmp_path / "sweeps").exists()  # no partition, no manifest, no run


@pytest.mark.parametrize("name, points", [("client_count", 350), ("heterogeneity_tinyimagenet", 300),
                                          ("heterogeneity_agnews", 300), ("client_subset", 120), ("dropout", 150),
                                          ("local_epochs", 240), ("lambda", 90), ("digits_smoke", 4),
                                          ("extensions", 42), ("extensions_mnist", 14), ("dp_mnist_dir", 48),
                                          ("dp_mnist_iid", 36), ("dp_mnist_pilot", 1), ("digits_bf16", 6),
                                          ("synthetic_client_count", 45)])
def test_the_shipped_sweeps_expand(name, points, tmp_path):
    doc = yaml.safe_load((REPO / "configs" / "sweeps" / f"{name}.yaml").read_text())
    if not (REPO / doc["base"]).exists():  # the CIFAR-100 config comes with the CIFAR-100 support
        doc["base"] = str(REPO / "configs" / "mnist_dir0.1_fedcp.yaml")
    doc["base"] = str(REPO / doc["base"])
    doc["root"] = str(tmp_path)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    sw = sweep.load_sweep(path)
    assert len(sw.points) == points and len({p.run_dir for p in sw.points}) == points
    assert all(p.data_path is not None for p in sw.points)


def test_partitions_are_made_once_per_distinct_setting(tmp_path):
    path = write_sweep(tmp_path, grid={"num_clients": [4, 6], "seed": [1, 2]}, partition=DIGITS6)
    sw = sweep.load_sweep(path)
    shards = {p.name: p.data_path for p in sw.points}
    assert shards["num_clients=4,seed=1"] == shards["num_clients=4,seed=2"]
    assert shards["num_clients=6,seed=1"] == shards["num_clients=6,seed=2"] != shards["num_clients=4,seed=1"]
    assert "data.num_clients=4" in sw.points[0].overrides
    made = sweep.make_partitions(sw, say=lambda *_: None)
    assert sorted(p.name for p in made) == ["digits_dir0.5_n4_s2.h5", "digits_dir0.5_n6_s2.h5"]
    assert sorted(f.name for f in (tmp_path / "sweeps" / "t" / "data").iterdir()) == [p.name for p in sorted(made)]
    assert sweep.make_partitions(sw, say=lambda *_: None) == []  # already there


def test_a_shard_another_sweep_finished_first_is_used(tmp_path, monkeypatch):
    """Two sweeps with one partition block started together: the one that lost the race to write a
    shard exited 2 ("written by another process … use it, or pass --force"), though the shard, named
    by its partition, is the one it needs."""
    from fedcp_dist.data.shards import write

    path = write_sweep(tmp_path, grid={"seed": [1]}, partition=DIGITS6)
    sw = sweep.load_sweep(path)
    target = sw.points[0].data_path
    make_shard(sw.points[0].partition, tmp_path / "theirs.h5")
    real = write._write

    def other_process_first(path, *args):  # the other sweep's shard lands while this one writes
        os.link(tmp_path / "theirs.h5", target)
        return real(path, *args)

    monkeypatch.setattr(write, "_write", other_process_first)
    said = []
    assert sweep.make_partitions(sw, say=said.append) == []
    assert said[-1] == f"partition {display_path(target)}: made by another process meanwhile; using it"
    assert os.path.samefile(target, tmp_path / "theirs.h5")  # theirs, left as it was
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary left


def test_make_shard_is_the_partition_command_as_a_function(tmp_path, capsys):
    spec = PartitionSpec.from_dict({"num_clients": 4, "beta": 1, "seed": 3})
    assert spec.beta == 1.0 and isinstance(spec.beta, float) and spec.source == "digits"
    assert sweep.partition_file_name(spec) == "digits_dir1.0_n4_s3.h5"
    out = make_shard(spec, tmp_path / "a.h5", say=lambda *_: None)
    partition_main(["--num-clients", "4", "--beta", "1", "--seed", "3", "--out", str(tmp_path / "b.h5")])
    a, b = read_info(out), read_info(tmp_path / "b.h5")
    assert a.num_clients == 4 and a.seed == 3 and a.partition_params["beta"] == 1.0
    assert a.train_counts.tolist() == b.train_counts.tolist() and a.partition_params == b.partition_params
    assert (a.train_label_counts == b.train_label_counts).all()
    with pytest.raises(UserError, match="already exists; pass --force"):
        make_shard(spec, out)
    make_shard(PartitionSpec(num_clients=5), out, force=True, say=lambda *_: None)
    assert read_info(out).num_clients == 5
    with pytest.raises(UserError, match="--beta must be a finite number > 0, got 0.0"):
        make_shard(PartitionSpec(num_clients=4, beta=0), tmp_path / "c.h5")
    with pytest.raises(UserError, match="--num-clients is required"):
        make_shard(PartitionSpec(), tmp_path / "c.h5")
    assert not (tmp_path / "c.h5").exists()
    with pytest.raises(UserError, match="'betta' is not a fedcp-partition option"):
        PartitionSpec.from_dict({"betta": 1})
    with pytest.raises(UserError, match="expected float, got 'x'"):
        PartitionSpec.from_dict({"beta": "x"})


# ----------------------------------------------------------------------------- a real sweep


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    path = write_sweep(folder, name="real", grid={"method": ["fedcp", "fedavg"], "seed": [1, 2]}, partition=DIGITS6,
                       overrides={"rounds": 2, "eval_every": 1, "participation": 0.5})  # 3 of 6 clients a round
    res = run_cmd([str(BIN / "fedcp-sweep"), str(path)], timeout=600)
    return path, folder / "sweeps" / "real", res


def test_local_executor_runs_the_points_then_skips_them(finished_sweep, capsys):
    path, sweep_dir, first = finished_sweep
    assert first.returncode == 0, first.stdout + first.stderr
    assert "4 to run" in first.stdout and "[4/4] running" in first.stdout
    assert "real: 4/4 finished, 0 failed" in first.stdout
    shards = list((sweep_dir / "data").iterdir())
    assert [s.name for s in shards] == ["digits_dir0.5_n6_s2.h5"]  # both seeds and methods share it
    runs = sorted((sweep_dir / "runs").iterdir())
    assert [r.name for r in runs] == ["method=fedavg,seed=1", "method=fedavg,seed=2",
                                      "method=fedcp,seed=1", "method=fedcp,seed=2"]
    for r in runs:
        cfg = yaml.safe_load((r / "config.yaml").read_text())
        assert cfg["data"]["path"] == str(shards[0].resolve()) and cfg["rounds"] == 2
        assert f"method={cfg['method']},seed={cfg['seed']}" == r.name
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert manifest["grid_keys"] == ["method", "seed"] and len(manifest["points"]) == 4

    stamps = {f: f.stat().st_mtime_ns for r in runs for f in (r / "summary.json", r / "metrics.jsonl")}
    logs = {f: f.read_text() for f in (sweep_dir / "logs").iterdir()}
    capsys.readouterr()
    sweep_cli.main([str(path)])  # again, in this process: nothing runs, so nothing needs a process of its own
    again = capsys.readouterr().out
    assert "4 finished, 0 to run" in again and again.count("(skipped)") == 4
    assert "running" not in again and "warning" not in again
    assert stamps == {f: f.stat().st_mtime_ns for f in stamps}
    assert logs == {f: f.read_text() for f in (sweep_dir / "logs").iterdir()}
    sweep_cli.main([str(path), "--dry-run"])
    dry = capsys.readouterr().out
    assert dry.count(" finished ") == 4 and "pending" not in dry and "config differs" not in dry


def _summaries(sweep_dir: Path) -> dict:
    out = {}
    for r in (sweep_dir / "runs").iterdir():
        s = r / "summary.json"
        if s.exists():
            cfg = yaml.safe_load((r / "config.yaml").read_text())
            out.setdefault(cfg["method"], {})[cfg["seed"]] = 100 * json.loads(s.read_text())["best_acc"]
    return out


def _csv(path: Path) -> dict:
    with open(path, newline="") as f:
        return {row["method"]: row for row in csv.DictReader(f)}


def test_report_on_the_sweep(finished_sweep, tmp_path, capsys):
    _, sweep_dir, first = finished_sweep
    assert first.returncode == 0
    out = tmp_path / "report"
    report.main([str(sweep_dir), "--out", str(out)])
    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert md.splitlines()[0] == "# Report: real" and md in printed
    rows = [ln for ln in md.splitlines() if ln.startswith("| fed")]
    assert [r.split("|")[1].strip() for r in rows] == ["fedcp", "fedavg"]  # the grid's order
    assert all("±" in r and "(" not in r for r in rows) and "missing" not in md

    values = _summaries(sweep_dir)
    table = _csv(out / "report.csv")
    for method, by_seed in values.items():
        row = table[method]
        assert row["n_seeds"] == "2" and row["seeds"] == "1 2" and row["n_expected"] == "2"
        assert float(row["mean"]) == pytest.approx(statistics.mean(by_seed.values()), abs=1e-9)
        assert float(row["std"]) == pytest.approx(statistics.pstdev(by_seed.values()), abs=1e-9)
        cell = f"{statistics.mean(by_seed.values()):.2f} ± {statistics.pstdev(by_seed.values()):.2f}"
        assert f"| {method} | {cell} |" in md
    assert_png(out / "acc_vs_round.png")


def test_report_marks_missing_runs_and_does_not_average_them(finished_sweep, tmp_path, capsys):
    _, sweep_dir, first = finished_sweep
    assert first.returncode == 0
    copy = tmp_path / "real"
    shutil.copytree(sweep_dir, copy)
    (copy / "runs" / "method=fedcp,seed=2" / "summary.json").unlink()  # unfinished or failed
    shutil.rmtree(copy / "runs" / "method=fedavg,seed=1")  # never started
    report.main([str(copy)])
    md = (copy / "report.md").read_text()
    values = _summaries(copy)
    fedcp, fedavg = values["fedcp"][1], values["fedavg"][2]
    assert f"| fedcp | {fedcp:.2f} ± 0.00 (1/2) |" in md
    assert f"| fedavg | {fedavg:.2f} ± 0.00 (1/2) |" in md
    assert "usual" not in md  # no row is complete: there is no usual seed count to name (was "the usual 0")
    missing = md[md.index("missing: 2 run(s)"):]
    assert "method=fedcp,seed=2" in missing and "no summary.json" in missing
    assert "method=fedavg,seed=1" in missing and "not started" in missing
    table = _csv(copy / "report.csv")
    assert table["fedcp"]["n_seeds"] == "1" and table["fedcp"]["n_expected"] == "2"
    assert float(table["fedcp"]["mean"]) == pytest.approx(fedcp, abs=1e-9)
    assert "missing: 2 run(s)" in capsys.readouterr().out


def test_report_keeps_apart_the_runs_made_under_an_earlier_sweep_file(finished_sweep, tmp_path, capsys):
    """The sweep file edited after its points ran (rounds 2 -> 3 here): fedcp-sweep keeps the
    finished runs with a warning, and the report averaged them as if they were the new points.
    sweep.json now says what each point is, so they are listed apart with the keys, and the sweep
    folder copied elsewhere (its shard with it) is not called changed for its new shard path."""
    _, sweep_dir, first = finished_sweep
    assert first.returncode == 0
    shutil.copytree(sweep_dir, tmp_path / "sweeps" / "real")
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert all(p["config"]["rounds"] == 2 and p["config"].get("method", "fedcp") in ("fedcp", "fedavg")
               and "out_dir" not in p["config"] and "threads" not in p["config"] for p in manifest["points"])
    edited = write_sweep(tmp_path, name="real", grid={"method": ["fedcp", "fedavg"], "seed": [1, 2]},
                         partition=DIGITS6, overrides={"rounds": 3, "eval_every": 1, "participation": 0.5})
    copy = tmp_path / "sweeps" / "real"
    report.main([str(copy), "--no-plots"])  # the copy, as it was made: nothing changed
    assert "missing" not in capsys.readouterr().out
    sweep.manifest.write_manifest(sweep.load_sweep(edited))
    report.main([str(copy), "--no-plots"])
    out = capsys.readouterr().out
    md = (copy / "report.md").read_text()
    assert "| fedcp | – (0/2) |" in md and "| fedavg | – (0/2) |" in md, md
    assert md.count("made under an earlier sweep file (its config differs from the point's now in rounds)") == 4
    assert "0/4 runs finished, 4 made under an earlier sweep file" in out
    # more rounds: the advice is fedcp-sweep's, to remove summary.json and resume (removing the folder
    # threw the finished rounds away); fewer rounds cannot go on: the folder
    assert md.count("remove its summary.json and run fedcp-sweep again (it resumes from its last checkpoint)") == 4
    fewer = write_sweep(tmp_path, name="real", grid={"method": ["fedcp", "fedavg"], "seed": [1, 2]},
                        partition=DIGITS6, overrides={"rounds": 1, "eval_every": 1, "participation": 0.5})
    sweep.manifest.write_manifest(sweep.load_sweep(fewer))
    report.main([str(copy), "--no-plots"])
    capsys.readouterr()
    md = (copy / "report.md").read_text()
    assert md.count("remove its folder and run fedcp-sweep again") == 4 and "remove its summary.json" not in md
    sweep.manifest.write_manifest(sweep.load_sweep(edited))
    # a manifest written before points said what they are: no run is judged
    old = json.loads((copy / "sweep.json").read_text())
    for p in old["points"]:
        del p["config"]
    (copy / "sweep.json").write_text(json.dumps(old))
    report.main([str(copy), "--no-plots"])
    assert "4/4 runs finished" in capsys.readouterr().out


def test_a_point_at_todays_defaults_is_not_called_stale():
    """sweep.json leaves out the keys at their defaults; a key the point lacks is today's default,
    not the value an older version had for configs without it (fastText's fasttext_mean: every
    AG News point was reported as made under an earlier sweep file)."""
    from fedcp_dist.cli.report_runs import _stale_keys
    from fedcp_dist.config import flatten

    for cfg in (Config(method="fedavg", model="fasttext"), Config(method="fedcp", rounds=3)):
        have = flatten(cfg.to_dict())
        defaults = flatten(Config().to_dict())
        wanted = {k: v for k, v in have.items() if defaults.get(k) != v}
        assert _stale_keys(have, wanted) == []
        assert _stale_keys(have, {**wanted, "rounds": 7}) == ["rounds"]
        assert _stale_keys({**have, "out_dir": "elsewhere", "threads": 3}, wanted) == []  # not defining
    assert _stale_keys(None, {"rounds": 7}) == []


# ----------------------------------------------------------------------------- hand-written runs


def fake_run(folder: Path, method: str, seed: int, lam: float, best: float, finished: bool = True) -> None:
    folder.mkdir(parents=True)
    cfg = Config(method=method, seed=seed, lam=lam, rounds=4, eval_every=2, out_dir=str(folder))
    cfg.data.path = "data/x.h5"
    (folder / "config.yaml").write_text(dump_config(cfg))
    accs = [0.1, best - 0.05, best]
    with open(folder / "metrics.jsonl", "w") as f:
        for t, acc in zip((0, 2, 4), accs):
            f.write(json.dumps({"round": t + 1, "evaluated_after": t, "acc": acc}) + "\n")
    if finished:
        (folder / "summary.json").write_text(json.dumps({"method": method, "best_acc": best, "final_acc": best,
                                                         "rounds": 4, "seconds_per_round": 1.0}))


def test_report_without_a_manifest_uses_the_keys_that_differ(tmp_path, capsys):
    best = {(0.1, 1): 0.90, (0.1, 2): 0.92, (0.1, 3): 0.95, (1.0, 1): 0.80, (1.0, 2): 0.84, (1.0, 3): 0.0}
    for (lam, seed), acc in best.items():
        fake_run(tmp_path / "runs" / f"a{lam}" / f"s{seed}", "fedcp", seed, lam, acc, finished=(lam, seed) != (1.0, 3))
    fake_run(tmp_path / "runs" / "b" / "fedavg", "fedavg", 1, 0.1, 0.5)
    report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| method | lam=0.1 | lam=1.0 |" in md
    m, s = statistics.mean([90, 92, 95]), statistics.pstdev([90, 92, 95])
    assert f"| fedcp | {m:.2f} ± {s:.2f} | 82.00 ± 2.00 (2/3) |" in md
    assert "| fedavg | 50.00 ± 0.00 (n=1) |  |" in md
    assert "missing: 1 run(s)" in md and "a1.0/s3" in md
    assert_png(tmp_path / "out" / "acc_vs_round.png")
    assert_png(tmp_path / "out" / "acc_vs_lam.png")
    # --by chooses the columns; --metric another summary key
    report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out2"), "--by", "method", "--metric", "final_acc",
                 "--no-plots"])
    md = (tmp_path / "out2" / "report.md").read_text()
    assert "| method | method=fedavg | method=fedcp |" in md and "of 100·final_acc" in md
    capsys.readouterr()
    assert "'nothing'" in cli_error(capsys, report.main, [str(tmp_path / "runs"), "--by", "nothing"])
    assert "'best'" in cli_error(capsys, report.main, [str(tmp_path / "runs"), "--metric", "best"])
    # a mistyped key: the closest one, not the list of every key the runs hold
    for argv, said in ((["--by", "metod"], "--by 'metod' is not a key of any run (did you mean 'method'?)"),
                       (["--rows", "seeed"], "--rows 'seeed' is not a key of any run (did you mean 'seed'?)"),
                       (["--metric", "fianl_acc"], "--metric 'fianl_acc' is in no summary.json (did you mean "
                                                   "'final_acc'?)"),
                       # a record metric with the number typed, not its pattern (rounds_to_P is refused)
                       (["--metric", "round_to_95"], "--metric 'round_to_95' is in no summary.json (did you mean "
                                                     "'rounds_to_95'?)"),
                       (["--metric", "acc_afer_10"], "--metric 'acc_afer_10' is in no summary.json (did you mean "
                                                     "'acc_after_10'?)")):
        assert cli_error(capsys, report.main, [str(tmp_path / "runs"), *argv]) == f"error: fedcp-report: {said}\n"
    assert "no runs" in cli_error(capsys, report.main, [str(tmp_path / "out")])
    # options that would do nothing or the same twice (duplicate columns)
    runs = str(tmp_path / "runs")
    assert cli_error(capsys, report.main, [runs, "--by", "lam,lam"]) == "error: fedcp-report: --by names 'lam' twice\n"
    assert cli_error(capsys, report.main, [runs, "--metric", "best_acc, best_acc"]) == \
        "error: fedcp-report: --metric names 'best_acc' twice\n"
    assert "--selection draws selection_counts.png, which --no-plots leaves out" in cli_error(
        capsys, report.main, [runs, "--selection", "--no-plots"])
    assert "not a directory" in cli_error(capsys, report.main, [str(tmp_path / "none")])


def test_overwrite_removes_the_old_runs_reports_and_keeps_the_users_files(tmp_path, capsys):
    """fedcp-report and fedcp-analyze write into the run's folder by default: a fresh run with
    overwrite=true must not sit beside a report of the run it removed (DERIVED names them)."""
    from fedcp_dist.rundir.out_dir import prepare_out_dir

    run = tmp_path / "run"
    fake_run(run, "fedcp", 1, 5.0, 0.9)
    report.main([str(run), "--selection"])
    (run / "analysis").mkdir()
    (run / "analysis" / "report.md").write_text("old analysis")
    (run / "notes.md").write_text("mine")
    (run / "my_plot.png").write_bytes(b"mine")
    made = {p.name for p in run.iterdir()}
    assert {"report.md", "report.csv", "acc_vs_round.png"} <= made
    prepare_out_dir(run, overwrite=True, resume="auto").close()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "my_plot.png", "notes.md"]


def test_a_run_resumed_under_another_eval_every_is_not_filed_under_its_last_value(tmp_path, capsys):
    """eval_every may change on resume; config.yaml then holds the last value only. A run whose
    round records were evaluated on another schedule must not be averaged with the runs evaluated
    every eval_every rounds throughout (its best_acc is over other rounds)."""
    def run(name, evaluated, best):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        cfg = Config(method="fedcp", seed=1, rounds=4, eval_every=2, out_dir=str(folder))
        cfg.data.path = "data/x.h5"
        (folder / "config.yaml").write_text(dump_config(cfg))
        lines = [{"kind": "round", "round": r, **({"evaluated_after": r - 1, "acc": 0.5} if r in evaluated else {})}
                 for r in range(1, 5)] + [{"kind": "final_eval", "round": 4, "evaluated_after": 4, "acc": best}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (folder / "summary.json").write_text(json.dumps({"method": "fedcp", "best_acc": best, "rounds": 4}))

    run("every2", {1, 3}, 0.90)
    run("every1_then_2", {1, 2, 3}, 0.80)  # eval_every=1 for two rounds, then resumed with 2
    report.main([str(tmp_path / "runs"), "--no-plots"])
    md = (tmp_path / "runs" / "report.md").read_text()
    assert "| method | eval_every=2 | eval_every=changed (now 2) |" in md, md
    assert "| fedcp | 90.00 ± 0.00 | 80.00 ± 0.00 |" in md, md


def test_a_report_whose_axes_leave_method_out_keeps_the_methods_apart(tmp_path, capsys):
    """--rows lam (or --by seed) with FedCP and FedAvg runs averaged both methods into one cell,
    a figure of neither, under a header saying 'mean over seeds'."""
    for seed, acc in ((1, 0.80), (2, 0.82)):
        fake_run(tmp_path / "runs" / f"fedcp{seed}", "fedcp", seed, 0.1, acc)
        fake_run(tmp_path / "runs" / f"fedavg{seed}", "fedavg", seed, 0.1, acc - 0.5)
    report.main([str(tmp_path / "runs"), "--rows", "lam", "--by", "seed", "--no-plots"])
    captured = capsys.readouterr()
    md = (tmp_path / "runs" / "report.md").read_text()
    assert "| lam | method=fedavg,seed=1 | method=fedavg,seed=2 | method=fedcp,seed=1 | method=fedcp,seed=2 |" in md, md
    assert "| 0.1 | 30.00 ± 0.00 | 32.00 ± 0.00 | 80.00 ± 0.00 | 82.00 ± 0.00 |" in md, md
    assert "note: the runs hold 2 methods and neither --rows nor --by names method" in captured.err


def test_report_shows_dp_epsilon_infinite_and_absent(tmp_path):
    """dp_epsilon: a number where noise was added, ∞ without noise, n/a for runs without DP."""
    for lam, eps in ((0.1, 2.5), (1.0, float("inf"))):
        for seed in (1, 2):
            folder = tmp_path / "runs" / f"a{lam}" / f"s{seed}"
            fake_run(folder, "fedcp", seed, lam, 0.9)
            summary = json.loads((folder / "summary.json").read_text())
            (folder / "summary.json").write_text(json.dumps({**summary, "dp_epsilon": eps, "dp_delta": 1e-5}))
    fake_run(tmp_path / "runs" / "b", "fedavg", 1, 0.1, 0.5)
    report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--metric", "dp_epsilon", "--no-plots"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| fedcp | 2.5 ± 0 | ∞ |" in md and "| fedavg | n/a |  |" in md


METHODS12 = ("fedavg", "fedprox", "perfedavg", "pfedme", "fedamp", "ditto", "fedper", "fedrep", "fedrod", "fedfomo",
             "fedphp", "fedcp")


def test_every_method_of_the_comparison_plot_has_its_own_colour_and_marker_and_fedcp_stands_out(tmp_path, monkeypatch):
    from matplotlib.colors import to_hex

    from fedcp_dist.analysis.plots import series_styles
    from fedcp_dist.cli import report_plots

    for i, m in enumerate(METHODS12):
        fake_run(tmp_path / "runs" / m, m, 1, 0.1, 0.5 + 0.03 * i)
    col = report.collect(tmp_path / "runs")
    table = report.build_table(col, report.setting_keys(col, None), "best_acc")
    drawn = []
    monkeypatch.setattr(report_plots, "_save", lambda fig, path: drawn.append(fig))
    assert report_plots.plot_curves(table, tmp_path / "acc_vs_round.png")
    lines = {ln.get_label(): ln for ln in drawn[0].axes[0].get_lines()}
    assert set(lines) == set(METHODS12)
    assert len({to_hex(ln.get_color()) for ln in lines.values()}) == 12
    assert len({ln.get_marker() for ln in lines.values()}) == 12
    others = [ln for m, ln in lines.items() if m != "fedcp"]
    assert lines["fedcp"].get_linewidth() > max(ln.get_linewidth() for ln in others)
    assert lines["fedcp"].get_zorder() > max(ln.get_zorder() for ln in others)
    # beyond the palette and the markers: colours still all differ, markers for the first 16
    names = [f"m{i}" for i in range(40)]
    styles = series_styles(names)
    assert len({to_hex(st["color"]) for st in styles.values()}) == 40
    assert len({styles[n]["marker"] for n in names[:15]}) == 15
    assert "black" not in {st["color"] for st in styles.values()}  # kept for the highlighted method


def test_an_interrupted_report_leaves_the_previous_files_whole(tmp_path, monkeypatch):
    """A report stopped while it writes a plot (Ctrl-C, a full disk) keeps the earlier report's
    plot as it was, and no partial file is left beside it."""
    from matplotlib.figure import Figure

    for seed, acc in ((1, 0.9), (2, 0.8)):
        fake_run(tmp_path / "runs" / f"s{seed}", "fedcp", seed, 0.1, acc)
    out = tmp_path / "out"
    report.main([str(tmp_path / "runs"), "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert_png(out / "acc_vs_round.png")
    real_savefig = Figure.savefig

    def savefig_then_fail(fig, f, **kw):
        real_savefig(fig, f, **kw)
        f.truncate(100)  # half a file on disk, then the write stops
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", savefig_then_fail)
    fake_run(tmp_path / "runs" / "s3", "fedcp", 3, 0.1, 0.7)  # the next report would change every file
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path / "runs"), "--out", str(out)])
    assert exc.value.code != 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after["acc_vs_round.png"] == before["acc_vs_round.png"]  # the earlier plot, whole
    assert set(after) == set(before)  # no temporary file left
    # the table was written whole before the plots: the new run is in it
    assert "| fedcp | 80.00 ± 8.16 |" in after["report.md"].decode()


# ----------------------------------------------------------------------------- the SLURM path, without a cluster


def test_slurm_callable_pickles_and_requeues_itself(tmp_path, digits6):
    submitit = pytest.importorskip("submitit")
    run = sweep.SweepRun(cwd=str(tmp_path))
    again = pickle.loads(pickle.dumps(run))
    assert isinstance(again, sweep.SweepRun) and again.cwd == str(tmp_path) and not again.in_process
    delayed = run.checkpoint("method=fedcp,seed=1", ["--config", BASE])
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    assert delayed.function is run and delayed.args == ("method=fedcp,seed=1", ["--config", BASE])
    path = write_sweep(tmp_path, executor={"kind": "slurm", "nproc": 2, "slurm": {
        "partition": "debug", "gpus_per_task": 1, "cpus_per_task": 4, "time_min": 30, "array_parallelism": 8}},
        overrides={"rounds": 2, "data": {"path": str(digits6)}})
    params = sweep.slurm_parameters(sweep.load_sweep(path))
    assert params == {"name": "fedcp-t", "timeout_min": 30, "tasks_per_node": 2, "nodes": 1, "gpus_per_node": 2,
                      "slurm_partition": "debug", "cpus_per_task": 4, "slurm_array_parallelism": 8,
                      "slurm_signal_delay_s": 120}
    with pytest.raises(UserError, match="tasks_per_node"):
        sweep.load_sweep(write_sweep(tmp_path, executor={"nproc": 2, "slurm": {"tasks_per_node": 4}}))


def test_what_slurm_does_with_a_task_whose_run_checkpointed():
    """scontrol's view of the task once its run stopped on a SIGTERM: a restart count past this
    attempt's is SLURM's own requeue; a job no longer running is ending (scancel); else requeue."""
    from fedcp_dist.sweep import slurm

    env = {"SLURM_ARRAY_JOB_ID": "85", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "86", "SLURM_RESTART_COUNT": "0"}
    asked = []

    def shows(out):
        return lambda job: asked.append(job) or out

    line = "JobId=86 ArrayJobId=85 ArrayTaskId=1 JobName=fedcp-t JobState={} Reason=None Requeue=1 Restarts={} BatchFlag=1"
    assert slurm.slurm_task_fate(env, shows(line.format("COMPLETING", 1))) == "requeue"
    assert asked == ["85_1"]
    assert slurm.slurm_task_fate(env, shows(line.format("COMPLETING", 0))) == "end"
    assert slurm.slurm_task_fate(env, shows(line.format("CANCELLED", 0))) == "end"
    assert slurm.slurm_task_fate(env, shows(line.format("RUNNING", 0))) == "run"
    assert slurm.slurm_task_fate({**env, "SLURM_RESTART_COUNT": "1"}, shows(line.format("RUNNING", 1))) == "run"
    assert slurm.slurm_task_fate({"SLURM_JOB_ID": "7"}, shows(line.format("RUNNING", 0))) == "run" and asked[-1] == "7"
    assert slurm.slurm_task_fate({}, shows(line.format("RUNNING", 0))) == "unknown"

    def fails(job):
        raise subprocess.CalledProcessError(1, ["scontrol", "show", "job", job])

    assert slurm.slurm_task_fate(env, fails) == "unknown"


def test_a_tasks_error_is_told_by_its_own_line_and_a_checkpointed_stop_is_not_a_failure():
    from fedcp_dist.sweep import slurm

    def submitit_text(last):  # how submitit re-raises a task's error
        return ("Job (task=0) failed during processing with trace:\n----------------------\n"
                "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n" + last + "\n"
                "----------------------\nYou can check full logs with 'job.stderr(0)' and 'job.stdout(0)'or at "
                "paths:\n  - /s/85_0_0_log.err\n  - /s/85_0_0_log.out")

    assert slurm.task_outcome(submitit_text("RuntimeError: run seed=1 failed (exit status 2): error: bad")) == \
        ("failed", "RuntimeError: run seed=1 failed (exit status 2): error: bad")
    assert slurm.task_outcome(submitit_text(f"RuntimeError: {slurm.STOPPED} the job was ended (scancel)")) == \
        ("stopped", "the job was ended (scancel)")
    outcome, why = slurm.task_outcome(submitit_text(
        "submitit.core.utils.UncompletedJobError: Job not requeued because: timed-out too many times."))
    assert outcome == "stopped" and "executor.slurm.max_num_timeout" in why and "run the sweep again" in why
    assert slurm.task_outcome("just one line") == ("failed", "just one line")


def test_a_slurm_sweep_run_again_submits_no_point_an_earlier_submission_still_holds(tmp_path, digits6, monkeypatch):
    """Run again while its array job was still queued, a SLURM sweep submitted every unfinished point
    again; the second task of each then found it finished (or in use) and ended FAILED, and the
    sweep exited 1. Now the points SLURM still holds are not submitted, and a task whose point is
    finished or run by another task says so instead of failing."""
    import fcntl

    from fedcp_dist.sweep import slurm
    from fedcp_dist.sweep.manifest import write_manifest

    path = write_sweep(tmp_path, grid={"seed": [1, 2, 3]}, overrides={"rounds": 1, "data.path": str(digits6)})
    sw = sweep.load_sweep(path)
    names = [p.name for p in sw.points]
    assert slurm.queued_points(sw, lambda jobs: "") == {}  # nothing submitted yet
    write_manifest(sw, {"executor": "slurm", "array_job": "23", "jobs": {n: f"23_{i}" for i, n in enumerate(names)}})
    write_manifest(sw, {"executor": "slurm", "array_job": "27", "jobs": {names[2]: "27_0"}})
    asked = []

    def squeue(jobs):
        asked.append(jobs)
        return "23_1\n27_0\n"  # 23_0 ended; 23_2 ended and was submitted again as 27_0, still pending

    assert slurm.queued_points(sw, squeue) == {names[1]: "23_1", names[2]: "27_0"} and asked == [["23", "27"]]
    assert slurm.queued_points(sw, lambda jobs: None) is None  # squeue did not answer

    # a task whose point another task finished returns that run's summary and runs nothing
    run_dir = sw.points[0].run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"best_acc": 0.5}))
    task = sweep.SweepRun(cwd=str(REPO))
    assert task(names[0], ["--config", "no-such.yaml", f"out_dir={run_dir}"]) == {"best_acc": 0.5}
    # a task whose point another task runs now (the lock held): "elsewhere", not a failure
    busy = sw.points[1].run_dir
    busy.mkdir(parents=True)
    with open(busy / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RuntimeError) as exc:
            task(names[1], sw.run_args(sw.points[1]))
    assert slurm.task_outcome(str(exc.value)) == (
        "elsewhere", f"run {names[1]}'s out_dir is in use by another run (a task of another submission of this "
                     f"sweep): that one runs it")

    # --wait waits for the points it left to an earlier submission, then says how each ended
    answers = iter(["23_1\n27_0\n", "27_0\n", ""])
    said = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: said.append(" ".join(map(str, a))))
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    left = slurm._wait_for_earlier(sw, {names[0]: "23_0", names[1]: "23_1", names[2]: "27_0"},
                                   squeue=lambda jobs: next(answers))
    monkeypatch.undo()
    assert left == 2 and next(answers, "done") == "done"  # polled until SLURM held none of them
    assert said[0] == f"  23_0  {names[0]}: finished (a task of an earlier submission)"
    assert said[1].startswith(f"  23_1  {names[1]}: not finished by its task of an earlier submission")
    assert slurm._wait_for_earlier(sw, {names[1]: "23_1"}, squeue=lambda jobs: None) == 1  # squeue silent


def test_slurm_task_of_several_ranks_runs_the_config_in_process(digits6, tmp_path, monkeypatch):
    """Every task of a multi-task run calls fedcp_dist.run.run_config; a preempted run requeues through
    submitit's handler when it is installed, and is an error otherwise."""
    monkeypatch.chdir(REPO)  # the task changes to the submit directory
    out = tmp_path / "run"
    args = ["--config", BASE, f"data.path={digits6}", "rounds=1", "threads=1", f"out_dir={out}"]
    task = sweep.SweepRun(cwd=str(REPO), in_process=True)
    summary = task("p", args)
    assert summary["rounds"] == 1 and summary == json.loads((out / "summary.json").read_text())

    def preempted(*_):
        raise Preempted("checkpointed after 1 rounds")

    assert task("p", args) == summary  # run again (a task of another submission): the finished run's result
    monkeypatch.setattr(fedcp_run, "run_config", preempted)
    args[-1] = f"out_dir={tmp_path / 'unfinished'}"
    with pytest.raises(Preempted):
        task("p", args)
    calls = []

    def checkpoint_and_try_requeue(signum, frame):  # the name submitit's handler has
        calls.append(signum)

    previous = signal.signal(signal.SIGUSR2, checkpoint_and_try_requeue)
    try:
        assert task("p", args) is None
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert calls == [signal.SIGUSR2]


def test_local_points_give_torchrun_time_to_checkpoint_after_a_sigterm(monkeypatch):
    """torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM unless told otherwise; a point's
    environment raises that grace to a round's worth (the user's own setting wins)."""
    from fedcp_dist.sweep import local

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert local.run_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(local.SHUTDOWN_TIMEOUT_S) == "1800"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    assert local.run_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "90"


def test_metrics_read_from_the_records_rounds_to_acc_after_and_pir(tmp_path, capsys):
    """rounds_to_P, acc_after_R and the test PIR come from metrics.jsonl and analysis.jsonl, computed
    here by hand from the curves written below (evaluations after rounds 0, 2 and 4)."""
    curves = {1: [0.10, 0.96, 0.985], 2: [0.10, 0.94, 0.97], 3: [0.20, 0.97, 0.99]}
    for seed, accs in curves.items():
        folder = tmp_path / "runs" / f"s{seed}"
        fake_run(folder, "fedcp", seed, 0.1, max(accs))
        with open(folder / "metrics.jsonl", "w") as f:
            for t, acc in zip((0, 2, 4), accs):
                f.write(json.dumps({"round": t + 1, "evaluated_after": t, "acc": acc}) + "\n")
    # seed 1 probed its policy: the evaluation after round 2 is not the last and does not count
    probes = [{"kind": "eval", "evaluated_after": 2, "client": 0, "samples": 10, "pir": 0.9, "s_hist": [0] * 50},
              {"kind": "eval", "evaluated_after": 4, "client": 0, "samples": 10, "pir": 0.2, "s_hist": [0] * 50},
              {"kind": "eval", "evaluated_after": 4, "client": 1, "samples": 30, "pir": 0.6, "s_hist": [0] * 50}]
    (tmp_path / "runs" / "s1" / "analysis.jsonl").write_text("".join(json.dumps(p) + "\n" for p in probes))
    report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--no-plots",
                 "--metric", "rounds_to_95,rounds_to_98,rounds_to_99.5,acc_after_2,acc_after_3,pir_test,pir_test_spread"])
    with open(tmp_path / "out" / "report.csv", newline="") as f:
        table = {r["metric"]: r for r in csv.DictReader(f)}
    # first round at >= 95 %: 2, 4, 2
    assert float(table["rounds_to_95"]["mean"]) == pytest.approx(8 / 3)
    assert float(table["rounds_to_95"]["std"]) == pytest.approx(statistics.pstdev([2, 4, 2]))
    # >= 98 %: seeds 1 and 3 after round 4; seed 2 never, so it is not averaged in
    assert table["rounds_to_98"]["mean"] == "4.0" and table["rounds_to_98"]["seeds"] == "1 3"
    assert table["rounds_to_99.5"]["n_seeds"] == "0"
    assert float(table["acc_after_2"]["mean"]) == pytest.approx(statistics.mean([96, 94, 97]))
    assert table["acc_after_3"]["n_seeds"] == "0"  # nobody evaluated after round 3
    # seed 1 only: (10 * 0.2 + 30 * 0.6) / 40 = 0.5; the clients' PIRs 0.2 and 0.6 spread by 0.2
    assert float(table["pir_test"]["mean"]) == pytest.approx(0.5) and table["pir_test"]["seeds"] == "1"
    assert float(table["pir_test_spread"]["mean"]) == pytest.approx(0.2)
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| fedcp"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert cells[0] == "2.7 ± 0.9" and cells[1] == "4.0 ± 0.0 (2/3; 1 not reached)" and cells[2] == "not reached (3/3)"
    assert cells[4] == "n/a" and cells[5].startswith("0.5 ± 0")
    capsys.readouterr()
    # P outside (0, 100] is said to be out of range
    for bad, p in (("rounds_to_101", "101"), ("rounds_to_0", "0")):
        msg = cli_error(capsys, report.main, [str(tmp_path / "runs"), "--metric", bad])
        assert msg == f"error: fedcp-report: --metric {bad}: P must be a percentage in (0, 100], got {p}\n"


def test_the_curves_plot_ticks_the_evaluated_rounds_says_its_seeds_and_zooms_where_curves_meet(tmp_path, monkeypatch):
    """Evaluations every 2 rounds get ticks at 0, 2, 4 (not a locator's own spacing); one run a
    method is titled as one seed, two as a mean over 2 seeds; curves that end within a fifth of the
    plot's range of each other get an inset on the last half of the rounds, zoomed to them."""
    from fedcp_dist.cli import report_plots

    drawn = []
    monkeypatch.setattr(report_plots, "_save", lambda fig, path: drawn.append(fig))
    for m, best in (("fedcp", 0.95), ("fedper", 0.96)):
        fake_run(tmp_path / "one" / m, m, 1, 0.1, best)
    col = report.collect(tmp_path / "one")
    assert report_plots.plot_curves(report.build_table(col, report.setting_keys(col, None), "best_acc"), tmp_path / "a.png")
    fig = drawn[-1]
    main = fig.axes[0]
    (inset,) = main.child_axes
    assert list(main.get_xticks()) == [0, 2, 4]
    assert fig._suptitle.get_text() == "accuracy against rounds (one seed a curve)"
    # the inset shows rounds 2 and 4 (the last half of 4) of both curves, its y axis around 90-96 %
    assert [list(ln.get_xdata()) for ln in inset.get_lines()] == [[2, 4], [2, 4]]
    lo, hi = inset.get_ylim()
    assert 89.0 < lo < 90.0 and 96.0 < hi < 97.0  # 90 ... 96 % with a margin, against 10 ... 96 % on the main axis
    # two seeds a method: a mean over 2 seeds; curves far apart at the end: no inset
    for seed, best in ((1, 0.95), (2, 0.93)):
        fake_run(tmp_path / "two" / f"a{seed}", "fedcp", seed, 0.1, best)
    fake_run(tmp_path / "two" / "b", "fedavg", 1, 0.1, 0.3)
    col = report.collect(tmp_path / "two")
    report_plots.plot_curves(report.build_table(col, report.setting_keys(col, None), "best_acc"), tmp_path / "b.png")
    fig = drawn[-1]
    assert len(fig.axes) == 1 and not fig.axes[0].child_axes
    assert fig._suptitle.get_text() == "accuracy against rounds (mean ± 1 std over 1–2 seeds a curve)"
    assert report_plots.seeds_title({3}) == "accuracy against rounds (mean ± 1 std over 3 seeds)"
    # three methods end close together and one far below: the inset zooms on the three
    for m, best in (("fedcp", 0.95), ("fedper", 0.96), ("fedrep", 0.955), ("perfedavg", 0.60)):
        fake_run(tmp_path / "group" / m, m, 1, 0.1, best)
    col = report.collect(tmp_path / "group")
    report_plots.plot_curves(report.build_table(col, report.setting_keys(col, None), "best_acc"), tmp_path / "c.png")
    (inset,) = drawn[-1].axes[0].child_axes
    lo, hi = inset.get_ylim()
    assert 89.0 < lo < 90.0 and 96.0 < hi < 97.0  # the three's 90 ... 96 %, not perfedavg's 55 ... 60 %
    # two of them close and one far: no group worth an inset
    band = report_plots.zoom_band([("a", "", "", [0, 2, 4], [10, 90, 95], []),
                                   ("b", "", "", [0, 2, 4], [10, 91, 96], []),
                                   ("c", "", "", [0, 2, 4], [10, 50, 55], [])])
    assert band is None


def test_round_ticks_follow_the_evaluation_spacing():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedcp_dist.cli import report_plots

    fig, ax = plt.subplots()
    report_plots.round_ticks(ax, list(range(0, 51, 5)))  # 11 evaluations: one tick each
    assert list(ax.get_xticks()) == list(range(0, 51, 5))
    ax.set_xlim(0, 150)
    report_plots.round_ticks(ax, list(range(0, 151)))  # every round to 150: every 20 (10 would make 15 ticks)
    assert [t for t in ax.get_xticks() if 0 <= t <= 150] == [0, 20, 40, 60, 80, 100, 120, 140]
    ax.set_xlim(0, 200)
    report_plots.round_ticks(ax, list(range(0, 201, 5)))  # every 5 rounds to 200: every 25, a multiple of 5
    assert [t for t in ax.get_xticks() if 0 <= t <= 200] == list(range(0, 201, 25))
    plt.close(fig)


def test_dry_run_shows_the_launcher_it_runs(digits6, tmp_path, capsys, monkeypatch):
    """--dry-run's command is the one the local executor runs: fedcp-run --ranks N for nproc > 1
    (torchrun behind it, which ends a stopped point with 75 and no traceback; bare torchrun printed
    its traceback and exit status 1), the interpreter alone for 1."""
    import os
    import shlex
    import sys

    from fedcp_dist.cli import sweep as sweep_cli

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for nproc in (2, 1):
        path = write_sweep(tmp_path, executor={"kind": "local", "nproc": nproc},
                           overrides={"rounds": 2, "data.path": str(digits6)})
        sweep_cli.main([str(path), "--dry-run"])
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[1/2]")]
        words = shlex.split(lines[0])
        at = words.index("-m") - 1
        assert words[at] == "python", lines
        assert words[at + 1:at + 5] == (["-m", "fedcp_dist.run", "--ranks", "2"] if nproc == 2
                                        else ["-m", "fedcp_dist.run", "--config", words[at + 4]]), words


def test_a_run_whose_summary_gives_nan_is_missing_with_the_reason(tmp_path):
    fake_run(tmp_path / "runs" / "a", "fedcp", 1, 0.1, 0.9)
    fake_run(tmp_path / "runs" / "b", "fedcp", 2, 0.1, 0.8)
    (tmp_path / "runs" / "b" / "summary.json").write_text(json.dumps({"method": "fedcp", "best_acc": float("nan"),
                                                                      "rounds": 4}))
    col = report.collect(tmp_path / "runs")
    table = report.build_table(col, report.setting_keys(col, None), "best_acc")
    assert [(r.seed, r.why) for r in table.missing] == [(2, "summary.json gives 'best_acc' as nan")]
    # a metric read from the records: the file it was read from is named (it said summary.json)
    metrics = tmp_path / "runs" / "a" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"acc": 0.9}', '"acc": NaN}'))
    col = report.collect(tmp_path / "runs")
    table = report.build_table(col, report.setting_keys(col, None), "acc_after_4")
    assert [(r.seed, r.why) for r in table.missing] == [(1, "metrics.jsonl gives 'acc_after_4' as nan")]


@pytest.mark.parametrize("env, copies", [
    ({}, 1), ({"OMPI_COMM_WORLD_SIZE": "2"}, 2), ({"PMI_SIZE": "4"}, 4),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "3"}, 3), ({"WORLD_SIZE": "3"}, 1),
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}, 2),
    ({"SLURM_STEP_ID": "batch", "SLURM_STEP_NUM_TASKS": "2"}, 1),  # the batch script itself: one copy
])
def test_a_sweep_started_by_a_launcher_is_refused(env, copies, tmp_path, capsys, monkeypatch):
    """`mpirun -n 2 fedcp-sweep`: the copies ran every point twice at once (one mpi job of both),
    or one copy's point was FAILED by the other's lock although it finished."""
    assert sweep_cli.launched_copies(env) == copies
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if copies > 1:
        err = cli_error(capsys, sweep_cli.main, [str(write_sweep(tmp_path, grid={"seed": [1]}))])
        assert err == (f"error: fedcp-sweep was started {copies} times by a launcher (mpirun, srun or torchrun): it "
                       f"starts each point's ranks itself (executor.nproc); run one copy\n")
        assert not (tmp_path / "sweeps").exists()


def test_an_unfinished_point_whose_config_changed_is_named_not_resumed(digits6, tmp_path, capsys):
    """After a stopped sweep's base changed (lr), --dry-run said '(resumes)' and the sweep then
    FAILED the point with fedcp-run's advice 'overwrite=true', which a sweep refuses."""
    overrides = {"rounds": 2, "eval_every": 1, "checkpoint_every": 1, "data": {"path": str(digits6)}, "threads": 1}
    sweep_cli.main([str(write_sweep(tmp_path, overrides=overrides, grid={"seed": [1]}))])
    run_dir = next((tmp_path / "sweeps" / "t" / "runs").iterdir())
    (run_dir / "summary.json").unlink()  # stopped after its last checkpoint
    capsys.readouterr()
    changed = write_sweep(tmp_path, overrides={**overrides, "lr": 0.02}, grid={"seed": [1]})
    sweep_cli.main([str(changed), "--dry-run"])
    out = capsys.readouterr().out
    shown = display_path(run_dir)
    assert f"(config differs: lr: it cannot resume; remove {shown} to run it afresh)" in out, out
    with pytest.raises(SystemExit) as exc:
        sweep_cli.main([str(changed)])
    out = capsys.readouterr().out
    assert exc.value.code == 1
    assert "[1/1] FAILED" in out and (f"its checkpointed run was made with another lr, which a resume refuses; "
                                      f"remove {shown} to run it afresh") in out, out
    assert not (run_dir / "summary.json").exists() and (run_dir / "checkpoints").is_dir()  # left as it was


def test_a_report_of_loose_runs_beside_a_sweep_is_titled_by_its_folder(finished_sweep, tmp_path):
    """`fedcp-report runs` (loose runs and runs/sweeps/NAME) was titled by the nested sweep alone."""
    _, sweep_dir, _ = finished_sweep
    root = tmp_path / "runs"
    shutil.copytree(sweep_dir, root / "sweeps" / "real")
    fake_run(root / "loose", "fedcp", 1, 0.1, 0.5)
    report.main([str(root), "--out", str(tmp_path / "out"), "--no-plots"])
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Report: runs\n")
    report.main([str(root / "sweeps"), "--out", str(tmp_path / "out2"), "--no-plots"])
    assert (tmp_path / "out2" / "report.md").read_text().startswith("# Report: real\n")


def test_the_drift_warning_says_how_a_run_goes_on_to_more_rounds(tmp_path, capsys, digits6):
    """Raising a sweep's rounds made it warn "remove their directories to run them again" (all the
    rounds lost), where removing summary.json lets such a run resume from its last checkpoint; a
    method whose training depends on the total of rounds (FedPHP) or another changed key still has
    to run afresh."""
    from fedcp_dist.sweep.drift import drift_warning

    sw = sweep.load_sweep(write_sweep(tmp_path, grid={"method": ["fedavg", "fedphp"], "seed": [1, 2, 3]},
                                      overrides={"rounds": 2, "eval_every": 1, "data.path": str(digits6)}))
    # (method, seed): the keys its finished run was made with, and whether it kept a checkpoint
    made = {("fedavg", 1): ({"rounds": 1}, True), ("fedphp", 1): ({"rounds": 1}, True),
            ("fedavg", 2): ({"lr": 0.5}, True), ("fedphp", 2): ({"eval_every": 3}, True),
            ("fedphp", 3): ({"rounds": 5}, True),  # fewer rounds now: a resume would refuse
            ("fedavg", 3): ({"rounds": 1}, False)}  # no checkpoint (checkpoint_every: 0): it would start over
    for p in sw.points:
        key = (p.params["method"], p.params["seed"])
        cfg = sweep.points.point_config(sw, p)
        for k, v in made[key][0].items():
            setattr(cfg, k, v)
        p.run_dir.mkdir(parents=True)
        (p.run_dir / "config.yaml").write_text(dump_config(cfg))
        (p.run_dir / "summary.json").write_text("{}")
        if made[key][1]:
            (p.run_dir / "checkpoints" / "round_0000001").mkdir(parents=True)
            (p.run_dir / "checkpoints" / "round_0000001" / "COMPLETE").write_text("{}")
    drift_warning(sw)
    lines = capsys.readouterr().out.splitlines()
    on = next(p.run_dir for p in sw.points if (p.params["method"], p.params["seed"]) == ("fedavg", 1))
    fresh = next(p.run_dir for p in sw.points if (p.params["method"], p.params["seed"]) == ("fedavg", 2))
    assert lines == [
        f"warning: 2 finished run(s) were made with another value of eval_every, rounds and were kept; to take "
        f"them on to the new value, remove their summary.json and run the sweep again (each resumes from its last "
        f"checkpoint), e.g. rm {sweep.names.display_path(on / 'summary.json')}",
        f"warning: 4 finished run(s) were made with a different config (lr, rounds) and were kept; remove their "
        f"directories to run them again, e.g. {sweep.names.display_path(fresh)}"]


def test_a_grid_of_more_points_than_a_study_takes_is_refused_at_once(tmp_path, capsys, digits6, monkeypatch):
    """A mistyped grid of 160,000 points made `fedcp-sweep --dry-run` check each point's config for
    minutes, printing nothing."""
    grid = {"seed": list(range(40)), "lr": [0.1 * i for i in range(1, 21)], "lam": list(range(20)),
            "batch_size": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}
    with pytest.raises(UserError) as exc:
        sweep.load_sweep(write_sweep(tmp_path, grid=grid))
    assert str(exc.value) == ("sweep t: its grid makes 160,000 points (40 × 20 × 20 × 10); more than 20,000 is taken "
                              "for a slip (a list where one value was meant?): split the study into sweeps")
    capsys.readouterr()
    monkeypatch.setattr(sweep.points, "SAY_POINTS", 3)  # a long check is said first (2,000 points and more)
    sw = sweep.load_sweep(write_sweep(tmp_path, grid={"seed": [1, 2, 3, 4]},
                                      overrides={"rounds": 2, "data.path": str(digits6)}))
    assert len(sw.points) == 4 and capsys.readouterr().err == "sweep t: checking 4 points\n"


def test_a_partition_block_for_several_schemes_and_an_explicit_client_count_still_load(tmp_path):
    """Two compositions a sweep file may hold, which the day's refusals must not break: a grid over
    the partition scheme beside a block holding beta (dir's, ignored by iid), and overrides that set
    data.num_clients beside a partition block (the point then carried the key twice and every run
    was refused when it started, though --dry-run passed)."""
    sw = sweep.load_sweep(write_sweep(tmp_path, grid={"partition.partition": ["dir", "iid"]}, partition=DIGITS6,
                                      overrides={"rounds": 2, "data.num_clients": 6}))
    assert [p.params["partition.partition"] for p in sw.points] == ["dir", "iid"]
    for p in sw.points:
        assert [o for o in p.overrides if o.startswith("data.num_clients=")] == ["data.num_clients=6"]


def test_seeds_run_on_copies_of_one_shard_pool_into_one_cell(tmp_path, capsys, digits6):
    """Seeds run on node-local copies of one shard (another data.path each) were never averaged:
    each path was a column of one seed. The shard's content decides: the fingerprint a run's summary
    records, or the file's own; shards of other content stay apart."""
    import shutil

    from fedcp_dist.data.shards import read_info
    from fedcp_dist.run import run_config

    copies = []
    for node in ("node1", "node2"):
        (tmp_path / node).mkdir()
        copies.append(shutil.copy(digits6, tmp_path / node / "d.h5"))
    run_config("configs/digits_fedavg.yaml", [f"data.path={copies[0]}", f"out_dir={tmp_path / 'real'}", "rounds=1",
                                              "threads=1", "checkpoint_every=0"])
    fingerprint = json.loads((tmp_path / "real" / "summary.json").read_text())["data_fingerprint"]
    assert fingerprint and fingerprint == read_info(digits6).fingerprint

    def runs_on(paths, root):
        for seed, (path, acc) in enumerate(zip(paths, (0.80, 0.84)), 1):
            fake_run(root / f"s{seed}", "fedcp", seed, 0.1, acc)
            cfg = (root / f"s{seed}" / "config.yaml")
            cfg.write_text(cfg.read_text().replace("path: data/x.h5", f"path: {path}"))
        report.main([str(root), "--no-plots"])
        return (root / "report.md").read_text()

    md = runs_on(copies, tmp_path / "copies")  # the fingerprint read from each file
    assert "| fedcp | 82.00 ± 2.00 |" in md and "data.path" not in md, md
    other = tmp_path / "other.h5"
    shutil.copy(digits6, other)
    with __import__("h5py").File(other, "a") as f:
        f.attrs["fingerprint"] = "sha256:another"
    md = runs_on([copies[0], other], tmp_path / "apart")
    assert "data.path=" in md and "| fedcp |" in md and "82.00" not in md, md
    # copies beside another shard: a data.path column, the copies in one cell of it
    mixed = tmp_path / "mixed"
    runs_on(copies, mixed)
    fake_run(mixed / "s9", "fedcp", 9, 0.1, 0.5)
    cfg = mixed / "s9" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("path: data/x.h5", f"path: {other}"))
    report.main([str(mixed), "--no-plots"])
    md = (mixed / "report.md").read_text()
    assert f"| method | data.path={copies[0]} | data.path={other} |" in md, md
    assert "| fedcp | 82.00 ± 2.00 | 50.00 ± 0.00 (n=1) |" in md, md
    # copies gone from here (node-local disks): the fingerprint the summaries recorded
    gone = [str(tmp_path / "gone1" / "d.h5"), str(tmp_path / "gone2" / "d.h5")]
    root = tmp_path / "gone"
    for seed in (1, 2):
        fake_run(root / f"s{seed}", "fedcp", seed, 0.1, (0.80, 0.84)[seed - 1])
        cfg = root / f"s{seed}" / "config.yaml"
        cfg.write_text(cfg.read_text().replace("path: data/x.h5", f"path: {gone[seed - 1]}"))
        summary = root / f"s{seed}" / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "data_fingerprint": fingerprint}))
    report.main([str(root), "--no-plots"])
    assert "| fedcp | 82.00 ± 2.00 |" in (root / "report.md").read_text()
    capsys.readouterr()


def test_a_damaged_config_or_metrics_file_is_named_not_reported_as_a_result(tmp_path, capsys):
    """A finished run whose config.yaml was emptied or cut became a row 'None' filed under every key
    as null; a damaged line in metrics.jsonl made rounds_to_P 'not reached' and acc_after_R 'n/a'
    for a run that got there. Both are listed apart with the reason."""
    for seed, acc in ((1, 0.80), (2, 0.84), (3, 0.90)):
        fake_run(tmp_path / "runs" / f"s{seed}", "fedcp", seed, 0.1, acc)
    (tmp_path / "runs" / "s3" / "config.yaml").write_text("method: [unclosed\n")
    report.main([str(tmp_path / "runs"), "--no-plots"])
    md = (tmp_path / "runs" / "report.md").read_text()
    assert "| fedcp | 82.00 ± 2.00 |" in md and "None" not in md and "null" not in md, md
    assert "unreadable: 1 run(s) whose setting cannot be read, not averaged:" in md
    assert f"- {tmp_path / 'runs' / 's3'} (config.yaml is damaged (not a YAML mapping): its setting is unknown)" in md
    (tmp_path / "runs" / "s3" / "config.yaml").write_text("")
    report.main([str(tmp_path / "runs"), "--no-plots"])
    assert "config.yaml is damaged" in (tmp_path / "runs" / "report.md").read_text()

    metrics = tmp_path / "runs" / "s2" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], '{"round": 3, "evalu', lines[2]]) + "\n")
    report.main([str(tmp_path / "runs"), "--no-plots", "--metric", "rounds_to_50"])
    md = (tmp_path / "runs" / "report.md").read_text()
    assert "| fedcp | 2.0 ± 0.0 (1/2) |" in md, md  # s1 reached 50 % after 2 rounds; s2 is not "not reached"
    assert "not reached" not in md and "line 2 is not a JSON object; the file is damaged" in md, md
    capsys.readouterr()


def test_a_config_its_summary_contradicts_or_cut_at_a_line_end_is_named(tmp_path, capsys):
    """A config.yaml edited to another method filed a FedCP result under fedavg; one cut after its
    third line (method, rounds, seed) read as a valid setting whose other keys were null, about 90
    columns of them. Both are listed as unreadable."""
    for seed in (1, 2, 3):
        fake_run(tmp_path / "runs" / f"s{seed}", "fedcp", seed, 0.1, 0.8)
    cfg = tmp_path / "runs" / "s2" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("method: fedcp", "method: fedavg"))
    cut = tmp_path / "runs" / "s3" / "config.yaml"
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:3]))
    report.main([str(tmp_path / "runs"), "--no-plots"])
    md = (tmp_path / "runs" / "report.md").read_text()
    assert "| fedcp | 80.00 ± 0.00 |" in md and "fedavg" not in md.split("unreadable")[0] and "null" not in md, md
    assert (f"- {tmp_path / 'runs' / 's2'} (config.yaml says method fedavg but summary.json says fedcp: one of them was "
            f"edited or replaced, so its setting is unknown)") in md, md
    assert f"- {tmp_path / 'runs' / 's3'} (config.yaml lacks " in md and "keys a run writes (cut short or edited)" in md
    capsys.readouterr()


def test_a_run_going_on_is_said_to_be_running(tmp_path, capsys):
    """A run still going (its out_dir lock held) was listed as 'unfinished or failed'. The lock is
    looked up in the kernel's list, not taken: a run starting meanwhile must find it free."""
    import fcntl

    fake_run(tmp_path / "runs" / "s1", "fedcp", 1, 0.1, 0.8)
    fake_run(tmp_path / "runs" / "s2", "fedcp", 2, 0.1, 0.8, finished=False)
    with open(tmp_path / "runs" / "s2" / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        report.main([str(tmp_path / "runs"), "--no-plots"])
        held = (tmp_path / "runs" / "report.md").read_text()
    report.main([str(tmp_path / "runs"), "--no-plots"])
    free = (tmp_path / "runs" / "report.md").read_text()
    assert "no summary.json yet: running (a process on this machine holds its lock)" in held, held
    assert "no summary.json: unfinished or failed" in free and "running" not in free, free
    capsys.readouterr()


def test_a_finished_runs_records_cut_at_a_line_end_are_named_not_read(tmp_path, capsys):
    """metrics.jsonl cut after a whole line (or emptied) read as a run that evaluated less: a
    finished run's rounds_to_50 said 'not reached' and its acc_after_4 'n/a'. Records that do not
    reach the rounds summary.json says the run did (or lack the final evaluation) are named."""
    for seed in (1, 2):
        fake_run(tmp_path / "runs" / f"s{seed}", "fedcp", seed, 0.1, 0.8)
        with open(tmp_path / "runs" / f"s{seed}" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"kind": "final_eval", "evaluated_after": 4, "acc": 0.8}) + "\n")
    metrics = tmp_path / "runs" / "s2" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:1]))
    report.main([str(tmp_path / "runs"), "--no-plots", "--metric", "rounds_to_70,acc_after_4"])
    md = (tmp_path / "runs" / "report.md").read_text()
    assert "| fedcp | 2.0 ± 0.0 (1/2) | 80.00 ± 0.00 (1/2) |" in md, md
    assert "not reached" not in md and ("metrics.jsonl ends after round 1 of the 4 that summary.json says the run "
                                        "did: cut short or replaced") in md, md
    metrics.write_text("")
    report.main([str(tmp_path / "runs"), "--no-plots", "--metric", "rounds_to_70"])
    assert "ends after round 0 of the 4" in (tmp_path / "runs" / "report.md").read_text()
    capsys.readouterr()


def test_an_unfinished_point_whose_rounds_its_training_depends_on_changed_cannot_resume(tmp_path, digits6):
    """A DP point with a target ε stopped, then the sweep's rounds changed: the sweep resumed it and
    the run refused with 'use another out_dir, or overwrite=true', which a sweep refuses. Where the
    training depends on the total (a target ε calibrates the noise to it), a change of rounds is one
    that a resume refuses, and the sweep says to remove the folder instead."""
    from fedcp_dist.sweep.drift import resume_drift
    from fedcp_dist.sweep.points import point_config

    for dp, refused in (({"dp": "central", "dp_target_epsilon": 8.0, "dp_delta": 0.01}, ["rounds"]), ({}, [])):
        base = {"rounds": 3, "data": {"path": str(digits6)}, **dp}
        sw = sweep.load_sweep(write_sweep(tmp_path, overrides=base, grid={"seed": [1]}))
        point = sw.points[0]
        point.run_dir.mkdir(parents=True, exist_ok=True)
        ran = point_config(sw, point)
        ran.rounds = 2  # the run was made under rounds: 2
        (point.run_dir / "config.yaml").write_text(dump_config(ran))
        assert resume_drift(sw, point) == refused, dp


def test_an_unfinished_point_whose_rounds_fell_below_its_checkpoints_cannot_resume(tmp_path, digits6):
    """A point stopped after 4 of 5 rounds, then the sweep's rounds lowered to 2: --dry-run said it
    resumes and the sweep launched it, and the run refused ('resume with rounds >= 4')."""
    from fedcp_dist.sweep.drift import resume_drift
    from fedcp_dist.sweep.points import point_config

    sw = sweep.load_sweep(write_sweep(tmp_path, overrides={"rounds": 2, "data": {"path": str(digits6)}},
                                      grid={"seed": [1]}))
    point = sw.points[0]
    ran = point_config(sw, point)
    ran.rounds = 5
    point.run_dir.mkdir(parents=True)
    (point.run_dir / "config.yaml").write_text(dump_config(ran))
    for r in (3, 4):
        (point.run_dir / "checkpoints" / f"round_{r:07d}").mkdir(parents=True)
        (point.run_dir / "checkpoints" / f"round_{r:07d}" / "COMPLETE").write_text("{}")
    assert resume_drift(sw, point) == ["rounds"]
    for rounds, refused in ((3, ["rounds"]), (4, []), (6, [])):  # the newest checkpoint is resumed: 4 rounds done
        sw = sweep.load_sweep(write_sweep(tmp_path, overrides={"rounds": rounds, "data": {"path": str(digits6)}},
                                          grid={"seed": [1]}))
        assert resume_drift(sw, sw.points[0]) == refused, rounds


def test_a_point_not_started_is_filed_under_the_method_and_seed_its_sweep_gives_it(tmp_path, capsys):
    """A point refused at its start (or not yet run) has no config.yaml: when the sweep's grid does
    not name the method or the seed, the report read them from sweep.json's record of the point,
    not as None (a row `None`, `seed=null`, apart from the method's own row)."""
    sweep_dir = tmp_path / "s"
    fake_run(sweep_dir / "runs" / "lam=1.0", "fedavg", 3, 1.0, 0.8)
    points = [{"name": f"lam={lam}", "run_dir": f"runs/lam={lam}", "params": {"lam": lam},
               "config": {"method": "fedavg", "seed": 3, "lam": lam, "rounds": 4, "eval_every": 2,
                          "data.path": "data/x.h5"}} for lam in (1.0, 2.0)]
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "s", "grid_keys": ["lam"], "grid": {"lam": [1.0, 2.0]},
                                                      "points": points}))
    report.main([str(sweep_dir), "--no-plots"])
    md = (sweep_dir / "report.md").read_text()
    assert "None" not in md and "null" not in md
    assert "| fedavg | 80.00 ± 0.00 | – (0/1) |" in md
    assert "- fedavg lam=2.0,seed=3:" in md and "not started" in md


def test_a_point_its_existing_shard_does_not_fit_is_refused_before_anything_runs(digits6, tmp_path, capsys):
    """A grid value the shard cannot serve (50 of its 6 clients; the text model on an image shard):
    --dry-run listed the points as pending and the sweep ran them, failing each on the same line."""
    for grid, words, extra_keys in (
            ({"data.clients": [3, 50]}, "config key 'data.clients' asks for 50 clients but", {}),
            ({"model": ["cnn", "fasttext"]}, "config key 'model': 'fasttext' reads text shards", {}),
            # a target ε the 6 clients cannot reach in 2 rounds: the run would refuse it at its start
            ({"dp_target_epsilon": [5, 0.0001]}, "config key 'dp_target_epsilon': 0.0001 is not reachable in 2 rounds",
             {"dp": "central", "participation": 0.5})):
        path = write_sweep(tmp_path, overrides={"rounds": 2, "data": {"path": str(digits6)}, **extra_keys}, grid=grid)
        for extra in (["--dry-run"], []):
            err = cli_error(capsys, sweep_cli.main, [str(path), *extra])
            assert err.startswith("error: sweep point ") and words in err, err
            assert not (tmp_path / "sweeps").exists()


def test_a_damaged_shard_of_the_sweep_is_named_once_with_the_way_out(tmp_path, capsys):
    """A shard the sweep made, damaged since (cut short by a full disk): --dry-run said `exists` and
    every point failed on the same line. Now the sweep refuses before anything runs, naming the file
    and saying that removing it makes the sweep write it again."""
    path = write_sweep(tmp_path, grid={"seed": [1]}, partition=DIGITS6)
    sw = sweep.load_sweep(path)
    shard = sw.points[0].data_path
    sweep.make_partitions(sw, say=lambda _: None)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 3])
    capsys.readouterr()
    err = cli_error(capsys, sweep_cli.main, [str(path), "--dry-run"])
    assert err.startswith("error: sweep point seed=1: ") and str(shard.name) in err, err
    assert err.rstrip().endswith("; remove it and the sweep makes it again"), err
    shard.unlink()
    sweep_cli.main([str(path), "--dry-run"])
    assert f"partition {display_path(shard)}: to be made" in capsys.readouterr().out
