"""The run directory: the lock, the overwrite and resume rules, status, reading, writing, and the one
list of keys that do not define an experiment, as the engine, fedcp-sweep and fedcp-report use it."""
import json

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO
from fedcp_dist.rundir import directory as rundir
from fedcp_dist.rundir.checkpoint import Checkpointer
from fedcp_dist.cli import report_runs
from fedcp_dist.config import Config, flatten, unflatten
from fedcp_dist.errors import UserError
from fedcp_dist.rundir.directory import NOT_DEFINING, RESUMABLE_CHANGES, RunDir, RunWriter, check_resume_config
from fedcp_dist.rundir.out_dir import prepare_out_dir
from fedcp_dist.rundir.present import format_value
from fedcp_dist.run import run_config
from fedcp_dist.sweep import config_drift, load_sweep
from fedcp_dist.sweep.points import point_config

BASE = str(REPO / "configs" / "digits_fedcp.yaml")


def _fill(out, checkpoint=False):
    """A run directory with every run file, a checkpoint, and two files that are not the run's."""
    out.mkdir(parents=True, exist_ok=True)
    for name in rundir.RUN_FILES:
        (out / name).write_text("x")
    if checkpoint:
        _checkpoint(out)
    (out / "notes.txt").write_text("mine")
    (out / "logs").mkdir()
    (out / "logs" / "a.log").write_text("mine too")


def _checkpoint(out, rounds=2):
    Checkpointer(str(out), 0, 1, 2).save(rounds, {"w": torch.zeros(2)}, {}, {"records": [], "config": {}},
                                         lambda ok: ok)


# ----------------------------------------------------------------------------- the lock and the rules


def test_the_lock_is_exclusive_and_released_on_close(tmp_path):
    out = tmp_path / "run"
    first = prepare_out_dir(out, overwrite=False, resume="auto")
    assert (out / ".lock").exists()
    with pytest.raises(UserError, match=r"in use by another run \(lock .*\.lock is held\)"):
        prepare_out_dir(out, overwrite=False, resume="auto")
    with pytest.raises(UserError, match="in use by another run"):  # overwrite does not break a held lock
        prepare_out_dir(out, overwrite=True, resume="auto")
    first.close()
    prepare_out_dir(out, overwrite=False, resume="auto").close()


def test_an_out_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"out_dir .*file/run cannot be written: "):
        prepare_out_dir(tmp_path / "file" / "run", overwrite=False, resume="auto")


def test_overwrite_removes_the_run_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    _fill(out, checkpoint=True)
    prepare_out_dir(out, overwrite=True, resume="auto").close()
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == [".lock", "logs", "logs/a.log", "notes.txt"]



def test_overwrite_removes_a_folder_in_a_run_files_place(tmp_path):
    out = tmp_path / "run"
    _fill(out, checkpoint=True)
    (out / "summary.json").unlink()
    (out / "summary.json").mkdir()
    (out / "summary.json" / "x").write_text("x")
    prepare_out_dir(out, overwrite=True, resume="auto").close()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".lock", "logs", "logs/a.log", "notes.txt"]


def test_overwrite_that_cannot_remove_a_file_stops_in_one_line_naming_it(tmp_path, monkeypatch):
    """An immutable metrics.jsonl or checkpoint file (chattr +i), or one without permission: the
    start stops naming it and the lock is released, instead of a traceback, or of a fresh run
    starting beside a checkpoint it then calls damaged."""
    import os

    out = tmp_path / "run"
    _fill(out, checkpoint=True)
    real_unlink = os.unlink

    def refuse(path, *a, **kw):
        if os.path.basename(str(path)) in ("COMPLETE", "metrics.jsonl"):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", refuse)
    with pytest.raises(UserError) as exc:
        prepare_out_dir(out, overwrite=True, resume="auto")
    assert str(exc.value) == (f"overwrite=true could not remove {out / 'checkpoints' / 'round_0000002' / 'COMPLETE'} "
                              "(and 3 more): Operation not permitted; remove it by hand (an immutable file needs "
                              "chattr -i) or choose another out_dir")
    monkeypatch.setattr(os, "unlink", real_unlink)
    prepare_out_dir(out, overwrite=True, resume="auto").close()  # the lock was released; now it clears
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_an_out_dir_without_file_locks_is_named_so(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(UserError) as exc:
        prepare_out_dir(tmp_path / "run", overwrite=False, resume="auto")
    assert str(exc.value) == (f"out_dir {tmp_path / 'run'} cannot be locked (No locks available): its file system has "
                              "no file locks; choose an out_dir on one that has (a run's lock keeps two runs out of one "
                              "folder)")



def test_a_checkpoints_file_in_the_folders_place_is_refused_at_start(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("x")
    with pytest.raises(UserError) as exc:
        prepare_out_dir(out, overwrite=False, resume="auto")
    assert str(exc.value) == (f"{out / 'checkpoints'} is not a folder: the run keeps its checkpoints there; move it "
                              "away or pass overwrite=true")
    prepare_out_dir(out, overwrite=True, resume="auto").close()
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("target", ["elsewhere/unmounted/ck", "checkpoints"])
def test_a_checkpoints_link_to_nowhere_is_refused_at_start(tmp_path, target):
    """A link to a scratch folder not mounted (or a loop) made the run start over from round 0,
    rewrite metrics.jsonl and fail at its first checkpoint with "File exists"."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(tmp_path / target if "/" in target else target)
    with pytest.raises(UserError) as exc:
        prepare_out_dir(out, overwrite=False, resume="auto")
    assert str(exc.value) == (f"{out / 'checkpoints'} is a symbolic link to "
                              f"{tmp_path / target if '/' in target else target}, which is not a folder that can be "
                              f"reached (not mounted? a loop?); mount or mend it, or pass overwrite=true to start afresh")
    prepare_out_dir(out, overwrite=True, resume="auto").close()
    assert not (out / "checkpoints").is_symlink()
    (tmp_path / "real").mkdir()
    (out / "checkpoints").symlink_to(tmp_path / "real")  # a link to a folder that is there: the run's, as ever
    prepare_out_dir(out, overwrite=False, resume="auto").close()


def test_an_out_dir_that_is_a_file_or_whose_lock_is_a_folder_is_named(tmp_path):
    """A sweep point's folder replaced by a file said "cannot be written: File exists", and a
    folder in the place of its .lock "cannot be written: Is a directory", naming out_dir only."""
    out = tmp_path / "run"
    out.write_text("x")
    with pytest.raises(UserError) as exc:
        prepare_out_dir(out, overwrite=False, resume="auto")
    assert str(exc.value) == f"out_dir {out} is a file, not a folder; move it away or choose another out_dir"
    out.unlink()
    (out / ".lock").mkdir(parents=True)
    with pytest.raises(UserError) as exc:
        prepare_out_dir(out, overwrite=False, resume="auto")
    assert str(exc.value) == f"out_dir {out} cannot be written ({out / '.lock'}): Is a directory"


def test_an_out_dir_that_is_a_broken_link_is_named(tmp_path):
    """It said "out_dir … cannot be written: File exists"."""
    out = tmp_path / "run"
    out.symlink_to(tmp_path / "gone")
    with pytest.raises(UserError) as exc:
        prepare_out_dir(out, overwrite=False, resume="auto")
    assert str(exc.value) == (f"out_dir {out} is a symbolic link to {tmp_path / 'gone'}, which does not exist (or is "
                              f"a loop); mend the link or choose another out_dir")


def test_report_names_a_damaged_summary_as_damaged(tmp_path):
    out = tmp_path / "run"
    _fill(out)
    (out / "config.yaml").write_text("method: fedcp\nseed: 1\n")
    for damaged in ("{not json", "[1, 2]"):
        (out / "summary.json").write_text(damaged)
        (run,) = report_runs.collect(str(out)).runs
        assert run.why == "summary.json is damaged (not a JSON object)", run.why
    (out / "summary.json").unlink()
    (run,) = report_runs.collect(str(out)).runs
    assert run.why == "no summary.json: unfinished or failed"


def test_a_finished_run_is_refused_and_left_as_it_was(tmp_path):
    out = tmp_path / "run"
    _fill(out)
    for resume in ("auto", "never"):
        # the files hold "x": summary.json is said to be damaged as well as finished
        with pytest.raises(UserError, match=r"holds a finished run whose summary is damaged \(not a JSON object: "
                                            r"summary.json\).*overwrite=true"):
            prepare_out_dir(out, overwrite=False, resume=resume)
    assert all((out / name).read_text() == "x" for name in rundir.RUN_FILES)
    with pytest.raises(UserError, match="finished run") as refused:  # keeps the failed call's frame alive
        prepare_out_dir(out, overwrite=False, resume="auto")
    prepare_out_dir(out, overwrite=True, resume="auto").close()  # the refusal released its lock
    assert refused.value is not None and not (out / "summary.json").exists()


@pytest.mark.parametrize("what, refused", [("nothing", False), ("metrics", True), ("checkpoint", True),
                                           ("incomplete checkpoint", False), ("config only", False)])
def test_resume_never_refuses_an_unfinished_run(what, refused, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    if what == "metrics":
        (out / "metrics.jsonl").write_text('{"round": 1}\n')
    elif what == "checkpoint":
        _checkpoint(out)
    elif what == "incomplete checkpoint":  # a write that was interrupted: no COMPLETE marker
        (out / "checkpoints" / "round_0000002").mkdir(parents=True)
    elif what == "config only":
        (out / "config.yaml").write_text("rounds: 1\n")
    if refused:
        with pytest.raises(UserError, match="holds an unfinished run and resume=never"):
            prepare_out_dir(out, overwrite=False, resume="never")
    else:
        prepare_out_dir(out, overwrite=False, resume="never").close()
    prepare_out_dir(out, overwrite=False, resume="auto").close()  # auto continues it


# ----------------------------------------------------------------------------- reading


def test_status(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.status() == "pending"  # not there
    run.path.mkdir()
    (run.path / ".lock").write_text("")
    assert run.status() == "pending"  # a lock alone is no run
    for name in ("config.yaml", "metrics.jsonl", "checkpoints"):
        other = RunDir(tmp_path / name)
        other.path.mkdir()
        (other.path / name).mkdir() if name == "checkpoints" else (other.path / name).write_text("")
        assert other.status() == "unfinished", name
    (run.path / "summary.json").write_text("{}")
    assert run.status() == "finished"


def test_metrics_tolerate_a_torn_last_line_only(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_metrics() == []
    rows = [{"round": 1, "evaluated_after": 0, "acc": 0.5}, {"round": 2, "evaluated_after": 1, "acc": 0.75}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    run.metrics.write_text(text + '{"round": 3, "evaluated_af')  # stopped mid-write
    assert run.read_metrics() == rows
    assert report_runs.Run(tmp_path, {}, {}, None, "").curve() == [(0, 0.5), (1, 0.75)]
    run.metrics.write_text(text.replace("\n", "\n[1, 2]\n", 1) + json.dumps({"round": 3}) + "\n")
    with pytest.raises(UserError, match=r"metrics.jsonl: line 2 is not a JSON object; the file is damaged"):
        run.read_metrics()


def test_summary_and_config(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_summary() is None and run.read_config() is None
    run.summary.write_text("[1, 2]")
    assert run.read_summary() is None  # not an object
    run.summary.write_text('{"best_acc": 0.5}')
    assert run.read_summary() == {"best_acc": 0.5}
    run.config.write_text("rounds: [1, 2\n")
    assert run.read_config() is None
    run.config.write_text("rounds: 3\ndata:\n  path: x.h5\n")
    assert run.read_config() == {"rounds": 3, "data.path": "x.h5"}


# ----------------------------------------------------------------------------- writing


def test_the_writer_writes_on_rank_0_only(tmp_path):
    RunWriter(tmp_path / "other", enabled=False).write_summary({"a": 1})
    assert not (tmp_path / "other").exists()
    w = RunWriter(tmp_path / "run", enabled=True)
    w.start_metrics([{"round": 1}])
    w.log({"round": np.int64(2), "acc": np.float32(0.5)})
    w.write_config("rounds: 2\n")
    w.save_final_global({"w": torch.ones(2, requires_grad=True)})
    w.write_summary({"best_acc": np.float64(0.25)})
    w.close()
    run = RunDir(tmp_path / "run")
    assert run.read_metrics() == [{"round": 1}, {"round": 2, "acc": 0.5}]
    assert run.read_config() == {"rounds": 2} and run.read_summary() == {"best_acc": 0.25}
    assert torch.load(run.final_global, weights_only=True)["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in run.path.iterdir()) == ["config.yaml", "final_global.pt", "metrics.jsonl",
                                                          "summary.json"]  # no temporary files left


def _final_globals(digits6, tmp_path, method, check=None) -> list:
    """final_global.pt of two 2-round runs, evaluated every round and every other round."""
    finals = []
    for every in (1, 2):
        out = tmp_path / f"every{every}"
        summary = run_config(BASE, [f"data.path={digits6}", f"method={method}", "rounds=2", f"eval_every={every}",
                                    "threads=1", f"out_dir={out}"])
        if check and every == 1:
            check(RunDir(out), summary)
        finals.append(torch.load(out / "final_global.pt", weights_only=True))
    return finals


def _assert_same(finals) -> None:
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_run_config_writes_a_run_directory_and_evaluation_does_not_train(digits6, tmp_path):
    """run_config's run directory; and why eval_every may change on resume: evaluating less often trains
    the same model (evaluation leaves the training state as it was)."""

    def check(run: RunDir, summary: dict) -> None:
        assert run.status() == "finished" and run.read_summary() == json.loads(json.dumps(summary))
        records = run.read_metrics()
        assert [r["kind"] for r in records] == ["round", "round", "final_eval"]
        assert [r["evaluated_after"] for r in records] == [0, 1, 2]
        assert max(r["acc"] for r in records) == summary["best_acc"]
        assert run.read_config()["rounds"] == 2 and set(torch.load(run.final_global, weights_only=True))
        with pytest.raises(UserError, match="finished run"):
            run_config(BASE, [f"data.path={digits6}", "rounds=2", f"out_dir={run.path}"])

    _assert_same(_final_globals(digits6, tmp_path, "fedcp", check))


def test_evaluation_that_adapts_does_not_train_either(digits6, tmp_path):
    """Per-FedAvg takes a training step before it evaluates: on a copy, so the same model is trained."""
    _assert_same(_final_globals(digits6, tmp_path, "perfedavg"))


# ----------------------------------------------------------------------------- which keys define a run


def _changed(key: str, value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    return [1, 2]  # None or a list


def test_the_list_names_real_keys():
    keys = set(flatten(Config().to_dict()))
    assert set(NOT_DEFINING) <= keys and set(rundir.RESUMABLE_DEFINING) <= keys
    assert set(RESUMABLE_CHANGES) == set(NOT_DEFINING) | {"rounds", "eval_every"}
    assert not set(NOT_DEFINING) & set(rundir.RESUMABLE_DEFINING)


def test_resume_sweep_drift_and_report_columns_use_the_one_list(tmp_path, digits6):
    """Change one key at a time: resuming allows it, the sweep calls the run drifted and the report makes
    it a column exactly as the list says."""
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "k", "root": str(tmp_path / "sweeps"), "base": BASE,
                                          "overrides": {"rounds": 2, "data.path": str(digits6)}, "grid": {"seed": [1]}}))
    sw = load_sweep(sweep_file)
    (point,) = sw.points
    point.run_dir.mkdir(parents=True)
    want = point_config(sw, point)
    flat = flatten(want.to_dict())
    defining = []
    for key, value in flat.items():
        changed = dict(flat, **{key: _changed(key, value)})
        nested = unflatten(changed)
        # resume
        if key in RESUMABLE_CHANGES:
            check_resume_config(want.to_dict(), nested, "out")
        else:
            with pytest.raises(UserError, match=f"config key '{key}'"):
                check_resume_config(want.to_dict(), nested, "out")
        # sweep drift: the finished run was made with the changed value
        point.run_dir.joinpath("config.yaml").write_text(yaml.safe_dump(nested))
        assert config_drift(sw, point) == ([] if key in NOT_DEFINING else [key]), key
        # report columns
        runs = [report_runs.Run(tmp_path, {}, flat, None, ""), report_runs.Run(tmp_path, {}, changed, None, "")]
        assert report_runs._differing(runs) == ([] if key in NOT_DEFINING or key in report_runs.ROW_KEYS else [key]), key
        if key not in NOT_DEFINING:
            defining.append(key)
    assert "rounds" in defining and "eval_every" in defining and "lr" in defining and "data.path" in defining
    assert len(defining) + len(NOT_DEFINING) == len(flat)


def test_resume_check_defaults_paths_and_rounds_scheduled_methods(tmp_path):
    old = Config(method="fedcp", rounds=10).to_dict()
    old_without_amp = {k: v for k, v in old.items() if k != "amp"}  # written before amp existed
    check_resume_config(old_without_amp, Config(method="fedcp", rounds=10).to_dict(), "out")
    with pytest.raises(UserError, match=r"config key 'amp' is 'bf16' but the checkpointed run in out used 'none'"):
        check_resume_config(old_without_amp, Config(method="fedcp", rounds=10, amp="bf16").to_dict(), "out")
    check_resume_config(old, Config(method="fedcp", rounds=20, eval_every=5).to_dict(), "out")
    # the same file by another name is the same data
    (tmp_path / "x.h5").write_text("")
    (tmp_path / "link.h5").symlink_to(tmp_path / "x.h5")
    a, b = Config(method="fedcp"), Config(method="fedcp")
    a.data.path, b.data.path = str(tmp_path / "x.h5"), str(tmp_path / "link.h5")
    check_resume_config(a.to_dict(), b.to_dict(), "out")
    b.data.path = str(tmp_path / "other.h5")
    with pytest.raises(UserError, match="'data.path'"):
        check_resume_config(a.to_dict(), b.to_dict(), "out")
    # FedPHP's moving-average weight is scheduled over the run's rounds: a new total changes its training
    with pytest.raises(UserError, match=r"'rounds' is 20 .* used 10; fedphp's training depends on the total"):
        check_resume_config(Config(method="fedphp", rounds=10).to_dict(), Config(method="fedphp", rounds=20).to_dict(),
                            "out")
    check_resume_config(Config(method="fedphp", rounds=10).to_dict(), Config(method="fedphp", rounds=10, eval_every=3).to_dict(), "out")


def test_rounds_scheduled_is_the_method_class_answer(monkeypatch):
    """rundir asks the method's class whether its training depends on the total rounds, by no name."""
    from fedcp_dist.algorithms.fedavg import FedAvg

    before, after = Config(method="fedavg", rounds=10).to_dict(), Config(method="fedavg", rounds=20).to_dict()
    check_resume_config(before, after, "out")
    monkeypatch.setattr(FedAvg, "rounds_scheduled", classmethod(lambda cls, cfg: f"a schedule over {cfg['rounds']}"))
    with pytest.raises(UserError, match=r"'rounds' is 20 .* used 10; a schedule over 20; use another out_dir"):
        check_resume_config(before, after, "out")


def test_format_value():
    values = [0.1, 1.0, 1, 1e-05, 2.5e10, True, False, None, "fedcp", [0.1, 0.2], [], (1, "a")]
    assert [format_value(v) for v in values] == ["0.1", "1.0", "1", "1e-05", "25000000000.0", "true", "false", "null",
                                                 "fedcp", "0.1-0.2", "empty", "1-a"]


def _package_imports() -> dict:
    """fedcp_dist module -> the fedcp_dist modules it imports anywhere (module level or in a function)."""
    import ast

    root = REPO / "fedcp_dist"
    mods = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(REPO).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for m, p in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            targets |= {n for n in names if n in mods and n != m and not m.startswith(n + ".")}
        graph[m] = targets
    return graph


def test_the_run_directory_modules_import_one_way():
    """config, loggers, rundir and checkpoint: none of them reaches itself through its imports, so
    each can be read (and changed) knowing only the ones below it."""
    graph = _package_imports()
    for start in ("fedcp_dist.config", "fedcp_dist.rundir.loggers", "fedcp_dist.rundir.directory", "fedcp_dist.rundir.checkpoint"):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        assert start not in seen, f"{start} imports itself through {sorted(seen & set(graph))}"


def test_every_checkpoint_damaged_tells_a_reader_its_own_way_out(tmp_path):
    """fedcp-analyze on a run whose every checkpoint is damaged gave fedcp-run's advice
    (overwrite=true to start afresh), which is no way out for a tool that reads the models."""
    out = tmp_path / "run"
    out.mkdir()
    _checkpoint(out)
    ck = Checkpointer(str(out), 0, 1, 2)
    (ck.latest() / "global.pt").write_bytes(b"damaged")
    with pytest.raises(UserError) as exc:
        ck.latest(warn=lambda *_: None, reading=True)
    assert str(exc.value).endswith("no intact models to read; restore the damaged file from a copy")
    with pytest.raises(UserError, match="overwrite=true to start afresh$"):
        ck.latest(warn=lambda *_: None)


def test_the_result_table_says_a_rate_over_no_sample_is_undefined():
    """A two-class run whose test splits held no positive sample printed "nan %" for its balanced
    accuracy and positive-class recall."""
    from fedcp_dist.rundir.present import result_table

    s = {"method": "fedcp", "source": "csv", "num_clients": 2, "world_size": 1, "launcher": "single",
         "device": "cpu", "rounds": 1, "best_acc": 0.995, "best_after_rounds": 1, "final_acc": 0.995,
         "final_acc_client_mean": 0.99, "final_auc": 0.5, "final_balanced_acc": float("nan"),
         "final_pos_recall": float("nan"), "seconds_per_round": 0.1}
    rows = dict(line.split("  ", 1) for line in result_table(s).splitlines()[1:-1])
    assert rows["final balanced accuracy"].strip() == "undefined (a class absent from the test splits)"
    assert rows["final positive-class recall"].strip() == "undefined (no positive test sample)"
    assert "nan" not in result_table(s)
    rows = dict(line.split("  ", 1) for line in result_table({**s, "final_pos_recall": 0.5,
                                                              "final_balanced_acc": 0.625}).splitlines()[1:-1])
    assert rows["final balanced accuracy"].strip() == "62.50 %" and rows["final positive-class recall"].strip() == "50.00 %"
