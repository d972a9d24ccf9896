"""LEAF's JSON files (FEMNIST, Shakespeare) → a shard with one client per LEAF user.

LEAF's scripts (``preprocess.sh`` of github.com/TalwalkarLab/leaf, ``-t sample``) write
``data/train/*.json`` and ``data/test/*.json``; each file is an object with ``users`` (names),
``num_samples`` (one count per user), ``user_data`` ({user: {"x": [...], "y": [...]}}) and, for
non-i.i.d. Shakespeare, ``hierarchies`` (not used here). A user's samples sit in one train file and
in the test file made from the same input file; users are spread over many files. Here every user
is one client, with exactly LEAF's train and test samples (no re-split), clients in the order of
their sorted names (the order of LEAF's own ``read_data``).

* FEMNIST: ``x`` a sample is 784 floats, the 28×28 greyscale scan row by row divided by 255
  (``data_to_json.py``: dark ink on white paper, so 1.0 is the white background); ``y`` 0–61
  (digits, then upper-case, then lower-case letters). Stored as uint8 round(255·x), 1×28×28, the
  same values LEAF's scan had, not inverted.
* Shakespeare: ``x`` an 80-character string, ``y`` the next character; both stored as indices into
  LEAF's 80-symbol alphabet (:data:`ALPHABET`, from LEAF's ``language_utils.py``), ``x`` as a text
  shard's int32 ids (every row 80 real characters, no padding), ``y`` as the class (80 classes).

Which of the two the files hold is read from the first user's first sample (a list of numbers or
a string), or given (``--leaf-task``). Every mistake is a one-line :class:`UserError` naming the
file and the user; the shard is written only after every file was read and checked.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from fedcp_dist.data.common import NORM_MEAN, NORM_STD, one_line, progress
from fedcp_dist.errors import UserError
from fedcp_dist.options import repeated

TASKS = ("femnist", "shakespeare")
#: LEAF's Shakespeare symbols in index order (``ALL_LETTERS`` of its ``models/utils/language_utils.py``):
#: newline, space, ! " & ' ( ) , - . 0-9 : ; > ? A-Z [ ] a-z }
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
FEMNIST_SHAPE = (1, 28, 28)
FEMNIST_CLASSES = 62
#: the length of LEAF's Shakespeare sequences (shake_utils.py's seq_length)
SEQ_LEN = 80
#: byte → alphabet index (-1: not a symbol of the alphabet)
_INDEX = np.full(256, -1, dtype=np.int64)
_INDEX[np.frombuffer(ALPHABET.encode("ascii"), dtype=np.uint8)] = np.arange(len(ALPHABET))


@dataclass
class LeafData:
    """Every user's samples: ``train`` and ``test`` {user: (x, y)}; ``users`` sorted."""

    task: str
    users: list
    train: dict
    test: dict
    files: dict = field(default_factory=dict)  # split → number of files read
    #: Shakespeare: characters per sequence (0 for FEMNIST)
    seq_len: int = 0


def leaf_folders(root) -> tuple[Path, Path]:
    """(train, test) folders of LEAF's layout under ``root`` (``root/train``, or ``root/data/train``:
    a data set's folder of LEAF's repository)."""
    if root is None:
        raise UserError("--source leaf needs --root DIR, the folder holding LEAF's train/ and test/ folders")
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--root {root} is not a directory")
    for base in (root, root / "data"):
        if (base / "train").is_dir() and (base / "test").is_dir():
            return base / "train", base / "test"
    raise UserError(f"--root {root} holds no train/ and test/ folders of LEAF's JSON files (nor does {root / 'data'}); "
                    f"make them with LEAF's preprocess.sh ... -t sample")


def _json_files(folder: Path) -> list:
    named = sorted(p for p in folder.iterdir() if p.suffix == ".json")
    for p in named:
        if p.is_symlink() and not p.exists():  # a link to a file on a disk not mounted, say
            raise UserError(f"{p} is a symbolic link to {os.readlink(p)}, which does not exist (or is a loop)")
    files = [p for p in named if p.is_file()]
    if not files:
        raise UserError(f"{folder} holds no .json file")
    return files


class _Floats(dict):
    """json's parse_float through a cache: FEMNIST's pixels take 256 distinct values, so each
    value is one float object instead of one per pixel (a file's parse takes ~4x less memory)."""

    def __missing__(self, text):
        value = self[text] = float(text)
        return value


def _unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook: an object naming a key twice (a user's data written twice, of which
    json would keep the last silently) is refused."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"the key {repeated(k for k, _ in pairs)!r} appears twice in one object")
    return out


def _load(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(), parse_float=_Floats().__getitem__, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UserError(f"{path}: not valid JSON: {one_line(exc)}") from None
    if not isinstance(data, dict) or not all(k in data for k in ("users", "num_samples", "user_data")):
        raise UserError(f"{path}: not a LEAF data file (an object with 'users', 'num_samples' and 'user_data')")
    users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(user_data, dict):
        raise UserError(f"{path}: 'users' and 'num_samples' must be lists and 'user_data' an object")
    if len(users) != len(counts):
        raise UserError(f"{path}: 'users' names {len(users)} users but 'num_samples' holds {len(counts)} counts")
    listed = {u for u in users if isinstance(u, str)}
    for user in user_data:
        if user not in listed:
            raise UserError(f"{path}: user {user!r} has data in 'user_data' but is not in 'users'")
    return data


def detect_task(path: Path, user, x) -> str:
    """The task a user's ``x`` list belongs to (its first sample: 784 numbers or a string)."""
    first = x[0] if isinstance(x, list) and x else None
    if isinstance(first, str):
        return "shakespeare"
    if isinstance(first, list) and len(first) == 784:
        return "femnist"
    raise UserError(f"{path}: user {user!r}: cannot tell the LEAF task from its first sample (FEMNIST: 784 "
                    f"pixel values, Shakespeare: a string); give --leaf-task femnist|shakespeare")


def _femnist(where: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    for j, row in enumerate(x):
        if not isinstance(row, list) or len(row) != 784:
            got = f"{len(row)} values" if isinstance(row, list) else type(row).__name__
            raise UserError(f"{where} sample {j}: x holds {got}, expected 784 pixel values (28x28, FEMNIST)")
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise UserError(f"{where}: x holds something other than numbers") from None
    if not np.all((arr >= 0) & (arr <= 1)):  # NaN fails too
        j = int(np.argmax(~np.all((arr >= 0) & (arr <= 1), axis=1)))
        raise UserError(f"{where} sample {j}: pixel values must lie in [0, 1] (LEAF writes pixel/255)")
    images = np.rint(arr * 255).astype(np.uint8).reshape(len(x), *FEMNIST_SHAPE)
    return images, _labels(where, y, FEMNIST_CLASSES)


def _labels(where: str, y: list, num_classes: int) -> np.ndarray:
    bad = next((j for j, v in enumerate(y) if type(v) is not int or not 0 <= v < num_classes), None)
    if bad is not None:
        raise UserError(f"{where} sample {bad}: label {y[bad]!r} is not an integer in 0..{num_classes - 1}")
    return np.asarray(y, dtype=np.int64)


def _ids(where: str, what: str, texts: list, length: int) -> np.ndarray:
    """Strings of ``length`` characters → (n, length) alphabet indices."""
    for j, s in enumerate(texts):
        if not isinstance(s, str) or len(s) != length:
            got = f"{len(s)} characters" if isinstance(s, str) else f"a {type(s).__name__}"
            raise UserError(f"{where} sample {j}: {what} is {got}, expected a string of {length}")
    joined = "".join(texts)
    raw = joined.encode("utf-8")
    ids = _INDEX[np.frombuffer(raw, dtype=np.uint8)] if len(raw) == len(joined) else None
    if ids is None or (ids < 0).any():
        pos = next(i for i, ch in enumerate(joined) if ch not in ALPHABET)
        ch = joined[pos]
        raise UserError(f"{where} sample {pos // length}: {what} holds {ch!r} (U+{ord(ch):04X}), not one of "
                        f"LEAF's {len(ALPHABET)} Shakespeare symbols")
    return ids.reshape(len(texts), length)


def _shakespeare(where: str, x: list, y: list, length: int) -> tuple[np.ndarray, np.ndarray]:
    return _ids(where, "x", x, length).astype(np.int32), _ids(where, "y", y, 1).reshape(-1)


def _read_split(folder: Path, split: str, task: Optional[str]) -> tuple[str, dict, dict]:
    """(task, {user: (x, y)}, {user: file}) of one split's files; Shakespeare's sequences must all
    have :data:`SEQ_LEN` characters, as LEAF's scripts write them."""
    out, where_of = {}, {}
    files = _json_files(folder)
    for path in progress(files, total=len(files), desc=f"reading LEAF {split}", unit="file"):
        data = _load(path)
        for user, count in zip(data["users"], data["num_samples"]):
            entry = data["user_data"].get(user) if isinstance(user, str) else None
            if not isinstance(entry, dict) or not isinstance(entry.get("x"), list) or not isinstance(entry.get("y"), list):
                raise UserError(f"{path}: user {user!r} has no {{'x': [...], 'y': [...]}} entry in 'user_data'")
            if user in out:
                if where_of[user] == path:  # its one entry in user_data would serve for both
                    raise UserError(f"{path}: user {user!r} is named twice in 'users'")
                raise UserError(f"{path}: user {user!r} is also in {where_of[user]} ({split} split)")
            x, y = entry["x"], entry["y"]
            where = f"{path}: user {user!r}"
            if len(x) != len(y):
                raise UserError(f"{where} has {len(x)} x but {len(y)} y")
            if not x:
                raise UserError(f"{where} has no samples")
            if type(count) is not int:
                raise UserError(f"{where}: 'num_samples' holds {count!r}, not a count (an integer)")
            if count != len(y):
                raise UserError(f"{where}: 'num_samples' says {count!r} but it has {len(y)} samples")
            task = task or detect_task(path, user, x)
            if task == "femnist":
                out[user] = _femnist(where, x, y)
            else:
                out[user] = _shakespeare(where, x, y, SEQ_LEN)
            where_of[user] = path
        del data
    return task, out, where_of


def read_leaf(root, task: Optional[str] = None) -> LeafData:
    """Read and check LEAF's ``train/`` and ``test/`` files under ``root`` (``task``: femnist,
    shakespeare, or None to tell from the content)."""
    if task is not None and task not in TASKS:
        raise UserError(f"--leaf-task must be one of {', '.join(TASKS)}, got {task!r}")
    train_dir, test_dir = leaf_folders(root)
    task, train, train_at = _read_split(train_dir, "train", task)
    _, test, test_at = _read_split(test_dir, "test", task)
    if not train:
        raise UserError(f"LEAF's files under {train_dir} list no users: there is no client to make")
    for user in test:
        if user not in train:
            raise UserError(f"{test_at[user]}: user {user!r} has no training samples (in no file of {train_dir}); "
                            f"personalized learning needs each user in both splits (LEAF's -t sample, not -t user)")
    for user in train:
        if user not in test:
            raise UserError(f"{train_at[user]}: user {user!r} has no test samples (in no file of {test_dir})")
    files = {"train": len(_json_files(train_dir)), "test": len(_json_files(test_dir))}
    return LeafData(task, sorted(train), train, test, files, SEQ_LEN if task == "shakespeare" else 0)


def write_leaf_shard(root, out: Path, task: Optional[str], names_chars: int, say: Callable[[str], None],
                     num_clients: Optional[int] = None, replace: bool = True) -> None:
    """Read LEAF's files under ``root`` and write the shard ``out`` (one client per user);
    ``num_clients``, when given, must be the number of users (``replace``: see
    :func:`~fedcp_dist.data.shards.write_shard`)."""
    from fedcp_dist.data.shards import write_shard

    leaf_folders(root)  # a missing or wrong --root is said before anything else
    say(f"reading LEAF files under {root}" + (f" ({task})" if task else ""))
    data = read_leaf(root, task)
    if num_clients is not None and num_clients != len(data.users):
        raise UserError(f"--num-clients is {num_clients} but LEAF's files under {root} hold {len(data.users)} users "
                        f"(leave --num-clients out for --source leaf)")
    n_train = sum(len(y) for _, y in data.train.values())
    n_test = sum(len(y) for _, y in data.test.values())
    say(f"  {data.task}: {len(data.users)} users, {n_train} train / {n_test} test samples "
        f"({data.files['train']} + {data.files['test']} files)")
    params = {"task": data.task, "root": str(Path(root).resolve()), "num_clients": len(data.users),
              "train_files": data.files["train"], "test_files": data.files["test"]}
    if sum(len(u) + 4 for u in data.users) <= names_chars:
        params["clients"] = list(data.users)

    def clients():
        for user in data.users:
            (tx, ty), (vx, vy) = data.train.pop(user), data.test.pop(user)
            if data.task == "femnist":
                yield tx, ty, vx, vy
            else:
                yield tx, ty, vx, vy, np.full(len(ty), tx.shape[1], np.int32), np.full(len(vy), vx.shape[1], np.int32)

    say(f"writing {len(data.users)} clients (LEAF's users, LEAF's train/test split) to {out}")
    rows = progress(clients(), total=len(data.users), desc="writing clients", unit="client")
    if data.task == "femnist":
        write_shard(out, rows, source="femnist", num_classes=FEMNIST_CLASSES,
                    input_shape=FEMNIST_SHAPE, mean=(NORM_MEAN,), std=(NORM_STD,), partition="leaf",
                    partition_params=params, seed=-1, replace=replace)
    else:
        write_shard(out, rows, source="shakespeare", num_classes=len(ALPHABET),
                    input_shape=(data.seq_len,), mean=(), std=(), partition="leaf", partition_params=params, seed=-1,
                    kind="text", vocab=list(ALPHABET), replace=replace)
