"""A/B of the fused step between two source trees (or two precisions), interleaved in one process.

    git worktree add /tmp/before <commit>                       # the tree to compare against
    python bench/ab_step.py /tmp/before .                       # float32: before vs this tree
    python bench/ab_step.py /tmp/before . --amp bf16            # the same under amp=bf16
    python bench/ab_step.py . . --amp none,bf16                 # this tree: float32 vs amp=bf16

Each side imports its tree's ``fedcp_dist`` (and ``bench``) as its own set of modules; before each
call that side's modules are put back into ``sys.modules``, so the two versions' code never mixes.
A round is FedCP's real fused local training (the paper's η = 0.005, λ = 5, B = ``--batch``) of
``--slots`` synthetic clients with ``--steps`` full batches each, the MNIST CNN, one thread, freed
memory kept as the engine keeps it on a CPU. The rounds alternate A, B, B, A, ... for ``--pairs``
pairs and each is timed in this process's CPU time: on a machine shared with other work both sides
see the same load, so the median of the pairs' B/A ratios compares them fairly where absolute
seconds do not. Also says whether the two sides' results (all values the clients finish with,
losses included) are equal bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

_OWN = ("fedcp_dist", "bench")


def _side(tree: str, amp: str, slots: int, batch: int, steps: int):
    """(one_round, modules) of ``tree`` with ``amp``: a callable training one fused group, and the
    modules it was imported with."""
    for name in [n for n in sys.modules if n.split(".")[0] in _OWN]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(tree).resolve()))
    try:
        from bench.models import client
        from fedcp_dist.algorithms import make_algorithm
        from fedcp_dist.algorithms.base import Context
        from fedcp_dist.config import Config
        from fedcp_dist.fused.groups import train_group
        from fedcp_dist.models import build_model
    finally:
        sys.path.pop(0)
    shape, device = (1, 28, 28), torch.device("cpu")
    cfg = Config(lr=0.005, lam=5.0, batch_size=batch, fused="true", fused_workers=1, amp=amp)
    torch.manual_seed(0)
    algo = make_algorithm("fedcp", cfg, build_model("cnn", shape, 10), device)
    algo.num_clients = slots
    algo.set_global(algo.init_global_state())
    datas = [dataclasses.replace(client(shape, 10, 0, steps * batch, device, seed=c), cid=c) for c in range(slots)]

    def one_round():
        items = [(algo.init_client_state(c), datas[c], Context(1, c, torch.Generator().manual_seed(c)))
                 for c in range(slots)]
        return train_group(algo, items)

    return one_round, {n: m for n, m in sys.modules.items() if n.split(".")[0] in _OWN}


def flat_values(o) -> torch.Tensor:
    """Every tensor and number in ``o`` (nested lists, dicts, dataclasses), float64, in a fixed order."""
    out: list = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v.detach().to(torch.float64).flatten())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(torch.tensor([float(v)], dtype=torch.float64))

    walk(o)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def compare(tree_a: str, tree_b: str, amps=("none", "none"), pairs: int = 8, slots: int = 8, batch: int = 10,
            steps: int = 10, clock=time.process_time) -> dict:
    """Interleaved rounds of the two sides; seconds per step (``clock``) and the B/A ratios."""
    before = {n: m for n, m in sys.modules.items() if n.split(".")[0] in _OWN}
    try:
        return _compare(tree_a, tree_b, amps, pairs, slots, batch, steps, clock)
    finally:  # the caller's own modules back, whatever the sides imported
        for name in [n for n in sys.modules if n.split(".")[0] in _OWN]:
            del sys.modules[name]
        sys.modules.update(before)


def _compare(tree_a, tree_b, amps, pairs, slots, batch, steps, clock) -> dict:
    sides = [_side(t, a, slots, batch, steps) for t, a in zip((tree_a, tree_b), amps)]

    def run(i):
        fn, mods = sides[i]
        for name in [n for n in sys.modules if n.split(".")[0] in _OWN]:
            del sys.modules[name]
        sys.modules.update(mods)
        t0 = clock()
        out = fn()
        seconds = clock() - t0
        # modules imported on first use belong to this side too (a submodule import resolves
        # through its package, so it came from this side's tree)
        mods.update({n: m for n, m in sys.modules.items() if n.split(".")[0] in _OWN})
        return seconds / steps, out

    firsts = [run(i)[1] for i in (0, 1)]  # warm-up, and the results compared
    va, vb = flat_values(firsts[0]), flat_values(firsts[1])
    times: list = [[], []]
    for p in range(pairs):
        for i in ((0, 1) if p % 2 == 0 else (1, 0)):
            times[i].append(run(i)[0])
    ratios = [b / a for a, b in zip(*times)]
    return {"a": tree_a, "b": tree_b, "amp_a": amps[0], "amp_b": amps[1], "pairs": pairs, "slots": slots,
            "batch": batch, "steps": steps, "a_median_s_per_step": statistics.median(times[0]),
            "b_median_s_per_step": statistics.median(times[1]), "median_ratio_b_over_a": statistics.median(ratios),
            "ratios": ratios, "results_bit_identical": va.shape == vb.shape and bool(torch.equal(va, vb)),
            "values_compared": int(va.numel())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="source tree A (a repository checkout)")
    p.add_argument("b", help="source tree B")
    p.add_argument("--amp", default="none", help="none, bf16, or A's,B's (e.g. none,bf16)")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    amps = args.amp.split(",")
    for tree in (args.a, args.b):
        if not (Path(tree) / "fedcp_dist" / "__init__.py").is_file():
            p.error(f"{tree}: not a source tree (no fedcp_dist/__init__.py)")
    if len(amps) not in (1, 2) or any(a not in ("none", "bf16") for a in amps):
        p.error(f"--amp {args.amp}: none, bf16, or two of them separated by a comma")
    if min(args.pairs, args.slots, args.batch, args.steps) < 1:
        p.error("--pairs, --slots, --batch and --steps must be at least 1")
    torch.set_num_threads(1)
    from fedcp_dist.runtime import keep_freed_memory

    keep_freed_memory("auto", torch.device("cpu"))
    res = compare(args.a, args.b, (amps[0], amps[-1]), args.pairs, args.slots, args.batch, args.steps)
    print(f"A {res['a']} (amp={res['amp_a']}): {1e3 * res['a_median_s_per_step']:.2f} ms a step (median, CPU time)")
    print(f"B {res['b']} (amp={res['amp_b']}): {1e3 * res['b_median_s_per_step']:.2f} ms a step (median, CPU time)")
    print(f"B/A: {res['median_ratio_b_over_a']:.3f} (median of {res['pairs']} interleaved pairs); results "
          f"{'bit-identical' if res['results_bit_identical'] else 'differ'} ({res['values_compared']} values)")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
