"""``report.json`` and ``report.md`` in the analysis folder: the runs' numbers, the figures with a
sentence each on what they show, and the Grad-CAM and DLG results.

A later call on the same runs that computes only some parts (say ``--dlg``) keeps the other parts
of an existing report: the JSON is merged section by section and the Markdown rebuilt from it. A
report of other runs (a reused ``--out``) is not merged: its sections are dropped, with a note.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable

from fedcp_dist.analysis.records import pir_by_round, loss_by_round
from fedcp_dist.fileio import atomic_write_bytes

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
#: report.json's list of the runs its sections describe (their resolved paths, sorted)
RUN_DIRS = "run_dirs"

CAPTIONS = {
    "accuracy": "Accuracy of the personalized models on their clients' test splits (sample-weighted, solid; "
                "mean over clients, dashed), micro AUC, and the training and test loss, against rounds trained.",
    "pir": "PIR, the share of each feature the policy sends to the personal head, averaged over features "
           "and samples: per round over the training samples each client saw (left) and at each evaluation "
           "over its test samples (right); thin lines are single clients, the thick one the sample-weighted mean.",
    "s_distribution": "The distribution of s over each client's test samples at the last evaluation: each "
                      "row is one client's histogram of the policy's personal shares (colour: the share of its "
                      "s values in the bin, log scale), the white tick its mean (the PIR).",
    "loss_before_after": "Training loss before and after each round's local learning (sample-weighted over the "
                         "round's clients) against the accuracy at each evaluation: the gap is what local "
                         "learning gains on the clients' own data.",
    "gradcam": "Grad-CAM of the personalized FedCP model on test images with only the global head active and "
               "with only the personal head active, for the true label, on the extractor's last convolution.",
    "dlg": "Images reconstructed by a semi-honest server from one round's upload (first row: the true images; "
           "captions: PSNR per image, lower is more private).",
    "dlg_dp": "What DP buys against DLG/iDLG: reconstruction PSNR (left, mean ± std over the attacked uploads; lower "
              "is more private) and the share of labels recovered (right) against the noise multiplier σ, a line "
              "per run and clip norm C; the server reads the upload clipped to C with N(0, (σC)²) on every value, "
              "as if it knew every other participant's update.",
}


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def run_numbers(run) -> dict:
    """The numbers of one run: accuracy, AUC, and (with probes) PIR and losses at the end."""
    out = {"label": run.label, "path": str(run.path), "method": run.method, "model": run.model,
           "rounds": run.config.get("rounds"), "rounds_recorded": len(run.rounds), "finished": run.summary is not None}
    if run.evals:
        best = max(run.evals, key=lambda e: e["acc"])
        last = run.evals[-1]
        out.update(best_acc=best["acc"], best_after_rounds=best["evaluated_after"], last_evaluated_after=last["evaluated_after"],
                   last_acc=last["acc"], last_acc_client_mean=last.get("acc_client_mean"), last_auc=last.get("auc"))
    if run.eval_probes:
        last = max(p.evaluated_after for p in run.eval_probes)
        probes = [p for p in run.eval_probes if p.evaluated_after == last]
        out["pir_eval"] = {"evaluated_after": last, "mean": _finite(pir_by_round(probes, "evaluated_after")[last]),
                           "clients": {str(p.client): p.pir for p in sorted(probes, key=lambda p: p.client)}}
    if run.train_probes:
        losses = loss_by_round(run.train_probes)
        last = max(losses)
        out["pir_train_last_round"] = _finite(pir_by_round([p for p in run.train_probes if p.round == last])[last])
        out["loss_last_round"] = {"round": last, "before": _finite(losses[last][0]), "after": _finite(losses[last][1])}
    return out


def _pct(x) -> str:
    return f"{100 * x:.2f}" if isinstance(x, (int, float)) else "–"


def _num(x, fmt="{:.4f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "–"


def markdown(report: dict) -> str:
    lines = ["# Analysis", ""]
    runs = report.get("runs", [])
    if runs:
        lines += ["| run | method | model | rounds | best acc (%) | last acc (%) | last AUC | PIR (test, last eval) |"
                  " loss before → after (last round) |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in runs:
            pir = r.get("pir_eval", {}).get("mean")
            loss = r.get("loss_last_round", {})
            la = (f"{_num(loss.get('before'))} → {_num(loss.get('after'))}" if loss else "–")
            lines.append(f"| {r['label']} | {r['method']} | {r['model']} | {r['rounds_recorded']} | "
                         f"{_pct(r.get('best_acc'))} | {_pct(r.get('last_acc'))} | {_num(r.get('last_auc'))} | "
                         f"{_num(pir, '{:.3f}')} | {la} |")
        if not any("pir_eval" in r or "loss_last_round" in r for r in runs):
            lines += ["", "No `analysis.jsonl` in these runs: PIR, s and loss-before/after figures need the "
                          "engine's probes (run FedCP with `analysis=true`)."]
        lines.append("")
    for name, fig in report.get("figures", {}).items():
        lines += [f"## {fig['title']}", "", fig["caption"], "", f"![{fig['title']}]({fig['file']})", ""]
    cam = report.get("gradcam")
    if cam:
        lines += [f"Grad-CAM: {cam['note']}", ""]
    dlg = report.get("dlg")
    if dlg:
        lines += ["## DLG privacy evaluation", "", dlg["protocol"], "", dlg["table"]]
    return "\n".join(lines).rstrip() + "\n"


def is_report_folder(path) -> bool:
    """Whether ``path`` is a folder :func:`update_report` wrote (its ``report.json``, an object with
    ``figures``, beside ``report.md``) and not a run directory (no ``config.yaml``): the analysis
    folder that a glob such as ``runs/sweeps/X/runs/*`` matches once fedcp-analyze wrote there."""
    path = Path(path)
    if (path / "config.yaml").exists() or not (path / REPORT_MD).is_file():
        return False
    try:
        report = json.loads((path / REPORT_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and isinstance(report.get("figures"), dict)


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def update_report(out: Path, sections: dict, run_dirs: list, note: Callable[[str], None] = _note) -> dict:
    """Merge ``sections`` of the runs ``run_dirs`` into ``out/report.json`` (figures merged by name)
    and rewrite both files; the sections of a report of other runs are dropped (``note`` says so)."""
    out = Path(out)
    path = out / REPORT_JSON
    runs = sorted(str(Path(r).resolve()) for r in run_dirs)
    report: dict = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            report = old if isinstance(old, dict) else {}
        except (OSError, ValueError):
            report = {}
    if report and report.get(RUN_DIRS) != runs:  # a reused --out: another run's DLG table is not these runs'
        dropped = sorted(k for k, v in report.items() if k != RUN_DIRS and v)
        if dropped:
            whose = "described other runs" if RUN_DIRS in report else "does not name the runs it described"
            note(f"note: {path} {whose}: its sections ({', '.join(dropped)}) are dropped, not merged with these runs'")
        report = {}
    report[RUN_DIRS] = runs
    figures = dict(report.get("figures", {}))
    figures.update(sections.pop("figures", {}))
    report.update(sections)
    report["figures"] = {k: v for k, v in figures.items() if (out / v["file"]).is_file()}
    atomic_write_bytes(path, (json.dumps(report, indent=2) + "\n").encode("utf-8"))
    atomic_write_bytes(out / REPORT_MD, markdown(report).encode("utf-8"))
    return report
