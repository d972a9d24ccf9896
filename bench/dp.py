"""DP benchmark: what ``dp: central`` costs a round on the default (fused) path, against the same
round without it, measured in the same run.

    python bench/dp.py                                        # MNIST, 20 clients, Dir(0.1), FedCP, 1 rank
    torchrun --nproc_per_node=2 bench/dp.py threads=1         # the same on 2 ranks
    python bench/dp.py --shard data/x.h5 --config configs/digits_fedcp.yaml method=fedavg
    python bench/dp.py participation=0.5 --dp dp_clip=adaptive   # --dp: the DP variant's own keys

It runs the config (the paper's MNIST setting by default, partitioned from ``--mnist-root`` as
bench/round.py does) as the engine would (``fused: auto`` unless an override says otherwise) without
DP and with ``dp: central`` (``--dp``: the DP variant's keys, default a fixed clip of 0.1 and noise
multiplier 1), alternating the two ``--repeats`` times in one process on the same shard (so a
machine shared with other work slows both alike), each for ``--warmup`` rounds and then ``rounds``
timed ones (evaluation every round, no checkpoints), and prints one table: seconds per round, local
training (where the per-client clip happens), evaluation and the all-reduce's own time (the noise
comes after it, inside the round), each the mean over the timed rounds of every repeat, and the DP /
no-DP ratios; then the DP work alone on the run's shapes (one client's clip, the server's noise on a
round's sum), which a busy machine blurs less than the round's ratio. The target is a round at most
1.1x as long. The figures go to ``--json`` (default bench/last_dp.json).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedcp_dist.config import load_config, merged_overrides  # noqa: E402
from fedcp_dist.runtime import init_runtime  # noqa: E402
from fedcp_dist.engine.simulator import Simulator  # noqa: E402

#: the DP variant's keys unless --dp says otherwise
DEFAULT_DP = ("dp=central", "dp_clip=0.1", "dp_noise_multiplier=1.0")
#: the figures of a variant: the means over its timed rounds
FIGURES = ("seconds", "train_seconds", "eval_seconds", "allreduce_seconds")


def _round_bench():
    spec = importlib.util.spec_from_file_location("bench_round", REPO / "bench" / "round.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variant_overrides(shard, overrides: list, dp: list) -> list:
    """One variant's overrides: the shard, evaluation every round, no checkpoints, the user's
    ``overrides``, then the DP keys (none for the variant without)."""
    return merged_overrides([f"data.path={shard}", "data.num_clients=0", "data.source=", "data.input_shape=null",
                             "eval_every=1", "checkpoint_every=0", "overwrite=true"], overrides, dp)


def timed_means(records: list, warmup: int) -> dict:
    """The mean of each of :data:`FIGURES` over the round records after the first ``warmup``."""
    rounds = [r for r in records if r.get("kind") == "round"][warmup:]
    return {k: float(np.mean([r[k] for r in rounds])) for k in FIGURES}


def ratios(base: dict, dp: dict) -> dict:
    """DP / no-DP of each figure."""
    return {k: dp[k] / base[k] if base[k] > 0 else float("nan") for k in FIGURES}


def dp_work_seconds(sim, repeats: int = 20) -> dict:
    """The DP work alone, timed on the run's real shapes (median of ``repeats``): one client's clip
    (its delta over every uploaded tensor, one norm) and the server's noise on a round's whole sum."""
    import torch

    from fedcp_dist.state.placement import STREAM_DP_NOISE
    from fedcp_dist.comm.privacy import add_noise_

    gs = sim.store.global_state
    keys = list(sim.agg.names)
    g = torch.Generator(device=sim.rt.device).manual_seed(0)
    upload = {k: gs[k] + 0.01 * torch.randn(gs[k].shape, generator=g, device=gs[k].device) for k in keys}
    values = torch.zeros(sim.agg.num_params, dtype=torch.float64, device=sim.rt.device)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            if sim.rt.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if sim.rt.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    return {"clip_seconds_per_client": timed(lambda: sim.dp.client_upload(upload, gs, keys, sim.compressor, None)),
            "noise_seconds_per_round": timed(lambda: add_noise_(values, 1.0, 1, STREAM_DP_NOISE, 0)),
            "values": sim.agg.num_params}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard", help="an existing partition (default: MNIST Dir(0.1), 20 clients, made once)")
    p.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "data" / "mnist"),
                   help="folder of the gzipped MNIST IDX files, used when --shard is not given or missing")
    p.add_argument("--config", default=str(REPO / "configs" / "mnist_dir0.1_fedcp.yaml"))
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds at the start of each variant (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="times each variant runs, alternating (default 2)")
    p.add_argument("--dp", nargs="*", default=list(DEFAULT_DP), help="the DP variant's keys "
                   f"(default: {' '.join(DEFAULT_DP)}); dp=central is added when missing")
    p.add_argument("--json", default=str(REPO / "bench" / "last_dp.json"))
    p.add_argument("overrides", nargs="*", help="config overrides of both variants (default rounds=3)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    dp = [*args.dp] if any(a.startswith("dp=") for a in args.dp) else ["dp=central", *args.dp]

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    shard = Path(args.shard) if args.shard else REPO / "data" / "bench_mnist_dir0.1_n20.h5"
    if not shard.exists():
        if rank == 0:
            _round_bench().make_mnist_shard(Path(args.mnist_root), shard)
        else:
            while not shard.exists():
                time.sleep(0.5)
    overrides = merged_overrides(["rounds=3"], args.overrides)

    def config(keys: list, out_dir: str):
        cfg = load_config(args.config, variant_overrides(shard, overrides, keys))
        cfg.rounds += args.warmup
        cfg.out_dir = out_dir
        return cfg

    first = config([], "/nonexistent")
    rt = init_runtime(first.device, first.threads, first.collective_timeout, keep_freed=first.keep_freed_memory)
    bench = _round_bench()
    runs = {"no DP": [], "DP": []}
    lines = {}
    for _ in range(args.repeats):
        for name, keys in (("no DP", []), ("DP", dp)):
            out_dir = bench.shared_scratch(rt, "fedcp-bench-dp-")
            sim = Simulator(config(keys, out_dir), rt, echo=lambda line, n=name: lines.setdefault(n, line))
            sim.run()
            runs[name].append(timed_means(sim.records, args.warmup))
            lines.setdefault(f"{name} path", sim.path)
            if name == "DP":
                work = dp_work_seconds(sim)
            rt.barrier()
            if rt.rank == 0:
                shutil.rmtree(out_dir, ignore_errors=True)
    rt.close()
    if rt.rank != 0:
        return
    means = {name: {k: float(np.mean([r[k] for r in rs])) for k in FIGURES} for name, rs in runs.items()}
    ratio = ratios(means["no DP"], means["DP"])
    rows = [("setting", f"{first.method} on {shard.name}, {rt.world_size} rank(s) × {rt.threads} thread(s), "
                        f"{rt.device}; rounds={first.rounds - args.warmup} timed after {args.warmup} warm-up, "
                        f"{args.repeats} repeats"),
            ("CPU", bench.cpu_model()),
            ("training path", f"{lines.get('no DP path')} / DP: {lines.get('DP path')}"),
            ("DP keys", " ".join(dp))]
    for k in FIGURES:
        rows.append((k.replace("_", " "), f"{means['no DP'][k]:.4f} s → {means['DP'][k]:.4f} s  "
                                          f"(DP / no DP {ratio[k]:.3f}x)"))
    verdict = "within" if ratio["seconds"] <= 1.1 else "above"
    rows.append(("round", f"{ratio['seconds']:.3f}x, {verdict} the 1.1x target"))
    rows.append(("DP work alone", f"{1e3 * work['clip_seconds_per_client']:.2f} ms per client (clip), "
                                  f"{1e3 * work['noise_seconds_per_round']:.2f} ms per round (noise on "
                                  f"{work['values']:,} values)"))
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows), flush=True)
    Path(args.json).write_text(json.dumps({"dp": dp, "overrides": overrides, "warmup": args.warmup,
                                           "repeats": args.repeats, "world_size": rt.world_size,
                                           "threads": rt.threads, "device": str(rt.device),
                                           "cpu_model": bench.cpu_model(), "means": means, "ratio": ratio,
                                           "dp_work": work, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)(sys.argv[1:])
