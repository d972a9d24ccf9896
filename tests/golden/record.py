"""Digests of every method's trajectory on the digits shard: the reference a refactor must keep.

    python tests/golden/record.py --out tests/golden/digests.json              # record, 1 rank
    torchrun --standalone --nproc_per_node=2 tests/golden/record.py --out ...  # record, 2 ranks
    python tests/golden/record.py --check tests/golden/digests.json --cases fedcp fedavg   # compare
    python tests/golden/record.py --out tests/golden/digests.json --cases mymethod         # add a case

Every registered method is a case (its preset, configs/digits_<method>.yaml, as it is); recording
some cases into an existing file keeps the others, on the machine kind the file was recorded on.

Each case runs ROUNDS rounds of a ``configs/digits_<method>.yaml`` config (plus the case's
overrides) in this process on the embedded digits partition (20 clients, Dir(0.1), seed 1),
evaluating every round and checkpointing after round 1. The digests were recorded when clients
trained one by one by default: every case pins ``fused=false`` (the default is now ``auto``), and
the ``-fused`` cases override it with ``fused=true`` and keep the placement by samples
(``placement=samples``) that every run had then. Its digest covers the final global state,
every client's persistent state in that checkpoint (all ranks' parts), the metric records without
their timings (and byte counts, ACCOUNTING), and the summary without them: SHA-256 over the exact bytes and float reprs.
The file also records the machine it was made on (torch version, CPU capability and model): float results
are bit-identical only on the same kind of machine and thread count. Recorded again on an Intel Xeon
(AVX-512) when fused groups became fixed by the configuration (the two ``-fused`` cases changed by
float rounding, their accuracies did not; every other case equals what the code before that change
gave on this machine, bit for bit), and on an AMD EPYC (AVX2) when the automatic groups became a
power-of-two number dealt to equal weight (again only the two ``-fused`` cases changed, with the
same accuracies; the other 23 equal the previous code's results on that machine), each time with
the 2-rank cases equal to the 1-rank ones.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the package of this checkout

from fedcp_dist.algorithms import ALGORITHMS  # noqa: E402
ROUNDS = 2
#: record keys that measure time (or depend on the buffer layout), left out of the digest
UNSTABLE = ("seconds", "train_seconds", "train_cpu_seconds", "eval_seconds", "allreduce_seconds",
            "allreduce_bytes", "peer_exchange_seconds", "seconds_per_round", "load_seconds",
            "launcher", "world_size", "device")
#: the byte counts every averaging run records (fedcp_dist.comm.compress.uplink_record): added after the
#: digests were recorded, a function of the config and the cohort (tests/test_compress.py), left out
ACCOUNTING = ("uplink_bytes", "uplink_bytes_dense", "downlink_bytes", "downlink_bytes_dense")
#: what the summary says of the data it ran on (added after the digests were recorded; it names the
#: shard, it is not a result), left out
PROVENANCE = ("data_fingerprint",)
#: how many evaluated clients had trained (partial participation): added after the digests were
#: recorded, a function of the config and the cohorts (tests/test_trained_count.py), left out
COHORT_COUNTS = ("eval_clients_trained", "final_eval_clients_trained")
#: every registered method, in the registry's order
METHODS = tuple(ALGORITHMS)
CASES = {
    **{m: (m, []) for m in METHODS},
    "fedcp-fused": ("fedcp", ["fused=true", "placement=samples"]),
    "fedavg-fused": ("fedavg", ["fused=true", "placement=samples"]),
    "fedcp-rho0.5": ("fedcp", ["participation=0.5"]),
    "fedavg-rho-range": ("fedavg", ["participation_range=[0.3, 0.8]"]),
    "fedcp-eval-gumbel": ("fedcp", ["cpn_eval_gumbel=true"]),
    "fedcp-cpn-sample": ("fedcp", ["cpn_input=sample"]),
    "fedcp-cpn-2bn": ("fedcp", ["cpn_layers=2", "cpn_norm=batchnorm", "cpn_act=tanh"]),
    "fedcp-no-cpn": ("fedcp", ["fedcp_cpn=false"]),
    "fedcp-no-gfm": ("fedcp", ["fedcp_gfm=false"]),
    "fedcp-lam0": ("fedcp", ["lam=0"]),
    "fedavg-bf16": ("fedavg", ["amp=bf16"]),
    "fedprox-mu0": ("fedprox", ["prox_mu=0"]),
    "fedrep-e2": ("fedrep", ["local_epochs=2", "fedrep_head_epochs=2"]),
}


def _tensor_digest(h, state: dict) -> None:
    import torch

    for k in sorted(state, key=str):
        t = state[k]
        h.update(str(k).encode())
        if isinstance(t, dict):
            _tensor_digest(h, t)
            continue
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(state[k].shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo): two processors of one instruction set (AVX-512 on an
    Intel Xeon and on an AMD EPYC) can still round differently in their math libraries."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def fingerprint() -> dict:
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_model": cpu_model(), "threads": 1}


def digest_run(out: Path) -> dict:
    import torch

    g = hashlib.sha256()
    _tensor_digest(g, torch.load(out / "final_global.pt", weights_only=True))
    ck = out / "checkpoints" / "round_0000001"
    clients = {}
    for part in sorted(ck.glob("clients_*.pt")):
        clients.update(torch.load(part, weights_only=True)["clients"])
    c = hashlib.sha256()
    _tensor_digest(c, {int(k): v for k, v in clients.items()})
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [{k: v for k, v in r.items() if k not in UNSTABLE + ACCOUNTING + COHORT_COUNTS} for r in records]
    summary = {k: v for k, v in json.loads((out / "summary.json").read_text()).items()
               if k not in UNSTABLE + ACCOUNTING + PROVENANCE + COHORT_COUNTS}
    return {"global": g.hexdigest(), "clients": c.hexdigest(), "metrics": _sha(records), "summary": _sha(summary),
            "final_acc": summary["final_acc"], "best_acc": summary["best_acc"]}


def run_case(rt, shard: str, name: str, work: Path) -> dict:
    from fedcp_dist.config import load_config
    from fedcp_dist.engine.simulator import Simulator

    method, extra = CASES[name]
    out = work / name
    cfg = load_config(str(REPO / "configs" / f"digits_{method}.yaml"), [
        f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=1", "keep_checkpoints=5", "threads=1",
        f"data.path={shard}", f"out_dir={out}", "overwrite=true", "fused=false", *extra])
    Simulator(cfg, rt, echo=lambda *_: None).run()
    rt.barrier()
    return digest_run(out) if rt.is_main else {}


#: on another kind of machine (CPU capability, torch) float results differ by rounding: then the
#: accuracies must agree within this much instead of the digests bit for bit
ACC_TOLERANCE = 0.02


def differences(want: dict, got: dict, exact: bool) -> list:
    """What differs between a recorded case and a new run of it (empty: nothing)."""
    if exact:
        return [k for k in ("global", "clients", "metrics", "summary") if want[k] != got[k]]
    return [k for k in ("final_acc", "best_acc") if abs(want[k] - got[k]) > ACC_TOLERANCE]


def compare(recorded: dict, world_size: int, results: dict) -> list:
    """The cases whose digests differ from ``recorded`` (printed, with what differs)."""
    exact = recorded.get("fingerprint") == fingerprint()
    if not exact:
        print(f"note: recorded on {recorded.get('fingerprint')}, this machine is {fingerprint()}: "
              f"comparing accuracies within {ACC_TOLERANCE} instead of digests")
    differ = []
    for name, got in results.items():
        want = recorded["world_sizes"].get(str(world_size), {}).get(name)
        if want is None:
            print(f"{name}: not recorded")
            continue
        parts = differences(want, got, exact)
        if parts:
            differ.append(name)
            print(f"{name}: DIFFERS ({', '.join(parts)}): final acc {want['final_acc']:.4f} -> {got['final_acc']:.4f}")
    print(f"{len(results) - len(differ)} of {len(results)} cases {'bit-identical' if exact else 'within tolerance'} "
          f"on {world_size} rank(s)")
    return differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write (rank 0)")
    p.add_argument("--cases", nargs="*", default=list(CASES), help="case names (default: all)")
    p.add_argument("--shard", help="the digits shard (default: partition it into a temporary directory)")
    p.add_argument("--check", metavar="DIGESTS", help="compare with this digests file instead of writing --out; "
                   "exit 1 when any case differs")
    args = p.parse_args(argv)
    if not args.out and not args.check:
        p.error("give --out (record) or --check (compare)")
    import torch

    from fedcp_dist.runtime import init_runtime

    torch.set_num_threads(1)
    rt = init_runtime("cpu", 1)
    shard = args.shard
    if shard is None:
        # rank 0 partitions into a path every rank derives alike (the launcher's pid), then all read it
        tmp = Path(os.environ.get("FEDCP_GOLDEN_TMP", tempfile.gettempdir())) / f"golden-digits-{os.getppid()}.h5"
        if rt.is_main:
            from fedcp_dist.data.make import PartitionSpec, make_shard

            make_shard(PartitionSpec(source="digits", partition="dir", beta=0.1, num_clients=20, seed=1), tmp,
                       force=True, say=lambda *_: None)
        rt.barrier()
        shard = str(tmp)
    work_dir = Path(tempfile.gettempdir()) / f"golden-runs-{os.getppid()}"
    results = {}
    for name in args.cases:
        results[name] = run_case(rt, shard, name, work_dir)
        if rt.is_main:
            print(f"{name}: {results[name]['final_acc']:.4f} {results[name]['global'][:12]}", flush=True)
    if rt.is_main and args.check:
        differ = compare(json.loads(Path(args.check).read_text()), rt.world_size, results)
        rt.close()
        return 1 if differ else 0
    if rt.is_main:
        out = Path(args.out)
        data = json.loads(out.read_text()) if out.exists() else {}
        cases = data.get("world_sizes", {}).get(str(rt.world_size), {})
        if data.get("fingerprint", fingerprint()) != fingerprint() and set(cases) - set(results):
            print(f"{out} was recorded on {data['fingerprint']}, this machine is {fingerprint()}: record every case "
                  f"here (no --cases) or add this one on that kind of machine", file=sys.stderr)
            rt.close()
            return 2
        data["fingerprint"] = fingerprint()
        data.setdefault("world_sizes", {})[str(rt.world_size)] = {**cases, **results}
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
