"""``fedcp-partition``: partition a data source among clients into one HDF5 shard file.

Three modes::

    fedcp-partition --source digits --partition dir --num-clients 20 --beta 0.1 --seed 1 \\
        --out data/digits_dir0.1_n20.h5
    fedcp-partition --source agnews --root DIR --max-len 200 --text-pipeline reference \\
        --partition dir --num-clients 20 --out data/agnews_dir0.1_n20.h5
    fedcp-partition --source imagefolder --root CT/ --partition folders --image-size 64 \\
        --channels 1 --out data/ct_folders.h5            # CT/<hospital>/<class>/<image>
    fedcp-partition --source csv --root fraud.csv --label-col Class --client-col bank \\
        --partition column --out data/fraud_banks.h5
    fedcp-partition --source leaf --root leaf/data/femnist/data --out data/femnist.h5   # LEAF's users
    fedcp-partition --source synthetic --synthetic-alpha 1 --synthetic-beta 1 --num-clients 1000 \\
        --seed 1 --out data/synthetic_a1_b1_n1000.h5
    fedcp-partition --describe data/digits_dir0.1_n20.h5
    fedcp-partition --from-npz DIR --out FILE [--num-classes C] [--source NAME] [--allow-pickle]
    fedcp-partition --to-npz DIR --shard FILE [--force]     # the reference library's npz layout
    fedcp-partition --source mnist --root R --partition dir --out FILE --to-npz DIR

``--to-npz DIR`` writes a shard's clients as DIR/config.json, DIR/train/{i}.npz and
DIR/test/{i}.npz (:mod:`fedcp_dist.data.npz_export`): the shard given by ``--shard``, or the one
this command has just written to ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np

from fedcp_dist import interrupts
from fedcp_dist.data.make import (SPLIT_OPTIONS, PartitionSpec, check_out, make_shard, say_written, text_options,
                                  with_progress)
from fedcp_dist.data.npz_export import check_export_target, export_npz
from fedcp_dist.data.text import DEFAULT_MAX_LEN, DEFAULT_MIN_FREQ, DEFAULT_TEXT_PIPELINE, DEFAULT_VOCAB_SIZE, TEXT_PIPELINES
from fedcp_dist.errors import ArgumentParser, UserError, cli_main

NPZ_NAME = re.compile(r"^(\d+)\.npz$")


def _build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fedcp-partition",
                description="Partition a data source among federated clients into an HDF5 shard.")
    mode = p.add_argument_group("input (one of)")
    mode.add_argument("--source", default=None,
                      help="data source: digits (default, offline), mnist, fmnist, cifar10, "
                           "cifar100, tinyimagenet, agnews (text), imagefolder (ROOT/<class>/<image>), "
                           "csv (a table), leaf (LEAF's FEMNIST or Shakespeare JSON files, one client per "
                           "user), synthetic (FedProx's Synthetic(alpha, beta), generated); with --from-npz, "
                           "the name recorded in the file")
    mode.add_argument("--describe", metavar="FILE", help="summarise an existing shard file")
    p.add_argument("--all", action="store_true",
                   help="--describe: one row per client however many there are (default: a "
                        "summary beyond 50 clients)")
    mode.add_argument("--from-npz", metavar="DIR",
                      help="import DIR/train/{i}.npz and DIR/test/{i}.npz client files")
    mode.add_argument("--shard", metavar="FILE", help="--to-npz: the existing shard to export")
    p.add_argument("--to-npz", metavar="DIR",
                   help="also write the shard's clients in the reference library's layout: "
                        "DIR/config.json, DIR/train/{i}.npz, DIR/test/{i}.npz, each a dict "
                        "{'x', 'y'} under 'data' (images float32 (x/255 - mean)/std); the shard "
                        "is --shard FILE, or the --out this command writes")
    p.add_argument("--root", help="directory holding the source's files (torchvision's layout for "
                                  "mnist, fmnist, cifar10, cifar100; tiny-imagenet-200/; AG News "
                                  "train.csv and test.csv; imagefolder: the image folder; csv: the "
                                  "CSV file itself)")
    p.add_argument("--download", action="store_true",
                   help="let torchvision download the source (mnist, fmnist, cifar10, cifar100)")
    p.add_argument("--include-val", action="store_true",
                   help="tinyimagenet: add the 10,000 val images (val/val_annotations.txt) after the "
                        "100,000 train images; the default, as the paper, uses the train folder only")
    text = p.add_argument_group("text sources (agnews)")
    text.add_argument("--max-len", type=int, default=None,
                      help=f"tokens kept per text, padded with id 0 (default {DEFAULT_MAX_LEN})")
    text.add_argument("--text-pipeline", default=DEFAULT_TEXT_PIPELINE, metavar="|".join(TEXT_PIPELINES),
                      help="reference (default): the FedCP authors' AG News pipeline, torchtext's "
                           "basic_english tokens and a vocabulary of the train and test texts, "
                           "uncapped; alnum: runs of [a-z0-9] and a vocabulary of the training "
                           f"texts only, capped at {DEFAULT_VOCAB_SIZE} ids")
    text.add_argument("--vocab-size", type=int, default=None,
                      help=f"most token ids, padding (0) and unknown (1) included (default: no cap "
                           f"with --text-pipeline reference, {DEFAULT_VOCAB_SIZE} with alnum)")
    text.add_argument("--min-freq", type=int, default=None,
                      help=f"fewest occurrences in the counted texts for a token to get its own "
                           f"id (default {DEFAULT_MIN_FREQ})")
    own = p.add_argument_group("your own data (imagefolder, csv)")
    own.add_argument("--image-size", default=None, metavar="N|HxW",
                     help="imagefolder: resize every image to N x N or H x W pixels (default: the "
                          "first image's size, upright by its EXIF orientation)")
    own.add_argument("--channels", type=int, default=None, choices=(1, 3),
                     help="imagefolder: 1 (greyscale) or 3 (RGB) (default: 1 when the first image "
                          "is greyscale or a palette of greys, else 3); transparency is composited "
                          "onto white, 16-bit greyscale scaled to 8 bits")
    own.add_argument("--label-col", default=None, metavar="NAME",
                     help="csv: the column holding the labels (required)")
    own.add_argument("--client-col", default=None, metavar="NAME",
                     help="csv: the column naming each row's client (with --partition column)")
    own.add_argument("--drop-cols", default=None, metavar="A,B",
                     help="csv: comma-separated columns that are not features")
    leaf = p.add_argument_group("LEAF (--source leaf: --root holds train/*.json and test/*.json)")
    leaf.add_argument("--leaf-task", default=None, choices=("femnist", "shakespeare"),
                      help="what the files hold (default: told from the first user's first sample: 784 "
                           "pixel values or a string)")
    syn = p.add_argument_group("Synthetic(alpha, beta) (--source synthetic, with --num-clients and --seed)")
    syn.add_argument("--synthetic-alpha", type=float, default=None, metavar="A",
                     help="std of u_k, the mean of client k's model entries W_k, b_k ~ N(u_k, 1) (required "
                          "unless --synthetic-iid)")
    syn.add_argument("--synthetic-beta", type=float, default=None, metavar="B",
                     help="std of B_k, the mean of client k's input mean v_k ~ N(B_k, 1) (required unless "
                          "--synthetic-iid)")
    syn.add_argument("--synthetic-iid", action="store_true",
                     help="Synthetic-IID: one W, b ~ N(0, 1) for every client, inputs N(0, Sigma)")
    syn.add_argument("--synthetic-min-samples", type=int, default=50, metavar="M",
                     help="a client holds floor(lognormal(4, 2)) + M samples (default 50, FedProx's)")
    syn.add_argument("--synthetic-max-samples", type=int, default=None, metavar="M",
                     help="cap on a client's samples (default: none; the uncapped law averages about "
                          "450 a client)")
    p.add_argument("--partition", default="dir", choices=("dir", "pat", "iid", "folders", "column"),
                   help="partition scheme (default dir); natural partitions: folders "
                        "(imagefolder, ROOT/<client>/<class>/<image>), column (csv, --client-col)")
    p.add_argument("--num-clients", type=int,
                   help="number of clients (natural partitions: taken from the data)")
    p.add_argument("--beta", type=float, default=0.1, help="Dirichlet concentration (default 0.1)")
    p.add_argument("--classes-per-client", type=int, default=2,
                   help="classes per client for pat (default 2)")
    p.add_argument("--unbalanced", action="store_true",
                   help="pat: draw unequal share sizes (default balanced)")
    p.add_argument("--batch-size", type=int, default=10,
                   help="batch size, only used for the minimum client size (default 10)")
    p.add_argument("--train-ratio", type=float, default=0.75,
                   help="fraction of each client's samples used for training (default 0.75)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--max-tries", type=int, default=10000,
                   help="dir: redraws before giving up (default 10000)")
    p.add_argument("--num-classes", type=int,
                   help="--from-npz: number of classes (default max label + 1)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="--from-npz: accept npz files holding a pickled dict under 'data' "
                        "(only for files you trust)")
    p.add_argument("--out", help="output shard file (.h5)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file (and --to-npz folder)")
    return p


def _say(msg: str) -> None:
    print(msg, flush=True)


def _out_arg(args) -> str:
    if not args.out:
        raise UserError("--out FILE is required (or use --describe FILE)")
    return args.out


def _partition(args, given: set) -> None:
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(PartitionSpec)}
    spec = PartitionSpec(**{**options, "source": args.source or "digits"})
    spec.check_scheme_options(given)
    spec.check(given)
    make_shard(spec, _out_arg(args), force=args.force, say=_say)


# ----------------------------------------------------------------------------- npz import


def _npz_ids(folder: Path) -> list[int]:
    if not folder.is_dir():
        raise UserError(f"--from-npz: directory {folder} does not exist")
    ids = sorted(int(m.group(1)) for name in os.listdir(folder)
                 if (m := NPZ_NAME.match(name)))
    if not ids:
        raise UserError(f"--from-npz: no {{i}}.npz files in {folder}")
    if ids != list(range(len(ids))):
        missing = sorted(set(range(ids[-1] + 1)) - set(ids))
        raise UserError(f"--from-npz: client files in {folder} are not numbered 0..{len(ids) - 1} "
                        f"contiguously (missing {missing[0]}.npz)")
    return ids


def _read_npz(path: Path, allow_pickle: bool) -> tuple[np.ndarray, np.ndarray]:
    """Read raw (x, y) from one client npz file, in either layout."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if "x" in z.files and "y" in z.files:
                return z["x"], z["y"]
            if "data" not in z.files:
                raise UserError(f"{path} holds neither arrays 'x' and 'y' nor a 'data' dict "
                                f"(found: {', '.join(z.files) or 'nothing'})")
        if not allow_pickle:
            raise UserError(f"{path} holds a pickled object under 'data', which is never loaded "
                            f"by default; pass --allow-pickle if you trust this file")
        with np.load(path, allow_pickle=True) as z:
            data = z["data"]
            data = data.item() if isinstance(data, np.ndarray) and data.dtype == object else data
    except UserError:
        raise
    except Exception as exc:  # zipfile, pickle and value errors from a bad file
        raise UserError(f"{path} could not be read as npz: "
                        f"{' '.join(str(exc).split())}") from None
    if not isinstance(data, dict) or "x" not in data or "y" not in data:
        raise UserError(f"{path}: 'data' is not a dict with keys 'x' and 'y'")
    return np.asarray(data["x"]), np.asarray(data["y"])


def _to_uint8_images(x: np.ndarray, path: Path) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None, :, :]
    if x.ndim != 4:
        raise UserError(f"{path}: x has shape {x.shape}, expected (n, C, H, W) or (n, H, W)")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        if x.size and np.isnan(x).any():
            raise UserError(f"{path}: float x holds NaN (at index {tuple(int(i) for i in np.argwhere(np.isnan(x))[0])}); "
                            f"images must hold values in [-1, 1]")
        if x.size and (np.min(x) < -1.01 or np.max(x) > 1.01):
            raise UserError(f"{path}: float x must hold images in [-1, 1], found values in "
                            f"[{np.min(x):.3g}, {np.max(x):.3g}]")
        return np.clip(np.round((x.astype(np.float64) + 1) / 2 * 255), 0, 255).astype(np.uint8)
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (x.min() < 0 or x.max() > 255):
            raise UserError(f"{path}: integer x must hold values in 0..255")
        return x.astype(np.uint8)
    raise UserError(f"{path}: x has unsupported dtype {x.dtype}")


def _to_labels(y: np.ndarray, n: int, path: Path) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:  # column vector of labels
        y = y.reshape(-1)
    if y.ndim != 1 or len(y) != n:
        raise UserError(f"{path}: y has shape {y.shape}, expected ({n},)")
    if n and not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.floating) or not np.all(y == np.round(y)):
            raise UserError(f"{path}: y must hold integer class labels, got {y.dtype}")
    y = y.astype(np.int64)
    if n and y.min() < 0:
        raise UserError(f"{path}: y holds negative labels")
    return y


def _load_npz_client(folder: Path, i: int, allow_pickle: bool):
    out = []
    for split in ("train", "test"):
        path = folder / split / f"{i}.npz"
        x, y = _read_npz(path, allow_pickle)
        x = _to_uint8_images(np.asarray(x), path)
        out += [x, _to_labels(np.asarray(y), len(x), path)]
    return tuple(out)


#: the most classes an imported shard may declare (ImageNet-21k has about 21,800)
MAX_CLASSES = 100_000


def _npz_config(folder: Path) -> dict:
    """What an export's ``config.json`` says that an import needs: ``num_classes`` (None when it
    says none); a text or table export, which --from-npz cannot read (images only), is refused."""
    from fedcp_dist.data.npz_export import NORMALISATION
    from fedcp_dist.data.shards import KIND

    path = folder / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UserError(f"--from-npz: {path} is not readable JSON ({getattr(exc, 'strerror', None) or exc}); fix or "
                        f"remove it") from None
    if not isinstance(data, dict):
        raise UserError(f"--from-npz: {path} does not hold a JSON object; fix or remove it")
    kinds = {v: k for k, v in NORMALISATION.items()}
    kind = kinds.get(data.get("normalisation"), KIND)
    if kind != KIND:
        raise UserError(f"--from-npz reads folders of images; {folder} is the export of a {kind} shard (its "
                        f"config.json): keep the shard itself, which --to-npz was made from")
    classes = data.get("num_classes")
    if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int) or classes < 1):
        raise UserError(f"--from-npz: {path}'s num_classes must be an integer >= 1, got {classes!r}")
    return {"num_classes": classes}


def _from_npz(args) -> None:
    from fedcp_dist.data.shards import write_shard

    folder = Path(args.from_npz)
    out = check_out(_out_arg(args), args.force)
    if args.num_classes is not None and args.num_classes < 1:
        raise UserError(f"--num-classes must be >= 1, got {args.num_classes}")
    ids = _npz_ids(folder / "train")
    test_ids = _npz_ids(folder / "test")
    if test_ids != ids:
        raise UserError(f"--from-npz: {folder}/train holds {len(ids)} clients but "
                        f"{folder}/test holds {len(test_ids)}")
    n = len(ids)
    written = _npz_config(folder)

    _say(f"loading {n} clients from {folder} (checking shapes and labels)")
    shape, max_label = None, -1
    for i in ids:  # first pass: shapes and labels, so that attributes are known before writing
        train_x, train_y, test_x, test_y = _load_npz_client(folder, i, args.allow_pickle)
        for x, split in ((train_x, "train"), (test_x, "test")):
            if shape is None:
                shape = x.shape[1:]
            elif x.shape[1:] != shape:
                raise UserError(f"{folder / split / f'{i}.npz'}: images of shape {x.shape[1:]} "
                                f"differ from the shape {shape} of earlier clients")
        for y in (train_y, test_y):
            if len(y):
                max_label = max(max_label, int(y.max()))
    # the classes: --num-classes, else what an export's config.json says (its last classes may hold no
    # sample), else the largest label + 1
    said = "--num-classes"
    num_classes = args.num_classes
    if num_classes is None and written.get("num_classes") is not None:
        said, num_classes = f"{folder / 'config.json'}'s num_classes", written["num_classes"]
    if num_classes is None:
        num_classes = max_label + 1
    if num_classes < 1:
        raise UserError(f"--from-npz: {folder} holds no samples")
    if max_label >= num_classes:
        raise UserError(f"{said} {num_classes} is too small: labels go up to {max_label}")
    if num_classes > MAX_CLASSES:  # the shard's per-class counts: a row of num_classes per client, buffered
        raise UserError(f"{said} {num_classes} is more than the {MAX_CLASSES:,} classes a shard takes "
                        f"(its labels go up to {max_label})")

    _say(f"partitioning: kept as stored ({n} clients, {num_classes} classes)")
    channels = int(shape[0])
    clients = (_load_npz_client(folder, i, args.allow_pickle) for i in ids)
    _say(f"writing {n} clients to {out}")
    write_shard(out, with_progress(clients, n), source=args.source or "npz",
                num_classes=num_classes, input_shape=shape, mean=(0.5,) * channels,
                std=(0.5,) * channels, partition="npz",
                partition_params={"dir": str(folder.resolve())}, seed=-1, replace=args.force)
    say_written(out, _say)


# ----------------------------------------------------------------------------- describe


def _describe(path: str, all_clients: bool) -> None:
    from fedcp_dist.data.shards import describe_lines, read_info

    for line in describe_lines(read_info(path), all_clients):
        _say(line)


def _to_npz(args, shard) -> None:
    export_npz(shard, args.to_npz, force=args.force, say=_say)


def _check_export_args(args) -> None:
    if args.shard is not None and args.to_npz is None:
        raise UserError("--shard names the shard to export: it needs --to-npz DIR")
    if args.to_npz is None:
        return
    if args.describe:
        raise UserError("--describe and --to-npz cannot be used together (export with --shard FILE --to-npz DIR)")
    if args.shard is not None:
        given = [f for f, v in (("--source", args.source), ("--from-npz", args.from_npz), ("--out", args.out))
                 if v is not None]
        if given:
            raise UserError(f"--shard FILE --to-npz DIR exports an existing shard; {given[0]} makes a new one "
                            f"(drop --shard to export the --out it writes)")
        if not Path(args.shard).is_file():
            raise UserError(f"--shard: no such file: {args.shard}")
    elif args.out is None:
        raise UserError("--to-npz DIR needs the shard to export: --shard FILE, or --out FILE of the shard "
                        "this command makes")
    if args.out is not None:
        out, npz = Path(args.out).resolve(), Path(args.to_npz).resolve()
        if out == npz or out in npz.parents or npz in out.parents:
            raise UserError(f"--to-npz {args.to_npz} and --out {args.out} overlap: the export is a folder of its own "
                            f"beside the shard; name another")
    check_export_target(args.to_npz, args.force)  # before a shard is made, not after it


@cli_main
def main(argv=None) -> None:
    """Entry point of ``fedcp-partition``. Ctrl-C and SIGTERM stop it (exit 130, 143) with no file
    written, wherever in a shard's writing they come (:mod:`fedcp_dist.interrupts`)."""
    with interrupts.stops_on(signal.SIGINT, signal.SIGTERM):
        _main(argv)


def _main(argv) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _build_parser()
    args = parser.parse_args(argv)
    given = parser.given(argv)  # an option that does not apply is refused at its default value too
    _check_export_args(args)
    if args.describe and args.from_npz:
        raise UserError("--describe and --from-npz cannot be used together")
    if (args.describe or args.from_npz or args.shard) and args.include_val:
        raise UserError("--include-val applies to --source tinyimagenet only")
    if args.describe or args.from_npz or args.shard:
        own_source = {"leaf_task": "leaf", "synthetic_alpha": "synthetic", "synthetic_beta": "synthetic",
                      "synthetic_iid": "synthetic", "synthetic_min_samples": "synthetic",
                      "synthetic_max_samples": "synthetic", "image_size": "imagefolder",
                      "channels": "imagefolder", "label_col": "csv", "client_col": "csv", "drop_cols": "csv"}
        own = [key for key in own_source if key in given]
        if own:
            raise UserError(f"--{own[0].replace('_', '-')} applies to --source {own_source[own[0]]} only")
    if args.describe:  # it only reads FILE: an --out, --force or --source would be ignored
        named = [flag for flag, key in (("--source", "source"), ("--out", "out"), ("--force", "force"))
                 if key in given]
        if named:
            raise UserError(f"{named[0]} does not apply to --describe, which only reads FILE")
    if args.describe or args.from_npz or args.shard:
        text_options(args.max_len, args.vocab_size, args.min_freq, "image",
                     "--describe" if args.describe else "--from-npz" if args.from_npz else "--shard",
                     args.text_pipeline)
    if args.all and not args.describe:
        raise UserError("--all applies to --describe only")
    if not args.from_npz:
        for key in ("num_classes", "allow_pickle"):
            if key in given:
                raise UserError(f"--{key.replace('_', '-')} applies to --from-npz only")
    if args.from_npz or args.describe or args.shard:  # the clients are kept as stored: no split of ours applies
        used = "--describe" if args.describe else "--from-npz" if args.from_npz else "--shard"
        split = [key for key in (*SPLIT_OPTIONS, "num_clients", "train_ratio", "seed", "root", "download")
                 if key in given]
        if split:
            raise UserError(f"--{split[0].replace('_', '-')} does not apply to {used}, which keeps the clients as "
                            f"stored")
    if args.describe:
        _describe(args.describe, args.all)
    elif args.shard is not None:
        _to_npz(args, args.shard)
    elif args.from_npz:
        _from_npz(args)
        if args.to_npz:
            _to_npz(args, args.out)
    else:
        _partition(args, given)
        if args.to_npz:
            _to_npz(args, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
