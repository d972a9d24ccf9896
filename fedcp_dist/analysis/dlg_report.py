"""The DLG/iDLG results as ``fedcp-dlg`` reports them: one row per run, attack and DP setting, the
markdown table and the rows of the reconstruction grid (:mod:`fedcp_dist.analysis.dlg` attacks)."""
from __future__ import annotations

import math

import numpy as np
import torch

from fedcp_dist.analysis.imaging import psnr

#: images per attacked batch shown in a grid, at most
GRID_MAX_IMAGES = 8


def summarise(results: list) -> list:
    """One row per (run, attack): PSNR and SSIM mean ± population std over the attacked uploads
    (each upload's value the mean over its B·S images), the share of labels recovered, and the DP
    setting the uploads were attacked under (clip C and noise multiplier σ; None: as sent)."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r.run, r.attack), []).append(r)
    rows = []
    for (run, attack), rs in groups.items():
        p = np.array([r.psnr for r in rs])
        s = np.array([r.ssim for r in rs])
        rows.append({"run": run, "method": rs[0].method, "attack": attack, "uploads": len(rs),
                     "psnr_mean": float(p.mean()), "psnr_std": float(p.std()),
                     "ssim_mean": float(s.mean()), "ssim_std": float(s.std()),
                     "label_acc": float(np.mean([r.label_acc for r in rs])),
                     "labels_inferred": all(r.labels_inferred for r in rs),
                     "dp_clip": rs[0].dp_clip, "dp_noise": rs[0].dp_noise})
    return rows


def markdown_table(rows: list) -> str:
    """The table of :func:`summarise`'s rows; with DP settings two more columns, C and σ."""
    dp = any(r.get("dp_clip") is not None for r in rows)
    extra = " clip C | noise σ |" if dp else ""
    lines = [f"| run | method | attack |{extra} PSNR (dB) | SSIM | labels recovered | uploads |",
             "| --- | --- | --- |" + (" ---: | ---: |" if dp else "") + " ---: | ---: | ---: | ---: |"]
    for r in rows:
        attack = r["attack"].upper().replace("IDLG", "iDLG")
        if r["attack"] == "idlg" and not r["labels_inferred"]:
            attack += " (labels not in the upload: as DLG)"
        setting = ""
        if dp:
            setting = (" as sent | 0 |" if r.get("dp_clip") is None
                       else f" {dp_value(r['dp_clip'])} | {dp_value(r['dp_noise'])} |")
        lines.append(f"| {r['run']} | {r['method']} | {attack} |{setting} {r['psnr_mean']:.2f} ± {r['psnr_std']:.2f} | "
                     f"{r['ssim_mean']:.3f} ± {r['ssim_std']:.3f} | {100 * r['label_acc']:.0f} % | {r['uploads']} |")
    return "\n".join(lines) + "\n"


def dp_value(v: float) -> str:
    """A clip norm or noise multiplier as the table shows it (∞: no clipping)."""
    return "∞" if math.isinf(v) else f"{v:g}"


def grid_rows(results: list, attack: str) -> list:
    """Rows for :func:`fedcp_dist.analysis.plots.dlg_grid`: the true images once (a row per run if
    the runs attacked different images), then each run's reconstructions, at most
    :data:`GRID_MAX_IMAGES` images per attacked batch."""
    chosen = [r for r in results if r.attack == attack]
    runs = list(dict.fromkeys(r.run for r in chosen))
    rows = []

    def images(rs, what):
        return [img for r in rs for img in getattr(r, what)[:GRID_MAX_IMAGES]]

    def captions(rs):
        return [f"{ps:.1f} dB" for r in rs for ps in
                [psnr(r.truth[i], r.guess[i]) for i in range(min(len(r.truth), GRID_MAX_IMAGES))]]

    first = [r for r in chosen if r.run == runs[0]]
    same = all(len([r for r in chosen if r.run == run]) == len(first) and all(
        torch.equal(a.truth, b.truth) for a, b in zip(first, [r for r in chosen if r.run == run])) for run in runs)
    if same:
        rows.append(("truth", images(first, "truth"), [f"c{r.client} b{r.batch}" for r in first
                                                        for _ in range(min(len(r.truth), GRID_MAX_IMAGES))]))
    for run in runs:
        rs = [r for r in chosen if r.run == run]
        if not same:
            rows.append((f"{run}\ntruth", images(rs, "truth"), None))
        rows.append((f"{run}\n({rs[0].method})", images(rs, "guess"), captions(rs)))
    return rows
