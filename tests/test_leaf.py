"""LEAF import (fedcp-partition --source leaf): small FEMNIST and Shakespeare sets written in LEAF's
own layout (tests/leaf_files.py: users over two files per split) go through the real reader; the
shard holds one client per user with LEAF's train/test split, bad files stop with one line naming
the file and the user, and two-round FedCP runs learn on both."""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import expect_user_error, run
from leaf_files import FEMNIST_FILES, SHAKESPEARE_FILES, femnist_set, ids, shakespeare_set
from fedcp_dist.cli.partition import main
from fedcp_dist.data.leaf import ALPHABET
from fedcp_dist.data.shards import load_clients, read_info, read_vocab


def partition(capsys, root, out, *extra):
    main(["--source", "leaf", "--root", str(root), "--out", str(out), *map(str, extra)])
    return capsys.readouterr().out


def test_femnist_users_become_clients_with_leafs_own_split(tmp_path, capsys):
    users = femnist_set(tmp_path / "leaf")
    said = partition(capsys, tmp_path / "leaf", tmp_path / "f.h5")
    assert "femnist: 5 users, 67 train / 34 test samples (2 + 2 files)" in said
    info = read_info(tmp_path / "f.h5")
    assert (info.source, info.kind, info.input_shape, info.num_classes) == ("femnist", "image", (1, 28, 28), 62)
    assert info.partition == "leaf" and info.partition_params["task"] == "femnist"
    names = sorted(u for f in FEMNIST_FILES for u in f)
    assert info.partition_params["clients"] == names  # LEAF's read_data order: sorted user names
    clients = load_clients(tmp_path / "f.h5", range(info.num_clients))
    for i, name in enumerate(names):
        for split, which in (("train", 0), ("test", 1)):
            leaf = users[name][which]
            x = clients[i][f"{split}_x"]
            assert x.dtype == np.uint8 and x.shape == (len(leaf["y"]), 1, 28, 28)
            want = np.rint(np.asarray(leaf["x"]) * 255).astype(np.uint8).reshape(-1, 1, 28, 28)
            assert np.array_equal(x, want) and clients[i][f"{split}_y"].tolist() == leaf["y"]
    # LEAF's 1.0 (white paper) is stored as 255 and its ink stays dark: not inverted
    corner = users[names[0]][0]["x"][0][0]
    assert corner > 0.8 and clients[0]["train_x"][0, 0, 0, 0] == round(corner * 255)
    assert clients[0]["train_x"][0, 0, 2, 10] < 50  # the class's dark bar


def test_shakespeare_users_become_clients_over_leafs_80_symbols(tmp_path, capsys):
    users = shakespeare_set(tmp_path / "data")
    # a data set's folder of LEAF's repository (leaf/data/shakespeare, which holds data/train)
    partition(capsys, tmp_path, tmp_path / "s.h5")
    info = read_info(tmp_path / "s.h5")
    assert (info.source, info.kind, info.input_shape, info.num_classes, info.vocab_size) == \
        ("shakespeare", "text", (80,), 80, 80)
    vocab = read_vocab(tmp_path / "s.h5")
    assert vocab == list(ALPHABET) and len(ALPHABET) == 80
    # the indices LEAF's word_to_indices gives, counted by hand along its ALL_LETTERS
    assert [ALPHABET.index(c) for c in "\n A[]a}"] == [0, 1, 25, 51, 52, 53, 79]
    names = sorted(u for f in SHAKESPEARE_FILES for u in f)
    clients = load_clients(tmp_path / "s.h5", range(info.num_clients))
    for i, name in enumerate(names):
        for split, which in (("train", 0), ("test", 1)):
            leaf = users[name][which]
            c = clients[i]
            assert c[f"{split}_x"].tolist() == [ids(s) for s in leaf["x"]]
            assert c[f"{split}_y"].tolist() == [ALPHABET.index(ch) for ch in leaf["y"]]
            assert (c[f"{split}_len"] == 80).all()


def test_the_task_is_told_from_the_content_or_given(tmp_path, capsys):
    femnist_set(tmp_path / "f")
    partition(capsys, tmp_path / "f", tmp_path / "a.h5", "--leaf-task", "femnist")
    assert read_info(tmp_path / "a.h5").source == "femnist"
    first = sorted((tmp_path / "f" / "train").glob("*.json"))[0]
    expect_user_error(capsys, ["--source", "leaf", "--root", tmp_path / "f", "--leaf-task", "shakespeare",
                               "--out", tmp_path / "b.h5"], str(first), "user 'f0003_41' sample 0: x is a list")
    assert not (tmp_path / "b.h5").exists()


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _drop(data, user):
    i = data["users"].index(user)
    del data["users"][i], data["num_samples"][i], data["user_data"][user]


def _add(data, user, entry):
    data["users"].append(user)
    data["num_samples"].append(len(entry["y"]))
    data["user_data"][user] = entry


@pytest.mark.parametrize("split, change, fragments", [
    ("train", None, ["not valid JSON"]),
    ("train", lambda d: d["user_data"]["f0001_12"].update(x=[], y=[]) or d["num_samples"].__setitem__(1, 0),
     ["user 'f0001_12' has no samples"]),
    ("test", lambda d: d["user_data"]["f0003_41"]["y"].pop(), ["user 'f0003_41' has 6 x but 5 y"]),
    ("train", lambda d: d["num_samples"].__setitem__(0, 99), ["user 'f0003_41'", "'num_samples' says 99 but it has 12"]),
    ("train", lambda d: _drop(d, "f0001_12"), ["test/all_data_0", "user 'f0001_12' has no training samples",
                                               "-t sample"]),
    ("test", lambda d: _drop(d, "f0001_12"), ["train/all_data_0", "user 'f0001_12' has no test samples"]),
    ("train", lambda d: _add(d, "f0010_07", d["user_data"]["f0001_12"]),
     ["train/all_data_0", "user 'f0010_07' is also in", "all_data_1_niid_05_keep_0_train_9.json"]),
    # named twice in one file's users, its one user_data entry counted twice: "is also in" the same file
    ("train", lambda d: d["users"].append("f0001_12") or d["num_samples"].append(d["num_samples"][1]),
     ["train/all_data_0", "user 'f0001_12' is named twice in 'users'"]),
    ("train", lambda d: d["user_data"]["f0001_12"]["x"][3].__setitem__(5, 1.5),
     ["user 'f0001_12' sample 3: pixel values must lie in [0, 1]"]),
    ("train", lambda d: d["user_data"]["f0001_12"]["x"][2].pop(), ["user 'f0001_12' sample 2: x holds 783 values"]),
    ("test", lambda d: d["user_data"]["f0003_41"]["y"].__setitem__(4, 62),
     ["user 'f0003_41' sample 4: label 62 is not an integer in 0..61"]),
    ("train", lambda d: d["user_data"].update(ghost={"x": [], "y": []}),
     ["user 'ghost' has data in 'user_data' but is not in 'users'"]),
])
def test_a_bad_femnist_file_names_the_file_and_the_user(tmp_path, capsys, split, change, fragments):
    femnist_set(tmp_path / "leaf")
    path = sorted((tmp_path / "leaf" / split).glob("*.json"))[0]
    if change is None:
        path.write_text(path.read_text()[:-100])  # cut short
    else:
        _edit(path, change)
    out = tmp_path / "out.h5"
    out.write_bytes(b"earlier shard")
    err = expect_user_error(capsys, ["--source", "leaf", "--root", tmp_path / "leaf", "--out", out, "--force"],
                            *fragments)
    # the message names the file (the edited one, or the one holding the user's other split)
    assert re.search(rf"{tmp_path}/leaf/(train|test)/all_data_[01]_niid_05_keep_0_(train|test)_9\.json", err), err
    assert out.read_bytes() == b"earlier shard"  # nothing written over it
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out.h5")] == ["out.h5"]  # no temporary left


@pytest.mark.parametrize("change, fragments", [
    (lambda d: d["user_data"]["HAMLET_OPHELIA"]["x"].__setitem__(2, "|" * 80),
     ["user 'HAMLET_OPHELIA' sample 2: x holds '|' (U+007C), not one of LEAF's 80 Shakespeare symbols"]),
    (lambda d: d["user_data"]["HAMLET_OPHELIA"]["x"].__setitem__(1, "to be"),
     ["user 'HAMLET_OPHELIA' sample 1: x is 5 characters, expected a string of 80"]),
    (lambda d: d["user_data"]["HAMLET_OPHELIA"]["y"].__setitem__(0, "ab"),
     ["user 'HAMLET_OPHELIA' sample 0: y is 2 characters, expected a string of 1"]),
    # the first sequence read is the one at fault, not the first of the right length after it
    (lambda d: d["user_data"][d["users"][0]]["x"].__setitem__(0, "abc"),
     ["sample 0: x is 3 characters, expected a string of 80"]),
    # sequences of one other length throughout are not LEAF's either
    (lambda d: [u["x"].__setitem__(j, s[:5]) for u in d["user_data"].values() for j, s in enumerate(u["x"])],
     ["sample 0: x is 5 characters, expected a string of 80"]),
    (lambda d: d["num_samples"].__setitem__(0, str(d["num_samples"][0])),
     ["'num_samples' holds '", "not a count (an integer)"]),
])
def test_a_bad_shakespeare_file_names_the_file_and_the_user(tmp_path, capsys, change, fragments):
    shakespeare_set(tmp_path / "leaf")
    path = sorted((tmp_path / "leaf" / "train").glob("*.json"))[0]
    _edit(path, change)
    expect_user_error(capsys, ["--source", "leaf", "--root", tmp_path / "leaf", "--out", tmp_path / "o.h5"],
                      str(path), *fragments)
    assert not (tmp_path / "o.h5").exists()


def test_leaf_refuses_options_of_other_sources(tmp_path, capsys):
    femnist_set(tmp_path / "leaf")
    base = ["--source", "leaf", "--root", tmp_path / "leaf", "--out", tmp_path / "o.h5"]
    expect_user_error(capsys, base + ["--train-ratio", 0.8], "--train-ratio", "preprocess.sh --tf")
    expect_user_error(capsys, base + ["--partition", "iid"], "--partition applies to sources split among clients")
    expect_user_error(capsys, base + ["--beta", 0.5], "--beta applies to sources split among clients")
    expect_user_error(capsys, base + ["--num-clients", 3], "--num-clients is 3 but LEAF's files", "hold 5 users")
    expect_user_error(capsys, base + ["--max-len", 20], "--max-len applies to text sources")
    expect_user_error(capsys, base + ["--synthetic-alpha", 1], "--synthetic-alpha applies to --source synthetic only")
    # the shard recorded seed -1 whatever --seed said
    expect_user_error(capsys, base + ["--seed", 5], "--seed: --source leaf keeps LEAF's own users", "draws nothing")
    expect_user_error(capsys, ["--source", "mnist", "--leaf-task", "femnist", "--num-clients", 2, "--out", tmp_path / "o.h5"],
                      "--leaf-task applies to --source leaf only")
    expect_user_error(capsys, ["--source", "leaf", "--root", tmp_path, "--out", tmp_path / "o.h5"],
                      "holds no train/ and test/ folders")
    expect_user_error(capsys, ["--source", "leaf", "--out", tmp_path / "o.h5"], "--source leaf needs --root DIR")
    with pytest.raises(SystemExit):  # and nothing before it on stdout ("reading LEAF files under None")
        main(["--source", "leaf", "--out", str(tmp_path / "o.h5")])
    assert capsys.readouterr().out == ""
    empty = tmp_path / "empty"
    for split in ("train", "test"):  # LEAF's layout, every file listing no user: a traceback from HDF5 before
        (empty / split).mkdir(parents=True)
        (empty / split / "a.json").write_text('{"users": [], "num_samples": [], "user_data": {}}')
    expect_user_error(capsys, ["--source", "leaf", "--root", empty, "--out", tmp_path / "o.h5"],
                      f"LEAF's files under {empty / 'train'} list no users: there is no client to make")
    assert not (tmp_path / "o.h5").exists()


def _rounds(out):
    lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["kind"] == "round"]


def _run(shard, out, source, *extra):
    said = []
    summary = run("configs/digits_fedcp.yaml",
                  ["rounds=2", "eval_every=1", "eval_batch_size=8", "threads=1", f"data.path={shard}",
                   f"data.source={source}", f"out_dir={out}", *extra], echo=lambda *a: said.append(" ".join(map(str, a))))
    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == [1, 2] and all(math.isfinite(r["train_loss"]) for r in rounds)
    assert rounds[0]["evaluated_after"] == 0  # the first evaluation is of the untrained models
    return summary, rounds, said[0]


def test_fedcp_learns_femnist_writers_in_two_rounds(tmp_path, capsys):
    femnist_set(tmp_path / "leaf")
    partition(capsys, tmp_path / "leaf", tmp_path / "f.h5")
    summary, rounds, start = _run(tmp_path / "f.h5", tmp_path / "run", "femnist", "model=cnn", "local_epochs=5")
    assert "fedcp on 5 clients (femnist)" in start
    assert summary["final_acc"] >= max(rounds[0]["acc"] + 0.3, 0.75), (rounds[0]["acc"], summary["final_acc"])


def test_fedcp_learns_shakespeare_with_the_lstm_fused_in_two_rounds(tmp_path, capsys):
    shakespeare_set(tmp_path / "leaf")
    partition(capsys, tmp_path / "leaf", tmp_path / "s.h5")
    summary, rounds, start = _run(tmp_path / "s.h5", tmp_path / "run", "shakespeare", "model=lstm",
                                  "lstm_hidden=32", "lr=0.5", "local_epochs=3")
    assert "training: fused" in start  # the LSTM's own grouped form, not a sequential fall-back
    # the text repeats a 29-symbol cycle: the next character follows from the last one
    assert rounds[1]["train_loss"] < rounds[0]["train_loss"] - 0.3, rounds
    assert summary["final_acc"] >= rounds[0]["acc"] + 0.1, (rounds[0]["acc"], summary["final_acc"])


def test_fedrep_trains_the_lstm_in_its_own_loop(tmp_path, capsys):
    shakespeare_set(tmp_path / "leaf")
    partition(capsys, tmp_path / "leaf", tmp_path / "s.h5")
    _, rounds, start = _run(tmp_path / "s.h5", tmp_path / "run", "shakespeare", "method=fedrep", "model=lstm",
                            "lstm_hidden=16", "lr=0.5", "local_epochs=2")
    assert "training: sequential" in start and "fedrep" in start
    assert rounds[1]["train_loss"] < rounds[0]["train_loss"], rounds


def test_a_user_written_twice_or_a_file_link_to_nowhere_is_named(tmp_path, capsys):
    """A user's data written twice in one file's user_data was accepted (the last copy won); a .json
    that is a link to nowhere was passed over, then the folder said to hold no .json file."""
    femnist_set(tmp_path / "leaf")
    path = sorted((tmp_path / "leaf" / "train").glob("*.json"))[0]
    text = path.read_text()
    i = text.index('"user_data": {') + len('"user_data": {')
    first = json.loads(text)["users"][0]
    text = text[:i] + f'"{first}": {{"x": [], "y": []}}, ' + text[i:]
    path.write_text(text)
    args = ["--source", "leaf", "--root", tmp_path / "leaf", "--out", tmp_path / "o.h5"]
    expect_user_error(capsys, args, f"{path}: not valid JSON", f"the key '{first}' appears twice in one object")
    femnist_set(tmp_path / "leaf2")
    for p in (tmp_path / "leaf2" / "train").glob("*.json"):
        p.unlink()
    (tmp_path / "leaf2" / "train" / "a.json").symlink_to(tmp_path / "gone.json")
    expect_user_error(capsys, [*args[:3], tmp_path / "leaf2", *args[4:]],
                      f"{tmp_path / 'leaf2' / 'train' / 'a.json'} is a symbolic link to {tmp_path / 'gone.json'}, "
                      "which does not exist")
    assert not (tmp_path / "o.h5").exists()
