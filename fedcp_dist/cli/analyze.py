"""``fedcp-analyze``: the paper's pictures for runs a user just made; ``fedcp-dlg``: its privacy table.

    fedcp-analyze runs/digits_fedcp                                  # curves, report in runs/digits_fedcp/analysis/
    fedcp-analyze runs/cnn runs/resnet --out reports/cnn_vs_resnet   # overlaid
    fedcp-analyze runs/digits_fedcp --gradcam --clients 0,3 --samples 6
    fedcp-analyze runs/fedcp runs/fedavg runs/fedper --dlg --clients 0,1 --batches 2
    fedcp-dlg runs/fedcp runs/fedavg runs/fedper --clients 0,1 --batches 2  # the DLG part alone

Curves come from ``metrics.jsonl`` (any run) and the probes of ``analysis.jsonl`` (PIR, s, loss
before/after: FedCP runs with ``analysis=true``, see :mod:`fedcp_dist.engine.probes`). Grad-CAM and DLG rebuild the run's method from its
newest checkpoint (see :mod:`fedcp_dist.analysis.runstate`). Everything is written to the analysis
folder — ``RUN/analysis/`` for one run, ``PARENT/analysis/`` (the runs' common parent) for several,
or ``--out`` — with ``report.md`` and ``report.json``.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional

from fedcp_dist.errors import ArgumentParser, UserError, cli_main
from fedcp_dist.fileio import cannot_write_in
from fedcp_dist.options import repeated
from fedcp_dist.rundir.directory import DIVERGED, METRICS, RunDir


def _int_list(text: str, option: str) -> list:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"{option}: expected comma-separated client ids, got {text!r}") from None
    if not out:
        raise UserError(f"{option}: no client id in {text!r}")
    if any(c < 0 for c in out):
        raise UserError(f"{option}: client ids are >= 0, got {text!r}")
    _once(out, option, "client ")
    return out


def _once(values: list, option: str, what: str = "") -> None:
    """Each value of a list option once: a client given twice was attacked twice, an attack run twice."""
    twice = repeated(values)
    if twice is not None:
        shown = f"{twice:g}" if isinstance(twice, float) else twice
        raise UserError(f"{option}: {what}{shown} is given twice")


def _check_device_and_seed(args) -> None:
    """``--device`` a device torch knows and this machine has; ``--seed`` one numpy and torch take."""
    import torch

    from fedcp_dist.options import SEED_MAX

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device: {args.device!r} is not a torch device (cpu, cuda, cuda:N, ...)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise UserError(f"--device {args.device}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        raise UserError(f"--device {args.device}: only cpu and cuda devices are supported")
    seed = getattr(args, "seed", 0)
    if not 0 <= seed <= SEED_MAX:
        raise UserError(f"--seed must be an integer in [0, {SEED_MAX}], got {seed}")


def _add_dlg_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DLG privacy evaluation")
    g.add_argument("--batches", type=int, default=2, help="attacked uploads per client (default 2)")
    g.add_argument("--batch-size", type=int, default=1, help="B: samples per local step of the attacked client (default 1)")
    g.add_argument("--local-steps", type=int, default=1, help="S: local SGD steps of the attacked round (default 1)")
    g.add_argument("--attacks", default="dlg,idlg", help="comma-separated: dlg, idlg (default both)")
    g.add_argument("--steps", type=int, default=100, help="L-BFGS iterations per restart (default 100)")
    g.add_argument("--restarts", type=int, default=1, help="random starts per attack; the best match wins (default 1)")
    g.add_argument("--knowledge", default="server", choices=("server", "oracle"),
                   help="server: what a semi-honest server knows (default); oracle: also the client's private state")
    g.add_argument("--seed", type=int, default=0, help="which samples are attacked, and the dummies' start (default 0)")
    g.add_argument("--dp-clip", help="comma-separated clip norms C (inf: no clipping): attack each upload as dp=central "
                                     "releases it, clipped to C, under every --dp-noise (default: as sent)")
    g.add_argument("--dp-noise", help="comma-separated noise multipliers σ (N(0, (σC)²) on every uploaded value; "
                                      "default 0 with --dp-clip)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _float_list(text: Optional[str], option: str) -> list:
    try:
        return [float(t) for t in (text or "").split(",") if t.strip()]
    except ValueError:
        raise UserError(f"{option}: expected comma-separated numbers, got {text!r}") from None


def dp_settings(clips: Optional[str], noises: Optional[str]) -> tuple:
    """The (C, σ) settings of --dp-clip × --dp-noise (σ > 0 with C = inf left out: no noise scale)."""
    c, n = _float_list(clips, "--dp-clip"), _float_list(noises, "--dp-noise")
    _once(c, "--dp-clip")
    _once(n, "--dp-noise")
    if n and not c:
        raise UserError("--dp-noise needs --dp-clip: the noise's standard deviation is σ·C")
    settings = tuple((clip, noise) for clip in c for noise in (n or [0.0]) if not (math.isinf(clip) and noise > 0))
    if c and not settings:
        raise UserError("--dp-clip inf takes --dp-noise 0 only: the noise's standard deviation is σ·C")
    return settings


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (out_dir of fedcp-run)")
    p.add_argument("--out", help="analysis folder (default RUN_DIR/analysis, or PARENT/analysis for several runs)")
    p.add_argument("--labels", help="comma-separated names of the runs in the figures (default: folder names)")
    p.add_argument("--clients", help="comma-separated client ids (default: a few spread over the clients; "
                                     "Grad-CAM 0,1; DLG 0)")
    p.add_argument("--data", help="the runs' HDF5 shard, if config.yaml's data.path does not resolve from here")
    p.add_argument("--device", default="cpu", help="torch device for Grad-CAM and DLG (default cpu)")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fedcp-analyze", description="Curves, Grad-CAM and a DLG privacy evaluation of runs.")
    _add_common(p)
    g = p.add_argument_group("Grad-CAM (FedCP)")
    g.add_argument("--gradcam", action="store_true", help="Grad-CAM of the global and the personal head")
    g.add_argument("--samples", type=int, default=6, help="test images per client (default 6)")
    g.add_argument("--layer", help="extractor module to explain (name as in named_modules; default its last Conv2d)")
    p.add_argument("--dlg", action="store_true", help="also run the DLG/iDLG privacy evaluation")
    _add_dlg_options(p)
    return p


#: fedcp-analyze's options of Grad-CAM, of DLG and of both (the analyses that rebuild a run's models):
#: without --gradcam or --dlg they have no effect
GRADCAM_OPTIONS = ("samples", "layer")
DLG_OPTIONS = ("batches", "batch_size", "local_steps", "attacks", "steps", "restarts", "knowledge", "seed", "dp_clip",
               "dp_noise", "no_progress")
MODEL_OPTIONS = ("data", "device")


def check_options_used(args, given: set) -> None:
    """Refuse an option of an analysis that is not asked for, even at its default value: it would
    be accepted and do nothing. ``given``: what the command line names (``ArgumentParser.given``)."""
    for keys, asked, needs in ((GRADCAM_OPTIONS, args.gradcam, "--gradcam"), (DLG_OPTIONS, args.dlg, "--dlg"),
                               (MODEL_OPTIONS, args.gradcam or args.dlg, "--gradcam or --dlg")):
        named = [k for k in keys if k in given]
        if named and not asked:
            raise UserError(f"--{named[0].replace('_', '-')} applies to {needs} only")


def build_dlg_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fedcp-dlg", description="DLG/iDLG reconstruction from one round's upload: PSNR and SSIM.")
    _add_common(p)
    _add_dlg_options(p)
    return p


# ----------------------------------------------------------------------------- the parts


def _out_dir(runs: list, out: Optional[str]) -> Path:
    if out:
        path = Path(out)
    elif len(runs) == 1:
        path = Path(runs[0]) / "analysis"
    else:
        path = Path(os.path.commonpath([str(Path(r).resolve()) for r in runs])) / "analysis"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the analysis folder {path}: {exc.strerror}") from None
    problem = cannot_write_in(path)  # before an attack or Grad-CAM computes what it could not save
    if problem:
        raise UserError(f"cannot write in the analysis folder {path}: {problem}")
    return path


def _run_folders(paths: list) -> list:
    """``paths`` less the analysis folders fedcp-analyze wrote (a note each): several runs' default
    folder is their common parent's ``analysis/``, which the same glob given again matches."""
    from fedcp_dist.analysis.report import REPORT_JSON, is_report_folder

    reports = [p for p in paths if is_report_folder(p)]
    if len(reports) == len(paths):
        raise UserError(f"{reports[0]} is an analysis folder fedcp-analyze wrote ({REPORT_JSON}), not a run directory")
    for p in reports:
        print(f"note: {p} skipped: an analysis folder fedcp-analyze wrote ({REPORT_JSON}), not a run", file=sys.stderr)
    runs = [p for p in paths if p not in reports]
    resolved = [Path(p).resolve() for p in runs]
    twice = repeated(resolved)
    if twice is not None:  # it was drawn beside itself, and its own report's sections were dropped as another run's
        first, second = [runs[i] for i, r in enumerate(resolved) if r == twice][:2]
        said = f"run {first!r} is given twice" if first == second else f"{first!r} and {second!r} are one run"
        raise UserError(f"{said}; give each run once")
    return runs


def _file_stems(labels: list) -> dict:
    """{label: a file name part}: letters, digits, '.', '_' and '-' only (a '/' made a folder of the
    name, a '#' or a space broke report.md's links to the figure), distinct for distinct labels."""
    out: dict = {}
    for label in labels:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "run"
        while stem in out.values():
            stem += "_"
        out[label] = stem
    return out


def _labels(runs: list, labels: Optional[str]) -> list:
    if labels is not None:
        names = [t.strip() for t in labels.split(",")]
        if len(names) != len(runs) or not all(names):
            raise UserError(f"--labels: give one non-empty name per run ({len(runs)}), got {labels!r}")
    else:
        names = [Path(r).resolve().name for r in runs]
    if len(set(names)) != len(names):
        names = [f"{n}#{i}" for i, n in enumerate(names)]
    return names


def _figure(name: str, title: str, file: str) -> dict:
    from fedcp_dist.analysis.report import CAPTIONS

    return {name: {"title": title, "file": file, "caption": CAPTIONS[name]}}


def curves(runs: list, out: Path, clients: Optional[list]) -> dict:
    """The curve figures of the runs that have the data for them; {name: figure entry}."""
    from fedcp_dist.analysis import plots

    made = {}
    for name, title, fig in (
        ("accuracy", "Accuracy, AUC and loss", plots.plot_accuracy(runs)),
        ("pir", "PIR against rounds", plots.plot_pir(runs, clients)),
        ("s_distribution", "Distribution of s per client", plots.plot_s_distribution(runs, clients)),
        ("loss_before_after", "Loss before and after local learning", plots.plot_loss_before_after(runs)),
    ):
        if fig is not None:
            plots.save(fig, out / f"{name}.png")
            made.update(_figure(name, title, f"{name}.png"))
    return made


def gradcam(args, run_dirs: list, labels: list, out: Path, clients: list) -> tuple:
    from fedcp_dist.analysis import plots
    from fedcp_dist.analysis.gradcam import fedcp_head_maps
    from fedcp_dist.analysis.runstate import load_run_state

    if args.samples < 1:
        raise UserError(f"--samples must be >= 1, got {args.samples}")
    figures, notes = {}, []
    stems = _file_stems(labels)
    for run_dir, label in zip(run_dirs, labels):
        state = load_run_state(run_dir, args.data, args.device, changes={"cpn_eval_gumbel": False})
        if not hasattr(state.algo, "head_outputs"):
            if len(run_dirs) == 1:
                raise UserError(f"Grad-CAM compares FedCP's global and personal heads; {run_dir} ran {state.cfg.method}")
            print(f"Grad-CAM: {label} ran {state.cfg.method}, not FedCP: skipped")
            continue
        if state.info.kind != "image":
            raise UserError(f"Grad-CAM explains images; {run_dir} trained on {state.info.kind}")
        datas = state.load_data(clients)
        maps = [fedcp_head_maps(state, c, datas[c], args.samples, args.layer) for c in clients]
        name = "gradcam.png" if len(run_dirs) == 1 else f"gradcam_{stems[label]}.png"
        plots.save(plots.gradcam_grid(maps), out / name)
        key = "gradcam" if len(run_dirs) == 1 else f"gradcam_{label}"
        entry = _figure("gradcam", f"Grad-CAM: global vs personal head ({label})", name)
        figures[key] = entry["gradcam"]
        notes.append(f"{label}: the models after {state.rounds_done} of {state.cfg.rounds} rounds (newest checkpoint), "
                     f"clients {', '.join(map(str, clients))}, layer {args.layer or 'last Conv2d'}")
        print(f"Grad-CAM of {label}: models after {state.rounds_done} of {state.cfg.rounds} rounds -> {out / name}")
    if not figures:
        raise UserError("Grad-CAM compares FedCP's global and personal heads; none of the runs is FedCP")
    return figures, {"note": "; ".join(notes)}


def attack_setup(args, clients: list):
    """The DLG attack of the command line, checked (before anything is computed)."""
    from fedcp_dist.analysis import dlg

    attacks = tuple(a.strip().lower() for a in args.attacks.split(",") if a.strip())
    _once(list(attacks), "--attacks")
    setup = dlg.AttackSetup(clients=clients, batches=args.batches, batch_size=args.batch_size,
                            local_steps=args.local_steps, attacks=attacks, steps=args.steps, restarts=args.restarts,
                            knowledge=args.knowledge, seed=args.seed, dp=dp_settings(args.dp_clip, args.dp_noise))
    setup.check()
    return setup


def privacy(args, setup, run_dirs: list, labels: list, out: Path) -> tuple:
    import json

    from fedcp_dist.analysis import dlg, dlg_report, plots
    from fedcp_dist.fileio import atomic_write_bytes

    attacks, clients = setup.attacks, setup.clients
    results = dlg.attack_runs(list(zip(run_dirs, labels)), setup, args.data, args.device,
                              progress=not args.no_progress)
    rows = dlg_report.summarise(results)
    table = dlg_report.markdown_table(rows)
    protocol = (f"Each attacked client trains one round from the run's newest checkpoint with the method's own local "
                f"training on {setup.samples} of its training images ({setup.local_steps} step(s) of {setup.batch_size}); "
                f"the server ({setup.knowledge} knowledge) matches (sent − uploaded)/(η·S) with L-BFGS, {setup.steps} "
                f"iterations × {setup.restarts} start(s); clients {', '.join(map(str, clients))}, {setup.batches} "
                f"upload(s) each, seed {setup.seed}. PSNR/SSIM: mean ± std over the attacked uploads; lower PSNR is "
                f"more private.")
    figures = {}
    for attack in attacks:
        name = f"dlg_{attack}.png"
        plots.save(plots.dlg_grid(dlg_report.grid_rows(results, attack), f"{attack.upper().replace('IDLG', 'iDLG')} "
                                  f"reconstructions"), out / name)
        figures[f"dlg_{attack}"] = {**_figure("dlg", f"DLG reconstructions ({attack})", name)["dlg"]}
    if setup.dp:
        attack = "idlg" if "idlg" in attacks else attacks[0]
        fig = plots.dlg_dp_curves(rows, attack)
        if fig is not None:
            plots.save(fig, out / "dlg_dp.png")
            figures["dlg_dp"] = _figure("dlg_dp", "DLG against clipped and noised uploads", "dlg_dp.png")["dlg_dp"]
        protocol += (f" DP settings (clip C, noise multiplier σ): "
                     f"{', '.join(f'({c:g}, {n:g})' for c, n in setup.dp)}: the upload's delta over every uploaded "
                     f"tensor clipped to C, N(0, (σC)²) added to every value, as dp=central releases it to a server "
                     f"that knows every other participant's update.")
    payload = {"setup": {k: getattr(setup, k) for k in ("clients", "batches", "batch_size", "local_steps", "attacks",
                                                         "steps", "restarts", "knowledge", "seed", "dp")},
               "runs": dict(zip(labels, map(str, run_dirs))), "summary": rows,
               "uploads": [r.row() for r in results]}
    atomic_write_bytes(out / "dlg.json", (json.dumps(payload, indent=2) + "\n").encode("utf-8"))
    print(table, end="")
    return figures, {"protocol": protocol, "table": table, "rows": rows}


# ----------------------------------------------------------------------------- entry points


def _run(args, do_curves: bool, do_gradcam: bool, do_dlg: bool) -> None:
    from fedcp_dist.analysis.records import read_run
    from fedcp_dist.analysis.report import run_numbers, update_report

    paths = _run_folders(args.runs)
    run_dirs = [Path(r) for r in paths]
    for r in run_dirs:
        if not (r / "config.yaml").is_file():
            raise UserError(f"{r} is not a run directory (no config.yaml)")
        if RunDir(r).status() == DIVERGED:  # drawn all the same: what a diverged run looks like may be the question
            print(f"note: {r} diverged (every update was non-finite; it learned nothing): its figures show the "
                  f"untrained model, not a result", file=sys.stderr)
    labels = _labels(paths, args.labels)
    _check_device_and_seed(args)
    chosen = _int_list(args.clients, "--clients") if args.clients is not None else None
    setup = attack_setup(args, chosen or [0]) if do_dlg else None
    out = _out_dir(paths, args.out)
    sections: dict = {"figures": {}}
    if do_curves:
        runs = [read_run(p, label) for p, label in zip(run_dirs, labels)]
        for r in runs:  # a failed sweep point: as refused as one without metrics.jsonl, not 0 figures and exit 0
            if not r.rounds:
                raise UserError(f"{r.path} has no recorded round (its {METRICS} holds none): the run stopped before "
                                f"its first round ended, or has not ended one yet")
        present = {p.client for r in runs for p in (*r.train_probes, *r.eval_probes)}
        if chosen and present and not set(chosen) <= present:
            missing = sorted(set(chosen) - present)
            raise UserError(f"--clients: no probe rows of client(s) {', '.join(map(str, missing))} in these runs "
                            f"(their clients: {min(present)} to {max(present)})")
        sections["runs"] = [run_numbers(r) for r in runs]
        sections["figures"].update(curves(runs, out, chosen))
    if do_gradcam:
        figures, info = gradcam(args, run_dirs, labels, out, chosen or [0, 1])
        sections["figures"].update(figures)
        sections["gradcam"] = info
    if do_dlg:
        figures, info = privacy(args, setup, run_dirs, labels, out)
        sections["figures"].update(figures)
        sections["dlg"] = info
    made = len(sections["figures"])
    update_report(out, sections, run_dirs)
    print(f"wrote {made} figure(s) and {out / 'report.md'}")


@cli_main
def main(argv=None) -> None:
    """Entry point of ``fedcp-analyze``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_options_used(args, parser.given(argv))
    _run(args, do_curves=True, do_gradcam=args.gradcam, do_dlg=args.dlg)


@cli_main
def main_dlg(argv=None) -> None:
    """Entry point of ``fedcp-dlg``: the DLG part of ``fedcp-analyze`` alone."""
    args = build_dlg_parser().parse_args(argv)
    _run(args, do_curves=False, do_gradcam=False, do_dlg=True)


if __name__ == "__main__":
    main(sys.argv[1:])
