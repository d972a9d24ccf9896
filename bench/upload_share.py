"""The CPN's share of FedCP's upload, per paper setting: what the switches that leave the CPN out of
some rounds' uploads can save.

    python bench/upload_share.py                 # every setting of bench/models.py
    python bench/upload_share.py --rounds 30 --json upload_share.json

No training: each setting's model is built (CPU, untrained) and its upload counted as the engine
averages it (``fedcp_dist.comm.compress.upload_parts``: BatchNorm statistics stay with the clients). A
switch that sends the CPN only in the rounds t (0 … T − 1) with t mod U = 0 (``cpn_upload_every=U``,
``policy_refresh_every=U``), s = ⌈T/U⌉ of T, saves share · (1 − s/T) of the uplink; a warm-up of W
rounds saves share · W/T; the asynchronous CPN's saving depends on the cohort draws and is not
computed here. "of model" is
the CPN's size against the rest of the upload (extractor and head), the ratio the paper states.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedcp_dist.algorithms import make_algorithm  # noqa: E402
from fedcp_dist.comm.compress import skipped_part_saving, upload_parts  # noqa: E402
from fedcp_dist.config import Config  # noqa: E402
from fedcp_dist.models import build_model  # noqa: E402

#: name -> (model, input shape, classes, vocabulary); the paper's settings (bench/models.py's)
SETTINGS = {
    "mnist_cnn": ("cnn", (1, 28, 28), 10, 0),
    "cifar100_cnn": ("cnn", (3, 32, 32), 100, 0),
    "tinyimagenet_cnn": ("cnn", (3, 64, 64), 200, 0),
    "tinyimagenet_resnet18": ("resnet18", (3, 64, 64), 200, 0),
    "agnews_fasttext": ("fasttext", (200,), 4, 50_000),
}


def cpn_share(model: str, shape, classes: int, vocab: int = 0, **cfg_keys) -> dict:
    """The upload of FedCP with ``model`` per part, and the CPN's share of it."""
    torch.manual_seed(0)
    cfg = Config(**cfg_keys)
    algo = make_algorithm("fedcp", cfg, build_model(model, shape, classes, vocab_size=vocab), torch.device("cpu"))
    parts = upload_parts(algo, algo.init_global_state(), cfg.aggregate_bn_stats)
    total = sum(parts.values())
    cpn = parts.get("cpn", 0)
    return {"parts": parts, "upload": total, "cpn": cpn, "share": cpn / total, "of_model": cpn / (total - cpn)}


def sent_rounds(rounds: int, every: int) -> int:
    """Rounds t (0 … rounds − 1) in which the CPN travels when it does only for t mod every = 0."""
    return sum(1 for t in range(rounds) if t % every == 0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    p.add_argument("--rounds", type=int, default=30, help="rounds the savings are over (default 30)")
    p.add_argument("--every", default="2,3,5", help="comma-separated U (and P) to show savings for")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad or not names:
        p.error(f"--settings: unknown {', '.join(bad) or '(none)'}; known: {', '.join(SETTINGS)}")
    try:
        every = [int(u) for u in args.every.split(",")]
    except ValueError:
        p.error(f"--every: comma-separated integers, got {args.every!r}")
    if args.rounds < 1 or any(u < 1 for u in every):
        p.error("--rounds and every --every value must be >= 1")
    rows = []
    print(f"{'setting':<22} {'upload':>11} {'CPN':>9} {'share':>7} {'of model':>8}  "
          + "  ".join(f"U={u}".rjust(7) for u in every) + f"   (saving over {args.rounds} rounds)")
    for name in names:
        model, shape, classes, vocab = SETTINGS[name]
        r = cpn_share(model, shape, classes, vocab)
        r["setting"] = name
        r["saving_every"] = {u: skipped_part_saving(r["share"], sent_rounds(args.rounds, u), args.rounds)
                             for u in every}
        rows.append(r)
        print(f"{name:<22} {r['upload']:>11,} {r['cpn']:>9,} {100 * r['share']:>6.2f}% {100 * r['of_model']:>7.2f}%  "
              + "  ".join(f"{100 * s:>6.1f}%" for s in r["saving_every"].values()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "settings": rows}, indent=2) + "\n")


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
