"""Round benchmark: where a round's time goes, and how close training comes to the machine's peak.

    python bench/round.py                                     # MNIST, 20 clients, Dir(0.1), FedCP, 1 rank
    torchrun --nproc_per_node=2 bench/round.py threads=1      # the same on 2 ranks
    python bench/round.py --shard data/x.h5 method=fedavg rounds=3
    python bench/round.py --fused                             # the same with fused=true
    python bench/round.py --sequential                        # the same with fused=false
    python bench/round.py --compare                           # sequential, then fused, in one run
    python bench/round.py --compare-amp                       # float32, then amp=bf16, in one run

Without ``--fused`` or ``--sequential`` the run trains as the engine would (``fused: auto`` unless
the config or an override says otherwise), so the default figures are those a user gets.

It partitions the real MNIST files (``--mnist-root``, default ../shared/data/mnist, gzipped IDX files
are unpacked into a temporary folder) unless ``--shard`` names an existing partition, runs the
paper's setting (η = 0.005, B = 10, E = 1, λ = 5, evaluation every round) for ``--warmup`` rounds
and then ``rounds`` timed rounds on the launcher it was started under, and prints one table:

* seconds per round, split into local training, evaluation and aggregation (the all-reduce);
* client-samples per second per rank (local training);
* achieved GFLOP/s per rank in local training, from a FLOP count of one client's real local
  training (forward and backward, counted by torch's FlopCounterMode), against the same machine's
  float32 matrix-multiply peak measured in the same run (GFLOP/s per rank with its threads);
* the round's FLOP floor: its useful work (the clients' local training as counted above, plus a
  forward pass of each client's personalized model per evaluated test sample, counted the same
  way) at the ranks' summed matmul peak, and how many times that the round took; the same at the
  bf16 matmul peak measured in the same run, with the units that run bf16 here (a GPU's tensor
  cores; a CPU's AMX-BF16 or AVX512-BF16, or none: emulated);
* on a CPU, the same rate and fraction per CPU-second of one thread (this process's CPU time in
  local training over its threads, against the GEMM's rate per CPU-second): on a machine shared
  with other work that is what compares variants fairly (use threads=1 there: with more threads
  the CPU time also counts their spin-waiting);
* with ``fused`` on a CPU rank of several threads, how many fused groups train side by side
  (config key ``fused_workers``, one thread each);
* the ranks' local steps (batches × epochs) when every client trains, how the clients were placed
  (config key ``placement``) and the imbalance max/mean steps per rank, for all clients and
  averaged over the timed rounds' cohorts;
* with ``fused``, the fused steps each rank takes when every client trains and how many of the
  slots are active a step on average (a step costs a fixed part plus a part per active client,
  ``bench/kernels.py --slot-scan``: unequal clients in a group leave the fixed part to few);
* bytes and seconds of the round's all-reduce;
* peak memory per rank (RSS on CPU, the process's peak so far, so with ``--compare`` the fused
  figure includes the sequential run's; max allocated on CUDA, per variant).

``--fused`` runs with ``fused=true`` (``--fused-group N`` sets ``fused_group``, 0 = auto: the slot cap
× ⌈1 / participation⌉; ``--fused-slots N`` overrides how many clients train at once, and so the auto group size); ``--compare`` runs the sequential
and the fused variant back to back in one invocation (same shard, same data on the device) and
adds their ratios, so that machines shared with other work still give a fair comparison. The
FLOP count is always that of the sequential local training, so GFLOP/s are useful work per
second for both variants.

The same figures go to ``--json`` (default bench/last.json) for comparison across commits.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedcp_dist.fused import groups as fused_groups  # noqa: E402
from fedcp_dist.fused import memory as fused_memory  # noqa: E402
from fedcp_dist.fused.slots import slot_occupancy  # noqa: E402
from fedcp_dist.algorithms.base import Context  # noqa: E402
from fedcp_dist.config import load_config, merged_overrides  # noqa: E402
from fedcp_dist.state.placement import STREAM_EVAL, STREAM_TRAIN, client_steps, imbalance, sample_cohort, steps_per_rank  # noqa: E402
from fedcp_dist.runtime import init_runtime  # noqa: E402
from fedcp_dist.engine.simulator import Simulator  # noqa: E402


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The processor as the benchmark tables name it: model name plus x86 family and model numbers
    (virtual machines often hide the generation behind a bare "AMD EPYC"; the family says it, e.g.
    25 for Zen 3/4 and 26 for Zen 5, whose convolutions and GEMMs reach different fractions of the
    same peak), or what ``platform`` knows where there is no /proc/cpuinfo."""
    import platform

    fields: dict = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine() or "?"
    name = fields.get("model name") or platform.processor() or platform.machine() or "?"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def matmul_peak_gflops(device, n=2048, repeats=5, clock=time.perf_counter, dtype=torch.float32) -> float:
    """Best ``dtype`` GEMM rate of this rank with its threads (per second of ``clock``)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, clock() - t0)
    return 2 * n**3 / best / 1e9


def bf16_units(device, cpuinfo: str = "/proc/cpuinfo") -> str:
    """What runs bf16 products here: a GPU's name and whether it has bf16 tensor cores (compute
    capability 8.0 and newer), or a CPU's bf16 instructions from its flags (amx_bf16, avx512_bf16;
    none: oneDNN emulates bf16 with float32 arithmetic, slower than float32 itself)."""
    if torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}: " + ("bf16 tensor cores" if major >= 8 else
                                                             f"no bf16 tensor cores (compute capability {major}.{minor})")
    flags: set = set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    units = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return ", ".join(units) if units else "none (bf16 is emulated: amp=bf16 runs slower than float32 here)"


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def make_mnist_shard(root: Path, out: Path) -> None:
    if not sorted(root.glob("*-ubyte.gz")):
        sys.exit(f"{Path(sys.argv[0]).name if sys.argv and sys.argv[0] else 'bench'}: no MNIST files (*-ubyte.gz) in "
                 f"{root}; pass --mnist-root DIR (a folder of "
                 f"the four gzipped IDX files) or --shard FILE (a partition made by fedcp-partition)")
    raw = Path(tempfile.mkdtemp()) / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in root.glob("*-ubyte.gz"):
        with gzip.open(f) as src, open(raw / f.name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst)
    from fedcp_dist.cli.partition import main as partition

    partition(["--source", "mnist", "--root", str(raw.parents[1]), "--partition", "dir", "--beta", "0.1",
               "--num-clients", "20", "--seed", "1", "--out", str(out), "--force"])
    shutil.rmtree(raw.parents[1], ignore_errors=True)


def shared_scratch(rt, prefix: str) -> str:
    """A fresh run folder every rank names alike (ranks must share ``out_dir``; the engine checks it
    at start-up): rank 0's random token, all-gathered, under ``data/bench-runs`` of the checkout,
    which the ranks of a multi-node job see as they see the checkout itself. Rank 0 makes it."""
    token = int(rt.all_gather(torch.tensor([random.getrandbits(62)], dtype=torch.int64, device=rt.device))[0, 0])
    path = REPO / "data" / "bench-runs" / f"{prefix}{token:x}"
    if rt.rank == 0:
        path.mkdir(parents=True)
    return str(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard", help="an existing partition (default: MNIST Dir(0.1), 20 clients, made once)")
    p.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "data" / "mnist"),
                   help="folder of the gzipped MNIST IDX files, used when --shard is not given or missing "
                        "(default: shared/data/mnist beside the checkout)")
    p.add_argument("--config", default=str(REPO / "configs" / "mnist_dir0.1_fedcp.yaml"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--startup-only", action="store_true",
                   help="measure start-up (placement + loading this rank's clients) and its memory, then stop")
    p.add_argument("--fused", action="store_true", help="train with fused=true (groups of clients at once)")
    p.add_argument("--sequential", action="store_true", help="train with fused=false (one client at a time)")
    p.add_argument("--compare", action="store_true", help="run the sequential and the fused variant back to back")
    p.add_argument("--compare-amp", action="store_true",
                   help="run float32 and then amp=bf16 back to back (the training path as chosen) and print the ratio")
    p.add_argument("--fused-group", type=int, default=0, help="fused_group: clients per group (0: auto, from the slot cap and participation)")
    p.add_argument("--fused-slots", type=int, default=0,
                   help="clients trained at once in a fused group (0: the memory plan, capped per device)")
    p.add_argument("--json", default=str(REPO / "bench" / "last.json"))
    p.add_argument("overrides", nargs="*", help="config overrides (default rounds=3)")
    args = p.parse_args(argv)
    if args.fused_slots:
        fused_memory.CPU_SLOTS = fused_memory.CUDA_SLOTS = args.fused_slots

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    shard = Path(args.shard) if args.shard else REPO / "data" / "bench_mnist_dir0.1_n20.h5"
    if not shard.exists():
        if rank == 0:
            make_mnist_shard(Path(args.mnist_root), shard)
        else:
            while not shard.exists():
                time.sleep(0.5)
    overrides = merged_overrides(["rounds=3"], args.overrides)

    if args.fused and args.sequential:
        p.error("--fused and --sequential exclude each other")

    if args.compare and args.compare_amp:
        p.error("--compare and --compare-amp exclude each other (one pair of variants a run)")

    def config(variant, out_dir: str):
        fused_on, amp = variant if isinstance(variant, tuple) else (variant, None)
        cfg = load_config(args.config, bench_overrides(shard, overrides, fused_on, args.fused_group)
                          + ([f"amp={amp}"] if amp else []))
        cfg.rounds = cfg.rounds + args.warmup
        cfg.out_dir = out_dir
        return cfg

    chosen = True if args.fused else False if args.sequential else None
    first = config(chosen, "/nonexistent")
    rt = init_runtime(first.device, first.threads, first.collective_timeout, keep_freed=first.keep_freed_memory)
    variants = ([False, True] if args.compare else [(chosen, "none"), (chosen, "bf16")] if args.compare_amp
                else [chosen])
    results, flops_per_train_sample, flops_per_test_sample = [], None, None
    for fused_on in variants:
        out_dir = shared_scratch(rt, "fedcp-bench-")
        cfg = config(fused_on, out_dir)
        t_start = time.perf_counter()
        sim = Simulator(cfg, rt, echo=lambda *_: None)
        if args.startup_only:
            startup = time.perf_counter() - t_start
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            held = sum(d.train_x.numel() + d.test_x.numel() for d in sim.data.values()) / 2**20
            print(f"rank {rt.rank}: {len(sim.owned)} of {sim.num_clients} clients, start-up {startup:.2f} s "
                  f"(loading the shard {sim.setup.load_seconds:.2f} s), {held:.1f} MiB of images held, peak RSS {rss:.0f} MiB",
                  flush=True)
            rt.barrier()
            if rt.rank == 0:
                shutil.rmtree(out_dir, ignore_errors=True)
            rt.close()
            return
        if flops_per_train_sample is None:
            flops_per_train_sample, flops_per_test_sample = flops_per_sample(sim, cfg, rt)
        results.append(measure(sim, cfg, rt, args.warmup, flops_per_train_sample, flops_per_test_sample))
        rt.barrier()  # every rank is done with the folder
        if rt.rank == 0:
            shutil.rmtree(out_dir, ignore_errors=True)
    rt.close()
    if rt.rank != 0:
        return
    for res in results:
        print_table(res, args.warmup)
    if args.compare_amp:
        f32, b16 = results
        out = {"float32": f32, "bf16": b16, "comparison": {
            "round_speedup": f32["seconds_per_round"] / b16["seconds_per_round"],
            "train_speedup": f32["train_seconds"] / b16["train_seconds"],
            "bf16_peak_over_float32_peak": [b / f for b, f in zip(b16["matmul_peak_bf16_gflops_per_rank"],
                                                                    b16["matmul_peak_gflops_per_rank"])]}}
        c = out["comparison"]
        print(f"amp=bf16 against float32 ({b16['bf16_units']}): local training {c['train_speedup']:.2f}x the speed, whole round "
              f"{c['round_speedup']:.2f}x; the matrix units' bf16 peak is "
              f"{', '.join(f'{v:.2f}x' for v in c['bf16_peak_over_float32_peak'])} their float32 peak")
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return
    out = results[0] if len(results) == 1 else {"sequential": results[0], "fused": results[1]}
    if len(results) == 2:
        seq, fus = results
        ratio = {
            "round_speedup": seq["seconds_per_round"] / fus["seconds_per_round"],
            "train_speedup": seq["train_seconds"] / fus["train_seconds"],
            "fraction_of_peak_sequential": seq["train_fraction_of_peak"],
            "fraction_of_peak_fused": fus["train_fraction_of_peak"],
        }
        if "train_fraction_of_peak_cpu_time" in seq:
            ratio["train_speedup_cpu_time"] = sum(seq["train_cpu_seconds_per_thread"]) / sum(fus["train_cpu_seconds_per_thread"])
            ratio["fraction_of_peak_cpu_time_sequential"] = seq["train_fraction_of_peak_cpu_time"]
            ratio["fraction_of_peak_cpu_time_fused"] = fus["train_fraction_of_peak_cpu_time"]
        out["comparison"] = ratio
        print(f"fused / sequential: local training {ratio['train_speedup']:.2f}x faster, "
              f"whole round {ratio['round_speedup']:.2f}x faster; training / peak "
              f"{', '.join(f'{100 * v:.1f} %' for v in seq['train_fraction_of_peak'])} -> "
              f"{', '.join(f'{100 * v:.1f} %' for v in fus['train_fraction_of_peak'])}")
        if "train_speedup_cpu_time" in ratio:
            print(f"per CPU-second: local training {ratio['train_speedup_cpu_time']:.2f}x faster; training / peak "
                  f"{', '.join(f'{100 * v:.1f} %' for v in ratio['fraction_of_peak_cpu_time_sequential'])} -> "
                  f"{', '.join(f'{100 * v:.1f} %' for v in ratio['fraction_of_peak_cpu_time_fused'])}")
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def bench_overrides(shard, overrides: list, fused_on: Optional[bool], fused_group: int) -> list:
    """The config overrides of one benchmarked variant: the shard, evaluation every round, no
    checkpoints, the user's ``overrides``, then fused=true/false where a variant is forced (None:
    the config's own ``fused``, by default ``auto``)."""
    out = [f"data.path={shard}", "data.num_clients=0", "data.source=", "data.input_shape=null", "eval_every=1",
           "checkpoint_every=0", "overwrite=true"]
    forced = [f"fused={'true' if fused_on else 'false'}"] if fused_on is not None else []
    return merged_overrides(out, overrides, forced + [f"fused_group={fused_group}"])


def flops_per_sample(sim, cfg, rt) -> tuple:
    """(FLOPs per trained sample, per evaluated test sample), counted on the first rank that holds
    clients (a rank may hold none: a fused group's clients stay together) and given to every rank."""
    mine = [train_flops_per_sample(sim, cfg), eval_flops_per_sample(sim, cfg)] if sim.owned else [-1.0, -1.0]
    every = rt.all_gather(torch.tensor(mine, dtype=torch.float64, device=rt.device)).cpu()
    first = next(r for r in range(every.shape[0]) if every[r, 0] >= 0)
    return float(every[first, 0]), float(every[first, 1])


def train_flops_per_sample(sim, cfg, batches: int = 8) -> float:
    """FLOPs per trained sample, counted on the sequential local training of this rank's largest
    client cut to its first ``batches`` full batches (every full batch costs the same)."""
    big = max(sim.owned, key=lambda c: sim.data[c].n_train)
    d = sim.data[big]
    m = min(d.n_train, batches * cfg.batch_size)
    cut = {"train_x": d.train_x[:m], "train_y": d.train_y[:m]}
    if getattr(d, "train_len", None) is not None:
        cut["train_len"] = d.train_len[:m]
    d = dataclasses.replace(d, **cut)
    train_flops = count_flops(lambda: sim.algo.local_train(sim.store.get(big), d, Context(0, big, sim.trainer.generator(STREAM_TRAIN, 0, big))))
    return train_flops / num_batches_samples(d.n_train, cfg)


def eval_flops_per_sample(sim, cfg, samples: int = 64) -> float:
    """FLOPs per evaluated test sample: the personalized model's forward pass (``predict``) on the
    first ``samples`` test samples of this rank's client with the most."""
    big = max(sim.owned, key=lambda c: sim.data[c].n_test)
    d = sim.data[big]
    m = min(d.n_test, samples)
    if m == 0:
        return 0.0
    ctx = Context(0, big, sim.trainer.generator(STREAM_EVAL, 0, big))
    with torch.no_grad():
        state = sim.algo.prepare_eval(sim.store.get(big), d, ctx)
        return count_flops(lambda: sim.algo.predict(state, d.test_batch(0, m)[0], ctx)) / m


def num_batches_samples(n: int, cfg) -> int:
    """Samples one client trains on in a round (epochs × its kept samples)."""
    return cfg.local_epochs * (n - n % cfg.batch_size if cfg.drop_last and n >= cfg.batch_size else n)


def measure(sim, cfg, rt, warmup: int, flops_per_train_sample: float, flops_per_test_sample: float) -> dict:
    """Run the simulator and return this variant's figures (all ranks gathered)."""
    peak = matmul_peak_gflops(rt.device)
    peak_bf16 = matmul_peak_gflops(rt.device, dtype=torch.bfloat16)
    on_cpu = rt.device.type == "cpu"
    # per CPU-second of one thread: CPU time over the threads
    peak_cpu = matmul_peak_gflops(rt.device, clock=lambda: time.process_time() / rt.threads) if on_cpu else None
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    t0 = time.perf_counter()
    summary = sim.run()
    wall = time.perf_counter() - t0
    rounds = [r for r in sim.records if r["kind"] == "round"][warmup:]

    # this rank's trained samples per timed round
    def rank_samples(t):
        n = 0
        for c in sample_cohort(cfg.seed, t, sim.num_clients, cfg.participation, cfg.participation_range,
                                   cfg.participation_draw):
            if sim.owner[c] == rt.rank:
                n += num_batches_samples(sim.data[int(c)].n_train, cfg)
        return n

    samples = [rank_samples(r["round"] - 1) for r in rounds]
    train_s = [r["train_seconds"] for r in rounds]
    train_cpu = sum(r["train_cpu_seconds"] for r in rounds) / rt.threads if on_cpu else float("nan")
    mem = (torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda"
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    test_samples = sum(sim.data[c].n_test for c in sim.owned)
    mine = torch.tensor([float(np.sum(samples)), float(np.sum(train_s)), float(mem), peak, train_cpu,
                         peak_cpu if on_cpu else float("nan"), float(test_samples), peak_bf16], dtype=torch.float64)
    if rt.distributed:
        gathered = [torch.zeros_like(mine) for _ in range(rt.world_size)]
        dist.all_gather(gathered, mine.to(rt.device) if rt.backend == "nccl" else mine)
        per_rank = torch.stack([g.cpu() for g in gathered])
    else:
        per_rank = mine[None]
    mean = lambda k: float(np.mean([r[k] for r in rounds]))  # noqa: E731
    tot_samples = per_rank[:, 0].sum().item()
    res = {
        "setting": (f"{summary['source']} {summary['num_clients']} clients, {cfg.method}, B={cfg.batch_size}, E={cfg.local_epochs}"
                    + (f", amp={cfg.amp}" if cfg.amp != "none" else "")),
        "fused": bool(sim.fused),
        "training": sim.path,
        "fused_slots": (fused_memory.CUDA_SLOTS if rt.device.type == "cuda" else fused_memory.CPU_SLOTS) if sim.fused else None,
        # fused groups side by side on this rank's threads (config key fused_workers)
        "fused_workers": (fused_groups.workers_for(cfg.fused_workers, rt.device, rt.threads, len(sim.setup.owned_groups(rt.rank)))
                          if sim.fused else None),
        "world_size": rt.world_size,
        "launcher": rt.launcher,
        "device": str(rt.device),
        # the vector instruction set torch's CPU kernels use here (the fraction of peak depends on it)
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
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
        **placement_figures(sim, cfg, rt, rounds),
    }
    # the round's useful work at the ranks' summed matmul peak: the floor no round can beat
    evaluations = sum("acc" in r for r in rounds) / len(rounds)
    round_flops = (tot_samples / len(rounds) * flops_per_train_sample
                   + evaluations * per_rank[:, 6].sum().item() * flops_per_test_sample)
    res["eval_flops_per_sample"] = flops_per_test_sample
    res["round_tflop"] = round_flops / 1e12
    res["flop_floor_seconds"] = round_flops / (per_rank[:, 3].sum().item() * 1e9)
    res["round_over_floor"] = res["seconds_per_round"] / res["flop_floor_seconds"]
    # the same floor at the bf16 peak: what amp=bf16 could at best reach on these units
    res["bf16_units"] = bf16_units(rt.device)
    res["matmul_peak_bf16_gflops_per_rank"] = per_rank[:, 7].tolist()
    res["flop_floor_bf16_seconds"] = round_flops / (per_rank[:, 7].sum().item() * 1e9)
    res["round_over_floor_bf16"] = res["seconds_per_round"] / res["flop_floor_bf16_seconds"]
    res["train_fraction_of_peak"] = [g / pk for g, pk in zip(res["train_gflops_per_rank"], res["matmul_peak_gflops_per_rank"])]
    if on_cpu:
        res["train_cpu_seconds_per_thread"] = (per_rank[:, 4] / len(rounds)).tolist()
        res["train_gflops_per_cpu_second"] = [float(a * flops_per_train_sample / c / 1e9) for a, c in per_rank[:, [0, 4]].tolist()]
        res["matmul_peak_gflops_per_cpu_second"] = per_rank[:, 5].tolist()
        res["train_fraction_of_peak_cpu_time"] = [g / pk for g, pk in zip(res["train_gflops_per_cpu_second"],
                                                                           res["matmul_peak_gflops_per_cpu_second"])]
    return res


def placement_figures(sim, cfg, rt, rounds) -> dict:
    """How the clients were placed (config key ``placement``) and the ranks' local steps: in a round
    in which every client trains, and in the timed rounds' cohorts (max/mean over the ranks; 1 is
    balanced). The same on every rank: a function of the config and the shard's counts."""
    steps = client_steps(sim.setup.info.train_counts[sim.setup.clients], cfg.batch_size, cfg.local_epochs, cfg.drop_last)
    per_round = []
    for r in rounds:
        cohort = sample_cohort(cfg.seed, r["round"] - 1, sim.num_clients, cfg.participation, cfg.participation_range,
                               cfg.participation_draw)
        per_round.append(imbalance(steps_per_rank(steps[cohort], sim.owner[cohort], rt.world_size)))
    out = {"placement": sim.setup.placement, "steps_per_rank": sim.setup.rank_steps.tolist(),
           "steps_imbalance": sim.setup.imbalance, "cohort_steps_imbalance": float(np.mean(per_round))}
    trainer = getattr(sim.trainer, "groups", None)
    if sim.fused and trainer is not None and trainer.slots is not None:
        out.update(fused_occupancy(sim, cfg, rt, steps, trainer.slots))
    return out


def fused_occupancy(sim, cfg, rt, steps, slots: int) -> dict:
    """The fused steps each rank takes in a round in which every client trains (a phase of
    ``local_epochs`` epochs) and the active slots per step on average: each of its groups (all of
    them as one on a device that trains a rank's groups jointly) scheduled as
    :func:`~fedcp_dist.fused.slots.slot_occupancy` says. A step costs a fixed part plus a part per
    active slot (``bench/kernels.py --slot-scan``), so few active slots a step mean the fixed part
    weighs more."""
    fused_steps, slot_steps = [], []
    for r in range(rt.world_size):
        groups = [list(g) for g in sim.setup.owned_groups(r)]
        if fused_groups.trains_jointly(cfg, rt.device) and len(groups) > 1:
            groups = [[c for g in groups for c in g]]
        occ = [k for g in groups for k in slot_occupancy([int(steps[c]) for c in g], slots)]
        fused_steps.append(len(occ))
        slot_steps.append(int(sum(occ)))
    return {"fused_steps_per_rank": fused_steps, "slot_steps_per_rank": slot_steps, "fused_step_slots": slots,
            "mean_active_slots_per_rank": [s / n if n else 0.0 for s, n in zip(slot_steps, fused_steps)]}


def print_table(res: dict, warmup: int) -> None:
    fused_row = f"{res['training']}, at most {res['fused_slots']} clients at once" if res["fused"] else res["training"]
    if res["fused"] and (res.get("fused_workers") or 1) > 1:
        fused_row += f" per worker, {res['fused_workers']} workers of 1 thread side by side"
    rows = [
        ("setting", res["setting"]),
        ("local training", fused_row),
        ("ranks", f"{res['world_size']} ({res['launcher']}, {res['device']}, {res['threads_per_rank']} thread(s) each)"),
        ("CPU", res.get("cpu_model", "?")),
        ("CPU instruction set", res.get("cpu_isa", "?")),
        ("steps per rank", f"{'/'.join(str(v) for v in res['steps_per_rank'])} (placed by {res['placement']}), max/mean "
                           f"{res['steps_imbalance']:.3f}; timed rounds' cohorts {res['cohort_steps_imbalance']:.3f}"),
    ]
    if "fused_steps_per_rank" in res:
        rows.append(("fused steps per rank", f"{'/'.join(str(v) for v in res['fused_steps_per_rank'])}, "
                                             f"{'/'.join(f'{v:.2f}' for v in res['mean_active_slots_per_rank'])} of "
                                             f"{res['fused_step_slots']} slots active a step on average"))
    rows += [
        ("seconds per round", f"{res['seconds_per_round']:.2f}  (mean of {res['timed_rounds']} after {warmup} warm-up)"),
        ("  local training", f"{res['train_seconds']:.2f}"),
        ("  evaluation", f"{res['eval_seconds']:.2f}"),
        ("  aggregation (all-reduce)", f"{res['allreduce_seconds']:.4f} s, {res['allreduce_bytes'] / 2**20:.1f} MiB"),
        ("client-samples/s per rank", ", ".join(f"{v:.0f}" for v in res["client_samples_per_s_per_rank"])),
        ("client-samples/s, all ranks", f"{res['client_samples_per_s_total']:.0f}"),
        ("training FLOP per sample", f"{res['train_flops_per_sample'] / 1e6:.1f} MFLOP (forward + backward, counted)"),
        ("training GFLOP/s per rank", ", ".join(f"{v:.1f}" for v in res["train_gflops_per_rank"])),
        ("matmul peak GFLOP/s per rank", ", ".join(f"{v:.1f}" for v in res["matmul_peak_gflops_per_rank"])),
        ("training / peak", ", ".join(f"{100 * v:.1f} %" for v in res["train_fraction_of_peak"])),
        ("FLOP floor of a round", f"{res['round_tflop']:.3f} TFLOP (training + {res['eval_flops_per_sample'] / 1e6:.1f} "
                                  f"MFLOP per evaluated test sample) at the ranks' summed peak = "
                                  f"{res['flop_floor_seconds']:.2f} s; the round took {res['round_over_floor']:.2f}x that"),
    ]
    if "train_fraction_of_peak_cpu_time" in res:
        rows += [
            ("  per CPU-second (thread)", ", ".join(
                f"{g:.1f} / {pk:.1f} GFLOP/s = {100 * f:.1f} %" for g, pk, f in zip(
                    res["train_gflops_per_cpu_second"], res["matmul_peak_gflops_per_cpu_second"],
                    res["train_fraction_of_peak_cpu_time"]))),
        ]
    rows += [
        ("bf16 units", res["bf16_units"]),
        ("bf16 matmul peak per rank", ", ".join(f"{v:.1f} GFLOP/s ({v / f:.2f}x float32)" for v, f in zip(
            res["matmul_peak_bf16_gflops_per_rank"], res["matmul_peak_gflops_per_rank"]))),
        ("FLOP floor at the bf16 peak", f"{res['flop_floor_bf16_seconds']:.2f} s; the round took "
                                        f"{res['round_over_floor_bf16']:.2f}x that"),
        ("peak memory per rank", ", ".join(f"{v:.0f} MiB" for v in res["peak_memory_mib_per_rank"])),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows), flush=True)


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
