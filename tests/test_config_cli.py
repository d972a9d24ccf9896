"""Config loading and the run command's refusals: one line naming the key, exit 2, no traceback."""
import os
import subprocess
import sys

import pytest
import yaml

from conftest import run_cmd
from fedcp_dist.config import Config, given_once, load_config, merged_overrides, parse_overrides
from fedcp_dist.errors import UserError
from fedcp_dist.run import main


def test_defaults_are_the_papers():
    c = Config()
    assert (c.lr, c.batch_size, c.local_epochs, c.lam, c.participation, c.tau) == (0.005, 10, 1, 5.0, 1.0, 1.0)


def test_yaml_then_overrides(digits6):
    cfg = load_config("configs/digits_fedcp.yaml", ["rounds=7", "lam=0", "data.path=" + str(digits6), "participation_range=[0.2, 0.5]"])
    assert cfg.rounds == 7 and cfg.lam == 0.0 and isinstance(cfg.lam, float)
    assert cfg.data.path == str(digits6) and cfg.participation_range == [0.2, 0.5]
    assert cfg.method == "fedcp" and cfg.lr == 0.05


def test_parse_overrides_nested():
    assert parse_overrides(["a=1", "data.path=x.h5", "b=true"]) == {"a": 1, "data": {"path": "x.h5"}, "b": True}


def test_an_override_given_twice_is_refused_and_tools_layer_theirs_under_the_users(capsys):
    """`rounds=3 … rounds=5` ran 5 rounds silently (the last value won), where a config file's key
    written twice is refused."""
    with pytest.raises(UserError) as exc:
        given_once(["rounds=3", "lr=0.1", " rounds =5"])
    assert str(exc.value) == "override 'rounds' is given twice ('rounds=3' and ' rounds =5'); give it once"
    with pytest.raises(UserError, match="given twice"):  # the same value twice too: a slip all the same
        given_once(["seed=1", "seed=1"])
    assert given_once(["data.path=a.h5", "data.seed=2"]) == ["data.path=a.h5", "data.seed=2"]
    # fedcp-run refuses them before anything starts (under --ranks too), in one line, exit 2
    for argv in (["--print-config"], ["--ranks", "2"], []):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--config", "configs/digits_fedcp.yaml", "data.path=a.h5", "rounds=2", "data.path=b.h5"])
        assert stop.value.code == 2
        assert capsys.readouterr().err == ("error: override 'data.path' is given twice ('data.path=a.h5' and "
                                           "'data.path=b.h5'); give it once\n")
    # load_config's overrides are layers (a tool's, then a user's): the later value of a key wins
    assert load_config("configs/digits_fedcp.yaml", ["rounds=3", "rounds=5"], validate=False).rounds == 5
    # a tool's own defaults under the user's, and what it forces over both: each key once, the last layer's
    assert merged_overrides(["eval_every=1", "overwrite=true"], ["eval_every=5", "rounds=2"], ["fused=true"]) == \
        ["overwrite=true", "eval_every=5", "rounds=2", "fused=true"]
    assert merged_overrides(["fused=false"], [], ["fused=true"]) == ["fused=true"]
    with pytest.raises(UserError, match="'rounds' is given twice"):  # within the user's layer, refused
        merged_overrides(["eval_every=1"], ["rounds=2", "rounds=3"])


def test_a_text_key_takes_its_override_as_typed_and_a_comment_is_never_dropped(tmp_path):
    """YAML read `out_dir=2024` as a number and `client_state_dir=0755` as an octal one (refused
    as not text), and dropped ` #b` of `out_dir=runs/a #b` silently (the run went to runs/a)."""
    cfg = load_config("configs/digits_fedcp.yaml", ["out_dir=2024", "client_state=disk", "client_state_dir=0755",
                                                    "rounds=12", "lr=1e-2", 'method="fedavg"'], validate=False)
    assert (cfg.out_dir, cfg.client_state_dir, cfg.rounds, cfg.lr, cfg.method) == ("2024", "0755", 12, 0.01, "fedavg")
    # a key that takes text or another type keeps YAML's reading where that type takes it
    cfg = load_config("configs/digits_fedcp.yaml", ["fused=false", "fused_group=8"], validate=False)
    assert cfg.fused is False and cfg.fused_group == 8
    assert load_config("configs/digits_fedcp.yaml", ['out_dir="runs/a #b"'], validate=False).out_dir == "runs/a #b"
    assert load_config("configs/digits_fedcp.yaml", ["out_dir=runs/a#b"], validate=False).out_dir == "runs/a#b"
    for item in ("out_dir=runs/a #b", "lr=0.1 # tuned"):
        with pytest.raises(UserError) as exc:
            load_config("configs/digits_fedcp.yaml", [item], validate=False)
        key, raw = item.split("=", 1)
        assert str(exc.value) == (f"override {item!r}: YAML reads the ' #…' as a comment and would drop it; remove "
                                  f"it, or quote the value to keep it as text: {key}='\"{raw}\"'")
    with pytest.raises(UserError) as exc:
        load_config("configs/digits_fedcp.yaml", ["data.path=~"], validate=False)
    assert str(exc.value) == ("config key 'data.path': expected str, got None (YAML reads '~' as None; quote it, "
                              "data.path='\"~\"', for the text)")
    with pytest.raises(UserError) as exc:  # the config file given without --config
        load_config(None, ["configs/digits_fedcp.yaml"], validate=False)
    assert str(exc.value) == ("override 'configs/digits_fedcp.yaml' is not of the form key=value (a config file? give "
                              "it as --config configs/digits_fedcp.yaml)")
    # a key that takes no text: quoting would not help, so it is not suggested
    for item, said in (("rounds=2.5", "expected int, got 2.5"), ("lam=yes", "expected float, got True (YAML reads "
                                                                          "'yes' as True)")):
        with pytest.raises(UserError) as exc:
            load_config("configs/digits_fedcp.yaml", [item], validate=False)
        assert str(exc.value) == f"config key '{item.split('=')[0]}': {said}", str(exc.value)


def test_a_shard_path_that_is_a_broken_link_names_its_target(tmp_path):
    link = tmp_path / "d.h5"
    link.symlink_to(tmp_path / "gone" / "d.h5")
    with pytest.raises(UserError) as exc:
        load_config("configs/digits_fedcp.yaml", [f"data.path={link}"])
    assert str(exc.value) == (f"config key 'data.path': {link} is a symbolic link to {tmp_path / 'gone' / 'd.h5'}, "
                              f"which does not exist")


def test_an_override_holding_a_byte_that_is_not_utf8_is_named():
    """A shell passes a path's raw bytes; Python keeps an undecodable byte as a surrogate escape."""
    raw = b"out_dir=/tmp/caf\xe9".decode("utf-8", "surrogateescape")
    with pytest.raises(UserError) as exc:
        parse_overrides([raw])
    assert str(exc.value) == ("override out_dir=…: the value holds byte 0xe9, which is not UTF-8 text (a path must be "
                              "valid UTF-8 to be written in config.yaml)")
    assert parse_overrides(["out_dir=/tmp/café 1"]) == {"out_dir": "/tmp/café 1"}


def test_a_data_path_that_is_no_regular_file_is_named_as_such():
    """/dev/zero was "no such file" (it exists)."""
    with pytest.raises(UserError) as exc:
        load_config("configs/digits_fedcp.yaml", ["data.path=/dev/zero"])
    assert str(exc.value) == ("config key 'data.path': /dev/zero is not a regular file (a device, a pipe or a socket); "
                              "name the HDF5 partition file")


def test_an_override_holding_a_line_break_is_refused():
    """YAML folded it into a space: out_dir=$'/tmp/o/a\\nb' wrote the run into '/tmp/o/a b'."""
    with pytest.raises(UserError) as exc:
        parse_overrides(["out_dir=/tmp/o/a\nb"])
    assert str(exc.value) == ("override out_dir=…: the value holds a line break, which YAML would read as a space "
                              "(out_dir=a<newline>b ran in 'a b'); a value of one line is taken")
    assert parse_overrides(["out_dir=/tmp/o/a b\n"]) == {"out_dir": "/tmp/o/a b"}  # a trailing one, as a shell may leave


def test_an_override_a_c_locale_cannot_read_names_the_locale(monkeypatch):
    """Under LC_ALL=C without Python's UTF-8 mode the valid UTF-8 bytes of é arrive undecoded: it
    said they were not UTF-8."""
    import sys

    monkeypatch.setattr(sys, "getfilesystemencoding", lambda: "ascii")
    raw = "out_dir=/tmp/caf\udcc3\udca9"
    with pytest.raises(UserError) as exc:
        parse_overrides([raw])
    assert str(exc.value) == ("override out_dir=…: the value holds byte 0xc3, which this process's locale (ascii) "
                              "cannot read; run with a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1")


@pytest.mark.parametrize(
    "override, key",
    [
        ("lrr=0.1", "lrr"),
        ("rounds=abc", "rounds"),
        ("rounds=1.5", "rounds"),
        ("lam=-1", "lam"),
        ("participation=1.5", "participation"),
        ("participation=0", "participation"),
        ("batch_size=0", "batch_size"),
        ("method=fedxyz", "method"),
        ("data.path=/nonexistent/x.h5", "data.path"),
        ("data.pth=x", "data.pth"),
        ("participation_range=[0.5, 0.2]", "participation_range"),
        ("drop_last=3", "drop_last"),
        ("lr=.nan", "lr"),
        ("amp=fp16", "amp"),
    ],
)
def test_bad_values_name_the_key(override, key, capsys, digits6):
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6}", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f"'{key}'" in err


def test_amp_is_accepted_for_every_method(digits6):
    """Every method's local training honours amp (tests/test_fused.py checks that it changes the numbers)."""
    from fedcp_dist.config import METHODS

    for method in METHODS:
        assert load_config("configs/digits_fedcp.yaml", [f"data.path={digits6}", f"method={method}", "amp=bf16"]).amp == "bf16"


def test_unknown_key_suggests(digits6):
    with pytest.raises(UserError, match="did you mean 'lam'"):
        load_config(None, ["lamb=1", f"data.path={digits6}"])


def test_client_count_must_agree(digits6, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6}", "data.num_clients=7", f"out_dir={tmp_path}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "data.num_clients" in err and "6 clients" in err


def test_print_config_does_not_need_the_data_file(tmp_path, capsys):
    """--print-config shows the config a run would use before its shard is made; stderr says the file
    is missing. Every other check still applies."""
    missing = tmp_path / "later.h5"
    main(["--config", "configs/digits_fedcp.yaml", f"data.path={missing}", "rounds=7", "--print-config"])
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed["data"]["path"] == str(missing) and printed["rounds"] == 7
    assert err.count("\n") == 1 and f"data.path {missing} does not exist" in err
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={missing}", "rounds=0", "--print-config"])
    assert exc.value.code == 2 and "'rounds'" in capsys.readouterr().err


def test_print_config_checks_the_config_against_a_shard_that_is_there(digits6, capsys):
    """With the shard in place, --print-config refuses what a run would refuse of it (clients it
    does not hold, another client count), as it refuses every other check: it printed the config
    and exited 0."""
    for override, said in (("data.clients=[25]", "data.clients"), ("data.num_clients=20", "'data.num_clients' is 20")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6}", override, "--print-config"])
        out, err = capsys.readouterr()
        assert exc.value.code == 2 and out == "" and said in err and err.count("\n") == 1, err
    main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6}", "data.clients=[5]", "--print-config"])
    assert yaml.safe_load(capsys.readouterr().out)["data"]["clients"] == [5]


def test_missing_and_broken_config_files(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    for path, words in ((tmp_path / "none.yaml", "not found"), (bad, "not valid YAML")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", str(path)])
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_a_key_set_twice_is_refused_naming_both_lines(tmp_path, capsys):
    """YAML would keep the last of two ``lr:`` lines without a word; nested mappings too. A merge
    key (``<<``) that a later key overrides is not a duplicate."""
    cases = {"lr: 0.1\nrounds: 3\nlr: 5.0\n": "key 'lr' is set twice (lines 1 and 3)",
             "data:\n  path: a.h5\n  path: b.h5\n": "key 'path' is set twice (lines 2 and 3)"}
    for i, (text, words) in enumerate(cases.items()):
        path = tmp_path / f"dup{i}.yaml"
        path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            main(["--config", str(path), "--print-config"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err == f"error: config file {path}: {words}; keep one\n", err
    from fedcp_dist.config import read_yaml_mapping

    merged = tmp_path / "merged.yaml"

    merged.write_text("x: &b {lr: 0.1, rounds: 3}\ny:\n  <<: *b\n  lr: 0.2\n")
    assert read_yaml_mapping(merged)["y"] == {"lr": 0.2, "rounds": 3}


def test_a_finished_run_is_not_overwritten(digits6, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"best_acc": 0.9}')
    with pytest.raises(SystemExit):
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={digits6}", f"out_dir={out}", "rounds=1"])
    assert "overwrite=true" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == '{"best_acc": 0.9}'


def test_command_line_error_has_no_traceback(tmp_path):
    r = run_cmd([sys.executable, "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", "lam=-2"], timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "'lam'" in r.stderr


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`fedcp-sweep --dry-run | head -1`: the reader goes away early; no traceback, the shell's SIGPIPE status."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: s\nroot: {tmp_path}/out\nbase: configs/digits_fedcp.yaml\n"
                     f"grid:\n  seed: {list(range(1, 400))}\n"  # ~150 KB of lines, more than a pipe holds
                     "partition: {source: digits, partition: dir, beta: 0.1, num_clients: 20, seed: 1}\n")
    r = subprocess.run(f"set -o pipefail; {sys.executable} -m fedcp_dist.cli.sweep --dry-run {sweep} | head -1",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("sweep s: 399 points"), r.stdout
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert r.returncode == 141, (r.returncode, r.stderr)


def test_method_options_are_config_keys_with_their_checks():
    import dataclasses

    from fedcp_dist.algorithms import method_options
    from fedcp_dist.algorithms.fedprox import FedProx
    from fedcp_dist.config import Config

    fields = {f.name: f for f in dataclasses.fields(Config)}
    for opt in method_options():
        assert fields[opt.name].default == opt.default and fields[opt.name].metadata["help"] == opt.help
    assert FedProx.options[0].name == "prox_mu" and FedProx.options[0].check(-1.0) == "must be >= 0, got -1.0"


def test_a_method_adds_its_keys_in_its_own_file(monkeypatch, digits6):
    """A new class with options: the config gains its keys, defaults, type checks and value checks."""
    import fedcp_dist.algorithms as algorithms
    from fedcp_dist import config
    from fedcp_dist.algorithms.fedavg import FedAvg
    from fedcp_dist.options import Option, above

    class Extra(FedAvg):
        name = "extra"
        options = (Option("extra_gain", 2.0, "Extra: a gain", above(0)),)

    monkeypatch.setattr(algorithms, "OPTION_CLASSES", (*algorithms.OPTION_CLASSES, Extra))
    monkeypatch.setattr(config, "Config", config._assemble_config())
    assert config.load_config(None, [f"data.path={digits6}"]).extra_gain == 2.0
    assert config.load_config(None, [f"data.path={digits6}", "extra_gain=3"]).extra_gain == 3.0
    with pytest.raises(UserError, match="'extra_gain': must be > 0"):
        config.load_config(None, [f"data.path={digits6}", "extra_gain=0"])
    with pytest.raises(UserError, match="'extra_gain': expected float"):
        config.load_config(None, [f"data.path={digits6}", "extra_gain=high"])


def test_compression_and_selection_ask_the_method_class(monkeypatch, digits6):
    """Upload compression needs a method whose uploads are averaged, feature-difference selection one
    with a client vector: each asks the configured method's class, whatever its name."""
    from fedcp_dist.algorithms.fedavg import FedAvg
    from fedcp_dist.capabilities import ClientVectors, supports

    base = [f"data.path={digits6}", "participation=0.5"]
    with pytest.raises(UserError, match=r"^config key 'compress': fedamp averages no uploads .*use compress=none$"):
        load_config(None, [*base, "method=fedamp", "compress=topk"])
    assert load_config(None, [*base, "method=fedavg", "compress=topk"]).compress == "topk"
    with pytest.raises(UserError, match=r"^config key 'client_selection': feature_difference needs a method that keeps "
                                        r"a client vector; fedavg keeps none$"):
        load_config(None, [*base, "method=fedavg", "client_selection=feature_difference"])
    for extra in ([], ["cpn_layers=2"]):  # a CPN design is an option of FedCP, not another class
        cfg = load_config(None, [*base, "method=fedcp", "client_selection=feature_difference", *extra])
        assert supports(cfg.method_class, ClientVectors) and cfg.method_class.__name__ == "FedCP"
    monkeypatch.setattr(FedAvg, "client_vector_dim", 3, raising=False)  # FedAvg given a client vector
    monkeypatch.setattr(FedAvg, "client_vector", lambda self, state: None, raising=False)
    assert load_config(None, [*base, "method=fedavg", "client_selection=feature_difference"]).method == "fedavg"


def test_openmp_threads_wait_asleep_unless_the_user_says_otherwise():
    """fedcp-run sets OMP_WAIT_POLICY=PASSIVE before torch loads, keeps a user's value, and changes
    nothing once torch is loaded (too late for OpenMP to read it)."""
    from fedcp_dist import run as run_mod

    env = {"PATH": "/bin"}
    run_mod.quiet_openmp(env, modules={})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    run_mod.quiet_openmp(env, modules={})
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {}
    run_mod.quiet_openmp(env, modules={"torch": object()})
    assert env == {}


def test_ranks_flag_becomes_torchrun_and_refuses_bad_values(capsys, monkeypatch, digits6, tmp_path):
    """``fedcp-run --ranks N`` is ``torchrun --standalone --nproc_per_node=N -m fedcp_dist.run`` with
    the same arguments, each rank its share of the cores, torchrun's SIGTERM grace raised; a bad
    value, a bad config or a launcher already present end in one line before anything starts. The
    launch goes to an out_dir of its own: the config's, runs/digits_fedcp, holds `make run`'s
    finished run, which --ranks refuses (`make run` then `make test` failed here)."""
    import os

    from fedcp_dist import run as run_mod
    from fedcp_dist.runtime import _cpu_count
    from fedcp_dist.sweep.local import SHUTDOWN_TIMEOUT_S

    cmd, env = run_mod.local_ranks_command(2, "configs/digits_fedcp.yaml", ["rounds=3", "lam=1"], env={"PATH": "/bin"})
    assert cmd == [sys.executable, "-m", "fedcp_dist.cli.ranks", "--standalone", "--nproc_per_node=2", "-m",
                   "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", "rounds=3", "lam=1"]
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": str(max(1, _cpu_count() // 2)),
                   "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S), "FEDCP_ONE_TERMINAL": "1"}
    _, env = run_mod.local_ranks_command(3, None, [], env={"OMP_NUM_THREADS": "4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})
    assert env == {"OMP_NUM_THREADS": "4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5",  # the user's values win
                   "FEDCP_ONE_TERMINAL": "1"}
    with pytest.raises(UserError, match="leave it out"):
        run_mod.local_ranks_command(2, None, [], env={"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2",
                                                      "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    # a SLURM job step of one task (an srun --pty shell, a step running a local sweep of 2-rank points)
    # starts its ranks (local sweeps' points failed there); a step of several tasks is a launcher
    one_task = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "7"}
    assert run_mod.local_ranks_command(2, None, [], env=one_task)[0][2] == "fedcp_dist.cli.ranks"
    with pytest.raises(UserError, match="leave it out"):
        run_mod.local_ranks_command(2, None, [], env={**one_task, "SLURM_STEP_NUM_TASKS": "2"})
    assert run_mod.parse_ranks("3") == 3 and run_mod.parse_ranks("auto") is None
    assert run_mod.auto_ranks("cpu") == _cpu_count()
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(UserError, match="--ranks"):
            run_mod.parse_ranks(bad)
    # through the command: nothing is executed for a bad value or a bad config
    started = []

    class Started(Exception):
        pass

    def execve(*a):  # the real one never returns: this process becomes torchrun
        started.append(a)
        raise Started

    monkeypatch.setattr(os, "execve", execve)
    shard = f"data.path={digits6}"
    for argv, word in ((["--ranks", "0", shard], "--ranks"), (["--ranks", "2", shard, "lam=-2"], "'lam'"),
                       (["--ranks", "x", "data.path=none.h5"], "--ranks"),
                       # a config the shard does not fit: refused here, not by each rank behind torchrun
                       (["--ranks", "2", shard, "data.source=mnist"], f"error: config key 'data.source' is 'mnist' but "
                                                                      f"{digits6} holds 'digits'\n"),
                       (["--ranks", "2", shard, "data.num_clients=7"], "'data.num_clients' is 7 but")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", "configs/digits_fedcp.yaml", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and word in err and err.count("\n") == 1, err
    with pytest.raises(Started):
        main(["--ranks", "2", "--config", "configs/digits_fedcp.yaml", shard, "rounds=1", f"out_dir={tmp_path / 'run'}"])
    assert len(started) == 1 and started[0][0] == sys.executable and "--nproc_per_node=2" in started[0][1]


def test_start_line_points_a_one_process_run_on_several_cores_to_ranks():
    from fedcp_dist.engine.startup import ranks_hint
    from helpers import FakeRuntime

    def rt(launcher, device, threads):
        return FakeRuntime(device=device, launcher=launcher, threads=threads)

    assert ranks_hint(rt("single", "cpu", 4)) == "; one rank per core trains faster: fedcp-run --ranks auto (or torchrun)"
    assert ranks_hint(rt("single", "cpu", 1)) == ""  # one thread: nothing to gain
    assert ranks_hint(rt("torchrun", "cpu", 2)) == ""  # already ranks
    assert ranks_hint(rt("single", "cuda", 8)) == ""  # a GPU rank's threads feed the GPU


def test_unflatten_inverts_flatten():
    from fedcp_dist.config import flatten, unflatten

    flat = {"data.path": "x.h5", "data.clients": [1, 2], "lr": 0.5}
    assert unflatten(flat) == {"data": {"path": "x.h5", "clients": [1, 2]}, "lr": 0.5}
    assert flatten(unflatten(flat)) == flat


def test_ranks_ending_is_said_as_a_runs():
    """fedcp-run --ranks (fedcp_dist/cli/ranks.py): failed ranks that agree give their status and one
    line; ranks that differ, or a signal, exit 1 naming each; a signalled torchrun exits 75 when rank 0
    reported its checkpoint, else 128 + the signal."""
    from fedcp_dist.cli import ranks

    assert ranks.failure_line({0: 2, 1: 2}, {}) == (
        2, "fedcp-run --ranks: ranks 0, 1 exited with status 2 (see the lines above)")
    assert ranks.failure_line({1: 75}, {}) == (75, "fedcp-run --ranks: rank 1 stopped after its checkpoint (see the "
                                                   "lines above)")
    # rank 1 refused first and torchrun stopped rank 0 (SIGTERM) before it said the same: still 2
    assert ranks.failure_line({0: -15, 1: 2}, {0: "SIGTERM"}) == (
        2, "fedcp-run --ranks: rank 1 exited with status 2 (see the lines above); torchrun then stopped rank 0")
    assert ranks.failure_line({0: 143, 1: 1, 2: 1}, {}) == (
        1, "fedcp-run --ranks: ranks 1, 2 exited with status 1 (see the lines above); torchrun then stopped rank 0")
    assert ranks.failure_line({0: -15}, {0: "SIGTERM"})[0] == 1  # a SIGTERM alone is not a status
    assert ranks.failure_line({0: 1, 1: -9}, {1: "SIGKILL"}) == (
        1, "fedcp-run --ranks: ranks failed (rank 0: status 1; rank 1: SIGKILL); their own lines, if any, are above")

def test_a_signalled_ranks_launch_exits_75_only_after_a_reported_checkpoint(tmp_path):
    import signal as sig

    from fedcp_dist.cli import ranks

    status = tmp_path / "status"
    assert ranks.stopped_status(str(status), sig.SIGTERM) == 128 + sig.SIGTERM  # no file
    status.write_text("preempted\n")
    assert ranks.stopped_status(str(status), sig.SIGTERM) == 75
    status.write_text("")
    assert ranks.stopped_status(str(status), sig.SIGINT) == 128 + sig.SIGINT
    status.write_text("finished\n")  # signalled after rank 0 wrote the run's final files: a finished run
    assert ranks.stopped_status(str(status), sig.SIGTERM) == 0


def test_a_ranks_launch_clears_the_callers_status_file_first(tmp_path, monkeypatch, capsys):
    """A status file left saying "finished" by an earlier run made a later launch, signalled before
    its ranks wrote anything, report the run finished and exit 0."""
    from fedcp_dist.cli import ranks

    status = tmp_path / "status"
    status.write_text("finished\n")
    monkeypatch.setenv("FEDCP_STATUS_FILE", str(status))
    import signal

    # torchrun (and ranks.main, for the signals it holds) installs handlers for this process's life, as
    # a launcher's process may; in the test's process they are put back, or a later test in this worker
    # that sends itself SIGINT gets torchrun's SignalException instead of its own handler
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                                              signal.SIGUSR2)}
    try:
        code = ranks.main(["--standalone", "--nproc_per_node=1", "--no-python", "false"])  # a rank that fails at once
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert code == 1 and status.read_text() == ""


def test_a_finished_run_says_so_in_the_status_file(digits6, tmp_path, monkeypatch):
    """Under a launcher signalled during the final evaluation or after the final files, the ranks'
    statuses said "stopped" (143) for a finished run, and a requeue then found it finished (exit 2)."""
    from fedcp_dist.run import run_config

    status = tmp_path / "status"
    monkeypatch.setenv("FEDCP_STATUS_FILE", str(status))
    run_config("configs/digits_fedavg.yaml", [f"data.path={digits6}", f"out_dir={tmp_path / 'run'}", "rounds=1",
                                              "threads=1", "checkpoint_every=0"])
    assert status.read_text() == "finished\n" and (tmp_path / "run" / "summary.json").is_file()


def test_ranks_refuse_a_finished_out_dir_before_the_ranks_start(digits6, tmp_path, capsys):
    """Each rank said it (rank 0's line, then rank 1's "another rank failed to start", torchrun's log
    lines and a status line): now the launch says it once, before torchrun starts."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        main(["--ranks", "2", "--config", "configs/digits_fedavg.yaml", f"data.path={digits6}", f"out_dir={out}"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: out_dir {out} holds a finished run (summary.json); choose another out_dir or pass overwrite=true\n")
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as stop:
        main(["--ranks", "2", "--config", "configs/digits_fedavg.yaml", f"data.path={digits6}", f"out_dir={out}",
              "resume=never"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: out_dir {out} holds an unfinished run and resume=never; use resume=auto or overwrite=true\n")


def test_ranks_refuse_a_resume_the_checkpointed_config_refuses_before_the_ranks_start(digits6, tmp_path, capsys,
                                                                                      monkeypatch):
    """An unfinished run resumed under another seed with --ranks 2: each rank said the refusal, with
    torchrun's log lines and a status line (five lines). The launch says it once, before torchrun
    starts; a change a resume allows (rounds) still launches."""
    from fedcp_dist.config import dump_config, load_config

    out = tmp_path / "run"
    (out / "checkpoints" / "round_0000001").mkdir(parents=True)
    (out / "checkpoints" / "round_0000001" / "COMPLETE").write_text("{}")
    made = load_config("configs/digits_fedavg.yaml", [f"data.path={digits6}", f"out_dir={out}", "seed=1", "rounds=2"])
    (out / "config.yaml").write_text(dump_config(made))
    monkeypatch.setattr(os, "execve", lambda *_: pytest.fail("torchrun was started"))
    with pytest.raises(SystemExit) as stop:
        main(["--ranks", "2", "--config", "configs/digits_fedavg.yaml", f"data.path={digits6}", f"out_dir={out}",
              "seed=3", "rounds=2"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: config key 'seed' is 3 but the checkpointed run in {out} used 1; use another out_dir, or "
        f"overwrite=true to start afresh\n")


@pytest.mark.parametrize("override, said", [
    ("threads=9223372036854775807", "config key 'threads': must lie in [0, 1024], got 9223372036854775807"),
    ("local_epochs=1000000000000", "config key 'local_epochs': must lie in [1, 10000], got 1000000000000"),
    ("cpn_hidden=100000000", "config key 'cpn_hidden': must lie in [0, 65536], got 100000000"),
    ("cpn_client_vector=head+embed cpn_embed_dim=100000000000",
     "config key 'cpn_embed_dim': must lie in [1, 65536], got 100000000000"),
    ("pfedme_k=99999999999999999999", "config key 'pfedme_k': must lie in [1, 10000], got 99999999999999999999"),
    ("lstm_layers=1000", "config key 'lstm_layers': must lie in [1, 64], got 1000"),
    ("fedrep_head_epochs=100001", "config key 'fedrep_head_epochs': must lie in [1, 10000], got 100001"),
])
def test_counts_and_widths_beyond_any_machine_are_refused_before_start_up(override, said):
    """threads=2**63-1 overflowed torch.set_num_threads (a traceback), 5,000 threads on 2 cores ran
    at a thirtieth of the speed, a CPN 10**8 wide asked the allocator for 204 GB (a C++ traceback)
    and 10**12 local epochs made a round nothing could stop but SIGKILL."""
    *before, last = override.split()
    with pytest.raises(UserError) as exc:
        load_config("configs/digits_fedcp.yaml", [*before, last])
    assert str(exc.value) == said
    key = last.split("=")[0]
    top = int(said.split(", ")[1].split("]")[0])
    cfg = load_config("configs/digits_fedcp.yaml", [*before, f"{key}={top}"], validate=False).validate(data_file=False)
    assert getattr(cfg, key) == top  # the bound itself is taken


def test_a_yaml_alias_bomb_under_a_key_is_refused_with_its_value_cut_short(tmp_path):
    """Nine levels of nine aliases (9**9 items, a few hundred bytes of YAML) under mmd_bandwidths:
    the refusal spelled the whole value out and grew to gigabytes before printing anything."""
    value = "[" + ",".join(["&a0 [1,1,1,1,1,1,1,1,1]"] + ["*a0"] * 8) + "]"
    for level in range(1, 9):
        value = "[" + ",".join([f"&a{level} {value}"] + [f"*a{level}"] * 8) + "]"
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"method: fedcp\nmmd_bandwidths: {value}\n")
    with pytest.raises(UserError) as exc:
        load_config(str(bomb))
    said = str(exc.value)
    assert said.startswith("config key 'mmd_bandwidths': must be null or a non-empty list of numbers > 0, got [[[...],")
    assert len(said) < 600 and "\n" not in said
    with pytest.raises(UserError) as exc:  # an override's value is shown as read, not as the parser's wrapper
        load_config("configs/digits_fedcp.yaml", ["lr.x=1"], validate=False)
    assert str(exc.value) == "config key 'lr': expected float, got {'x': 1}"


def test_a_refused_start_leaves_no_folder_it_made(tmp_path, capsys):
    """A start refused after rank 0 made out_dir (here a shard that is no HDF5 file) left an empty
    folder holding a lock file, and the folders made above it; a folder that was there before is left
    as it was."""
    bad = tmp_path / "bad.h5"
    bad.write_text("not hdf5")
    for out, existed in ((tmp_path / "new" / "run", False), (tmp_path / "old", True)):
        if existed:
            out.mkdir()
        with pytest.raises(SystemExit) as stop:
            main(["--config", "configs/digits_fedcp.yaml", f"data.path={bad}", f"out_dir={out}", "rounds=1"])
        assert stop.value.code == 2 and "is not a readable HDF5 file" in capsys.readouterr().err
        assert out.is_dir() == existed
        assert not (tmp_path / "new").exists()  # the folder above was made for it too
    (tmp_path / "new" / "other").mkdir(parents=True)  # a folder above that holds something else stays
    with pytest.raises(SystemExit):
        main(["--config", "configs/digits_fedcp.yaml", f"data.path={bad}", f"out_dir={tmp_path / 'new' / 'a' / 'b'}"])
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["other"]


def test_overrides_and_run_folders_may_come_on_either_side_of_an_option(capsys):
    """`fedcp-run --config F rounds=3 --print-config lam=1` said `unrecognized arguments: lam=1`
    (argparse took the positionals after an option for strays); so did `fedcp-analyze runs/a
    --gradcam runs/b` for its second run."""
    main(["--config", "configs/digits_fedcp.yaml", "rounds=3", "--print-config", "lam=1"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["rounds"], printed["lam"]) == (3, 1.0)
    from fedcp_dist.cli.analyze import build_parser as analyze_parser

    args = analyze_parser().parse_args(["runs/a", "--gradcam", "runs/b"])
    assert args.runs == ["runs/a", "runs/b"] and args.gradcam


def test_what_follows_a_double_dash_stays_positional_with_options_on_either_side():
    """Intermixed parsing took what follows `--` for options again: `fedcp-analyze -- --odd`
    said RUN_DIR was missing, `fedcp-run -- -x=1` said `unrecognized arguments`, and `fedcp-run --
    rounds=3 --print-config` printed the config. As in plain argparse, `--` ends the options."""
    from fedcp_dist.cli.analyze import build_parser as analyze_parser
    from fedcp_dist.run import build_parser as run_parser

    args = run_parser().parse_args(["--config", "F", "a=1", "--print-config", "--", "--print-config", "-x=1"])
    assert args.print_config and args.overrides == ["a=1", "--print-config", "-x=1"]
    assert not run_parser().parse_args(["--", "rounds=3", "--print-config"]).print_config
    parser = analyze_parser()
    args = parser.parse_args(["runs/a", "--dlg", "--", "--gradcam", "-b"])
    assert args.runs == ["runs/a", "--gradcam", "-b"] and args.dlg and not args.gradcam
    assert parser.given(["--steps", "5", "--", "--dlg"]) == {"steps", "runs"}
    with pytest.raises(UserError, match=r"^fedcp-report: unrecognized arguments: -e$"):
        from fedcp_dist.cli.report import build_parser as report_parser
        report_parser().parse_args(["d", "--", "-e"])


def test_a_sweep_file_given_to_run_and_a_run_config_given_to_sweep_are_named(capsys):
    """`fedcp-run --config configs/sweeps/X.yaml` said `unknown config key 'name'`, and `fedcp-sweep
    configs/digits_fedcp.yaml` `unknown key 'method'`: true, but not what went wrong."""
    from fedcp_dist.cli.sweep import main as sweep_main

    with pytest.raises(SystemExit) as stop:
        main(["--config", "configs/sweeps/tutorial_mnist.yaml", "--print-config"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: configs/sweeps/tutorial_mnist.yaml is a sweep file (name, base, grid), "
                                       "not a run's config: run it with fedcp-sweep configs/sweeps/tutorial_mnist.yaml\n")
    with pytest.raises(SystemExit) as stop:
        sweep_main(["configs/digits_fedcp.yaml", "--dry-run"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: configs/digits_fedcp.yaml is a run's config (its keys are a run's: "
                                       "method, ...), not a sweep file: run it with fedcp-run --config "
                                       "configs/digits_fedcp.yaml, or name it as a sweep file's base\n")


def test_a_missing_relative_path_says_it_was_read_from_the_current_directory(tmp_path, monkeypatch, capsys):
    """Run from another folder, `fedcp-run --config /repo/configs/digits_fedcp.yaml` said only `no such
    file: data/digits_dir0.1_n20.h5`, and `fedcp-sweep /repo/configs/sweeps/X.yaml` `config file not
    found: configs/...`: paths are read from the current directory, not from the file naming them."""
    from fedcp_dist.cli.sweep import main as sweep_main
    from conftest import REPO

    monkeypatch.chdir(tmp_path)
    here = f"(a relative path, read from the current directory {tmp_path})"
    for call, argv, line in (
            (main, ["--config", str(REPO / "configs" / "digits_fedcp.yaml")],
             f"error: config key 'data.path': no such file: data/digits_dir0.1_n20.h5 {here}"),
            (main, ["--config", "configs/digits_fedcp.yaml"], f"error: config file not found: configs/digits_fedcp.yaml {here}"),
            (sweep_main, [str(REPO / "configs" / "sweeps" / "tutorial_mnist.yaml"), "--dry-run"],
             f"error: sweep key 'base': config file not found: configs/mnist_dir0.1_fedcp.yaml {here}")):
        with pytest.raises(SystemExit) as stop:
            call(argv)
        assert (stop.value.code, capsys.readouterr().err) == (2, line + "\n")
    with pytest.raises(SystemExit):  # an absolute path is named as it is
        main(["--config", str(REPO / "configs" / "digits_fedcp.yaml"), f"data.path={tmp_path / 'none.h5'}"])
    assert capsys.readouterr().err == f"error: config key 'data.path': no such file: {tmp_path / 'none.h5'}\n"
