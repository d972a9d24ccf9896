"""``fedcp-report``: the paper's result table (and plots) from the runs under a directory.

    fedcp-report runs/sweeps/digits_smoke                  # report.md, report.csv, *.png in that directory
    fedcp-report runs/sweeps/client_count --out reports/n --metric final_acc
    fedcp-report runs/ --by lam                            # columns by lam, whatever else differs
    fedcp-report runs/sweeps/extensions --rows variant --metric best_acc,final_acc   # a row per variant

A run is a directory holding ``config.yaml``; it is finished when ``summary.json`` is there too.
Rows are methods, columns are settings: the values of the swept keys other than ``seed`` and
``method`` (a sweep's grid keys when a ``sweep.json`` is found, else the config keys whose values
differ between runs, or ``--by``); ``--rows KEY`` makes the rows by another key (a sweep's
``variant``, say), and ``--metric`` may list several summary keys, each then a column per setting;
besides the summary's keys it knows metrics read from each run's records (``rounds_to_95``: the
first round evaluated at 95 % or more; ``acc_after_10``; ``pir_test``, ``pir_test_spread``); ``dp_epsilon``
(``dp: central``'s ε after the last round) reads n/a for runs without DP and ∞ for runs without noise.
A cell is mean ± std over seeds of the metric (100·metric for accuracies and AUCs). Runs that are
missing or unfinished are listed and their cells marked ``(finished/expected)``; they are never
averaged in, and neither are runs whose summary says they diverged (they learned nothing): those are
listed apart and counted in their cells (``diverged (1/2)``). A sweep point's run made under an
earlier version of the sweep file (its config.yaml differs from what ``sweep.json`` now says the
point is, in a key that defines the experiment) has no result either: it is listed with the keys. Points a sweep's ``exclude`` rules kept from running are listed with their reasons, and
a cell that holds only such points reads ``excluded``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedcp_dist.cli.report_plots import plot_against_keys, plot_curves, plot_selection
from fedcp_dist.cli.report_runs import _keys_hint, _label, collect, setting_keys
from fedcp_dist.cli.report_table import build_table, markdown, write_csv
from fedcp_dist.errors import ArgumentParser, UserError, cli_main
from fedcp_dist.fileio import atomic_write_bytes, cannot_write_in
from fedcp_dist.options import repeated


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fedcp-report", description="Tabulate and plot the runs under a directory (a sweep's or any).")
    p.add_argument("dir", help="directory holding runs (any depth) and perhaps a sweep.json")
    p.add_argument("--out", help="where report.md, report.csv and the plots go (default: DIR)")
    p.add_argument("--by", help="comma-separated keys that make the columns (default: the swept keys)")
    p.add_argument("--metric", default="best_acc",
                   help="summary.json key(s) to tabulate, comma-separated (default best_acc); also "
                        "uplink_bytes_per_round (uplink_bytes / rounds) and, from each run's records, "
                        "rounds_to_P (first round evaluated at >= P %%), acc_after_R, pir_test and "
                        "pir_test_spread (FedCP's test PIR at the last evaluation: mean and spread over "
                        "clients, with analysis: true); dp_epsilon (dp=central: ε after the last round; n/a for "
                        "runs without DP, ∞ for runs without noise)")
    p.add_argument("--rows", default="method", help="the key whose values make the rows (default method; "
                                                     "a sweep's named variants: variant)")
    p.add_argument("--no-plots", action="store_true", help="write the table only")
    p.add_argument("--selection", action="store_true",
                   help="also plot the rounds each client trained in (selection_counts.png; runs with participation < 1)")
    return p


@cli_main
def main(argv=None) -> None:
    """Entry point of ``fedcp-report``."""
    args = build_parser().parse_args(argv)
    if args.selection and args.no_plots:  # --selection is a plot
        raise UserError("fedcp-report: --selection draws selection_counts.png, which --no-plots leaves out; "
                        "give one of them")
    by = [k.strip() for k in args.by.split(",") if k.strip()] if args.by else None
    metrics = [m.strip() for m in args.metric.split(",") if m.strip()]
    for flag, names in (("--by", by or []), ("--metric", metrics)):
        twice = repeated(names)
        if twice is not None:
            raise UserError(f"fedcp-report: {flag} names '{twice}' twice")
    rows = args.rows.strip()
    col = collect(args.dir)
    if rows != "method" and not any(r.value(rows) is not None for r in col.runs):
        known = sorted({k for r in col.runs for k in (*r.params, *r.config)})
        raise UserError(f"fedcp-report: --rows '{rows}' is not a key of any run{_keys_hint(rows, known)}")
    for r in col.runs:
        r.row_key = rows
    keys = setting_keys(col, by, rows)
    methods = {r.value("method") for r in col.runs}
    if rows != "method" and "method" not in keys and len(methods) > 1:
        # neither axis tells the methods apart: each cell would average different methods' runs
        keys = ["method", *keys]
        print(f"note: the runs hold {len(methods)} methods and neither --rows nor --by names method: the columns "
              f"tell them apart (a cell pools only one method's seeds)", file=sys.stderr)
    for r in col.runs:
        r.label = _label({"seed": r.seed, **{k: r.value(k) for k in keys}}, [*keys, "seed"])
    if not metrics:
        raise UserError("fedcp-report: --metric names no summary key")
    tables = [build_table(col, keys, m) for m in metrics]
    table = tables[0]
    out = Path(args.out) if args.out else Path(args.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"fedcp-report: cannot create --out {out}: {exc.strerror}") from None
    problem = cannot_write_in(out)
    if problem:
        raise UserError(f"fedcp-report: cannot write in {out}: {problem}")
    # the sweeps' names when every run is one of theirs, else the folder's (loose runs beside a sweep)
    in_sweeps = col.sweeps and all(r.sweep is not None for r in col.runs)
    title = f"Report: {', '.join(col.sweeps) if in_sweeps else Path(args.dir).resolve().name}"
    md = markdown(tables, title, rows, col.unreadable)
    atomic_write_bytes(out / "report.md", md.encode("utf-8"))
    write_csv(tables, out / "report.csv", rows)
    print(md, end="")
    written = [out / "report.md", out / "report.csv"]
    if not args.no_plots:
        if plot_curves(table, out / "acc_vs_round.png"):
            written.append(out / "acc_vs_round.png")
        written += plot_against_keys(table, out)
        if args.selection and plot_selection(table, out / "selection_counts.png"):
            written.append(out / "selection_counts.png")
    n_done, n_diverged = sum(r.finished for r in col.runs), sum(r.diverged for r in col.runs)
    n_stale = sum(bool(r.stale) for r in col.runs)
    print(f"\n{n_done}/{len(col.runs)} runs finished" + (f", {n_diverged} diverged" if n_diverged else "")
          + (f", {n_stale} made under an earlier sweep file" if n_stale else "")
          + f"; wrote {', '.join(str(p) for p in written)}")


if __name__ == "__main__":
    main(sys.argv[1:])
