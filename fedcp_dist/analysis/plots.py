"""The figures, drawn headless with matplotlib (Agg) and written atomically.

Each ``plot_*`` returns a matplotlib Figure, or None when the runs hold nothing to draw; several
runs are overlaid, one colour per run.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import numpy as np

from fedcp_dist.analysis.records import loss_by_round, pir_by_round
from fedcp_dist.errors import UserError
from fedcp_dist.fileio import atomic_write_bytes

DPI = 110
#: clients drawn one by one when none are chosen
DEFAULT_CLIENTS = 5


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG to ``path`` (complete or not at all) and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    pyplot().close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def _integer_x(*axes) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


#: line colours in the order series get them: matplotlib's ten, then five of its lighter tab20 shades
#: that stay apart from those ten (black is kept for the highlighted method)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#98df8a", "#ff9896", "#c5b0d5", "#ffbb78")
#: markers in the same order; "*" is kept for the highlighted method
MARKERS = ("o", "s", "D", "^", "v", "<", ">", "p", "h", "X", "P", "d", "H", "8", "1")
#: the method a comparison is about: drawn in black, thicker, over the others
HIGHLIGHT = "fedcp"


def _colour(i: int) -> str:
    """The i-th series' colour: the palette, then hues spaced by the golden ratio (never repeating)."""
    if i < len(PALETTE):
        return PALETTE[i]
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((0.13 + (i - len(PALETTE)) * 0.6180339887) % 1.0, 0.75, 0.7 + 0.2 * (i % 2))
    return "#{:02x}{:02x}{:02x}".format(round(255 * r), round(255 * g), round(255 * b))


def series_styles(names, highlight: str = HIGHLIGHT) -> dict:
    """A matplotlib style per name (colour, marker, line width, z-order), every colour different and
    every marker different while the markers last (15, besides the highlight's); ``highlight``, when
    among the names, is black, marked with a star, thicker and drawn over the rest."""
    out, i = {}, 0
    for name in names:
        if name == highlight:
            out[name] = dict(color="black", marker="*", markersize=8, linewidth=2.6, zorder=10)
            continue
        out[name] = dict(color=_colour(i), marker=MARKERS[i % len(MARKERS)], markersize=4, linewidth=1.3,
                         zorder=2)
        i += 1
    return out


def pick_clients(present, chosen: Optional[list], k: int = DEFAULT_CLIENTS) -> list:
    """``chosen`` (those present), or up to ``k`` of the present clients spread evenly over their ids."""
    present = sorted(set(present))
    if chosen:
        return [c for c in chosen if c in present]
    if len(present) <= k:
        return present
    idx = np.linspace(0, len(present) - 1, k).round().astype(int)
    return [present[i] for i in sorted(set(idx.tolist()))]


def plot_accuracy(runs: list):
    """Accuracy (sample-weighted and client mean), AUC and losses against rounds trained."""
    if not any(r.evals or r.rounds for r in runs):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, run in enumerate(runs):
        c = _colour(i)
        xs = [e["evaluated_after"] for e in run.evals]
        axes[0].plot(xs, [100 * e["acc"] for e in run.evals], "-o", ms=3, color=c, label=f"{run.label}")
        axes[0].plot(xs, [100 * e.get("acc_client_mean", float("nan")) for e in run.evals], "--", color=c,
                     label=f"{run.label} (client mean)")
        axes[1].plot(xs, [e.get("auc", float("nan")) for e in run.evals], "-o", ms=3, color=c, label=run.label)
        axes[2].plot([r["round"] for r in run.rounds], [r["train_loss"] if r.get("train_loss") is not None else float("nan") for r in run.rounds], "-",
                     color=c, label=f"{run.label} train")
        axes[2].plot(xs, [e.get("test_loss", float("nan")) for e in run.evals], ":o", ms=3, color=c,
                     label=f"{run.label} test")
    for ax, title, ylabel in zip(axes, ("accuracy", "AUC", "loss"), ("accuracy (%)", "micro AUC", "loss")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rounds trained")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _integer_x(*axes)
    fig.tight_layout()
    return fig


def plot_pir(runs: list, clients: Optional[list]):
    """PIR against rounds: over each round's training samples (left) and at each evaluation over the
    test samples (right); chosen clients thin (one run only), the sample-weighted mean thick."""
    runs = [r for r in runs if r.has_probes]
    if not runs:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for side, (ax, key, title) in enumerate(zip(axes, ("round", "evaluated_after"),
                                                 ("training samples, each round", "test samples, each evaluation"))):
        for i, run in enumerate(runs):
            probes = run.train_probes if side == 0 else run.eval_probes
            if not probes:
                continue
            if len(runs) == 1:
                for j, cid in enumerate(pick_clients([p.client for p in probes], clients)):
                    pts = sorted((getattr(p, key), p.pir) for p in probes if p.client == cid)
                    ax.plot([x for x, _ in pts], [y for _, y in pts], "-", lw=1, alpha=0.8, color=_colour(j + 1),
                            label=f"client {cid}")
            mean = pir_by_round(probes, key)
            ax.plot(list(mean), list(mean.values()), "-", lw=2.5, color="black" if len(runs) == 1 else _colour(i),
                    label="mean" if len(runs) == 1 else f"{run.label} mean")
        ax.set_title(f"PIR, {title}", fontsize=10)
        ax.set_xlabel("round" if side == 0 else "rounds trained")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("PIR = mean s (personal share)")
    _integer_x(*axes)
    fig.tight_layout()
    return fig


#: clients drawn as rows of the s-distribution map when none are chosen
S_MAP_CLIENTS = 40


def s_shares(counts: list) -> np.ndarray:
    """A histogram of s as the share of its values in each bin (all zeros when empty)."""
    counts = np.asarray(counts, float)
    total = counts.sum()
    return counts / total if total > 0 else counts


def plot_s_distribution(runs: list, clients: Optional[list]):
    """The distribution of s over each chosen client's test samples at the run's last evaluation, one
    panel per run: a map with a row per client and a column per bin of the probes' histogram (s of
    every feature of every test sample), the colour the share of the client's s values in that bin
    on a log scale (one bin often holds a third of them, the tails a few), and the client's mean s
    (its PIR) as a white tick."""
    runs = [r for r in runs if r.eval_probes]
    if not runs:
        return None
    plt = pyplot()
    from matplotlib.colors import LogNorm

    rows = []
    for run in runs:
        last = max(p.evaluated_after for p in run.eval_probes)
        probes = {p.client: p for p in run.eval_probes if p.evaluated_after == last and sum(p.s_hist) > 0}
        chosen = pick_clients(list(probes), clients, k=S_MAP_CLIENTS)
        if chosen:
            rows.append((run, last, chosen, probes))
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, squeeze=False,
                             figsize=(9, sum(1.2 + 0.22 * len(chosen) for _, _, chosen, _ in rows)))
    for ax, (run, last, chosen, probes) in zip(axes[:, 0], rows):
        shares = np.stack([s_shares(probes[c].s_hist) for c in chosen])
        smallest = shares[shares > 0].min()
        image = ax.imshow(np.where(shares > 0, shares, np.nan), aspect="auto", cmap="viridis",
                          norm=LogNorm(vmin=smallest, vmax=1.0), extent=(0.0, 1.0, len(chosen) - 0.5, -0.5),
                          interpolation="nearest")
        pir = [probes[c].pir for c in chosen]
        ax.plot(pir, range(len(chosen)), "|", color="white", ms=9, mew=2, label="mean s (PIR)")
        ax.set_yticks(range(len(chosen)), [f"client {c}" for c in chosen], fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_xlabel("s (share of a feature sent to the personal head); empty bins blank")
        ax.set_title(f"{run.label}: s over each client's test samples after {last} rounds "
                     f"(PIR {min(pir):.2f}-{max(pir):.2f})", fontsize=10)
        ax.set_facecolor("#f4f4f4")
        ax.legend(loc="upper right", fontsize=7, facecolor="#444444", labelcolor="white", framealpha=0.8)
        fig.colorbar(image, ax=ax, label="share of the client's s values", pad=0.01)
    fig.tight_layout()
    return fig


def plot_loss_before_after(runs: list):
    """Training loss before and after local learning (sample-weighted over each round's clients),
    with the accuracy at each evaluation on the right axis."""
    runs = [r for r in runs if r.train_probes]
    if not runs:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    right = ax.twinx()
    for i, run in enumerate(runs):
        c = _colour(i)
        losses = loss_by_round(run.train_probes)
        xs = list(losses)
        ax.plot(xs, [b for b, _ in losses.values()], "-", color=c, label=f"{run.label} loss before")
        ax.plot(xs, [a for _, a in losses.values()], "--", color=c, label=f"{run.label} loss after")
        right.plot([e["evaluated_after"] for e in run.evals], [100 * e["acc"] for e in run.evals], ":o", ms=3,
                   color=c, alpha=0.7, label=f"{run.label} accuracy")
    ax.set_xlabel("round")
    ax.set_ylabel("training loss")
    right.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], fontsize=7, loc="center right")
    ax.set_title("loss before and after local learning, and accuracy", fontsize=10)
    _integer_x(ax)
    fig.tight_layout()
    return fig


def _gray_or_rgb(img):
    """(C, H, W) in [0, 1] → what imshow takes, and its colour map."""
    img = np.asarray(img)
    if img.shape[0] == 1:
        return img[0], "gray"
    return np.transpose(img, (1, 2, 0)), None


def gradcam_grid(maps: list):
    """Per client three rows — the test images, Grad-CAM with only the global head, with only the
    personal head — overlaid on the images; titles give the label and each head's prediction."""
    plt = pyplot()
    cols = max(m.images.shape[0] for m in maps)
    fig, axes = plt.subplots(3 * len(maps), cols, figsize=(1.6 * cols + 0.6, 1.75 * 3 * len(maps)), squeeze=False)
    for k, m in enumerate(maps):
        for j in range(cols):
            for row, what in enumerate(("input", "global", "personal")):
                ax = axes[3 * k + row, j]
                ax.set_xticks([])
                ax.set_yticks([])
                if j >= m.images.shape[0]:
                    ax.axis("off")
                    continue
                img, cmap = _gray_or_rgb(m.images[j])
                ax.imshow(img, cmap=cmap, vmin=0, vmax=1)
                if what == "input":
                    ax.set_title(f"label {int(m.labels[j])}, FedCP {int(m.pred['both'][j])}", fontsize=7)
                else:
                    ax.imshow(m.cams[what][j].numpy(), cmap="jet", alpha=0.5, vmin=0, vmax=1)
                    ax.set_title(f"{what} head → {int(m.pred[what][j])}", fontsize=7)
                if j == 0:
                    ax.set_ylabel(f"client {m.client}\n{what}", fontsize=8)
    fig.tight_layout()
    return fig


def dlg_grid(rows: list, title: str):
    """Reconstructions against the truth: ``rows`` = [(row label, images (n, C, H, W), per-image
    captions)], one image per column."""
    plt = pyplot()
    cols = max(len(imgs) for _, imgs, _ in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(1.3 * cols + 1.2, 1.45 * len(rows) + 0.4), squeeze=False)
    for i, (label, imgs, captions) in enumerate(rows):
        for j in range(cols):
            ax = axes[i, j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(imgs):
                ax.axis("off")
                continue
            img, cmap = _gray_or_rgb(imgs[j])
            ax.imshow(img, cmap=cmap, vmin=0, vmax=1)
            if captions and captions[j]:
                ax.set_title(captions[j], fontsize=6)
            if j == 0:
                ax.set_ylabel(label, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def dlg_dp_curves(rows: list, attack: str):
    """PSNR and the share of labels recovered against the noise multiplier σ, a line per run and
    clip norm, from :func:`fedcp_dist.analysis.dlg_report.summarise`'s rows of one ``attack`` (the
    rows attacked under DP settings; None when there are none)."""
    import math

    chosen = [r for r in rows if r["attack"] == attack and r.get("dp_clip") is not None]
    if not chosen:
        return None
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    lines: dict = {}
    for r in chosen:
        base = r["run"].rsplit(" C=", 1)[0]
        lines.setdefault((base, r["dp_clip"]), []).append(r)
    for i, ((base, clip), rs) in enumerate(sorted(lines.items(), key=lambda kv: (kv[0][0], kv[0][1]))):
        rs = sorted(rs, key=lambda r: r["dp_noise"])
        x = [r["dp_noise"] for r in rs]
        label = f"{base}, C={'∞' if math.isinf(clip) else f'{clip:g}'}"
        style = dict(marker="os^Dv"[i % 5], linestyle=("-", "--", ":", "-.")[i % 4], color=_colour(i), label=label)
        a1.errorbar(x, [r["psnr_mean"] for r in rs], yerr=[r["psnr_std"] for r in rs], capsize=3, **style)
        a2.plot(x, [100 * r["label_acc"] for r in rs], **style)
    a1.set_ylabel("reconstruction PSNR (dB)")
    a2.set_ylabel("labels recovered (%)")
    a2.set_ylim(-5, 105)
    small = min((r["dp_noise"] for r in chosen if r["dp_noise"] > 0), default=None)
    for ax in (a1, a2):
        ax.set_xlabel("noise multiplier σ" + (" (linear below the smallest > 0)" if small else ""))
        if small:  # 0 and noise multipliers decades apart on one axis
            ax.set_xscale("symlog", linthresh=small)
            ax.set_xlim(-0.3 * small, 1.5 * max(r["dp_noise"] for r in chosen))
        ax.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.suptitle(f"{attack.upper().replace('IDLG', 'iDLG')} against clipped and noised uploads", fontsize=9)
    fig.tight_layout()
    return fig
