"""Summary of a soak run: the first and the last rounds of a run directory side by side.

    python bench/soak.py runs/soak_digits_fedcp [--window 100]

Reads ``RUN_DIR/metrics.jsonl`` (a run made with ``record_memory=true`` has rank 0's resident
memory in each round's record) and the checkpoints kept under ``RUN_DIR/checkpoints``, and prints,
for the first and the last ``--window`` rounds recorded: the median and the mean seconds per round
(all rounds, and the rounds without an evaluation), the median training seconds (wall and rank 0's
CPU: on a loaded machine the CPU seconds are the steadier measure), the resident
memory (median and largest), the peak resident memory at the window's end, and the MiB of client
state held in memory; then the kept checkpoints' sizes (what a run keeps grows only by its round
records). Medians, because seconds per round on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def round_records(run_dir: Path) -> list:
    """The run's round records, one per round (a resumed run's repeated rounds: the last kept)."""
    from fedcp_dist.errors import UserError

    by_round = {}
    path = run_dir / "metrics.jsonl"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror}): give the folder of a run (its out_dir)") from None
    for line in text.splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a stop: the rounds before it still count
            if rec.get("kind") == "round":
                by_round[rec["round"]] = rec
    return [by_round[r] for r in sorted(by_round)]


def window_summary(records: list) -> dict:
    """The numbers of one window of round records."""
    secs = [r["seconds"] for r in records]
    plain = [r["seconds"] for r in records if "evaluated_after" not in r]
    out = {"rounds": f"{records[0]['round']}-{records[-1]['round']}", "n": len(records),
           "median_s": statistics.median(secs), "mean_s": statistics.fmean(secs),
           "median_s_no_eval": statistics.median(plain) if plain else float("nan"),
           "median_train_s": statistics.median(r["train_seconds"] for r in records)}
    if all("train_cpu_seconds" in r for r in records):  # what load on a shared machine inflates least
        out["median_train_cpu_s"] = statistics.median(r["train_cpu_seconds"] for r in records)
    if all("rss_mb" in r for r in records):
        rss = [r["rss_mb"] for r in records]
        out.update(median_rss_mb=statistics.median(rss), max_rss_mb=max(rss), peak_rss_mb=records[-1]["peak_rss_mb"],
                   held_mb=statistics.median(r["client_state_held_mb"] for r in records))
    if all("rss_anon_mb" in r for r in records):
        out["median_rss_anon_mb"] = statistics.median(r["rss_anon_mb"] for r in records)
    return out


def checkpoint_sizes(run_dir: Path) -> list:
    """[(round, bytes of its files, bytes of global.pt)] of the checkpoints kept (a disk store's
    client files included, those linked from an older checkpoint too)."""
    out = []
    for d in sorted((run_dir / "checkpoints").glob("round_*")):
        files = [p for p in d.rglob("*") if p.is_file()]
        glob = d / "global.pt"
        out.append((int(d.name.split("_")[1]), sum(p.stat().st_size for p in files),
                    glob.stat().st_size if glob.exists() else 0))
    return out


def summarise(run_dir: Path, window: int = 100) -> dict:
    recs = round_records(run_dir)
    if not recs:
        raise SystemExit(f"error: {run_dir / 'metrics.jsonl'} holds no round records")
    first, last = recs[:window], recs[-window:]
    return {"rounds_done": recs[-1]["round"], "first": window_summary(first), "last": window_summary(last),
            "checkpoints": checkpoint_sizes(run_dir)}


def format_summary(s: dict) -> str:
    keys = [("rounds", "rounds", "{}"), ("median_s", "median s/round", "{:.3f}"), ("mean_s", "mean s/round", "{:.3f}"),
            ("median_s_no_eval", "median s/round, no eval", "{:.3f}"), ("median_train_s", "median train s", "{:.3f}"),
            ("median_train_cpu_s", "median train CPU s", "{:.3f}"),
            ("median_rss_mb", "median RSS MiB (rank 0)", "{:.1f}"),
            ("median_rss_anon_mb", "median anonymous RSS MiB", "{:.1f}"), ("max_rss_mb", "max RSS MiB", "{:.1f}"),
            ("peak_rss_mb", "peak RSS MiB at end", "{:.1f}"), ("held_mb", "client state held MiB", "{:.3f}")]
    lines = [f"rounds done: {s['rounds_done']}", f"{'':26s} {'first':>12s} {'last':>12s}"]
    for key, label, fmt in keys:
        if key in s["first"] and key in s["last"]:
            lines.append(f"{label:26s} {fmt.format(s['first'][key]):>12s} {fmt.format(s['last'][key]):>12s}")
    for rnd, total, glob in s["checkpoints"]:
        lines.append(f"checkpoint round {rnd}: {total} bytes (global.pt {glob})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--window", type=int, default=100, help="rounds at each end (default 100)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    s = summarise(a.run_dir, a.window)
    print(json.dumps(s, indent=1) if a.json else format_summary(s))
    return 0


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    sys.exit(cli_main(main)())
