"""Run the pairwise covering array of every method's options (tests/combinations.py) and print one
line per row: the row, its outcome (ran / refused / failed), its seconds and what it varies.

    python bench/combinations.py [--methods fedcp,fedavg] [--out DIR] [--json FILE] [--only-failed FILE]

Each row runs 1-2 rounds on a tiny digits shard (5 clients, 16x16) made in DIR; rows with ranks=2
under torchrun. The array's rows must end ``ran`` (finite accuracies in [0, 1]); the start-up
refusals ``refused``, in one line naming the key. Every pair of values the config refuses is checked
too (one line naming both keys) without running. Exit status 1 when a row ends otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import combinations as C  # noqa: E402


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="", help="comma-separated methods (default: all)")
    p.add_argument("--out", default="", help="working directory (default: a temporary one, removed)")
    p.add_argument("--json", default="", help="write every row's outcome to this JSON file")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m] or list(C.ALGORITHMS)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="combinations-"))
    work.mkdir(parents=True, exist_ok=True)
    shard = C.tiny_shard(work / "shard")
    t_start = time.time()
    results, bad = [], 0

    # the pairs (and values) the config refuses: one line naming both keys, no run needed
    for method in methods:
        for k, v, err in C.refused_singles(method):
            ok = C.single_refusal_ok(method, k, str(err))
            bad += not ok
            results.append({"method": method, "label": f"{method}:single", "row": {k: v}, "expected": "refused",
                            "kind": "refused" if ok else "failed", "detail": str(err), "seconds": 0.0})
        for pair, err in C.refused_pairs(method):
            named = C.names_keys(str(err), list(pair))
            ok = "\n" not in str(err) and C.refused_key(str(err)) in pair and len(named) == 2
            bad += not ok
            results.append({"method": method, "label": f"{method}:pair", "row": pair, "expected": "refused",
                            "kind": "refused" if ok else "failed", "detail": str(err), "seconds": 0.0})

    # the one-rank rows first (in this process, quick), then the two-rank rows (torchrun)
    todo = sorted(C.rows(methods), key=lambda r: r[2].get(C.RANKS, 1))
    print(f"{len(todo)} rows to run; {len(results)} refusals checked without running", flush=True)
    for n, (method, label, row, expected) in enumerate(todo):
        out = work / "runs" / label.replace(":", "_").replace("#", "_")
        shutil.rmtree(out, ignore_errors=True)
        o = C.run_row(method, row, shard, out)
        ok = o.kind == expected
        if ok and expected == "refused":
            ok = C.refused_key(o.detail) in row
        bad += not ok
        ranks = row.get(C.RANKS, 1)
        print(f"[{n + 1}/{len(todo)}] {label:14s} ranks={ranks} {o.kind:8s}{'' if ok else ' (UNEXPECTED)'} "
              f"{o.seconds:6.1f}s  {o.detail[:160]}  | {C.describe(row)}", flush=True)
        results.append({"method": method, "label": label, "row": C.varied(row), "expected": expected,
                        "kind": o.kind if ok else "failed", "detail": o.detail, "seconds": round(o.seconds, 2)})
        shutil.rmtree(out, ignore_errors=True)
        if args.json:  # as it goes: an interrupted run keeps what it did
            Path(args.json).write_text(json.dumps({"rows": results}, indent=1))

    run_rows = [r for r in results if r["label"].count("#") or r["label"].endswith(tuple(C.START_REFUSED))]
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        "machine": cpu_model(),
        "methods": methods,
        "rows_run": len(run_rows),
        "ran": sum(r["kind"] == "ran" for r in run_rows),
        "refused_at_start_up": sum(r["kind"] == "refused" for r in run_rows),
        "refusals_checked_without_running": len(results) - len(run_rows),
        "two_rank_rows": sum(1 for _, _, row, _ in todo if row.get(C.RANKS, 1) == 2),
        "failed": bad,
        "seconds": round(time.time() - t_start),
    }
    print(json.dumps(summary, indent=1))
    for r in results:
        if r["kind"] == "failed":
            print(f"FAILED {r['label']}: {r['detail'][:400]} | {json.dumps(r['row'])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": results}, indent=1))
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    sys.exit(cli_main(main)())
