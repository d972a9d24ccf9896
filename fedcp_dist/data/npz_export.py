"""Export a shard's clients in the reference library's per-client npz layout (PFLlib's)::

    DIR/config.json       num_clients, num_classes, non_iid, balance, partition,
                          "Size of samples for labels in clients", alpha, batch_size (the
                          library's keys), and this project's: source, seed, shard, input_shape,
                          mean, std, normalisation
    DIR/train/{i}.npz     client i's training samples
    DIR/test/{i}.npz      client i's test samples

Each npz holds one pickled dict under the key ``data`` with arrays ``x`` and ``y`` (as
``np.savez_compressed(f, data={"x": x, "y": y})`` writes it; the library reads it with
``np.load(f, allow_pickle=True)["data"].tolist()``). ``y`` is int64. Images: ``x`` float32
(n, C, H, W), (x / 255 − mean) / std per channel, the library's ``ToTensor`` then ``Normalize``
(its MNIST generator: mean = std = 0.5, so values in [−1, 1]); the engine computes the same values
as (x · (1/255) − mean) · (1/std), which can differ in the last bit. Tables: ``x`` float32 (n, F),
(x − mean) / std with the shard's per-feature statistics. Text: ``x`` an object array (n, 2) of
(int64 token ids of length max_len, number of real tokens) pairs, the library's AG News layout.

Missing folders above DIR are made. The files are written into a temporary folder beside DIR that
replaces DIR only when complete, so an interrupted export leaves neither a partial DIR nor a
damaged earlier one.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from fedcp_dist.data.shards import KIND, TABLE_KIND, TEXT_KIND, load_clients, read_info
from fedcp_dist.errors import UserError
from fedcp_dist.fileio import folder_above_problem

#: clients read from the shard at once
CLIENTS_PER_READ = 64
#: what config.json says of the image values
NORMALISATION = {KIND: "(x / 255 - mean) / std per channel, float32",
                 TABLE_KIND: "(x - mean) / std per feature, float32",
                 TEXT_KIND: "token ids (int64) and real-token counts, not normalised"}


def client_arrays(kind: str, x: np.ndarray, y: np.ndarray, lengths, mean, std) -> dict:
    """One split of one client as the library stores it: {"x": ..., "y": int64}."""
    y = np.asarray(y, dtype=np.int64)
    if kind == TEXT_KIND:
        pairs = np.empty((len(x), 2), dtype=object)
        for r in range(len(x)):
            pairs[r, 0] = np.asarray(x[r], dtype=np.int64)
            pairs[r, 1] = int(lengths[r])
        return {"x": pairs, "y": y}
    if kind == TABLE_KIND:
        m = np.asarray(mean, dtype=np.float32).reshape(1, -1)
        s = np.asarray(std, dtype=np.float32).reshape(1, -1)
        return {"x": ((np.asarray(x, dtype=np.float32) - m) / s).astype(np.float32), "y": y}
    c = x.shape[1]
    m = np.asarray(mean, dtype=np.float32).reshape(1, c, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, c, 1, 1)
    scaled = np.asarray(x, dtype=np.float32) / np.float32(255.0)
    return {"x": ((scaled - m) / s).astype(np.float32), "y": y}


def _config(info, shard: Path) -> dict:
    params = info.partition_params or {}
    labels = info.train_label_counts + info.test_label_counts
    return {
        "num_clients": int(info.num_clients),
        "num_classes": int(info.num_classes),
        "non_iid": info.partition != "iid",
        "balance": bool(params.get("balance", False)) if info.partition == "pat" else info.partition == "iid",
        "partition": info.partition if info.partition in ("pat", "dir") else None,
        "Size of samples for labels in clients": [
            [[int(c), int(n)] for c, n in enumerate(row) if n > 0] for row in labels],
        "alpha": params.get("beta") if info.partition == "dir" else None,
        "batch_size": int(params.get("batch_size", 10)),
        "source": info.source,
        "seed": int(info.seed),
        "shard": str(shard.resolve()),
        "input_shape": [int(d) for d in info.input_shape],
        "mean": [float(v) for v in info.mean],
        "std": [float(v) for v in info.std],
        "normalisation": NORMALISATION[info.kind],
    }


def _save(path: Path, arrays: dict) -> None:
    with open(path, "wb") as f:
        np.savez_compressed(f, data=arrays)


def check_export_target(out, force: bool) -> None:
    """Refuse an export folder that cannot be written, before anything is made: DIR exists (without
    ``force``), is not a folder, or the nearest existing folder above it is a file or not writable.
    Missing folders above DIR are made by the export, as ``--out`` makes the shard's."""
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"--to-npz: {out} exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise UserError(f"--to-npz: {out} is not a directory")
    problem = folder_above_problem(out)
    if problem:
        raise UserError(f"--to-npz: {problem}")


def export_npz(shard, out_dir, *, force: bool = False, say: Callable[[str], None] = print) -> Path:
    """Write every client of ``shard`` to ``out_dir`` in the library's npz layout; returns out_dir.

    Raises :class:`UserError` when ``out_dir`` exists (unless ``force``: then it is replaced once
    the new export is complete) or cannot be written, or the shard cannot be read.
    """
    shard, out = Path(shard), Path(out_dir)
    info = read_info(shard)
    check_export_target(out, force)
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as exc:
        raise UserError(f"--to-npz: cannot write in {parent}: {exc.strerror}") from None
    say(f"exporting {info.num_clients} clients of {shard} to {out} (the reference's npz layout)")
    try:
        (tmp / "train").mkdir()
        (tmp / "test").mkdir()
        ids = list(range(info.num_clients))
        for start in range(0, len(ids), CLIENTS_PER_READ):
            for cid, a in load_clients(shard, ids[start:start + CLIENTS_PER_READ]).items():
                for split in ("train", "test"):
                    arrays = client_arrays(info.kind, a[f"{split}_x"], a[f"{split}_y"], a.get(f"{split}_len"),
                                           info.mean, info.std)
                    _save(tmp / split / f"{cid}.npz", arrays)
        (tmp / "config.json").write_text(json.dumps(_config(info, shard)) + "\n", encoding="utf-8")
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=parent))
            os.replace(out, old / out.name)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old / out.name, out)  # the earlier export back in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--to-npz: writing {out} failed: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_train, n_test = int(info.train_counts.sum()), int(info.test_counts.sum())
    say(f"wrote {out}: config.json, train/0..{info.num_clients - 1}.npz ({n_train} samples), "
        f"test/0..{info.num_clients - 1}.npz ({n_test} samples)")
    return out
