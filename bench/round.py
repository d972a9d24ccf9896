"""Round benchmark: where a round's time goes, and how close training comes to the machine's peak.

    python bench/round.py                                     # MNIST, 20 clients, Dir(0.1), FedCP, 1 rank
    torchrun --nproc_per_node=2 bench/round.py threads=1      # the same on 2 ranks
    python bench/round.py --shard data/x.h5 method=fedavg rounds=3

It partitions the real MNIST files (``--mnist-root``, default ../shared/data/mnist, gzipped IDX files
are unpacked into a temporary folder) unless ``--shard`` names an existing partition, runs the
paper's setting (η = 0.005, B = 10, E = 1, λ = 5, evaluation every round) for ``--warmup`` rounds
and then ``rounds`` timed rounds on the launcher it was started under, and prints one table:

* seconds per round, split into local training, evaluation and aggregation (the all-reduce);
* client-samples per second per rank (local training);
* achieved GFLOP/s per rank in local training, from a FLOP count of one client's real local
  training (forward and backward, counted by torch's FlopCounterMode), against the same machine's
  float32 matrix-multiply peak measured in the same run (GFLOP/s per rank with its threads);
* bytes and seconds of the round's all-reduce;
* peak memory per rank (RSS on CPU, max allocated on CUDA).

The same figures go to ``--json`` (default bench/last.json) for comparison across commits.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedcp_dist.algorithms.base import Context  # noqa: E402
from fedcp_dist.config import load_config  # noqa: E402
from fedcp_dist.placement import STREAM_TRAIN, sample_cohort  # noqa: E402
from fedcp_dist.runtime import init_runtime  # noqa: E402
from fedcp_dist.simulator import Simulator  # noqa: E402


def matmul_peak_gflops(device, n=2048, repeats=5) -> float:
    """Best float32 GEMM rate of this rank with its threads."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def make_mnist_shard(root: Path, out: Path) -> None:
    raw = Path(tempfile.mkdtemp()) / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in root.glob("*-ubyte.gz"):
        with gzip.open(f) as src, open(raw / f.name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst)
    from fedcp_dist.cli.partition import main as partition

    partition(["--source", "mnist", "--root", str(raw.parents[1]), "--partition", "dir", "--beta", "0.1",
               "--num-clients", "20", "--seed", "1", "--out", str(out), "--force"])
    shutil.rmtree(raw.parents[1], ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard", help="an existing partition (default: MNIST Dir(0.1), 20 clients, made once)")
    p.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "data" / "mnist"))
    p.add_argument("--config", default=str(REPO / "configs" / "mnist_dir0.1_fedcp.yaml"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--startup-only", action="store_true",
                   help="measure start-up (placement + loading this rank's clients) and its memory, then stop")
    p.add_argument("--json", default=str(REPO / "bench" / "last.json"))
    p.add_argument("overrides", nargs="*", help="config overrides (default rounds=3)")
    args = p.parse_args(argv)

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    shard = Path(args.shard) if args.shard else REPO / "data" / "bench_mnist_dir0.1_n20.h5"
    if not shard.exists():
        if rank == 0:
            make_mnist_shard(Path(args.mnist_root), shard)
        else:
            while not shard.exists():
                time.sleep(0.5)
    out_dir = tempfile.mkdtemp(prefix="fedcp-bench-") if rank == 0 else "/nonexistent"
    overrides = ["rounds=3", *args.overrides]
    cfg = load_config(args.config, [f"data.path={shard}", "data.num_clients=0", "data.source=",
                                    "data.input_shape=null", "eval_every=1", "checkpoint_every=0",
                                    "overwrite=true", *overrides])
    timed = cfg.rounds
    cfg.rounds = timed + args.warmup
    rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout)
    cfg.out_dir = out_dir
    t_start = time.perf_counter()
    sim = Simulator(cfg, rt, echo=lambda *_: None)
    if args.startup_only:
        startup = time.perf_counter() - t_start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        held = sum(d.train_x.numel() + d.test_x.numel() for d in sim.data.values()) / 2**20
        print(f"rank {rt.rank}: {len(sim.owned)} of {sim.num_clients} clients, start-up {startup:.2f} s "
              f"(loading the shard {sim.load_seconds:.2f} s), {held:.1f} MiB of images held, peak RSS {rss:.0f} MiB",
              flush=True)
        rt.close()
        shutil.rmtree(out_dir, ignore_errors=True)
        return

    # FLOPs per trained and per evaluated sample, counted on this rank's largest client
    big = max(sim.owned, key=lambda c: sim.data[c].n_train)
    d = sim.data[big]
    train_flops = count_flops(lambda: sim.algo.local_train(sim.client_state(big), d, Context(0, big, sim._generator(STREAM_TRAIN, 0, big))))
    trained = cfg.local_epochs * (d.n_train - d.n_train % cfg.batch_size if cfg.drop_last and d.n_train >= cfg.batch_size else d.n_train)
    flops_per_train_sample = train_flops / trained
    peak = matmul_peak_gflops(rt.device)

    t0 = time.perf_counter()
    summary = sim.run()
    wall = time.perf_counter() - t0
    rounds = [r for r in sim.records if r["kind"] == "round"][args.warmup:]

    # this rank's trained samples per timed round
    def rank_samples(t):
        n = 0
        for c in sample_cohort(cfg.seed, t, sim.num_clients, cfg.participation, cfg.participation_range):
            if sim.owner[c] == rt.rank:
                m = sim.data[int(c)].n_train
                n += cfg.local_epochs * (m - m % cfg.batch_size if cfg.drop_last and m >= cfg.batch_size else m)
        return n

    samples = [rank_samples(r["round"] - 1) for r in rounds]
    train_s = [r["train_seconds"] for r in rounds]
    mem = (torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda"
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    mine = torch.tensor([float(np.sum(samples)), float(np.sum(train_s)), float(mem), peak], dtype=torch.float64)
    if rt.distributed:
        gathered = [torch.zeros_like(mine) for _ in range(rt.world_size)]
        dist.all_gather(gathered, mine.to(rt.device) if rt.backend == "nccl" else mine)
        per_rank = torch.stack([g.cpu() for g in gathered])
    else:
        per_rank = mine[None]
    rt.close()
    if rt.rank != 0:
        return
    mean = lambda k: float(np.mean([r[k] for r in rounds]))  # noqa: E731
    tot_samples = per_rank[:, 0].sum().item()
    res = {
        "setting": f"{summary['source']} {summary['num_clients']} clients, {cfg.method}, B={cfg.batch_size}, E={cfg.local_epochs}",
        "world_size": rt.world_size,
        "launcher": rt.launcher,
        "device": str(rt.device),
        "threads_per_rank": rt.threads,
        "timed_rounds": len(rounds),
        "seconds_per_round": mean("seconds"),
        "train_seconds": mean("train_seconds"),
        "eval_seconds": mean("eval_seconds"),
        "allreduce_seconds": mean("allreduce_seconds"),
        "allreduce_bytes": rounds[0]["allreduce_bytes"],
        "client_samples_per_s_per_rank": [float(a / b) for a, b in per_rank[:, :2].tolist()],
        # all ranks together: the slowest rank's training time bounds the round
        "client_samples_per_s_total": tot_samples / per_rank[:, 1].max().item(),
        "train_flops_per_sample": flops_per_train_sample,
        "train_gflops_per_rank": [float(a * flops_per_train_sample / b / 1e9) for a, b in per_rank[:, :2].tolist()],
        "matmul_peak_gflops_per_rank": per_rank[:, 3].tolist(),
        "peak_memory_mib_per_rank": (per_rank[:, 2] / 2**20).tolist(),
        "wall_seconds": wall,
    }
    res["train_fraction_of_peak"] = [g / pk for g, pk in zip(res["train_gflops_per_rank"], res["matmul_peak_gflops_per_rank"])]
    rows = [
        ("setting", res["setting"]),
        ("ranks", f"{rt.world_size} ({rt.launcher}, {rt.device}, {rt.threads} thread(s) each)"),
        ("seconds per round", f"{res['seconds_per_round']:.2f}  (mean of {len(rounds)} after {args.warmup} warm-up)"),
        ("  local training", f"{res['train_seconds']:.2f}"),
        ("  evaluation", f"{res['eval_seconds']:.2f}"),
        ("  aggregation (all-reduce)", f"{res['allreduce_seconds']:.4f} s, {res['allreduce_bytes'] / 2**20:.1f} MiB"),
        ("client-samples/s per rank", ", ".join(f"{v:.0f}" for v in res["client_samples_per_s_per_rank"])),
        ("client-samples/s, all ranks", f"{res['client_samples_per_s_total']:.0f}"),
        ("training FLOP per sample", f"{flops_per_train_sample / 1e6:.1f} MFLOP (forward + backward, counted)"),
        ("training GFLOP/s per rank", ", ".join(f"{v:.1f}" for v in res["train_gflops_per_rank"])),
        ("matmul peak GFLOP/s per rank", ", ".join(f"{v:.1f}" for v in res["matmul_peak_gflops_per_rank"])),
        ("training / peak", ", ".join(f"{100 * v:.1f} %" for v in res["train_fraction_of_peak"])),
        ("peak memory per rank", ", ".join(f"{v:.0f} MiB" for v in res["peak_memory_mib_per_rank"])),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
