"""Scale benchmark: real MNIST partitioned over thousands of clients, its shard and its loading.

    python bench/scale.py                                  # N = 1,000, 5,000, 10,000; iid, Dir(1.0)
    python bench/scale.py --clients 1000 --partitions iid  # a subset
    python bench/scale.py --world-sizes 1 2 8 16 --json scale.json

It reads the real MNIST files (``--mnist-root``: a folder of the gzipped IDX files, unpacked into
a temporary folder, or a torchvision root holding ``MNIST/raw/``; default ../shared/data/mnist,
looked for beside the checkout and one level further up, for worktrees) once, then for every
partition and client count N prints one row:

* ``partition s``: :func:`~fedcp_dist.data.partition.partition_clients` (the Dirichlet draws,
  any top-up, the train/test split), with its draws and the samples a top-up moved;
* ``write s`` and ``MB``: :func:`~fedcp_dist.data.shards.write_shard` of every client, and the
  file's size;
* ``info ms``: :func:`~fedcp_dist.data.shards.read_info`, what every rank does first (the best of
  three);
* ``digest s``: :func:`~fedcp_dist.data.shards.verify.content_digest`, the first rank's pass over
  the whole shard that a run's start verifies it with (one pass, no cache);
* for each world size P: ``load s`` and ``RSS MB`` of loading rank 0's clients (placed as a run
  places them, :func:`~fedcp_dist.state.placement.place_clients`) with
  :func:`~fedcp_dist.data.shards.load_clients`, each in a fresh process, so that the peak RSS is
  that load's; ``+MB`` is its peak minus the same process's peak just before loading.

``--source digits`` runs the same on the embedded digits (1,797 samples; for a quick check, with
fewer clients).  ``--json FILE`` also writes the figures there.

``--source synthetic`` measures what a run costs as the population grows at a fixed cohort
(FedProx's Synthetic(1, 1), generated here, no files needed)::

    python bench/scale.py --source synthetic --clients 100 1000 10000 --cohort 100 --methods fedavg fedcp ditto

For every N it writes the shard (``write s``, ``MB``) and, for every method, runs ``--rounds``
rounds in a fresh process (one rank, ``client_state: disk``, ``client_data`` following it, a
cohort of ``--cohort`` clients, ``eval_clients`` = the cohort, evaluating every round, no
checkpoints): ``start s`` (the run's time outside its rounds: start-up, with the shard's metadata, placement
and the store, then the final evaluation and closing),
``s/round`` (the median round, evaluation included), of which ``train s`` and ``eval s`` (medians),
``AR KiB`` (the all-reduce's size) and ``RSS MB``, the process's peak resident memory.
``--min-samples`` / ``--max-samples`` bound a client's samples (the benchmark's law is uncapped:
cohorts then differ by orders of magnitude in samples from one draw to the next). Flat columns as N grows are what a population-independent run looks like.
"""
from __future__ import annotations

import argparse
import gzip
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MNIST_CANDIDATES = (REPO.parent / "shared" / "data" / "mnist",
                    REPO.parents[1] / "shared" / "data" / "mnist")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB.

    Linux: VmHWM of /proc/self/status, the high-water mark of this program's memory; getrusage's
    ru_maxrss would also count the parent's memory at the fork that started this process.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux and BSDs


def mnist_root(folder: Path, scratch: Path) -> Path:
    """A torchvision root for ``folder``: itself if it holds MNIST/raw, else the gzipped files
    unpacked under ``scratch``."""
    if (folder / "MNIST" / "raw").is_dir():
        return folder
    gz = sorted(folder.glob("*-ubyte.gz"))
    if not gz:
        sys.exit(f"error: no MNIST files (*-ubyte.gz or MNIST/raw/) in {folder}; pass --mnist-root DIR (the "
                 f"gzipped IDX files, or a torchvision root holding MNIST/raw/), or --source digits")
    raw = scratch / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for f in gz:
        with gzip.open(f) as src, open(raw / f.name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst)
    return scratch


def load_rank(path: str, world_size: int) -> dict:
    """Load rank 0's clients of ``path`` for ``world_size`` ranks; run in a fresh process."""
    import numpy as np

    from fedcp_dist.data.shards import load_clients, read_info
    from fedcp_dist.state.placement import place_clients

    info = read_info(path)
    owned = np.flatnonzero(place_clients(info.train_counts, world_size) == 0)
    before = peak_rss_mb()
    start = time.perf_counter()
    clients = load_clients(path, owned)
    seconds = time.perf_counter() - start
    samples = sum(len(c["train_y"]) + len(c["test_y"]) for c in clients.values())
    return {"world_size": world_size, "clients": len(clients), "samples": samples,
            "seconds": seconds, "peak_rss_mb": peak_rss_mb(), "rss_before_mb": before}


def measure_load(path: Path, world_size: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--load", str(path),
           "--world-size", str(world_size)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.splitlines()[-1])


def measure(src, kind: str, num_clients: int, args, work: Path) -> dict:
    import numpy as np

    from fedcp_dist.data.partition import client_rows, partition_clients
    from fedcp_dist.data.shards import read_info, write_shard

    start = time.perf_counter()
    part = partition_clients(src.y, src.num_classes, kind, num_clients, args.seed, beta=args.beta)
    partition_s = time.perf_counter() - start
    params = {"train_ratio": 0.75, "batch_size": 10, **part.report.params()}
    if kind == "dir":
        params["beta"] = args.beta
    path = work / f"{src.name}_{kind}_n{num_clients}.h5"
    start = time.perf_counter()
    write_shard(path, client_rows(src.x, src.y, part.shares), source=src.name,
                num_classes=src.num_classes, input_shape=src.input_shape, mean=src.mean,
                std=src.std, partition=kind, partition_params=params, seed=args.seed)
    write_s = time.perf_counter() - start
    info_s = []
    for _ in range(3):
        start = time.perf_counter()
        info = read_info(path)
        info_s.append(time.perf_counter() - start)
    assert info.num_clients == num_clients
    from fedcp_dist.data.shards.verify import content_digest

    digest = content_digest(info)
    assert digest.fingerprint == info.fingerprint
    draws = part.report.draws
    row = {"source": src.name, "partition": kind, "num_clients": num_clients,
           "partition_seconds": partition_s, "draws": draws.draws if draws else None,
           "moved_samples": draws.moved_samples if draws else None,
           "smallest_client": part.report.smallest,
           "min_train": part.report.min_train, "min_test": part.report.min_test,
           "write_seconds": write_s, "file_mb": path.stat().st_size / 1e6,
           "read_info_seconds": min(info_s), "digest_seconds": digest.seconds,
           "loads": [measure_load(path, p) for p in args.world_sizes]}
    assert int(np.sum(info.train_counts + info.test_counts)) == len(src.y)
    if not args.keep:
        path.unlink()
    return row


def run_child(config: str, overrides: list) -> dict:
    """One run in this (fresh) process; its start-up time, round times and peak memory."""
    from fedcp_dist.config import load_config
    from fedcp_dist.engine.simulator import Simulator
    from fedcp_dist.runtime import init_runtime

    cfg = load_config(config, overrides)
    rt = init_runtime(cfg.device, cfg.threads, env={})
    start = time.perf_counter()
    try:
        Simulator(cfg, rt, echo=lambda *_: None).run()
    finally:
        rt.close()
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if r.get("kind") == "round"]
    final = next(r for r in lines if r.get("kind") == "final_eval")

    def median(key):
        values = sorted(r[key] for r in records)
        return values[len(values) // 2]

    return {"wall_seconds": wall, "round_seconds": median("seconds"), "train_seconds": median("train_seconds"),
            "eval_seconds": median("eval_seconds"), "allreduce_bytes": records[-1]["allreduce_bytes"],
            "rounds": len(records), "start_seconds": wall - sum(r["seconds"] for r in records),
            "peak_rss_mb": peak_rss_mb(), "final_acc": final["acc"]}


def measure_cohort(num_clients: int, args, work: Path) -> list:
    """Rows of ``--source synthetic``: the shard of ``num_clients`` clients written, then a short run
    of each method at the fixed cohort, each in a fresh process."""
    path = work / f"synthetic_n{num_clients}.h5"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedcp_dist.cli.partition", "--source", "synthetic", "--synthetic-alpha",
                    "1", "--synthetic-beta", "1", "--num-clients", str(num_clients), "--seed", str(args.seed),
                    "--synthetic-min-samples", str(args.min_samples),
                    *(["--synthetic-max-samples", str(args.max_samples)] if args.max_samples else []),
                    "--out", str(path), "--force"], check=True, capture_output=True, cwd=REPO)
    write_s = time.perf_counter() - start
    cohort = min(args.cohort, num_clients)
    rows = []
    for method in args.methods:
        out = work / f"run_{method}_n{num_clients}"
        overrides = [f"method={method}", f"data.path={path}", f"data.num_clients={num_clients}",
                     f"out_dir={out}", "overwrite=true", f"rounds={args.rounds}", "eval_every=1",
                     f"participation={cohort / num_clients!r}", f"eval_clients={cohort}", "client_state=disk",
                     "checkpoint_every=0", "threads=1", f"seed={args.seed}"]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run", str(REPO / "configs" / "synthetic_fedcp.yaml"),
               *overrides]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if res.returncode != 0:
            sys.exit(f"error: {method} on N={num_clients} failed: {res.stderr.strip()[-2000:]}")
        rows.append({"source": "synthetic(1,1)", "num_clients": num_clients, "cohort": cohort, "method": method,
                     "write_seconds": write_s, "file_mb": path.stat().st_size / 1e6,
                     **json.loads(res.stdout.splitlines()[-1])})
        shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        path.unlink()
    return rows


COHORT_HEADER = (f"{'method':<8} {'N':>7} {'cohort':>6} {'write s':>7} {'MB':>7} {'start s':>7} "
                 f"{'s/round':>7} {'train s':>7} {'eval s':>6} {'AR KiB':>6} {'RSS MB':>7} {'acc':>6}")


def cohort_row(r: dict) -> str:
    return (f"{r['method']:<8} {r['num_clients']:>7} {r['cohort']:>6} {r['write_seconds']:>7.2f} "
            f"{r['file_mb']:>7.1f} {r['start_seconds']:>7.2f} {r['round_seconds']:>7.3f} {r['train_seconds']:>7.3f} "
            f"{r['eval_seconds']:>6.3f} {r['allreduce_bytes'] / 1024:>6.0f} {r['peak_rss_mb']:>7.0f} "
            f"{r['final_acc']:>6.3f}")


def table_header(world_sizes) -> str:
    head = (f"{'partition':<9} {'N':>6} {'part s':>7} {'draws':>5} {'moved':>5} {'min':>4} "
            f"{'write s':>7} {'MB':>6} {'info ms':>7} {'digest s':>8}")
    for p in world_sizes:
        head += f" | P={p:<3} {'load s':>6} {'RSS MB':>6} {'+MB':>5}"
    return head


def table_row(r: dict) -> str:
    """One row of the table; under each P: rank 0's clients, load seconds, peak RSS, its rise."""
    def dash(v):
        return "-" if v is None else v

    line = (f"{r['partition']:<9} {r['num_clients']:>6} {r['partition_seconds']:>7.2f} "
            f"{dash(r['draws']):>5} {dash(r['moved_samples']):>5} {r['smallest_client']:>4} "
            f"{r['write_seconds']:>7.2f} {r['file_mb']:>6.1f} "
            f"{r['read_info_seconds'] * 1000:>7.1f} {r['digest_seconds']:>8.2f}")
    for load in r["loads"]:
        line += (f" | {load['clients']:>5} {load['seconds']:>6.2f} {load['peak_rss_mb']:>6.0f} "
                 f"{load['peak_rss_mb'] - load['rss_before_mb']:>5.0f}")
    return line


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default="mnist", choices=("mnist", "digits", "synthetic"))
    p.add_argument("--mnist-root", default=None,
                   help="gzipped MNIST IDX files, or a torchvision root with MNIST/raw/ "
                        "(default: ../shared/data/mnist)")
    p.add_argument("--clients", type=int, nargs="+", default=[1000, 5000, 10000])
    p.add_argument("--partitions", nargs="+", default=["iid", "dir"], choices=("iid", "dir"))
    p.add_argument("--beta", type=float, default=1.0, help="Dirichlet beta (default 1.0)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--work", help="folder for the shards (default: a temporary one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the shards in --work")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--load", help=argparse.SUPPRESS)  # child mode: load one rank's clients
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cohort", type=int, default=100, help="synthetic: clients a round (default 100)")
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedcp", "ditto"], help="synthetic: the methods run")
    p.add_argument("--rounds", type=int, default=3, help="synthetic: rounds of each run (default 3)")
    p.add_argument("--min-samples", type=int, default=50,
                   help="synthetic: the fewest samples of a client (default 50, the benchmark's)")
    p.add_argument("--max-samples", type=int, default=0,
                   help="synthetic: the most samples of a client (default 0: no cap, the benchmark's law)")
    p.add_argument("--run", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # child mode: one run
    args = p.parse_args(argv)
    if args.load:
        print(json.dumps(load_rank(args.load, args.world_size)))
        return
    if args.run:
        print(json.dumps(run_child(args.run[0], args.run[1:])))
        return

    from fedcp_dist.data.sources import load_source

    scratch = Path(tempfile.mkdtemp(prefix="fedcp-scale-"))
    work = Path(args.work) if args.work else scratch
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.source == "synthetic":
            print(f"Synthetic(1, 1), a cohort of {args.cohort} clients, {args.rounds} rounds per run, one rank, "
                  f"client_state=disk, each run in a fresh process", flush=True)
            print(COHORT_HEADER, flush=True)
            rows = []
            for n in args.clients:
                for row in measure_cohort(n, args, work):
                    rows.append(row)
                    print(cohort_row(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
            return
        if args.source == "mnist":
            folder = Path(args.mnist_root) if args.mnist_root else next(
                (c for c in MNIST_CANDIDATES if c.is_dir()), MNIST_CANDIDATES[0])
            src = load_source("mnist", root=str(mnist_root(folder, scratch / "root")))
        else:
            src = load_source("digits")
        print(f"{src.name}: {len(src.y)} samples; rank 0's clients per world size P, each load "
              f"in a fresh process", flush=True)
        print(table_header(args.world_sizes), flush=True)
        rows = []
        for kind in args.partitions:
            for n in args.clients:
                rows.append(measure(src, kind, n, args, work))
                print(table_row(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
