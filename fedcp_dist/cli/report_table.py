"""The table ``fedcp-report`` prints from the runs :mod:`fedcp_dist.cli.report_runs` reads: a cell per
method and setting, mean ± std over seeds (:func:`build_table`), and its markdown and CSV forms.
``fedcp-report``'s command line (:mod:`fedcp_dist.cli.report`) and its plots
(:mod:`fedcp_dist.cli.report_plots`) both build on these two modules, which import neither."""
from __future__ import annotations

import collections
import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fedcp_dist.cli.report_runs import (
    _ROUNDS_TO, DERIVED, NOT_REACHED, RECORD_METRICS, Collection, _label, _sort_key, is_record_metric,
)
from fedcp_dist.errors import UserError
from fedcp_dist.options import did_you_mean
from fedcp_dist.fileio import atomic_write_bytes
from fedcp_dist.rundir.directory import ANALYSIS, DIVERGED, METRICS, SUMMARY


#: summary keys only some runs have (fedcp_dist.comm.compress.byte_totals: none for peer methods and runs saved
#: before every run counted its bytes; the saved bytes only with skipped uploads):
#: a report of runs that have none of them says n/a rather than stopping
OPTIONAL = ("uplink_bytes", "uplink_bytes_dense", "downlink_bytes", "downlink_bytes_dense", "uplink_bytes_sent",
            "uplink_bytes_saved", "uplink_saved_fraction", *DERIVED, "dp_epsilon", "dp_noise_multiplier", "dp_clip")
#: metrics whose value may be infinite and means it (dp_epsilon of a run without noise): such a cell reads ∞
INFINITE_OK = ("dp_epsilon",)
INFINITE_CELL = "∞"
#: a cell whose finished runs do not record the metric (a byte count of a run that skips nothing)
NA_CELL = "n/a"
MISSING_CELL = "–"
#: a cell whose points a sweep's exclude rules kept from running
EXCLUDED_CELL = "excluded"


def _is_percent(metric: str) -> bool:
    return "acc" in metric or "auc" in metric


@dataclass
class Cell:
    method: str
    setting: tuple
    label: str
    runs: list
    values: list = field(default_factory=list)
    seeds: list = field(default_factory=list)
    #: finished runs that do not record the metric
    not_recorded: int = 0
    #: finished runs whose accuracy never reached a rounds_to_P metric's P
    not_reached: int = 0
    #: runs that learned nothing (their summaries say diverged): no result, counted apart
    diverged: int = 0

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def expected(self) -> int:
        return len(self.runs)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else float("nan")

    @property
    def std(self) -> float:
        """Population standard deviation over seeds (numpy's default, as the reference's tables)."""
        if not self.values:
            return float("nan")
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / len(self.values))


@dataclass
class Table:
    metric: str
    keys: list
    methods: list
    settings: list  # [(values tuple, label)]
    cells: dict  # (method, values) -> Cell
    missing: list  # runs without a result (those that diverged apart)
    typical_n: int
    warnings: list
    #: (row, setting) -> the reasons of the excluded points there
    excluded: dict = field(default_factory=dict)
    #: [(row, label, reason, points)] for the report's list
    excluded_notes: list = field(default_factory=list)
    #: runs that ran to their end but learned nothing (:data:`fedcp_dist.rundir.directory.DIVERGED`)
    diverged: list = field(default_factory=list)

    def cell_text(self, method: str, setting: tuple) -> str:
        cell = self.cells.get((method, setting))
        if cell is None and (method, setting) in self.excluded:
            return EXCLUDED_CELL
        return self.text(cell)

    def text(self, cell: Optional[Cell]) -> str:
        if cell is None:
            return ""
        if not cell.values:
            if cell.diverged:
                return f"{DIVERGED} ({cell.diverged}/{cell.expected})"
            if cell.not_reached:
                return f"{NOT_REACHED} ({cell.not_reached}/{cell.expected})"  # as diverged: how many of how many
            if cell.not_recorded:  # finished runs without the metric (and perhaps unfinished ones)
                return NA_CELL + (f" ({cell.not_recorded}/{cell.expected})" if cell.not_recorded < cell.expected else "")
            return f"{MISSING_CELL} (0/{cell.expected})"
        if any(math.isinf(v) for v in cell.values):  # ε of runs without noise
            return INFINITE_CELL + (f" ({cell.n}/{cell.expected})" if cell.n < cell.expected else "")
        if _is_percent(self.metric):
            scale_fmt = "{:.2f}"
        elif _ROUNDS_TO.fullmatch(self.metric):
            scale_fmt = "{:.1f}"
        else:
            scale_fmt = "{:.4g}" if "fraction" in self.metric or abs(cell.mean) < 1e4 else "{:.0f}"
        s = f"{scale_fmt.format(cell.mean)} ± {scale_fmt.format(cell.std)}"
        if cell.diverged:
            s += f" ({cell.n}/{cell.expected}; {cell.diverged} {DIVERGED})"
        elif cell.not_reached:
            s += f" ({cell.n}/{cell.expected}; {cell.not_reached} {NOT_REACHED})"
        elif cell.n < cell.expected:
            s += f" ({cell.n}/{cell.expected})"
        elif cell.n != self.typical_n:
            s += f" (n={cell.n})"
        return s


def _record_metrics_like(metric: str) -> list:
    """The record metrics with the number a mistyped ``metric`` ends in (``round_to_95``:
    rounds_to_95, not the pattern ``rounds_to_P``, which --metric refuses); none without one (the
    error's list then says what P and R are)."""
    m = re.search(r"(\d+(?:\.\d+)?)$", metric)
    if m is None:
        return []
    return [f"rounds_to_{m.group(1)}"] + ([f"acc_after_{m.group(1)}"] if m.group(1).isdigit() else [])


def build_table(col: Collection, keys: list, metric: str) -> Table:
    runs = col.runs
    scale = 100.0 if _is_percent(metric) else 1.0
    finished = [r for r in runs if r.finished]
    diverged = [r for r in runs if r.diverged]
    m = _ROUNDS_TO.fullmatch(metric)
    if m and not 0 < float(m.group(1)) <= 100:
        raise UserError(f"fedcp-report: --metric {metric}: P must be a percentage in (0, 100], got {m.group(1)}")
    if finished and metric not in OPTIONAL and not is_record_metric(metric) and not any(isinstance(r.metric(metric), (int, float)) for r in finished):
        known = sorted(k for k, v in finished[0].summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        hint = did_you_mean(metric, [*known, *DERIVED, *_record_metrics_like(metric)])
        raise UserError(f"fedcp-report: --metric '{metric}' is in no {SUMMARY}{hint}" if hint else
                        f"fedcp-report: --metric '{metric}' is in no {SUMMARY}; numeric keys: {', '.join(known)}"
                        f" (and, computed from them: {', '.join(DERIVED)}; from the records: {', '.join(RECORD_METRICS)})")
    cells: dict = {}
    settings: dict = {}
    missing = []
    warnings = []
    for r in runs:
        setting = tuple(json.dumps(r.value(k), sort_keys=True, default=str) for k in keys)
        settings.setdefault(setting, tuple(r.value(k) for k in keys))
        key = (r.method, setting)
        cell = cells.setdefault(key, Cell(r.method, setting, "", []))
        cell.runs.append(r)
        if r.diverged:
            cell.diverged += 1
            continue
        value = r.metric(metric) if r.finished else None
        if (r.finished and r.records_problem and value is None and is_record_metric(metric)
                and metric not in r.summary):  # a damaged metrics.jsonl: unknown, not absent
            missing.append(r)
            continue
        if value == NOT_REACHED:
            cell.not_reached += 1
            continue
        if r.finished and value is None and metric not in r.summary:  # e.g. bytes a run that skips nothing lacks
            cell.not_recorded += 1
            continue
        source = (SUMMARY if metric in (r.summary or {}) or not is_record_metric(metric)
                  else ANALYSIS if metric.startswith("pir") else METRICS)  # where the value was read
        if r.finished and not isinstance(value, (int, float)):
            r.why = f"{source} has no numeric '{metric}'"
        elif r.finished and not (math.isfinite(value) or (metric in INFINITE_OK and math.isinf(value))):
            r.why = f"{source} gives '{metric}' as {value}"
        if r.finished and isinstance(value, (int, float)) and (math.isfinite(value) or
                                                                (metric in INFINITE_OK and math.isinf(value))):
            cell.values.append(scale * float(value))
            cell.seeds.append(r.seed)
        else:
            missing.append(r)
    for cell in cells.values():
        dup = [s for s, c in collections.Counter(map(str, cell.seeds)).items() if c > 1]
        if dup:
            warnings.append(f"{cell.method} {_label(dict(zip(keys, settings[cell.setting])), keys)}: "
                            f"seed {', '.join(dup)} appears in more than one run; each is counted")
    row_key = runs[0].row_key if runs else "method"
    excluded: dict = {}
    notes: dict = {}
    for params, reason, sweep in col.excluded:
        if len(col.sweeps) > 1:
            params = {**params, "sweep": sweep}
        setting = tuple(json.dumps(params.get(k), sort_keys=True, default=str) for k in keys)
        settings.setdefault(setting, tuple(params.get(k) for k in keys))
        row = str(params[row_key]) if row_key in params else None
        excluded.setdefault((row, setting), set()).add(reason)
        notes[(row, setting, reason)] = notes.get((row, setting, reason), 0) + 1
    order = sorted(settings, key=lambda s: tuple(_sort_key(v) for v in settings[s]))
    labels = [(s, _label(dict(zip(keys, settings[s])), keys) if keys else metric) for s in order]
    for (method, s), cell in cells.items():
        cell.label = dict(labels)[s]
    present = []
    order = col.method_order if row_key == "method" else col.orders.get(row_key, [])
    rows_seen = {r.method for r in runs} | {m for m, _ in excluded if m is not None}
    for m in [str(v) for v in order] + sorted(rows_seen):
        if m not in present and m in rows_seen:
            present.append(m)
    positions = {s: i for i, s in enumerate(order_s for order_s, _ in labels)}
    excluded_notes = [(m, dict(labels)[s], reason, n) for (m, s, reason), n in
                      sorted(notes.items(), key=lambda kv: (present.index(kv[0][0]) if kv[0][0] in present else -1,
                                                            positions[kv[0][1]], kv[0][2]))]
    complete = [c.n for c in cells.values() if c.values and c.n == c.expected]
    counts = collections.Counter(complete)
    typical = max(counts, key=lambda n: (counts[n], n)) if counts else 0
    # a point excluded without the row's key (the grid does not vary it: one method for every point) is
    # excluded from every row
    for (row, setting), reasons in list(excluded.items()):
        if row is None:
            for m in present:
                excluded.setdefault((m, setting), set()).update(reasons)
    return Table(metric, keys, present, labels, cells, missing, typical, warnings,
                 {k: v for k, v in excluded.items() if k[0] is not None}, excluded_notes, diverged)


def _unit(metric: str) -> str:
    return f"100·{metric} (%)" if _is_percent(metric) else metric


def markdown(table, title: str, row_name: str = "method", unreadable=()) -> str:
    """The report: one table, or a list of tables of several metrics side by side (a column per
    setting and metric); missing runs, ``unreadable`` ones ([(path, why)]: a damaged config) and
    warnings below it."""
    tables = table if isinstance(table, list) else [table]
    first = tables[0]
    units = "; ".join(_unit(t.metric) for t in tables)
    lines = [f"# {title}", "",
             f"Mean ± std over seeds of {units}; std is the population standard deviation (ddof = 0). "
             f"Columns: {', '.join(first.keys) if first.keys else 'one setting'}. "
             f"A cell marked (k/n) has k of its n runs finished"
             + (f"; (n=k) counts seeds when they differ from the usual {first.typical_n}" if first.typical_n else "")
             + (f"; {NA_CELL}: the runs do not record the metric" if any(
                 c.not_recorded for t in tables for c in t.cells.values()) else "")
             + (f"; {EXCLUDED_CELL}: not run, for the reason listed below" if first.excluded else "")
             + (f"; {DIVERGED}: runs that learned nothing, listed below and never averaged" if first.diverged else "")
             + ".", ""]
    columns = []  # (table, setting, label)
    for s, label in first.settings:
        for t in tables:
            name = label if len(tables) == 1 else (t.metric if len(first.settings) == 1 else f"{label} {t.metric}")
            columns.append((t, s, name))
    header = [row_name] + [name for _, _, name in columns]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("| " + " | ".join(["---"] + ["---:"] * len(columns)) + " |")
    for m in first.methods:
        row = [m] + [t.cell_text(m, s) for t, s, _ in columns]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    if first.diverged:
        lines.append(f"{DIVERGED}: {len(first.diverged)} run(s) that ran every round but learned nothing (every "
                     f"client's update non-finite in every round; their accuracy is the untrained model's), not "
                     f"averaged:")
        for r in sorted(first.diverged, key=lambda r: str(r.path)):
            lines.append(f"- {r.method} {r.label}: {r.path}")
        lines.append("")
    missing = {id(r): r for t in tables for r in t.missing}.values()
    if missing:
        lines.append(f"missing: {len(missing)} run(s) without a result, not averaged:")
        for r in sorted(missing, key=lambda r: str(r.path)):
            lines.append(f"- {r.method} {r.label}: {r.path} ({r.why})")
        lines.append("")
    if unreadable:
        lines.append(f"unreadable: {len(unreadable)} run(s) whose setting cannot be read, not averaged:")
        for path, why in sorted(unreadable, key=lambda u: str(u[0])):
            lines.append(f"- {path} ({why})")
        lines.append("")
    if first.excluded_notes:
        n = sum(k for *_, k in first.excluded_notes)
        lines.append(f"excluded: {n} point(s) the sweep's exclude rules kept from running:")
        for m, label, reason, k in first.excluded_notes:
            lines.append(f"- {m + ' ' if m is not None else ''}{label}: {k} point(s); {reason}")
        lines.append("")
    for t in tables:
        for w in t.warnings:
            if f"warning: {w}" not in lines:
                lines.append(f"warning: {w}")
    return "\n".join(lines).rstrip() + "\n"


def write_csv(table, path: Path, row_name: str = "method") -> None:
    """report.csv: a line per row and setting (and metric, with several: then a ``metric`` column)."""
    tables = table if isinstance(table, list) else [table]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    several = len(tables) > 1
    w.writerow([row_name, "setting", *(["metric"] if several else []), "n_seeds", "mean", "std", "seeds", "n_expected",
                "excluded", "n_diverged"])
    for m in tables[0].methods:
        for s, _ in tables[0].settings:
            for t in tables:
                cell = t.cells.get((m, s))
                reasons = "; ".join(sorted(t.excluded.get((m, s), ())))
                if cell is None:
                    if reasons:
                        w.writerow([m, dict(t.settings)[s], *([t.metric] if several else []), 0, "", "", "", 0, reasons,
                                    0])
                    continue
                w.writerow([m, dict(t.settings)[s], *([t.metric] if several else []), cell.n, repr(cell.mean) if cell.values else "",
                            repr(cell.std) if cell.values else "", " ".join(str(x) for x in cell.seeds),
                            cell.expected, reasons, cell.diverged])
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"))



