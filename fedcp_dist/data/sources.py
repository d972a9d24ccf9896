"""Data sources, loaded whole into memory: images as uint8 arrays, texts as int32 token ids.

Each source merges its train and test sets (train first, then test); the partitioner later
splits every client's share into its own train and test parts.

* ``digits``: scikit-learn's bundled 8x8 digits, upsampled to 28x28; needs neither a root nor a
  network and is the offline default.
* ``mnist``, ``fmnist``: read through :mod:`torchvision.datasets` from ``root`` (its
  ``MNIST/raw`` and ``FashionMNIST/raw`` idx-ubyte files).
* ``cifar10``, ``cifar100``: the python-pickle batches (``cifar-10-batches-py/``,
  ``cifar-100-python/``) read by this project's own reader, :mod:`fedcp_dist.data.cifar`, which
  checks each file's structure and runs no code a pickle names.  ``download`` fetches the
  original archive through torchvision.
* ``tinyimagenet``: the ``tiny-imagenet-200/`` folder (``wnids.txt``, ``train/<wnid>/images``),
  3x64x64 RGB, label = line of the wnid in ``wnids.txt``: the train folder's 100,000 images, the
  paper's and the reference's data set. ``include_val`` adds ``val/images`` labelled by
  ``val/val_annotations.txt`` (not by folder: some copies of the val folder are not reorganised
  per class).
* ``agnews``: the AG News ``train.csv`` / ``test.csv`` files, tokenised by
  :mod:`fedcp_dist.data.text`: by default (``text_pipeline="reference"``) as the FedCP authors did,
  torchtext's basic_english rules and a vocabulary of the train and test texts, uncapped;
  ``text_pipeline="alnum"``: ``[a-z0-9]`` runs and a vocabulary of the training texts only.
* ``imagefolder``, ``csv``: users' own image folders and tables, read by
  :mod:`fedcp_dist.data.owndata` with their own options (``load_source(..., own_options=...)``).
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from fedcp_dist.data import text as textlib
from fedcp_dist.data.cifar import CIFAR, cifar_batch, read_cifar_pickle
from fedcp_dist.data.common import NORM_MEAN, NORM_STD, Source, decode_images, progress, undecodable_line
from fedcp_dist.data.common import one_line as _one_line
from fedcp_dist.data.owndata import load_csv, load_imagefolder
from fedcp_dist.errors import UserError

#: Sources whose samples are token-id sequences rather than images.
TEXT_SOURCES = ("agnews",)
#: Sources whose samples are rows of numeric features.
TABLE_SOURCES = ("csv",)
#: Users' own data (:mod:`fedcp_dist.data.owndata`): loaded with their own options.
OWN_SOURCES = ("imagefolder", "csv")


def _make_source(name: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> Source:
    channels = int(x.shape[1])
    return Source(
        x=np.ascontiguousarray(x, dtype=np.uint8),
        y=np.ascontiguousarray(y, dtype=np.int64),
        num_classes=int(num_classes),
        mean=(NORM_MEAN,) * channels,
        std=(NORM_STD,) * channels,
        name=name,
    )


def _need_root(name: str, root, download_hint: bool = True) -> Path:
    if root is None:
        hint = " (and --download to fetch it there)" if download_hint else ""
        raise UserError(f"source '{name}' needs a data directory: pass --root DIR{hint}")
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--root {root} is not a directory")
    return root


def _no_download(name: str, how: str) -> None:
    raise UserError(f"source '{name}' cannot be downloaded by fedcp-partition: {how}")


# ----------------------------------------------------------------------------- digits


def _load_digits(root, download, **_) -> Source:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) * (255.0 / 16.0)
    t = torch.from_numpy(images).unsqueeze(1)  # (n, 1, 8, 8)
    t = F.interpolate(t, size=(28, 28), mode="bilinear", align_corners=False)
    x = t.round().clamp_(0, 255).to(torch.uint8).numpy()
    return _make_source("digits", x, np.asarray(bunch.target, dtype=np.int64), 10)


# ----------------------------------------------------------------------------- MNIST, FashionMNIST


def _bad_idx_header(cls, raw: Path) -> str:
    """What is wrong with the first idx-ubyte file under ``raw`` whose header is not one of unsigned
    bytes of the dimensions its name says (images 3, labels 1), or "" (torchvision asserts on it
    with no message)."""
    for url, _ in cls.resources:
        file = raw / os.path.splitext(os.path.basename(url))[0]
        ndim = 3 if "images" in file.name else 1
        try:
            with open(file, "rb") as f:
                head = f.read(4)
        except OSError:
            continue
        if head != bytes([0, 0, 0x08, ndim]):
            return (f"{file} is not an idx-ubyte file of {'images' if ndim == 3 else 'labels'}: it begins "
                    f"{head.hex(' ') or 'with nothing'}, expected 00 00 08 {ndim:02x}")
    return ""


def _torchvision_loader(name: str, class_name: str, num_classes: int) -> Callable:
    def load(root, download, **_) -> Source:
        if root is None:
            raise UserError(f"source '{name}' needs a data directory: pass --root DIR "
                            f"(and --download to fetch it there)")
        import torchvision.datasets as tvd

        cls = getattr(tvd, class_name)
        raw = Path(root) / cls.__name__ / "raw"
        if not download:
            for url, _ in cls.resources:  # the unpacked idx-ubyte files torchvision reads
                file = raw / os.path.splitext(os.path.basename(url))[0]
                if not file.is_file():
                    if Path(f"{file}.gz").is_file():  # as the files are published: torchvision reads them unpacked
                        raise UserError(f"source '{name}' under root '{root}': {file} is missing but {file}.gz "
                                        f"is there; unpack the files where they are (gunzip -k {raw}/*.gz)")
                    raise UserError(f"source '{name}' not found under root '{root}': {file} is "
                                    f"missing; pass --download to fetch it")
        parts = []
        for train in (True, False):
            try:
                ds = cls(root=str(root), train=train, download=download)
            except Exception as exc:  # a failed download, or a garbled idx file (torchvision
                # asserts on a bad header and fails to reshape a truncated body)
                if download:
                    raise UserError(f"could not download source '{name}' into root '{root}': "
                                    f"{_one_line(exc)}") from None
                raise UserError(f"source '{name}': " + (_bad_idx_header(cls, raw) or (
                    f"the idx-ubyte files in {raw} could not be read (truncated or corrupt?): "
                    f"{_one_line(exc)}"))) from None
            x, y = _arrays_of(ds)
            if len(x) != len(y):
                raise UserError(f"source '{name}': the idx-ubyte files in {raw} hold {len(x)} "
                                f"images but {len(y)} labels")
            parts.append((x, y))
        (train_x, _), (test_x, _) = parts
        if train_x.shape[1:] != test_x.shape[1:]:
            raise UserError(f"source '{name}': the idx-ubyte files in {raw} hold training images of "
                            f"{'x'.join(map(str, train_x.shape[1:]))} but test images of "
                            f"{'x'.join(map(str, test_x.shape[1:]))} (a file of another data set?)")
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        return _make_source(name, x, y, num_classes)

    return load


def _arrays_of(ds) -> tuple[np.ndarray, np.ndarray]:
    """The raw (x, y) arrays of a torchvision image data set, as (n, C, H, W) uint8 and int64."""
    data = ds.data
    data = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    if data.ndim == 3:  # MNIST-style (n, H, W)
        x = data[:, None, :, :]
    elif data.ndim == 4:  # CIFAR-style (n, H, W, C)
        x = data.transpose(0, 3, 1, 2)
    else:
        raise UserError(f"unexpected image array shape {tuple(data.shape)} in {type(ds).__name__}")
    targets = ds.targets
    y = targets.numpy() if hasattr(targets, "numpy") else np.asarray(targets)
    return np.ascontiguousarray(x, dtype=np.uint8), y.astype(np.int64)


# ----------------------------------------------------------------------------- CIFAR (the reader: fedcp_dist.data.cifar)


def _cifar_loader(name: str) -> Callable:
    layout = CIFAR[name]

    def load(root, download, **_) -> Source:
        root = _need_root(name, root)
        base = root / layout.folder
        if not base.is_dir() and root.name == layout.folder:
            base = root  # --root is the batch folder itself
        if not base.is_dir() and download:
            import torchvision.datasets as tvd

            try:
                getattr(tvd, layout.torchvision_class)(root=str(root), train=True, download=True)
            except (RuntimeError, OSError) as exc:
                raise UserError(f"could not download source '{name}' into root '{root}': "
                                f"{_one_line(exc)}") from None
            base = root / layout.folder
        if not base.is_dir():
            raise UserError(f"source '{name}' not found under root '{root}': it has no folder "
                            f"{layout.folder}; pass --download to fetch it")
        meta = read_cifar_pickle(base / layout.meta)
        names = meta.get(layout.meta_key)
        if not isinstance(names, (list, tuple)) or len(names) != layout.num_classes:
            found = len(names) if isinstance(names, (list, tuple)) else "no"
            raise UserError(f"{base / layout.meta}: '{layout.meta_key}' should list "
                            f"{layout.num_classes} class names, found {found}")
        xs, ys = [], []
        for file in layout.train + layout.test:
            data, labels = cifar_batch(base / file, layout)
            xs.append(data)
            ys.append(labels)
        x = np.concatenate(xs).reshape(-1, 3, 32, 32)  # rows are R, G, B planes of 32x32
        del xs
        return _make_source(name, x, np.concatenate(ys), layout.num_classes)

    return load


# ----------------------------------------------------------------------------- Tiny-ImageNet

TINY_FOLDER = "tiny-imagenet-200"
TINY_SIZE = 64
_JPEG_SUFFIXES = (".jpeg", ".jpg")
_DECODE_BLOCK = 1024


def _find_base(name: str, root: Path, folder: str, marker: str) -> Path:
    """``root/folder`` or ``root`` itself, whichever holds ``marker``."""
    for base in (root / folder, root):
        if (base / marker).is_file():
            return base
    raise UserError(f"source '{name}' not found: neither {root / folder / marker} nor "
                    f"{root / marker} exists")


def _read_wnids(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} could not be read: {_one_line(exc)}") from None
    wnids, seen = [], {}
    for number, line in enumerate(lines, 1):
        wnid = line.strip()
        if not wnid:
            continue
        if len(wnid.split()) != 1:
            raise UserError(f"{path} line {number}: expected one wnid, found {wnid!r}")
        if wnid in seen:
            raise UserError(f"{path} line {number}: wnid {wnid} repeats line {seen[wnid]}")
        seen[wnid] = number
        wnids.append(wnid)
    if not wnids:
        raise UserError(f"{path} lists no wnids")
    return wnids


def _read_rgb(path: Path) -> np.ndarray:
    """One image as uint8 (3, 64, 64); greyscale and other modes are converted to RGB."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.size != (TINY_SIZE, TINY_SIZE):
                raise UserError(f"{path} is {im.size[0]}x{im.size[1]} pixels, expected "
                                f"{TINY_SIZE}x{TINY_SIZE}")
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{path} is missing") from None
    except Exception as exc:  # PIL's errors for truncated or foreign files
        raise UserError(f"{path} is not a readable image: {_one_line(exc)}") from None
    return rgb.transpose(2, 0, 1)


def _load_tinyimagenet(root, download, include_val: bool = False, **_) -> Source:
    name = "tinyimagenet"
    if download:
        _no_download(name, "fetch tiny-imagenet-200.zip yourself, unzip it, and pass the folder "
                           "holding tiny-imagenet-200 (or that folder itself) as --root")
    root = _need_root(name, root, download_hint=False)
    base = _find_base(name, root, TINY_FOLDER, "wnids.txt")
    wnids = _read_wnids(base / "wnids.txt")
    index = {w: k for k, w in enumerate(wnids)}
    files, labels = [], []
    for k, wnid in enumerate(wnids):
        folder = base / "train" / wnid / "images"
        if not folder.is_dir():
            raise UserError(f"{folder} is missing (class {wnid} of {base / 'wnids.txt'})")
        names = sorted(n for n in os.listdir(folder) if n.lower().endswith(_JPEG_SUFFIXES))
        if not names:
            raise UserError(f"{folder} holds no .JPEG images")
        files += [folder / n for n in names]
        labels += [k] * len(names)
    n_train = len(files)
    n_val = _tiny_val(base, index, files, labels) if include_val else 0
    workers = max(1, min(8, os.cpu_count() or 1))
    x = decode_images(files, (3, TINY_SIZE, TINY_SIZE), _read_rgb, workers, _DECODE_BLOCK)
    src = _make_source(name, x, np.asarray(labels, dtype=np.int64), len(wnids))
    src.params = {**src.params, "include_val": bool(include_val), "train_images": n_train, "val_images": n_val}
    return src


def _tiny_val(base: Path, index: dict, files: list, labels: list) -> int:
    """Append the val images and their labels from ``val/val_annotations.txt``; their number."""
    ann = base / "val" / "val_annotations.txt"
    try:
        lines = ann.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{ann} is missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{ann} could not be read: {_one_line(exc)}") from None
    n_val = 0
    seen: dict = {}  # file name -> the line that listed it
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0].strip():
            raise UserError(f"{ann} line {number}: expected tab-separated file name, wnid and "
                            f"box, found {line.strip()!r}")
        file, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in index:
            raise UserError(f"{ann} line {number}: wnid {wnid!r} is not in {base / 'wnids.txt'}")
        if file in seen:  # one image twice: its copies could land in one client's train and test splits
            raise UserError(f"{ann} line {number}: {file} is listed again (line {seen[file]}); each val image once")
        seen[file] = number
        files.append(base / "val" / "images" / file)
        labels.append(index[wnid])
        n_val += 1
    if n_val == 0:
        raise UserError(f"{ann} lists no images")
    return n_val


# ----------------------------------------------------------------------------- AG News

AGNEWS_FOLDER = "ag_news_csv"
AGNEWS_CLASSES = 4


def read_agnews_csv(path) -> tuple[np.ndarray, list[str]]:
    """Labels (0-3) and texts (title + " " + description) of one AG News CSV file."""
    path = Path(path)
    labels: list[int] = []
    texts: list[str] = []
    line = 0
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a BOM (Excel's UTF-8) is not part of the text
            reader = csv.reader(f)
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                if len(row) != 3:
                    raise UserError(f"{path} line {line}: expected 3 columns (class index, title, "
                                    f"description), found {len(row)}")
                try:
                    k = int(row[0])
                except ValueError:
                    raise UserError(f"{path} line {line}: class index {row[0][:20]!r} is not an "
                                    f"integer") from None
                if not 1 <= k <= AGNEWS_CLASSES:
                    raise UserError(f"{path} line {line}: class index {k} is not in "
                                    f"1..{AGNEWS_CLASSES}")
                labels.append(k - 1)
                texts.append(row[1] + " " + row[2])
    except FileNotFoundError:
        raise UserError(f"{path} is missing") from None
    except UnicodeDecodeError:
        bad, what = undecodable_line(path)
        raise UserError(f"{path} line {bad}: not UTF-8 text ({what})") from None
    except csv.Error as exc:
        raise UserError(f"{path} line {line + 1}: {_one_line(exc)}") from None
    except OSError as exc:
        raise UserError(f"{path} could not be read: {_one_line(exc)}") from None
    if not labels:
        raise UserError(f"{path} holds no rows")
    return np.asarray(labels, dtype=np.int64), texts


def _load_agnews(root, download, max_len=textlib.DEFAULT_MAX_LEN, vocab_size=None,
                 min_freq=textlib.DEFAULT_MIN_FREQ, text_pipeline=textlib.DEFAULT_TEXT_PIPELINE) -> Source:
    """``vocab_size`` None: the pipeline's own cap (reference: none; alnum: 50,000)."""
    name = "agnews"
    try:
        textlib.check_pipeline(text_pipeline)
        if vocab_size is None and text_pipeline == "alnum":
            vocab_size = textlib.DEFAULT_VOCAB_SIZE
        textlib.check_text_options(max_len, vocab_size, min_freq)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    tokenizer = textlib.tokenizer_for(text_pipeline)
    if download:
        _no_download(name, "fetch the AG News train.csv and test.csv yourself and pass their "
                           "folder (or the folder holding ag_news_csv) as --root")
    root = _need_root(name, root, download_hint=False)
    base = _find_base(name, root, AGNEWS_FOLDER, "train.csv")
    train_y, train_texts = read_agnews_csv(base / "train.csv")
    test_y, test_texts = read_agnews_csv(base / "test.csv")
    texts = train_texts + test_texts
    # the reference counts the tokens of every text, this project's first pipeline the training texts'
    counted = texts if text_pipeline == "reference" else train_texts
    vocab = textlib.build_vocab(counted, vocab_size, min_freq, progress=progress, total=len(counted),
                                tokenizer=tokenizer)
    del train_texts, test_texts, counted
    ids, lengths = textlib.encode_texts(texts, vocab, max_len, progress=progress, tokenizer=tokenizer)
    params = {"max_len": int(max_len), "vocab_size_cap": 0 if vocab_size is None else int(vocab_size),
              "min_freq": int(min_freq)}
    if text_pipeline != "alnum":  # alnum shards keep the parameters (and bytes) they always had
        params["text_pipeline"] = text_pipeline
    return Source(x=ids, y=np.concatenate([train_y, test_y]), num_classes=AGNEWS_CLASSES,
                  mean=(), std=(), name=name, kind="text", lengths=lengths, vocab=vocab, params=params)


# ----------------------------------------------------------------------------- registry


_LOADERS: dict[str, Callable] = {
    "digits": _load_digits,
    "mnist": _torchvision_loader("mnist", "MNIST", 10),
    "fmnist": _torchvision_loader("fmnist", "FashionMNIST", 10),
    "cifar10": _cifar_loader("cifar10"),
    "cifar100": _cifar_loader("cifar100"),
    "tinyimagenet": _load_tinyimagenet,
    "agnews": _load_agnews,
    "imagefolder": None,  # fedcp_dist.data.owndata, through load_source's own_options
    "csv": None,
}

#: Names accepted by :func:`load_source`.
SOURCE_NAMES: tuple[str, ...] = tuple(_LOADERS)


def check_source_name(name: str) -> None:
    """Raise :class:`UserError` unless ``name`` is a known source."""
    if name not in _LOADERS:
        # leaf and synthetic bring their own clients (fedcp_dist.data.make reads them apart)
        raise UserError(f"unknown source '{name}'; known sources: {', '.join(SOURCE_NAMES)}, leaf, synthetic")


def source_kind(name: str) -> str:
    """``"text"``, ``"table"`` or ``"image"``: what the samples of source ``name`` are."""
    check_source_name(name)
    return "text" if name in TEXT_SOURCES else "table" if name in TABLE_SOURCES else "image"


def load_source(name: str, root=None, download: bool = False, *,
                max_len: int = textlib.DEFAULT_MAX_LEN,
                vocab_size: Optional[int] = None,
                min_freq: int = textlib.DEFAULT_MIN_FREQ, own_options: Optional[dict] = None,
                include_val: bool = False,
                text_pipeline: str = textlib.DEFAULT_TEXT_PIPELINE) -> Source:
    """Load source ``name`` (train and test merged, train first) from ``root``.

    ``download`` lets torchvision fetch a missing data set into ``root`` (mnist, fmnist, cifar10,
    cifar100).  ``max_len``, ``vocab_size`` (None: the pipeline's cap), ``min_freq`` and
    ``text_pipeline`` (:data:`~fedcp_dist.data.text.TEXT_PIPELINES`) apply to text sources only;
    ``own_options`` are the keyword arguments of :func:`~fedcp_dist.data.owndata.load_imagefolder`
    or :func:`~fedcp_dist.data.owndata.load_csv` (imagefolder, csv); ``include_val`` applies to
    tinyimagenet only (its val images after the train images).
    """
    check_source_name(name)
    if include_val and name != "tinyimagenet":
        raise UserError(f"--include-val applies to --source tinyimagenet only, not to '{name}'")
    if name in OWN_SOURCES:
        if download:
            _no_download(name, "it reads your own files from --root")
        loader = load_imagefolder if name == "imagefolder" else load_csv
        return loader(root, **(own_options or {}))
    if source_kind(name) == "text":
        return _LOADERS[name](root, download, max_len=max_len, vocab_size=vocab_size,
                              min_freq=min_freq, text_pipeline=text_pipeline)
    if name == "tinyimagenet":
        return _LOADERS[name](root, download, include_val=include_val)
    return _LOADERS[name](root, download)
