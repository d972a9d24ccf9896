"""Entry point: config → runtime → Simulator → run → close.

    fedcp-run --config configs/digits_fedcp.yaml rounds=50 lr=0.01
    torchrun --nproc_per_node=2 -m fedcp_dist.run --config configs/mnist_dir0.1_fedcp.yaml
    mpirun -n 2 python -m fedcp_dist.run --config ...
    srun --ntasks=8 python -m fedcp_dist.run --config ...
"""
from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from fedcp_dist.config import dump_config, load_config
from fedcp_dist.errors import ArgumentParser, Preempted, cli_main


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="fedcp-run",
        description="Run one federated experiment (FedCP or a baseline) on every rank of the job.",
        epilog="Overrides are key=value pairs (YAML values), e.g. rounds=50 lam=1 data.path=data/x.h5",
    )
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def run_config(config_path: Optional[str], overrides: Sequence[str] = ()) -> dict:
    """Run the experiment of ``config_path`` (None: the defaults) with ``key=value`` overrides on
    every rank of this job; returns its summary (on every rank).

    Raises :class:`~fedcp_dist.errors.UserError` for a bad config or out_dir, ``RunFailure`` when the
    run cannot go on and ``Preempted`` once a preemption signal's checkpoint is written.
    """
    cfg = load_config(config_path, list(overrides))
    # imported here so that --help and config errors stay fast
    from fedcp_dist.runtime import init_runtime
    from fedcp_dist.simulator import Simulator

    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, keep_freed=cfg.keep_freed_memory)
    try:
        return Simulator(cfg, rt).run()
    except Preempted:
        # torchrun turns a worker's exit status into its own: job scripts read this file instead
        status_file = os.environ.get("FEDCP_STATUS_FILE")
        if status_file and rt.is_main:
            with open(status_file, "w", encoding="utf-8") as f:
                f.write("preempted\n")
        raise
    finally:
        rt.close()


@cli_main
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.print_config:
        print(dump_config(load_config(args.config, args.overrides)), end="")
        return None
    run_config(args.config, args.overrides)
    return None


if __name__ == "__main__":
    main()
