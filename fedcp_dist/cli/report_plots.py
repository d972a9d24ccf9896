"""``fedcp-report``'s plots: accuracy against rounds, the metric against each swept key, and the
rounds each client trained in (``--selection``), from :mod:`fedcp_dist.cli.report_table`'s table.
matplotlib is imported only when a plot is drawn."""
from __future__ import annotations

import collections
import json
import math
import re
from pathlib import Path
from typing import Optional

from fedcp_dist.analysis.plots import pyplot as _pyplot
from fedcp_dist.analysis.plots import save as _save
from fedcp_dist.analysis.plots import series_styles
from fedcp_dist.cli.report_runs import Run, _label, _numeric, _sort_key
from fedcp_dist.cli.report_table import Table, _is_percent
from fedcp_dist.rundir.directory import RunDir
from fedcp_dist.rundir.present import format_value


# ----------------------------------------------------------------------------- plots


def _mean_std(values: list) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def round_ticks(ax, rounds: list) -> None:
    """x ticks at the evaluated rounds: each of them where there are few, else at most 12 at a
    multiple (1, 2, 5, 10, 20 …) of their spacing, so evaluations every 5 rounds get ticks at
    multiples of 5, never of 6."""
    from matplotlib.ticker import MultipleLocator

    rounds = sorted(set(rounds))
    if len(rounds) <= 16:
        ax.set_xticks(rounds)
        return
    step = 0
    for a, b in zip(rounds, rounds[1:]):
        step = math.gcd(step, b - a)
    step, span = max(step, 1), rounds[-1] - rounds[0]
    mult = next(m * 10 ** e for e in range(12) for m in (1, 2, 5) if span / (step * m * 10 ** e) <= 12)
    ax.xaxis.set_major_locator(MultipleLocator(step * mult))


def seeds_title(counts: set) -> str:
    """What the curves are over: one seed, or the mean ± 1 std over k seeds (a range when the
    series differ)."""
    if counts == {1}:
        return "accuracy against rounds (one seed a curve)"
    if len(counts) == 1:
        return f"accuracy against rounds (mean ± 1 std over {min(counts)} seeds)"
    return f"accuracy against rounds (mean ± 1 std over {min(counts)}–{max(counts)} seeds a curve)"


def zoom_band(series: list) -> Optional[tuple]:
    """(first round, low, high) of the inset that shows the last half of the rounds: zoomed to every
    curve where they all lie within a fifth of the whole plot's range there, else to the largest
    group of at least three that lie within a tenth of it (the methods that end close together
    while another ends far below: those the plot's own axis cannot tell apart); None where no
    inset helps."""
    if len(series) < 2:
        return None
    last = max(xs[-1] for *_, xs, _, _ in series)
    start = last / 2
    tails = [t for t in ([v for x, v in zip(xs, mean) if x >= start] for *_, xs, mean, _ in series) if t]
    every = [v for *_, mean, _ in series for v in mean]
    if not tails or max(every) == min(every):
        return None
    span = max(every) - min(every)
    group = tails
    if max(map(max, tails)) - min(map(min, tails)) >= 0.2 * span:
        group = max(([t for t in tails if min(t) >= low and max(t) < low + 0.1 * span]
                     for low in sorted(map(min, tails))), key=len)
        if len(group) < 3:
            return None
    top, bottom = max(map(max, group)), min(map(min, group))
    pad = max(0.1, 0.08 * (top - bottom))
    return start, bottom - pad, top + pad


def plot_curves(table: Table, path: Path) -> bool:
    """acc_vs_round.png: mean accuracy against rounds trained, ±1 std over seeds (finished runs),
    ticks at the evaluated rounds, a title that says over how many seeds, and an inset zoomed on the
    last half of the rounds where the curves end close together."""
    series = []  # (method, setting, label, xs, means, stds)
    seeds = set()
    for m in table.methods:
        for s, label in table.settings:
            cell = table.cells.get((m, s))
            if cell is None:
                continue
            per_x: dict = collections.defaultdict(list)
            for r in cell.runs:
                if r.finished:
                    for x, acc in r.curve():
                        per_x[x].append(100.0 * acc)
            if not per_x:
                continue
            seeds.add(max(len(v) for v in per_x.values()))
            xs = sorted(per_x)
            stats = [_mean_std(per_x[x]) for x in xs]
            series.append((m, s, label, xs, [a for a, _ in stats], [b for _, b in stats]))
    if not series:
        return False
    plt = _pyplot()
    styles_of = series_styles(table.methods)
    settings = [s for s, _ in table.settings if any(x[1] == s for x in series)]
    one_panel = len(settings) <= 1 or len(series) <= 6
    if one_panel:
        many = len(series) > 6  # the legend goes beside the axes, where it covers no curve
        fig, ax = plt.subplots(figsize=(8.6, 4.8) if many else (7, 4.5))
        styles = ["-", "--", ":", "-."]
        for m, s, label, xs, mean, std in series:
            style = styles[settings.index(s) % len(styles)]
            name = m if len(settings) <= 1 else f"{m}, {label}"
            st = styles_of[m]
            ax.plot(xs, mean, style, label=name, **st)
            ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                            color=st["color"], alpha=0.12, linewidth=0, zorder=st["zorder"] - 1)
        ax.set_xlabel("rounds trained")
        ax.set_ylabel("test accuracy (%)")
        round_ticks(ax, [x for *_, xs, _, _ in series for x in xs])
        ax.grid(alpha=0.3)
        band = zoom_band(series)
        if band is not None:
            start, lo, hi = band
            inset = ax.inset_axes([0.42, 0.1, 0.55, 0.5])
            for m, s, label, xs, mean, std in series:
                keep = [i for i, x in enumerate(xs) if x >= start]
                st = styles_of[m]
                inset.plot([xs[i] for i in keep], [mean[i] for i in keep], styles[settings.index(s) % len(styles)],
                           **{**st, "markersize": st["markersize"] * 0.7})
            inset.set_ylim(lo, hi)
            round_ticks(inset, [x for *_, xs, _, _ in series for x in xs if x >= start])
            inset.tick_params(labelsize=7)
            inset.grid(alpha=0.3)
            inset.set_title("last half of the rounds, zoomed", fontsize=7)
            ax.indicate_inset_zoom(inset, edgecolor="0.5")
        if many:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        elif band is not None:  # left of the inset, below the plateau, right of the curves' first rise
            ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.15, 0.08))
        else:
            ax.legend(fontsize=8)
        if len(settings) == 1 and table.keys:
            ax.set_title(dict(table.settings)[settings[0]], fontsize=9)
    else:
        ncols = min(4, len(settings))
        nrows = math.ceil(len(settings) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.9 * nrows), sharey=True, squeeze=False)
        for ax, s in zip(axes.flat, settings):
            for m, s2, label, xs, mean, std in series:
                if s2 != s:
                    continue
                st = styles_of[m]
                ax.plot(xs, mean, label=m, **{**st, "markersize": st["markersize"] * 0.75})
                ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                color=st["color"], alpha=0.12, linewidth=0, zorder=st["zorder"] - 1)
            ax.set_title(dict(table.settings)[s], fontsize=8)
            round_ticks(ax, [x for _, s2, _, xs, _, _ in series if s2 == s for x in xs])
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(settings):]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("rounds trained")
        for ax in axes[:, 0]:
            ax.set_ylabel("test accuracy (%)")
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(seeds_title(seeds), fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return True


def plot_against_keys(table: Table, out: Path) -> list:
    """acc_vs_<key>.png for each setting key with two or more values: mean metric per method, error bars."""
    written = []
    for i, key in enumerate(table.keys):
        values = {s[i]: json.loads(s[i]) for s, _ in table.settings}  # json text -> value
        if len(values) < 2:
            continue
        numeric = all(_numeric(v) for v in values.values())
        order = sorted(values, key=lambda t: _sort_key(values[t]))
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        others = [k for j, k in enumerate(table.keys) if j != i]
        lines: dict = collections.defaultdict(list)  # (method, rest) -> [(x, mean, std, marked)]
        for m in table.methods:
            for s, _ in table.settings:
                cell = table.cells.get((m, s))
                if cell is None or not cell.values:
                    continue
                vals = [json.loads(x) for x in s]
                rest = tuple(s[j] for j in range(len(s)) if j != i)
                rest_label = _label({k: vals[j] for j, k in enumerate(table.keys) if j != i}, others) if others else ""
                x = vals[i] if numeric else order.index(s[i])
                lines[(m, rest, rest_label)].append((x, cell.mean, cell.std, cell.n < cell.expected))
        styles_of = series_styles(table.methods)
        markers = "osD^v<>"
        rests = sorted({k[1] for k in lines})
        ring_label = "cell with missing runs"
        for (m, rest, rest_label), pts in sorted(lines.items(), key=lambda kv: (table.methods.index(kv[0][0]), kv[0][1])):
            pts.sort()
            name = m + (f" ({rest_label})" if rest_label else "")
            st = dict(styles_of[m])
            if len(rests) > 1:  # the marker tells the other keys' values apart, the colour the method
                st["marker"] = markers[rests.index(rest) % len(markers)]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], capsize=3, label=name, **st)
            marked = [p for p in pts if p[3]]
            if marked:  # cells with missing runs: hollow rings
                ax.plot([p[0] for p in marked], [p[1] for p in marked], "o", markersize=11, fillstyle="none",
                        color="red", label=ring_label)
                ring_label = None
        if numeric:
            xs = [float(v) for v in values.values()]
            if min(xs) > 0 and max(xs) / min(xs) >= 50:
                ax.set_xscale("log")
        else:
            ax.set_xticks(range(len(order)), [format_value(values[t]) for t in order], rotation=20, fontsize=8)
        ax.set_xlabel(key)
        ax.set_ylabel(f"{table.metric} (%)" if _is_percent(table.metric) else table.metric)
        ax.set_title(f"{table.metric} against {key} (mean ± std over seeds)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"acc_vs_{re.sub(r'[^A-Za-z0-9._-]', '_', key)}.png"
        _save(fig, out / name)
        written.append(out / name)
    return written


# ----------------------------------------------------------------------------- client selection


def client_rounds(run: Run) -> Optional[list]:
    """Rounds each client trained in: summary.json's ``selection_counts`` (feature-difference
    selection records them), else the round records' ``cohort`` lists, else (uniform sampling, a
    function of the config alone) the cohorts drawn again with the engine's own draw. None for a
    run without a result or with every client in every round."""
    if not run.finished:
        return None
    if isinstance(run.summary.get("selection_counts"), list):
        return [int(c) for c in run.summary["selection_counts"]]
    cfg = run.config
    rho, rho_range = cfg.get("participation", 1.0), cfg.get("participation_range")
    if rho_range is None and float(rho) >= 1:
        return None
    n = len(run.summary["shard_clients"]) if "shard_clients" in run.summary else int(run.summary.get("num_clients") or cfg["data.num_clients"])
    from fedcp_dist.comm.selection import selection_counts

    records = [r for r in RunDir(run.path).read_metrics() if r.get("kind") == "round"]
    if records and all("cohort" in r for r in records):
        return selection_counts((r["cohort"] for r in records), n)
    if cfg.get("client_selection", "uniform") != "uniform":
        return None
    from fedcp_dist.state.placement import sample_cohort

    draw, sampling = cfg.get("participation_draw", "rho"), cfg.get("participation_sampling", "fixed")
    return selection_counts((sample_cohort(int(cfg["seed"]), t, n, float(rho), rho_range, draw, sampling)
                             for t in range(int(cfg["rounds"]))), n)


def _train_sizes(run: Run, n: int) -> Optional[list]:
    """The run's clients' training samples, from its shard (None when the shard is not readable here)."""
    try:
        from fedcp_dist.data.shards import read_info

        sizes = read_info(run.config["data.path"]).train_counts
    except Exception:  # the shard may live on another machine: the plot then orders clients by id
        return None
    ids = run.summary.get("shard_clients") or list(range(n))
    return [int(sizes[i]) for i in ids] if len(ids) == n and max(ids) < len(sizes) else None


def plot_selection(table: Table, path: Path) -> bool:
    """selection_counts.png: rounds each client trained in (mean over seeds), one panel per
    participation (and other setting keys), one bar per client and selection mode, clients ordered by
    training samples."""
    split = [k for k in table.keys if k not in ("client_selection", "selection_vector", "sweep")]
    panels: dict = collections.defaultdict(dict)  # panel label -> {series label: [counts per run]}
    sizes: dict = {}
    for (m, s), cell in table.cells.items():
        for r in cell.runs:
            counts = client_rounds(r)
            if counts is None:
                continue
            mode = str(r.value("client_selection") or "uniform")
            if mode != "uniform":
                mode += f", {r.value('selection_vector') or 'client'} vector"
            panel = _label({k: r.value(k) for k in split}, split) if split else ""
            panels[panel].setdefault((m, mode), []).append(counts)
            sizes.setdefault(panel, _train_sizes(r, len(counts)))
    if not panels:
        return False
    several = len({m for series in panels.values() for m, _ in series}) > 1
    panels = {p: {(f"{m}: {mode}" if several else mode): c for (m, mode), c in series.items()}
              for p, series in panels.items()}
    plt = _pyplot()
    names = sorted(panels, key=lambda p: [_sort_key(v) for v in p.split(",")])
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.8 * len(names)), squeeze=False)
    for ax, panel in zip(axes[:, 0], names):
        series = panels[panel]
        n = len(next(iter(series.values()))[0])
        size = sizes.get(panel)
        order = sorted(range(n), key=lambda i: (size[i], i)) if size else list(range(n))
        width = 0.8 / len(series)
        over = ", mean over seeds" if any(len(runs) > 1 for runs in series.values()) else ""
        for j, (label, runs) in enumerate(sorted(series.items())):
            mean = [sum(c[i] for c in runs) / len(runs) for i in order]
            seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
            ax.bar([x - 0.4 + width * (j + 0.5) for x in range(n)], mean, width, label=label + seeds, color=f"C{j}")
        ax.set_xticks(range(n), [f"{i}\n{size[i]}" if size else str(i) for i in order], fontsize=7)
        ax.set_ylabel("rounds trained" + over)
        ax.set_title((panel + ": " if panel else "") + "rounds each client trained in" + over
                     + (" (x: client, its training samples; ordered by size)" if size else " (x: client)"), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    return True
