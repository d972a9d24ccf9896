"""Small LEAF data sets written the way LEAF's scripts write them (``data/train/*.json`` and
``data/test/*.json``: ``users``, ``num_samples``, ``user_data``; users spread over several files,
each train file's users in the test file of the same name), for the reader's tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedcp_dist.data.leaf import ALPHABET

#: FEMNIST: users of each input file (LEAF: at most 100 writers a file; here 2 files)
FEMNIST_FILES = (("f0003_41", "f0001_12"), ("f0010_07", "f0002_33", "f0000_20"))
#: Shakespeare: users (play character) of each file
SHAKESPEARE_FILES = (("THE_TEMPEST_PROSPERO", "HAMLET_OPHELIA"), ("KING_LEAR_FOOL", "HAMLET_HAMLET"))


def write_split(root: Path, split: str, files: list) -> list:
    """``files``: one {user: {"x": [...], "y": [...]}} per file, written as LEAF's split_data.py
    names them (``all_data_{i}_niid_05_keep_0_{split}_9.json``). Returns the paths."""
    folder = Path(root) / split
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, users in enumerate(files):
        data = {"users": list(users), "num_samples": [len(d["y"]) for d in users.values()], "user_data": users}
        path = folder / f"all_data_{i}_niid_05_keep_0_{split}_9.json"
        path.write_text(json.dumps(data))
        paths.append(path)
    return paths


def femnist_user(rng, n: int, classes=(0, 10, 36)) -> dict:
    """A writer's samples: each class a fixed bright square on LEAF's white (1.0) background, plus
    noise, values pixel/255 as data_to_json.py writes them; labels from ``classes``."""
    y = [int(classes[j % len(classes)]) for j in range(n)]
    x = []
    for label in y:
        img = np.full((28, 28), 255, dtype=np.int64)
        r = 2 + 8 * (classes.index(label) if label in classes else 0)
        img[r:r + 8, 4:24] = 0  # dark ink, a bar whose row depends on the class
        img = np.clip(img - rng.integers(0, 40, (28, 28)), 0, 255)
        x.append((img.reshape(-1) / 255).tolist())
    return {"x": x, "y": y}


def femnist_set(root: Path, seed: int = 0, train: int = 12, test: int = 6) -> dict:
    """LEAF FEMNIST files under root/train and root/test; {user: (train dict, test dict)}."""
    rng = np.random.default_rng(seed)
    users = {}
    for j, names in enumerate(FEMNIST_FILES):
        for k, name in enumerate(names):
            users[name] = (femnist_user(rng, train + j + k), femnist_user(rng, test + k))
    for split, which in (("train", 0), ("test", 1)):
        write_split(root, split, [{u: users[u][which] for u in names} for names in FEMNIST_FILES])
    return users


def shakespeare_text(rng, n: int) -> str:
    """Text in which the next character follows from the current one (a cycle over a few symbols)."""
    cycle = "the king said: 'HOLD!' [and] "
    start = int(rng.integers(0, len(cycle)))
    return "".join(cycle[(start + i) % len(cycle)] for i in range(n))


def shakespeare_user(rng, n: int, length: int = 80) -> dict:
    """``n`` samples as shake_utils.py makes them: every window of ``length`` characters and the next."""
    text = shakespeare_text(rng, n + length)
    return {"x": [text[i:i + length] for i in range(n)], "y": [text[i + length] for i in range(n)]}


def shakespeare_set(root: Path, seed: int = 0, train: int = 30, test: int = 10) -> dict:
    rng = np.random.default_rng(seed)
    users = {}
    for j, names in enumerate(SHAKESPEARE_FILES):
        for k, name in enumerate(names):
            users[name] = (shakespeare_user(rng, train + 3 * j + k), shakespeare_user(rng, test + k))
    for split, which in (("train", 0), ("test", 1)):
        write_split(root, split, [{u: users[u][which] for u in names} for names in SHAKESPEARE_FILES])
    return users


def ids(text: str) -> list:
    return [ALPHABET.index(c) for c in text]
