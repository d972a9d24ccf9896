"""Cohort benchmark: seconds per round against participants, start-up and memory, at thousands of clients.

    python bench/cohort.py --config configs/mnist_dir0.1_fedcp.yaml data.path=data/mnist_dir_n10000.h5 \\
        participation=0.01 threads=1
    torchrun --nproc_per_node=2 bench/cohort.py --config configs/mnist_dir0.1_fedcp.yaml method=ditto \\
        data.path=data/mnist_dir_n5000.h5 participation=0.01 threads=1 client_state=disk --eval

It builds the run as ``fedcp-run`` does (``key=value`` overrides as there; ``out_dir`` defaults to a
fresh folder under ``data/bench-runs``, the same on every rank, removed at the end; a disk store's
files are removed in any out_dir), then trains rounds 2 … ``--rounds``+1 (round indices 1 …; none of them
evaluates while ``eval_every`` > ``--rounds``), so that the figures are those of training rounds
alone, whatever N: the run's own first round evaluates every client, which costs far more than a
round's training at these client counts. ``--eval`` first runs round 1 with its evaluation of
every client (what a real run does first; that is where a device store makes every client's
state). Rank 0 prints one line per round (participants, seconds, training seconds) and, per rank,
the start-up seconds (shard, placement, model, store), the peak RSS (the process's, ``ru_maxrss``;
it counts pages of files mapped into memory too, such as a disk store's FedAMP/FedFomo banks), the
largest anonymous RSS (the process's own memory, ``RssAnon``) sampled after each round, and where
the client states live.
"""
from __future__ import annotations

import argparse
import importlib.util
import resource
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fedcp_dist.state.process_memory import anon_rss_bytes  # noqa: E402
from fedcp_dist.config import load_config, merged_overrides  # noqa: E402
from fedcp_dist.runtime import init_runtime  # noqa: E402
from fedcp_dist.engine.simulator import Simulator  # noqa: E402


def _round_bench():
    spec = importlib.util.spec_from_file_location("bench_round", REPO / "bench" / "round.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--rounds", type=int, default=2, help="training rounds timed (default 2)")
    p.add_argument("--eval", action="store_true", help="first run round 1 with its evaluation of every client")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    overrides = merged_overrides(["checkpoint_every=0", f"eval_every={a.rounds + 2}"], a.overrides)
    cfg = load_config(a.config, overrides)
    t0 = time.perf_counter()
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout)
    tmp = None
    if not any(o.startswith("out_dir=") for o in a.overrides):  # a fresh folder, the same on every rank
        tmp = cfg.out_dir = _round_bench().shared_scratch(rt, "cohort-")
    try:
        sim = Simulator(cfg, rt, echo=lambda *_: None)
        startup = time.perf_counter() - t0
        rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        say = print if rt.is_main else (lambda *_: None)
        say(f"{cfg.method} on {sim.num_clients} clients, {rt.world_size} rank(s), rho={cfg.participation}; "
            f"{sim.store_line}; training: {sim.path}")
        rounds = ([0] if a.eval else []) + list(range(1, a.rounds + 1))
        anon = anon_rss_bytes() / 2**20
        for t in rounds:
            rec, _ = sim.round(t)
            anon = max(anon, anon_rss_bytes() / 2**20)
            say(f"round {t + 1}: {rec['participants']} participants, {rec['seconds']:.2f} s "
                f"(training {rec['train_seconds']:.2f} s, evaluation {rec['eval_seconds']:.2f} s)")
        sim._close(failed=False)  # the store's writes end, its folder, the writer and out_dir's lock are released
        if hasattr(sim.store, "dir"):  # a disk store's files are the benchmark's, never a checkpoint's: they go
            shutil.rmtree(sim.store.dir, ignore_errors=True)
            try:
                sim.store.dir.parent.rmdir()  # the run's folder above the ranks', once the last rank's is gone
            except OSError:
                pass
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        line = torch.tensor([startup, rss_start, rss, len(sim.owned), anon], dtype=torch.float64)
        rows = [line.clone() for _ in range(rt.world_size)]
        if rt.world_size > 1:
            import torch.distributed as dist
            dist.all_gather(rows, line)
        for r, row in enumerate(rows):
            s, m0, m, n, an = row.tolist()
            say(f"rank {r}: {int(n)} clients, start-up {s:.2f} s, peak RSS {m0:.0f} MiB after start-up, "
                f"{m:.0f} MiB at the end; anonymous RSS after a round at most {an:.0f} MiB")
    finally:
        if tmp is not None:
            rt.barrier()
            if rt.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        rt.close()


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
