"""Faults in what a user writes and in the environment a run starts in: config values (numbers
as YAML 1.1 leaves them, seeds torch or numpy cannot take) and launcher variables (malformed,
inconsistent, left over from another job), each one line before any rank waits; a rendezvous that
cannot complete ends within rendezvous_timeout, naming where it waited."""
import math
import os
import signal
import shutil
import socket
import subprocess
import sys
import time
import typing

import pytest
import yaml

from conftest import BIN, REPO, run_cmd
from fedcp_dist.cli import config_reference
from fedcp_dist.config import SEED_MAX, components, load_config
from fedcp_dist.errors import RunFailure, UserError
from fedcp_dist.options import accepts
from fedcp_dist.runtime import detect_launcher, init_runtime
from helpers import documented, run

CONFIG = str(REPO / "configs" / "digits_fedavg.yaml")


# ----------------------------------------------------------------------------- numbers a user writes


@pytest.mark.parametrize("override, key, value", [
    ("lr=1e-3", "lr", 0.001),  # YAML 1.1 reads 1e-3 as text
    ("lr=5E-3", "lr", 0.005),
    ("lr=' 2e-2 '", "lr", 0.02),
    ("lam=1_000.5", "lam", 1000.5),
    ("mmd_sigma=1e-3", "mmd_sigma", 0.001),  # a number or the word median
    ("mmd_sigma=median", "mmd_sigma", "median"),
    ("rounds=1e2", "rounds", 100),  # an integer key: a whole number written as a float
    ("rounds=100.0", "rounds", 100),
    ("batch_size=1_0", "batch_size", 10),
    ("fused_workers=2", "fused_workers", 2),
    ("fused_workers=auto", "fused_workers", "auto"),
    ("participation_range=[1e-1, 2.5e-1]", "participation_range", [0.1, 0.25]),
    ("mmd_bandwidths=[1e1, 15]", "mmd_bandwidths", [10.0, 15]),
    ("collective_timeout=6e2", "collective_timeout", 600.0),
    ("seed=9223372036854775807", "seed", SEED_MAX),
    ("data.clients=3e0", "data.clients", 3),
])
def test_numbers_are_read_however_they_are_written(override, key, value, tmp_path):
    cfg = load_config(None, [override], validate=False)
    got = cfg.data.clients if key == "data.clients" else getattr(cfg, key)
    assert got == value and type(got) is type(value)
    # a config file says the same
    k, v = override.split("=", 1)
    path = tmp_path / "c.yaml"
    node = {"data": {"clients": yaml.safe_load(v)}} if k == "data.clients" else {k: yaml.safe_load(v)}
    path.write_text(yaml.safe_dump(node))
    got = load_config(str(path), validate=False)
    assert (got.data.clients if key == "data.clients" else getattr(got, key)) == value


def _numeric(opt) -> typing.Optional[type]:
    args = typing.get_args(opt.type) if typing.get_origin(opt.type) is typing.Union else (opt.type,)
    return int if int in args else float if float in args else None


def test_every_numeric_key_takes_its_value_in_e_notation():
    """Whatever the key, a number's e-notation (which YAML 1.1 reads as text) is the number."""
    checked = 0
    for comp in components():
        prefix = getattr(comp, "prefix", "")
        for opt in comp.options:
            kind = _numeric(opt)
            if kind is None or isinstance(opt.default, (bool, str, list)) or opt.default is None:
                continue
            cfg = load_config(None, [f"{prefix}{opt.name}={float(opt.default):e}"], validate=False)
            got = getattr(cfg.data if prefix else cfg, opt.name)
            assert got == opt.default and isinstance(got, kind), (opt.name, got)
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("override, fragments", [
    ("lr=1e-3x", ["config key 'lr': expected float, got '1e-3x'"]),
    ("lr=nan", ["config key 'lr': must be a finite number, got nan"]),
    ("lr=-inf", ["config key 'lr': must be a finite number"]),
    ("rounds=1.5", ["config key 'rounds': expected int, got 1.5"]),
    ("rounds=1e400", ["config key 'rounds': expected int, got '1e400'"]),
    ("mmd_sigma=-1e-3", ["config key 'mmd_sigma': must be a number > 0 or median, got -0.001"]),
    ("seed=9223372036854775808", ["config key 'seed': must be an integer in [0, 9223372036854775807]",
                                  "got 9223372036854775808"]),
    ("seed=-1", ["config key 'seed': must be an integer in [0, 9223372036854775807]", "got -1"]),
    ("seed=18446744073709551616", ["config key 'seed'"]),
    ("seed=1e30", ["config key 'seed': expected int"]),
])
def test_a_value_no_key_can_take_is_one_line(override, fragments, digits6_16px, capsys):
    from fedcp_dist.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--config", CONFIG, f"data.path={digits6_16px}", override, "--print-config"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err


def test_the_failure_table_quotes_what_a_bad_value_gets(digits6_16px, capsys):
    from fedcp_dist.run import main

    for override, example in (("lam=-1", "`error: config key 'lam': must be >= 0, got -1.0`"),
                              ("seed=-1", "`error: config key 'seed': must be an integer in [0, 9223372036854775807] "
                                          "(a seed torch and numpy both take), got -1`")):
        with pytest.raises(SystemExit):
            main(["--config", CONFIG, f"data.path={digits6_16px}", override, "--print-config"])
        documented("checkpoints.md", example, capsys.readouterr().err)
    documented("checkpoints.md", "`lr=1e-3` (which YAML 1.1 takes for text) is 0.001, `rounds=1e2` is 100",
               f"lr=1e-3 (which YAML 1.1 takes for text) is {load_config(None, ['lr=1e-3'], validate=False).lr}, "
               f"rounds=1e2 is {load_config(None, ['rounds=1e2'], validate=False).rounds}")


def test_the_largest_seed_runs(digits6_16px, tmp_path):
    """torch and numpy both take SEED_MAX: the model's draw, a subset of clients (numpy) and a
    cohort of half of them, over a round."""
    s = run(CONFIG, [f"data.path={digits6_16px}", f"out_dir={tmp_path}", "rounds=1", "threads=1",
                     f"seed={SEED_MAX}", "data.clients=4", "participation=0.5"])
    assert s["rounds"] == 1 and math.isfinite(s["final_acc"])


def test_the_configuration_reference_says_what_each_key_takes():
    """Every numeric key's row names its kind of number; the page explains how numbers are read."""
    page = config_reference.render()
    for comp in components():
        prefix = getattr(comp, "prefix", "")
        for opt in comp.options:
            if _numeric(opt) is None or opt.name == "clients":
                continue
            words = "an integer" if _numeric(opt) is int else "a number"
            listed = all(part.strip().lstrip("-").replace(".", "", 1).isdigit() for part in accepts(opt).split("|"))
            assert words in accepts(opt) or listed, (opt.name, accepts(opt))  # or the values themselves: 32 | 16 | 8
            assert f"| `{prefix}{opt.name}` |" in page
    for row in ("| `lr` | `0.005` | a number > 0 |", "| `rounds` | `100` | an integer > 0 |",
                "| `seed` | `1` | an integer in [0, 2^63 - 1] |", "| `participation` | `1.0` | a number in (0, 1] |",
                "| `fused_workers` | `auto` | auto \\| an integer >= 1 |", "| `mmd_sigma` | `median` | median \\| a number > 0 |"):
        assert row in page, row
    assert "takes `1e-3` for text, and a numeric key takes that text as the number it spells" in " ".join(page.split())


# ----------------------------------------------------------------------------- launcher variables

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, fragments", [
    ({"RANK": "abc"}, ["environment variable RANK='abc' is not an integer >= 0"]),
    ({**TORCHRUN, "RANK": "abc"}, ["RANK='abc' is not an integer in [0, 1] (WORLD_SIZE is 2)",
                                    "left over from an earlier job or an srun --pty shell? unset them"]),
    ({**TORCHRUN, "RANK": "2"}, ["RANK='2' is not an integer in [0, 1]"]),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, ["WORLD_SIZE='0' is not an integer >= 1"]),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, ["WORLD_SIZE='two'"]),
    ({**TORCHRUN, "MASTER_PORT": "http"}, ["MASTER_PORT='http' is not an integer in [1, 65535]"]),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT='70000'"]),
    ({**TORCHRUN, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK='2' is not an integer in [0, 1]"]),
    ({**TORCHRUN, "MASTER_ADDR": ""}, ["MASTER_ADDR"]),
    ({"FEDCP_LAUNCHER": "torchrun"}, ["FEDCP_LAUNCHER=torchrun but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are "
                                      "not set", "unset FEDCP_LAUNCHER to run one process"]),
    ({"FEDCP_LAUNCHER": "torchrun", "RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_ADDR, MASTER_PORT are not set"]),
    ({"TORCHELASTIC_RUN_ID": "x"}, ["TORCHELASTIC_RUN_ID is set but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"]),
    ({"FEDCP_LAUNCHER": "slurm"}, ["FEDCP_LAUNCHER=slurm but SLURM_PROCID, SLURM_STEP_NUM_TASKS are not set"]),
    ({"FEDCP_LAUNCHER": "mpirun"}, ["FEDCP_LAUNCHER='mpirun' is not one of torchrun, mpi, slurm, single"]),
    ({"RANK": "1"}, ["RANK='1' make this process a rank of a job, but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"]),
    ({"RANK": "0", "WORLD_SIZE": "4"}, ["but MASTER_ADDR, MASTER_PORT are not set: not a torchrun job"]),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "2"}, ["SLURM_PROCID='3' is not an integer in [0, 1]"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "x"}, ["SLURM_STEP_NUM_TASKS='x' is not an integer >= 1"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "abc"}, ["SLURM_JOB_ID='abc'"]),
])
def test_inconsistent_launcher_variables_are_refused_before_any_wait(env, fragments):
    t0 = time.monotonic()
    with pytest.raises(UserError) as exc:
        init_runtime("cpu", 1, 600.0, env=env, keep_freed=False, rendezvous_timeout=600.0)
    assert time.monotonic() - t0 < 5  # no rendezvous was tried
    msg = str(exc.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, msg


@pytest.mark.parametrize("env", [{"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
                                 {"OMPI_COMM_WORLD_SIZE": "abc"}, {"PMI_SIZE": "2", "PMI_RANK": "0"}])
def test_mpi_variables_no_mpirun_set_are_refused(digits6_16px, tmp_path, env):
    """Open MPI's or PMI's variables left in a plain shell: the run went on as an MPI rank of one
    (summary.json: launcher mpi), watching its shell as if it were mpirun."""
    if shutil.which("mpirun", path=str(BIN)) is None:
        pytest.skip("mpi4py and mpirun not installed (pip install '.[mpi]')")
    name = next(iter(env))
    r = run_cmd(["fedcp-run", "--config", "configs/digits_fedcp.yaml", f"data.path={digits6_16px}",
                 f"out_dir={tmp_path / 'run'}", "rounds=1"], env_extra=env)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {name}={env[name]} does not match the 1 rank MPI started this process among (no mpirun started it): "
        f"variables left over from an mpirun or a job step; unset them to run one process, or start it with mpirun"], \
        r.stderr
    assert not (tmp_path / "run").exists()


def test_the_failure_table_quotes_what_launcher_variables_get():
    for env, example in (({**TORCHRUN, "RANK": "abc"}, "`error: environment variable RANK='abc' is not an integer in "
                          "[0, 1] (WORLD_SIZE is 2) (read as torchrun's, since RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                          "are set; left over from an earlier job or an srun --pty shell? unset them to run one "
                          "process)`"),
                         ({"FEDCP_LAUNCHER": "torchrun"}, "`error: FEDCP_LAUNCHER=torchrun but RANK, WORLD_SIZE, "
                          "MASTER_ADDR, MASTER_PORT are not set …`")):
        with pytest.raises(UserError) as exc:
            detect_launcher(env)
        documented("checkpoints.md", example, f"error: {exc.value}")


@pytest.mark.parametrize("env, launcher", [
    ({}, "single"),
    ({"MASTER_PORT": "29500"}, "single"),  # a lone leftover export: harmless
    ({"LOCAL_RANK": "0"}, "single"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "single"),
    ({**TORCHRUN, "WORLD_SIZE": "1"}, "torchrun"),  # one rank: nothing to meet
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "7"}, "slurm"),  # an srun --pty shell
])
def test_harmless_leftovers_run_as_one_rank(env, launcher):
    assert detect_launcher(env) == launcher
    rt = init_runtime("cpu", 1, 600.0, env=env, keep_freed=False)
    assert (rt.world_size, rt.rank, rt.distributed) == (1, 0, False)
    rt.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_0_of_a_job_nobody_joins_stops_within_the_rendezvous_timeout(monkeypatch, capsys):
    """Leftover variables that make a plain run rank 0 of 2: it says at once what it waits for, and
    fails after rendezvous_timeout, naming the address and the variables (not collective_timeout's
    600 s and a DistStoreError)."""
    port = str(_free_port())
    for k, v in {**TORCHRUN, "MASTER_PORT": port}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    t0 = time.monotonic()
    with pytest.raises(RunFailure) as exc:
        init_runtime("cpu", 1, 600.0, env=os.environ, keep_freed=False, rendezvous_timeout=1.0)
    assert time.monotonic() - t0 < 15
    msg = str(exc.value)
    assert "\n" not in msg and f"did not meet at 127.0.0.1:{port} within rendezvous_timeout=1 s" in msg, msg
    assert f"RANK='0' WORLD_SIZE='2' MASTER_ADDR='127.0.0.1' MASTER_PORT='{port}'" in msg
    assert "left over from an earlier job (unset them to run one process)" in msg
    err = capsys.readouterr().err
    assert "note: RANK='0' WORLD_SIZE='2'" in err and "are set, but by no torchrun" in err
    assert f"waits up to rendezvous_timeout=1 s for the others at 127.0.0.1:{port}" in err
    documented("checkpoints.md", "`note: RANK='0' WORLD_SIZE='2' MASTER_ADDR='…' MASTER_PORT='…' are set, but by no "
               "torchrun …`", err)
    documented("checkpoints.md", "`error: rank 0: the 2 ranks of the job did not meet at …:… within rendezvous_timeout=… s "
               "(…); launcher torchrun read from RANK='0' WORLD_SIZE='2' …`", f"error: {msg}")


def test_a_rank_whose_master_never_comes_is_one_line_from_the_command(digits6_16px, tmp_path):
    """The whole command, as a user runs it: exit 1, one error line after the note, no traceback and
    no C++ stack of torch's connection retries."""
    env = {**TORCHRUN, "RANK": "1", "MASTER_PORT": str(_free_port())}
    t0 = time.monotonic()
    r = run_cmd([str(BIN / "fedcp-run"), "--config", CONFIG, f"data.path={digits6_16px}", f"out_dir={tmp_path}",
                 "rounds=1", "rendezvous_timeout=2"], env_extra=env, timeout=120)
    assert time.monotonic() - t0 < 60
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 2, r.stderr
    assert lines[0].startswith("note: ") and lines[1].startswith("error: rank 1: the 2 ranks of the job did not meet")
    assert "nothing answered at 127.0.0.1:" in lines[1] and "Traceback" not in r.stderr and "frame #" not in r.stderr


def test_a_rank_whose_port_something_else_holds_silently_stops_within_the_timeout(digits6_16px, tmp_path):
    """MASTER_PORT held by a process that takes connections and never answers (a service on the
    port, an earlier job's half-dead store): torch's store client waits for its first answer with
    no limit, so the rank waited for as long as the port was held, printing C++ stack traces. It
    now stops at rendezvous_timeout plus a few seconds, in one line."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()  # the kernel takes the connections; nobody answers
    env = {**TORCHRUN, "RANK": "1", "MASTER_PORT": str(holder.getsockname()[1])}
    try:
        t0 = time.monotonic()
        r = run_cmd([str(BIN / "fedcp-run"), "--config", CONFIG, f"data.path={digits6_16px}", f"out_dir={tmp_path}",
                     "rounds=1", "rendezvous_timeout=2"], env_extra=env, timeout=120)
        took = time.monotonic() - t0
    finally:
        holder.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 2 and took < 40, (took, r.stderr)
    assert lines[1].startswith("error: rank 1: the 2 ranks of the job did not meet"), lines
    assert "never answered as a rendezvous store" in lines[1] and "Exception raised from" not in r.stderr


def _slurm_rank(rank: int, port: int, step: str) -> tuple:
    from fedcp_dist.runtime import Endpoint

    env = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": step, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "2"}
    return Endpoint(rank, 2, rank, 2, f"tcp://127.0.0.1:{port}"), env


def test_a_rank_that_reaches_another_job_steps_store_stops_at_once():
    """Two srun steps of one allocation on one port: step 1's rank 1 reached step 0's store, joined
    its process group's rendezvous and waited there until SLURM killed it. Rank 0 says in the store
    whose it is; a rank of another step reads it and stops in one line."""
    import torch.distributed as dist

    from fedcp_dist.launch_env import OWNER_KEY, rendezvous

    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)  # step 0's rank 0
    server.set(OWNER_KEY, "SLURM job 5 step 0")
    ep, env = _slurm_rank(1, port, "1")
    t0 = time.monotonic()
    with pytest.raises(RunFailure) as exc:
        rendezvous("slurm", ep, 20.0, env)
    assert time.monotonic() - t0 < 10
    assert str(exc.value) == (f"rank 1: the rendezvous store at 127.0.0.1:{port} belongs to another job (SLURM job 5 "
                              f"step 0), not to this one (SLURM job 5 step 1): two jobs or job steps on one port (srun "
                              f"steps of one allocation that set the same MASTER_PORT, say); give each its own "
                              f"MASTER_PORT")
    # the same step's rank meets it: rank 0 of step 0 says whose it is, its rank 1 reads its own
    ep0, env0 = _slurm_rank(1, port, "0")
    assert rendezvous("slurm", ep0, 20.0, env0) is not None
    del server


def test_rank_0_on_a_port_in_use_says_so_at_once():
    """It said the ranks 'did not meet within rendezvous_timeout=120 s' of a port it could not open."""
    from fedcp_dist.launch_env import rendezvous

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        ep, env = _slurm_rank(0, holder.getsockname()[1], "0")
        t0 = time.monotonic()
        with pytest.raises(RunFailure) as exc:
            rendezvous("slurm", ep, 30.0, env)
        assert time.monotonic() - t0 < 15
    finally:
        holder.close()
    assert str(exc.value).startswith(f"rank 0: cannot open the job's rendezvous store at 127.0.0.1:"
                                     f"{ep.init_method.rsplit(':', 1)[1]}: the port is in use (another job, another step of this allocation or another service "
                                     f"holds it); set MASTER_PORT to a free port"), str(exc.value)


def test_a_stop_signal_while_the_ranks_meet_ends_the_wait_with_the_requeue_status(digits6_16px, tmp_path):
    """Rank 0 waiting for a rank that has not started (a slow node) took a preemption signal only
    once rendezvous_timeout was over, then failed with exit 1: the job was not requeued. It stops at
    once with 75 and the status a job script reads: nothing was trained in this attempt."""
    status = tmp_path / "status"
    env = {**os.environ, **TORCHRUN, "RANK": "0", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "FEDCP_STATUS_FILE": str(status), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FEDCP_LAUNCHER", None)
    p = subprocess.Popen([str(BIN / "fedcp-run"), "--config", CONFIG, f"data.path={digits6_16px}",
                          f"out_dir={tmp_path / 'run'}", "rounds=1", "rendezvous_timeout=300"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        err = ""
        while "waits up to rendezvous_timeout" not in err:  # the note before the wait
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            err += p.stderr.readline()
        time.sleep(1.0)
        t0 = time.monotonic()
        p.send_signal(signal.SIGUSR2)
        out, rest = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75 and took < 10, (p.returncode, took, rest)
    assert "rank 0: got SIGUSR2; stopping during start-up, before any training" in out, out
    assert rest.strip().splitlines()[-1].startswith("preempted: stopped while waiting for the job's other ranks at "
                                                    "127.0.0.1:"), rest
    assert status.read_text() == "stopped-at-start\n"


def test_a_job_script_attempt_on_a_finished_run_has_nothing_to_do(digits6_16px, tmp_path):
    """An array submitted again to resume its cancelled points: the tasks of finished points were
    refused (exit 2, FAILED). Under the job scripts (FEDCP_FINISHED_OK=1) such an attempt says so and
    exits 0; elsewhere a finished out_dir is still refused."""
    out = tmp_path / "run"
    run(CONFIG, [f"data.path={digits6_16px}", f"out_dir={out}", "rounds=1", "threads=1"])
    status = tmp_path / "status"
    args = [str(BIN / "fedcp-run"), "--config", CONFIG, f"data.path={digits6_16px}", f"out_dir={out}", "rounds=1"]
    r = run_cmd(args, env_extra={"FEDCP_FINISHED_OK": "1", "FEDCP_STATUS_FILE": str(status)})
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert r.stdout.startswith(f"out_dir {out} holds the finished run (summary.json, final accuracy 0.")
    assert r.stdout.rstrip().endswith("nothing to do (FEDCP_FINISHED_OK=1)") and status.read_text() == "finished\n"
    r = run_cmd(args)
    assert r.returncode == 2 and "holds a finished run" in r.stderr
    # the same out_dir asked for another run (more rounds, another lr): refused under the scripts too
    for other in ("rounds=2", "lr=0.2"):
        r = run_cmd([*(a for a in args if a != "rounds=1"), other] + ([] if other.startswith("rounds") else ["rounds=1"]),
                    env_extra={"FEDCP_FINISHED_OK": "1"})
        assert r.returncode == 2 and "holds a finished run" in r.stderr, (other, r.stdout + r.stderr)


def test_a_refusal_with_stderr_closed_is_said_on_stdout_and_exits_2(tmp_path):
    """``2>&-``: Python has no sys.stderr; the error line goes to stdout (as print does) and the exit
    status stays a refusal's."""
    r = subprocess.run([sys.executable, "-m", "fedcp_dist.run", "--config", CONFIG, f"data.path={tmp_path / 'no.h5'}",
                        f"out_dir={tmp_path / 'run'}"], cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=lambda: os.close(2))
    assert r.returncode == 2 and r.stdout.strip().splitlines()[-1].startswith("error: config key 'data.path'"), r.stdout


@pytest.mark.slow
def test_two_ranks_started_apart_by_hand_meet_and_run(digits6_16px, tmp_path):
    """The same variables set on purpose (two processes, no launcher), the second rank a few seconds
    late: they meet within rendezvous_timeout and run as two ranks."""
    port = str(_free_port())
    args = [str(BIN / "fedcp-run"), "--config", CONFIG, f"data.path={digits6_16px}", f"out_dir={tmp_path}",
            "rounds=1", "threads=1", "rendezvous_timeout=60"]
    env = {**os.environ, **TORCHRUN, "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FEDCP_LAUNCHER", None)
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    second = run_cmd(args, env_extra={**TORCHRUN, "RANK": "1", "MASTER_PORT": port}, timeout=300)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0 and second.returncode == 0, err + second.stderr
    assert "launcher=torchrun world_size=2" in out and "Traceback" not in err + second.stderr


# ----------------------------------------------------------------------------- stdout that goes away


@pytest.mark.parametrize("where", ["closed pipe", "/dev/full"])
def test_a_run_whose_stdout_cannot_be_written_trains_to_its_end(where, digits6_16px, tmp_path):
    """`fedcp-run … | head -1` died at its next progress line (`error: rank 0, round 1: Broken pipe`,
    exit 1, the round lost), `>/dev/full` at start-up as if out_dir's disk were full: the run now
    goes on without stdout, saying so once on stderr."""
    args = [str(BIN / "fedcp-run"), "--config", CONFIG, f"data.path={digits6_16px}", f"out_dir={tmp_path / 'run'}",
            "rounds=2", "eval_every=1", "threads=1"]
    if where == "/dev/full":
        with open("/dev/full", "w") as full:
            proc = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300)
        rc, err, reason = proc.returncode, proc.stderr, "No space left on device"
    else:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        proc.stdout.readline()  # the start line, then the reader goes away
        proc.stdout.close()
        err = proc.stderr.read()
        rc, reason = proc.wait(timeout=300), "Broken pipe"
    assert rc == 0, err
    assert err.strip().splitlines() == [f"note: stdout cannot be written ({reason}); the run goes on without it (its "
                                        f"progress is in metrics.jsonl)"], err
    assert (tmp_path / "run" / "summary.json").is_file()


def test_ranks_on_cuda_without_a_gpu_are_refused_before_torchrun(digits6_16px, tmp_path):
    """`fedcp-run --ranks 2 device=cuda` on a CPU machine: each rank said it among torchrun's own
    warning and error lines; now one line before torchrun starts."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    r = run_cmd([str(BIN / "fedcp-run"), "--ranks", "2", "--config", CONFIG, f"data.path={digits6_16px}",
                 f"out_dir={tmp_path / 'run'}", "device=cuda"])
    assert (r.returncode, r.stderr) == (2, "error: device=cuda but no CUDA device is visible to this process\n")
    assert not (tmp_path / "run").exists()
