"""Entry point: config → runtime → Simulator → run → close.

    fedcp-run --config configs/digits_fedcp.yaml rounds=50 lr=0.01
    fedcp-run --ranks auto --config configs/mnist_dir0.1_fedcp.yaml     # one rank per core (or GPU), via torchrun
    torchrun --nproc_per_node=2 -m fedcp_dist.run --config configs/mnist_dir0.1_fedcp.yaml
    mpirun -n 2 python -m fedcp_dist.run --config ...
    srun --ntasks=8 python -m fedcp_dist.run --config ...
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional, Sequence

from fedcp_dist.errors import (ONE_TERMINAL, ArgumentParser, Preempted, StdoutThatMayGo, UserError, check_address_space,
                               check_open_files, cli_main, job_rank, say)
from fedcp_dist.rundir.faults import fault_point
from fedcp_dist.rundir.preemption import StopSignals, write_status

#: how the OpenMP threads of torch's CPU kernels wait between parallel regions, unless the
#: environment says otherwise: asleep. The default (libgomp's) spins a while after every region,
#: which on a machine whose cores are shared with other processes costs many times the work of
#: small kernels (a rank's personalized evaluation of a thousand small clients: 10x the CPU time at
#: 2 threads); the policy changes no result, only how idle threads wait.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def quiet_openmp(env=os.environ, modules=sys.modules) -> None:
    """Set :data:`OPENMP_ENV` in ``env`` where the user has not, before torch loads (OpenMP reads
    it when torch's library loads; the ranks torchrun starts inherit it). Once torch is loaded it
    is too late, and nothing is changed."""
    if "torch" in modules:
        return
    for key, value in OPENMP_ENV.items():
        env.setdefault(key, value)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="fedcp-run",
        description="Run one federated experiment (FedCP or a baseline) on every rank of the job.",
        epilog="Overrides are key=value pairs (YAML values), e.g. rounds=50 lam=1 data.path=data/x.h5",
    )
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--ranks", default="1", metavar="N|auto",
                   help="start N ranks on this machine instead of running in this process: the command "
                        "becomes torchrun --standalone --nproc_per_node=N -m fedcp_dist.run ... (auto: one "
                        "per visible GPU, else one per usable core; on a CPU one rank per core trains faster "
                        "than one process with several threads); default 1")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def run_config(config_path: Optional[str], overrides: Sequence[str] = (), stop: Optional[StopSignals] = None) -> dict:
    """Run the experiment of ``config_path`` (None: the defaults) with ``key=value`` overrides on
    every rank of this job; returns its summary (on every rank).

    ``stop``: the preemption signals noted since the process started (:func:`main`); without it they
    are listened to from here. Raises :class:`~fedcp_dist.errors.UserError` for a bad config or
    out_dir, ``RunFailure`` when the run cannot go on and ``Preempted`` once a preemption signal's
    checkpoint is written (or, for a signal during start-up, before the first round).
    """
    from fedcp_dist.config import load_config  # torch loads with it, after main's signal handlers

    stop = stop if stop is not None else StopSignals()
    with stop:
        cfg = load_config(config_path, list(overrides))
        stop.listen((cfg.preempt_signal, "SIGTERM"))
        # imported here so that --help and config errors stay fast
        from fedcp_dist.runtime import init_runtime
        from fedcp_dist.engine.simulator import Simulator

        if os.environ.get(FINISHED_OK) == "1" and not cfg.overwrite:
            done = _finished_already(cfg)
            if done is not None:
                return done
        try:
            rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, keep_freed=cfg.keep_freed_memory,
                              rendezvous_timeout=cfg.rendezvous_timeout, stopped=lambda: stop.signum is not None)
        except Preempted:  # asked to stop while the ranks met: nothing trained in this attempt
            if job_rank() == "0":
                write_status(STOPPED_AT_START)
            raise
        stop.rank = rt.rank
        try:
            summary = Simulator(cfg, rt, stop=stop).run()
            if rt.is_main:  # for a launcher signalled after this: the run is finished, whatever the ranks' ending
                try:
                    write_status("finished")
                except OSError:  # the run's files are written: a job script's note cannot undo that
                    pass
            return summary
        except Preempted as exc:
            # torchrun turns a worker's exit status into its own: job scripts read this file instead
            if rt.is_main:
                write_status(STOPPED_AT_START if exc.nothing_new else "preempted")
            raise
        finally:
            rt.close()


#: set to 1 by the SLURM job scripts: an attempt whose out_dir holds the finished run (a requeue after
#: it finished, an array submitted again to resume its cancelled points) has nothing to do, and exits
#: 0 saying so, rather than being refused (exit 2, the array task FAILED)
FINISHED_OK = "FEDCP_FINISHED_OK"
#: what the status file says of a run stopped before it trained a round in this attempt (a job script
#: that sees it on attempt after attempt stops requeueing)
STOPPED_AT_START = "stopped-at-start"


def _finished_already(cfg) -> Optional[dict]:
    """The summary of the finished run in ``cfg.out_dir`` (not one that diverged) when it is this
    config's run (its config.yaml differs in no key that defines the experiment, ``rounds`` included),
    said in one line by the job's first rank; None otherwise, and the start refuses the out_dir as
    any finished one (a job that asks for more rounds, another seed or lr, is not "done")."""
    from fedcp_dist.rundir.directory import FINISHED, RunDir, check_resume_config

    run = RunDir(cfg.out_dir)
    summary = run.read_summary() if run.summary.exists() and run.status() == FINISHED else None
    have = run.read_config() if summary is not None else None
    if summary is None or have is None or have.get("rounds") != cfg.rounds:
        return None
    try:
        check_resume_config(have, cfg.to_dict(), cfg.out_dir, same_data=True)
    except UserError:
        return None
    if job_rank() == "0":
        print(f"out_dir {cfg.out_dir} holds the finished run (summary.json, final accuracy "
              f"{summary.get('final_acc', float('nan')):.4f}): nothing to do ({FINISHED_OK}=1)", flush=True)
        try:
            write_status("finished")
        except OSError:
            pass
    return summary


def parse_ranks(value: str) -> Optional[int]:
    """``--ranks``: a positive integer, or None for ``auto`` (see :func:`auto_ranks`)."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"--ranks must be a positive integer or auto, got {value!r}")
    return n


def auto_ranks(device: str) -> int:
    """``--ranks auto``: one rank per visible GPU where the config's device would be a GPU, else one
    per usable core."""
    import torch

    from fedcp_dist.runtime import _cpu_count

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return _cpu_count()


def local_ranks_command(n: int, config: Optional[str], overrides: Sequence[str], env=os.environ) -> tuple:
    """The torchrun command and environment that start ``n`` ranks of this run on this machine:
    one intra-op thread per rank's share of the cores, and torchrun's grace for a worker after a
    SIGTERM raised as for a sweep's points (``run_env``), so that a preempted round reaches its
    checkpoint."""
    from fedcp_dist.runtime import _cpu_count, detect_launcher
    from fedcp_dist.sweep.local import run_env

    launcher = detect_launcher(env)
    # a job step of one task (an srun --pty shell, a step that runs a local sweep) is one process to
    # start the ranks from; the ranks see torchrun's variables before SLURM's
    if launcher != "single" and not (launcher == "slurm" and env.get("SLURM_STEP_NUM_TASKS") == "1"):
        raise UserError("--ranks starts the ranks itself: under torchrun, mpirun or srun leave it out "
                        "(the launcher sets how many)")
    argv = [sys.executable, "-m", "fedcp_dist.cli.ranks", "--standalone", f"--nproc_per_node={n}",
            "-m", "fedcp_dist.run", *(["--config", config] if config else []), *overrides]
    out = run_env(env)
    out.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // n)))
    out[ONE_TERMINAL] = "1"
    return argv, out


@cli_main
def main(argv=None):
    # listening at once: reading the config, starting the runtime, loading the shard and verifying a
    # checkpoint can take minutes, and a preemption then must end in the requeue status too
    quiet_openmp()
    if sys.stdout is not None and not isinstance(sys.stdout, StdoutThatMayGo):
        sys.stdout = StdoutThatMayGo(sys.stdout)  # a reader gone (| head) does not end the training
    with StopSignals() as stop:
        fault_point("startup")  # the fault tests' hook
        _main(build_parser().parse_args(argv), stop)
        stop.finished()
    try:
        fault_point("exit")  # the fault tests' hook: a signal between a finished run and the process's end
    finally:
        if argv is not None:  # a caller in this process goes on: its Ctrl-C back. The process's own
            stop.interruptible()  # command line (fedcp-run, python -m): ignored to the end, which the
            # interpreter's teardown (torch's threads, the collectives) may take a while to reach


def _start_ranks(args, stop: StopSignals) -> None:
    """``--ranks N``: check what every rank would refuse once, then exec torchrun in this process's
    place (:mod:`fedcp_dist.cli.ranks`); returns only for one rank (``--ranks auto`` on one core)."""
    from fedcp_dist.config import load_config

    n = parse_ranks(args.ranks)  # a bad value before the config is read
    cfg = load_config(args.config, args.overrides)  # a bad config is one error here, not one per rank
    n = n or auto_ranks(cfg.device)
    if n > 1 and cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # each rank would say it, among torchrun's own lines
            raise UserError("device=cuda but no CUDA device is visible to this process")
    if n <= 1:
        return
    from fedcp_dist.data.shards import read_info
    from fedcp_dist.engine.startup import check_shard

    check_shard(cfg, read_info(cfg.data.path, label_counts=False))  # and so is a config the shard does not fit
    if not cfg.overwrite:  # and an out_dir the ranks would refuse (rank 0 checks it again, under its lock)
        from fedcp_dist.rundir.directory import RunDir
        from fedcp_dist.rundir.out_dir import refusal

        problem = refusal(RunDir(cfg.out_dir), cfg.resume)
        if problem:
            raise UserError(problem)
        if cfg.resume == "auto":  # and a resume its checkpointed run's config refuses (by every rank, once here)
            from fedcp_dist.rundir.directory import check_resume_config

            run = RunDir(cfg.out_dir)
            have = run.read_config() if run.has_checkpoint() else None
            if have is not None:  # config.yaml: the keys a resume may not change are the checkpoint's own
                check_resume_config(have, cfg.to_dict(), cfg.out_dir, same_data=True)  # (the data: by content)
    cmd, env = local_ranks_command(n, args.config, args.overrides)
    if stop.signum is not None:  # asked to stop (before the signals were held) before the ranks started
        write_status("preempted")
        raise Preempted("stopped before the ranks were started")
    sys.stdout.flush()
    sys.stderr.flush()
    fault_point("exec")  # the fault tests' hook: a signal in the last moment before the exec
    os.execve(cmd[0], cmd, env)  # torchrun in this process's place (fedcp_dist.cli.ranks: its ending said as a run's)


def _main(args, stop: StopSignals) -> None:
    if args.ranks != "1" and not args.print_config:
        from fedcp_dist.cli.ranks import HELD_ACROSS_EXEC  # (no torch)

        # the stop signals are held from here, before torch loads (the config module loads it): a
        # signal mask is a thread's, and the threads torch starts take the mask of the thread that
        # starts them. Held, a stop signal waits across the exec for the launcher's handlers
        # (fedcp_dist.cli.ranks), which stop before the ranks start (75); unheld, one that came
        # while torch loaded there ended it (143, 140), and one that a thread of torch took here
        # just before the exec was lost
        held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_ACROSS_EXEC)
        try:
            _before_start(args)
            _start_ranks(args, stop)
        finally:  # reached only without the exec (an error, or one rank): listening again
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    else:
        _before_start(args)
        if args.print_config:
            _print_config(args)
            return
    run_config(args.config, args.overrides, stop=stop)


def _before_start(args) -> None:
    check_address_space()  # before torch loads: under too low a limit some of its libraries abort the process
    check_open_files(several=args.ranks != "1", note=say)  # and the ranks torchrun starts inherit a raised limit
    from fedcp_dist.config import given_once

    given_once(args.overrides)  # a key typed twice, before anything starts


def _print_config(args) -> None:
    from fedcp_dist.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides, validate=False).validate(data_file=False)
    if os.path.isfile(cfg.data.path):  # the config against the shard, as a run checks it
        from fedcp_dist.data.shards import read_info
        from fedcp_dist.engine.startup import check_shard

        check_shard(cfg, read_info(cfg.data.path, label_counts=False))
    print(dump_config(cfg), end="")
    if not os.path.isfile(cfg.data.path):  # printed all the same: the file may be made later
        what = (f"{cfg.data.path} is not a regular file" if os.path.exists(cfg.data.path) else
                f"{cfg.data.path} does not exist") if cfg.data.path else "is not set"
        print(f"note: data.path {what}; a run needs the HDF5 partition written by fedcp-partition",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
