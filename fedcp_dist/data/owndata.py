"""Users' own data: a folder of images per class, or a table of numeric features in a CSV file.

* ``imagefolder``: torchvision's ImageFolder layout ``ROOT/<class>/<image>`` (a class folder's
  sub-folders included), any format Pillow reads (files whose suffix Pillow does not know are
  skipped and counted).  Classes are the
  sub-folders in sorted order (label k = the k-th name).  Every image is turned upright by its
  EXIF orientation (photos from cameras and phones), 16-bit greyscale is scaled to 8 bits
  (v / 257; not clipped), an image with transparency (alpha, or a transparent palette or colour
  key) is composited onto white, as it shows on a white page, and the image is converted to
  greyscale (``channels=1``) or RGB (``channels=3``; default: 1 when the first image is
  greyscale or a palette of greys, else 3; a palette image through its colours) and resized
  (bilinear) to ``image_size`` (default: the first image's upright size).  With the natural
  partition ``folders`` the layout is ``ROOT/<client>/<class>/<image>``: each top folder is one
  client (a hospital), the classes the union of the clients' class folders.
* ``csv``: a CSV file with a header row; ``label_col`` names the label (any values: the sorted
  distinct values become labels 0..C-1, numerically when all are integers), ``client_col``
  optionally the client of each row (natural partition ``column``: each distinct value, in
  sorted order, is one client), ``drop_cols`` columns to ignore; every other column is a numeric
  feature.  The features are kept raw (float32) in the shard; their mean and standard deviation
  over the training rows of all clients (never a test row) are the shard's ``mean`` / ``std``,
  and the engine standardises every batch with them, as it normalises images.

Images are decoded into one preallocated uint8 array a block of :data:`DECODE_BLOCK` files at a
time (threads), and CSV rows are parsed a block of :data:`CSV_BLOCK` rows at a time, so memory
is the data set plus a block, as for the built-in sources.  Every bad input is a one-line
:class:`~fedcp_dist.errors.UserError` naming the file (and, for a CSV, the line and column).
"""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Optional

import numpy as np

from fedcp_dist.data.common import NORM_MEAN, NORM_STD, Source, decode_images, one_line, progress, undecodable_line
from fedcp_dist.errors import UserError

#: files decoded per block (one block of decoded images is all that is held beyond the array)
DECODE_BLOCK = 512
#: CSV rows parsed per block
CSV_BLOCK = 8192
#: most feature columns of a table: its mean and std are shard attributes (HDF5: 64 KiB each)
MAX_FEATURES = 4096
#: the largest magnitude a float32 feature holds (a larger finite CSV value would be stored as inf)
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: greyscale Pillow modes: the first image in one of these makes the default channels 1
_GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
#: the natural partitions and the source that has each
NATURAL_PARTITIONS = {"folders": "imagefolder", "column": "csv"}


def parse_image_size(text) -> Optional[tuple]:
    """``"32"`` → (32, 32), ``"48x64"`` → (48, 64) (height x width); None stays None."""
    if text is None:
        return None
    parts = str(text).lower().split("x")
    try:
        hw = tuple(int(p) for p in parts)
    except ValueError:
        hw = ()
    if len(hw) == 1:
        hw = hw * 2
    if len(hw) != 2 or min(hw) < 1:
        raise UserError(f"--image-size must be N or HxW with positive integers, got {text!r}")
    return hw


def split_cols(text) -> list:
    """``"a,b"`` → ["a", "b"] (``--drop-cols``)."""
    if not text:
        return []
    return [c.strip() for c in str(text).split(",") if c.strip()]


# ----------------------------------------------------------------------------- image folders


def _image_suffixes() -> set:
    from PIL import Image

    return {s.lower() for s in Image.registered_extensions()}


def _listdir(folder: Path) -> list:
    try:
        return sorted(n for n in os.listdir(folder) if not n.startswith("."))
    except OSError as exc:
        raise UserError(f"{folder} could not be listed: {one_line(exc)}") from None


def _inside(path: str, folder: str) -> bool:
    """Whether the real path ``path`` is ``folder`` or lies under it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _class_files(folder: Path, suffixes: set) -> tuple[dict, int]:
    """{class name: [image files]} of ``folder/<class>/<image>`` and the count of skipped files.
    A class folder's sub-folders are read too, as torchvision's ImageFolder reads them
    (``<class>/2019/a.png``): each folder's files in sorted order, then its sub-folders in sorted
    order; hidden names are left out. A link to a folder is followed as torchvision follows it,
    once: a folder already read for the class (a link back up, a loop) is not read again, and a
    link into ROOT outside the class's own folder (up to ROOT, into another class) is skipped and
    counted: its images are another class's."""
    out, skipped = {}, 0
    root = os.path.realpath(folder)
    for name in _listdir(folder):
        sub = folder / name
        if not sub.is_dir():
            continue
        files = []
        pending = [sub]
        own = os.path.realpath(sub)
        seen = {own}
        while pending:
            here = pending.pop()
            inner = []
            for f in _listdir(here):
                path = here / f
                if path.is_dir():
                    real = os.path.realpath(path)
                    if _inside(real, root) and not _inside(real, own):
                        skipped += 1
                    elif real not in seen:
                        seen.add(real)
                        inner.append(path)
                elif path.is_file() and Path(f).suffix.lower() in suffixes:
                    files.append(path)
                else:
                    skipped += 1
            pending.extend(reversed(inner))  # the first sub-folder next
        out[name] = files
    return out, skipped


#: EXIF's orientation tag; values 5-8 turn the stored image by a quarter (its width and height swap)
_ORIENTATION = 0x0112
#: Pillow modes with an alpha channel (transparency given as a colour key in ``im.info`` also counts)
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def _wide_grey(im) -> bool:
    """16-bit greyscale (``I;16`` and its byte orders; ``I``, as which older Pillows open 16-bit PNGs)."""
    return im.mode.startswith("I;16") or im.mode == "I"


def _eight_bits(im):
    """A 16-bit greyscale image scaled to 8 bits (v / 257 rounded: 0 stays 0, 65535 becomes 255);
    Pillow's own conversion would clip every value above 255 to white. Other images as they are."""
    from PIL import Image

    if not _wide_grey(im):
        return im
    a = np.clip(np.asarray(im).astype(np.int64), 0, 65535)
    return Image.fromarray(((a + 128) // 257).astype(np.uint8))


def _on_white(im):
    """An image with transparency (alpha channel, or a transparent colour of a palette, greyscale
    or RGB image) composited onto white, as a viewer shows it on a white page; others as they are."""
    from PIL import Image

    if im.mode not in _ALPHA_MODES and "transparency" not in im.info:
        return im
    rgba = im.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)


def _read_image(path: Path, size: tuple, channels: int) -> np.ndarray:
    """One image as uint8 (channels, H, W): turned upright by its EXIF orientation, 16-bit
    greyscale scaled to 8 bits, transparency composited onto white, converted to L or RGB (a
    palette through its colours), resized (bilinear) to ``size``."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            im = _on_white(_eight_bits(ImageOps.exif_transpose(im)))
            im = im.convert("L" if channels == 1 else "RGB")
            if (im.height, im.width) != tuple(size):
                im = im.resize((size[1], size[0]), Image.BILINEAR)
            a = np.asarray(im, dtype=np.uint8)
    except FileNotFoundError:
        raise UserError(f"{path} is missing") from None
    except Exception as exc:  # PIL's errors for truncated or foreign files
        raise UserError(f"{path} is not a readable image: {one_line(exc)}") from None
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _grey_palette(im) -> bool:
    """True when every colour a palette image uses is a grey (R = G = B)."""
    used = np.unique(np.asarray(im))
    rgb = np.asarray(im.getpalette("RGB") or [], dtype=np.int64).reshape(-1, 3)
    used = used[used < len(rgb)]
    return bool(len(used)) and bool((rgb[used] == rgb[used][:, :1]).all())


def _first_image(path: Path) -> tuple[tuple, int]:
    """(H, W) as displayed (after its EXIF orientation) and default channels (1 for a greyscale
    mode or a palette of greys, else 3) of the first image."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            hw = (im.height, im.width)
            if im.getexif().get(_ORIENTATION) in (5, 6, 7, 8):
                hw = hw[::-1]
            grey = im.mode in _GREY_MODES or (im.mode == "P" and _grey_palette(im))
            return hw, (1 if grey else 3)
    except Exception as exc:
        raise UserError(f"{path} is not a readable image: {one_line(exc)}") from None


def _decode(files: list, size: tuple, channels: int) -> np.ndarray:
    """Decode ``files`` into one preallocated (n, channels, H, W) array, a block at a time."""
    workers = max(1, min(8, os.cpu_count() or 1))
    return decode_images(files, (channels,) + tuple(size), lambda f: _read_image(f, size, channels), workers,
                         DECODE_BLOCK)


def load_imagefolder(root, *, image_size=None, channels=None, natural: bool = False,
                     say=lambda _msg: None):
    """The images under ``root`` as a :class:`~fedcp_dist.data.common.Source`.

    ``natural``: the layout ``root/<client>/<class>/<image>``; the source's ``groups`` then give
    each sample's client (the index of its folder in sorted order) and ``group_names`` the folders.
    """
    if root is None:
        raise UserError("source 'imagefolder' needs its folder: pass --root DIR")
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--root {root} is not a directory")
    if channels is not None and channels not in (1, 3):
        raise UserError(f"--channels must be 1 or 3, got {channels}")
    size = parse_image_size(image_size)
    suffixes = _image_suffixes()
    if natural:
        tops = [n for n in _listdir(root) if (root / n).is_dir()]
        if not tops:
            raise UserError(f"{root} holds no client folders (--partition folders reads "
                            f"ROOT/<client>/<class>/<image>)")
        per_client = []
        skipped = 0
        for name in tops:
            classes, skip = _class_files(root / name, suffixes)
            if not classes:
                raise UserError(f"{root / name} holds no class folders (--partition folders reads "
                                f"ROOT/<client>/<class>/<image>)")
            per_client.append(classes)
            skipped += skip
        class_names = sorted({c for classes in per_client for c in classes})
    else:
        tops = None
        classes, skipped = _class_files(root, suffixes)
        if not classes:
            raise UserError(f"{root} holds no class folders (--source imagefolder reads "
                            f"ROOT/<class>/<image>)")
        per_client = [classes]
        class_names = sorted(classes)
    empty = [c for c in class_names if not any(classes.get(c) for classes in per_client)]
    if empty and any(classes.get(c) for classes in per_client for c in class_names):
        raise UserError(f"class folder '{empty[0]}' under {root} holds no image"
                        f"{f' (and {len(empty) - 1} more)' if len(empty) > 1 else ''}: a class without samples would "
                        f"be a class of the model's output none is ever labelled with; remove the folder")
    index = {c: k for k, c in enumerate(class_names)}
    files, labels, groups = [], [], []
    for g, classes in enumerate(per_client):
        for c in sorted(classes):
            files += classes[c]
            labels += [index[c]] * len(classes[c])
            groups += [g] * len(classes[c])
    if not files:
        raise UserError(f"{root} holds no images Pillow can read (looked for "
                        f"{', '.join(sorted(s for s in suffixes if s in ('.png', '.jpg', '.jpeg', '.bmp', '.tif')))} "
                        f"and the other formats Pillow knows)")
    first_size, first_channels = _first_image(files[0])
    size = size or first_size
    channels = channels or first_channels
    say(f"  {len(files)} images in {len(class_names)} classes"
        + (f" from {len(tops)} client folders" if natural else "")
        + (f" ({skipped} other files skipped)" if skipped else "")
        + f"; as {channels}x{size[0]}x{size[1]}")
    x = _decode(files, size, channels)
    params = {"image_size": list(size), "channels": channels, "classes": class_names}
    src = Source(x=x, y=np.asarray(labels, dtype=np.int64), num_classes=len(class_names),
                 mean=(NORM_MEAN,) * channels, std=(NORM_STD,) * channels, name="imagefolder",
                 params=params)
    if natural:
        src.groups = np.asarray(groups, dtype=np.int64)
        src.group_names = tops
    return src


# ----------------------------------------------------------------------------- CSV tables


def _label_values(raw: list) -> tuple[np.ndarray, list]:
    """Labels 0..C-1 for the distinct values of ``raw`` (numeric order when all are integers: then
    ``1``, ``01`` and ``+1`` are the one class 1, as they are the one number)."""
    distinct = sorted(set(raw))
    try:
        as_int = {v: int(v) for v in distinct}
    except ValueError:
        index = {v: k for k, v in enumerate(distinct)}
        return np.asarray([index[v] for v in raw], dtype=np.int64), list(distinct)
    names = sorted(set(as_int.values()))
    position = {n: k for k, n in enumerate(names)}
    index = {v: position[as_int[v]] for v in distinct}
    return np.asarray([index[v] for v in raw], dtype=np.int64), names


def read_csv_table(path, label_col: str, client_col: Optional[str] = None, drop_cols=()):
    """(features float32 (n, F), feature names, labels (n,) int64, class names, client values or None)."""
    path = Path(path)
    if not label_col:
        raise UserError("source 'csv' needs --label-col NAME (the column holding the labels)")
    if not path.is_file():
        raise UserError(f"--root {path} is not a file (source 'csv' reads one CSV file)")
    drop = set(drop_cols)
    blocks, raw_labels, raw_clients = [], [], []
    line = 0
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise UserError(f"{path} is empty (expected a header row)")
            header = [h.strip() for h in header]
            if "" in header:
                raise UserError(f"{path} line {reader.line_num}: column {header.index('') + 1} of the header has "
                                f"no name (a stray separator?)")
            for name in [label_col] + ([client_col] if client_col else []) + sorted(drop):
                if name not in header:
                    flag = ("--label-col" if name == label_col else
                            "--client-col" if name == client_col else "--drop-cols")
                    raise UserError(f"{path} has no column '{name}' ({flag}); its columns: "
                                    f"{', '.join(header)}")
            if len(set(header)) != len(header):
                dup = next(h for h in header if header.count(h) > 1)
                raise UserError(f"{path}: the column name '{dup}' appears twice in the header")
            skip = {label_col, client_col, *drop}
            feat_idx = [i for i, h in enumerate(header) if h not in skip]
            names = [header[i] for i in feat_idx]
            if not names:
                raise UserError(f"{path} has no feature columns left (all are label, client or dropped)")
            if len(names) > MAX_FEATURES:
                raise UserError(f"{path} has {len(names)} feature columns, at most {MAX_FEATURES} "
                                f"are supported (drop some with --drop-cols)")
            li = header.index(label_col)
            ci = header.index(client_col) if client_col else None
            block = np.empty((CSV_BLOCK, len(names)), dtype=np.float32)
            fill = 0
            for row in progress(reader, desc="reading rows", unit="row"):
                line = reader.line_num
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) != len(header):
                    raise UserError(f"{path} line {line}: {len(row)} fields, the header has "
                                    f"{len(header)}")
                for j, i in enumerate(feat_idx):
                    cell = row[i].strip()
                    if not cell:
                        raise UserError(f"{path} line {line}: column '{header[i]}' is empty, a feature column needs "
                                        f"a number in every row (drop the column with --drop-cols)")
                    try:
                        v = float(cell)
                    except ValueError:
                        v = math.nan
                    if not math.isfinite(v):
                        raise UserError(f"{path} line {line}: column '{header[i]}' holds "
                                        f"{cell[:30]!r}, not a finite number (drop the column "
                                        f"with --drop-cols)")
                    if abs(v) > FLOAT32_MAX:  # a finite number that float32 features would hold as inf
                        raise UserError(f"{path} line {line}: column '{header[i]}' holds {cell[:30]!r}, outside "
                                        f"float32's range (±3.4e38) that the features are stored in; rescale the "
                                        f"column or drop it with --drop-cols")
                    block[fill, j] = v
                label = row[li].strip()
                if not label:
                    raise UserError(f"{path} line {line}: the label column '{label_col}' is empty")
                raw_labels.append(label)
                if ci is not None:
                    client = row[ci].strip()
                    if not client:
                        raise UserError(f"{path} line {line}: the client column '{client_col}' is empty")
                    raw_clients.append(client)
                fill += 1
                if fill == CSV_BLOCK:
                    blocks.append(block)
                    block = np.empty_like(block)
                    fill = 0
            blocks.append(block[:fill])
    except UserError:
        raise
    except UnicodeDecodeError:
        bad, what = undecodable_line(path)
        raise UserError(f"{path} line {bad}: not UTF-8 text ({what}); save the file as UTF-8") from None
    except csv.Error as exc:
        raise UserError(f"{path} line {line + 1}: {one_line(exc)}") from None
    except OSError as exc:
        raise UserError(f"{path} could not be read: {one_line(exc)}") from None
    if not raw_labels:
        raise UserError(f"{path} holds no data rows")
    x = np.concatenate(blocks) if len(blocks) > 1 else blocks[0].copy()
    del blocks
    y, classes = _label_values(raw_labels)
    return x, names, y, classes, (raw_clients if client_col else None)


def load_csv(root, *, label_col=None, client_col=None, drop_cols=None, natural: bool = False,
             say=lambda _msg: None):
    """The table in the CSV file ``root`` as a :class:`~fedcp_dist.data.common.Source` of kind
    ``table`` (``mean`` / ``std`` are filled in once the training rows are known:
    :func:`train_statistics`)."""
    if root is None:
        raise UserError("source 'csv' needs its file: pass --root FILE.csv")
    if natural and not client_col:
        raise UserError("--partition column needs --client-col NAME (each value is one client)")
    if client_col and not natural:
        raise UserError("--client-col needs --partition column (each value of the column is one client)")
    if client_col and client_col == label_col:
        raise UserError(f"--client-col and --label-col are both '{label_col}'")
    x, names, y, classes, clients = read_csv_table(root, label_col, client_col, split_cols(drop_cols))
    say(f"  {len(y)} rows, {len(names)} feature columns, {len(classes)} classes "
        f"({', '.join(map(str, classes[:10]))}{', ...' if len(classes) > 10 else ''})")
    src = Source(x=x, y=y, num_classes=len(classes), mean=(), std=(), name="csv", kind="table",
                 params={"label_col": label_col, "classes": classes,
                         **({"client_col": client_col} if client_col else {}),
                         **({"drop_cols": split_cols(drop_cols)} if drop_cols else {})})
    src.feature_names = names
    if clients is not None:
        group_names = sorted(set(clients))
        index = {c: g for g, c in enumerate(group_names)}
        src.groups = np.asarray([index[c] for c in clients], dtype=np.int64)
        src.group_names = group_names
    return src


def train_statistics(x: np.ndarray, shares) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and standard deviation (population, float64) of the training rows of
    every client in ``shares`` (``(train_idx, test_idx)`` pairs), a block of rows at a time.
    A constant feature gets std 1 (it standardises to 0)."""
    idx = np.sort(np.concatenate([np.asarray(tr, dtype=np.int64) for tr, _ in shares]))
    if not len(idx):
        raise UserError("no training rows: nothing to compute the standardisation from")
    total = np.zeros(x.shape[1], dtype=np.float64)
    for start in range(0, len(idx), CSV_BLOCK):
        total += x[idx[start:start + CSV_BLOCK]].sum(axis=0, dtype=np.float64)
    mean = total / len(idx)
    sq = np.zeros_like(mean)
    for start in range(0, len(idx), CSV_BLOCK):
        d = x[idx[start:start + CSV_BLOCK]].astype(np.float64) - mean
        sq += (d * d).sum(axis=0)
    std = np.sqrt(sq / len(idx))
    std[std <= 1e-12] = 1.0
    return mean, std


def natural_shares(groups: np.ndarray, names: list, train_ratio: float, seed: int, what: str):
    """Each group's (client's) own train/test split, ``(train_idx, test_idx)`` per group in order,
    from one ``np.random.default_rng(seed)``; a client too small for one train and one test sample
    is an error naming it (``what``: "client folder" or "client")."""
    from fedcp_dist.data.partition import min_split_samples, split_train_test

    rng = np.random.default_rng(seed)
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=len(names))
    floor = min_split_samples(train_ratio)
    shares = []
    for g, idx in enumerate(np.split(order, np.cumsum(counts)[:-1])):
        if len(idx) < floor:
            raise UserError(f"{what} '{names[g]}' holds {len(idx)} samples; each client needs at "
                            f"least {floor} (one train and one test sample at --train-ratio "
                            f"{train_ratio:g})")
        shares.append(split_train_test(idx, train_ratio, rng))
    return shares
