"""Faults in the data a run is given, provoked on real shard files: one parametrised table of what
can be wrong with a shard (structural damage, bad values, in-place edits), each refused before any
training in one line naming the split, the client and the value (or the dataset and its dtype);
and the shard's content as resume checks it: a copy elsewhere resumes, an edited one is refused,
by what differs."""
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from conftest import REPO
from fedcp_dist.rundir.checkpoint import Checkpointer, check_same_data
from fedcp_dist.data.shards import (FORMAT_VERSION, IMAGE_FORMAT_VERSION, layout_digest, load_clients, read_info,
                                    write_shard)
from fedcp_dist.data.shards import verify
from fedcp_dist.data.shards.verify import cached_digest, content_digest, verify_shard
from fedcp_dist.errors import UserError
from fedcp_dist.rundir.directory import check_resume_config
from helpers import documented, run

CONFIG = str(REPO / "configs" / "digits_fedavg.yaml")


def _args(shard, out, *extra):
    return ["--config", CONFIG, f"data.path={shard}", f"out_dir={out}", "rounds=1", "threads=1", *extra]


def _refused(capsys, args, fragments):
    """``fedcp-run args`` (its main, in this process) ends in one ``error:`` line holding every
    fragment, exit 2, and nothing of a run is written."""
    from fedcp_dist.run import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    out = Path(next(a for a in args if str(a).startswith("out_dir=")).split("=", 1)[1])
    assert not (out / "metrics.jsonl").exists() and not (out / "summary.json").exists()
    return err


def _offsets(path, split):
    with h5py.File(path, "r") as f:
        return f[f"{split}_offsets"][()]


def _client_of(path, split, row):
    off = _offsets(path, split)
    return int(np.searchsorted(off, row, side="right") - 1), row - int(off[np.searchsorted(off, row, side="right") - 1])


def _replace(f, name, data):
    """Dataset ``name`` rewritten with ``data`` (another dtype, say), as a hand-made tool would."""
    del f[name]
    f.create_dataset(name, data=data)


# ----------------------------------------------------------------------------- the table of faults
#
# Each mutation edits the copied shard in place and returns the fragments the refusal must name.


def label_out_of_range(split, where, value):
    def mutate(path):
        n = int(_offsets(path, split)[-1])
        row = 3 if where == "first" else n - 1
        client, own = _client_of(path, split, row)
        with h5py.File(path, "a") as f:
            f[f"{split}_y"][row] = value
        return [f"client {client}'s {split}_y holds label {value} (its row {own})", "outside [0, 10)"]
    return mutate


def images_as_float(nan: bool):
    def mutate(path):
        with h5py.File(path, "a") as f:
            x = f["train_x"][()].astype(np.float32)
            if nan:
                x[0, 0, 0, 0] = np.nan
            _replace(f, "train_x", x)
        return ["dataset 'train_x' holds float32 values (0.0 to 255.0 in its first rows" + (", nan among them)"
                                                                                          if nan else ")"),
                "but an image shard stores uint8 pixel values 0-255", "train unscaled"]
    return mutate


def labels_as(dtype):
    def mutate(path):
        with h5py.File(path, "a") as f:
            _replace(f, "test_y", f["test_y"][()].astype(dtype))
        return [f"dataset 'test_y' holds {np.dtype(dtype)} values (0.0 to 9.0 in its first rows), but labels are integers"]
    return mutate


def permuted_labels(drop_digests: bool):
    """Client 0's training labels shuffled in place: every class count the same, other samples
    under each label (what no count check can see)."""
    def mutate(path):
        with h5py.File(path, "a") as f:
            off = f["train_offsets"][()]
            y = f["train_y"][off[0]:off[1]]
            assert len(set(y.tolist())) > 1
            f["train_y"][off[0]:off[1]] = np.roll(y, 1)
            if drop_digests:  # a shard written before array digests: its fingerprint only
                del f.attrs["array_digests"]
        if drop_digests:
            return ["does not hold what it was written with: its content's fingerprint is", "edited in place"]
        return ["does not hold what it was written with: its train_y (training labels) differ from the digests",
                "edited in place or damaged?"]
    return mutate


def moved_label_count(path):
    """Client 2's per-class test counts edited, their sum kept: every array and offset unchanged,
    so only counting the labels again can see it (the counts feed describe and the reports)."""
    with h5py.File(path, "a") as f:
        counts = f["test_label_counts"][2]
        src, dst = int(np.flatnonzero(counts)[0]), int(np.flatnonzero(counts == 0)[0])
        counts[src] -= 1
        counts[dst] += 1
        f["test_label_counts"][2] = counts
    return ["dataset 'test_label_counts' says client 2 holds", "its test_y holds", "1 such client(s)"]


def flipped_pixel(path):
    with h5py.File(path, "a") as f:
        f["test_x"][0, 0, 0, 0] ^= 1
    return ["its test_x (test samples) differ"]


def missing_file(path):
    Path(path).unlink()
    return ["config key 'data.path': no such file"]


def truncated(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 3])
    return ["not a readable HDF5 file (truncated or corrupt?)"]


def garbage(path):
    Path(path).write_bytes(b"not an hdf5 file" * 100)
    return ["not a readable HDF5 file"]


def wrong_version(path):
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = 99
    return ["has format_version 99"]


def missing_dataset(path):
    with h5py.File(path, "a") as f:
        del f["test_y"]
    return ["lacks the dataset 'test_y'"]


def short_dataset(path):
    with h5py.File(path, "a") as f:
        _replace(f, "train_y", f["train_y"][:-2])
    return ["dataset 'train_y' has (", "but 'train_offsets' ends at"]


def counts_disagree(path):
    with h5py.File(path, "a") as f:
        f["test_label_counts"][0, 0] += 1
    return ["'test_label_counts' does not add up to the client sizes of 'test_offsets'"]


def normalisation(mean, std, fragment):
    """mean/std attributes edited (an old shard without a fingerprint, or h5py by hand): used
    as they are, they broke the first convolution, blamed the clients for a non-finite loss, or
    trained silently on scaled inputs (a negative std)."""
    def mutate(path):
        with h5py.File(path, "a") as f:
            f.attrs["mean"], f.attrs["std"] = np.asarray(mean, np.float64), np.asarray(std, np.float64)
        return [fragment]
    return mutate


IMAGE_FAULTS = [
    # structural damage (refused before array digests and value checks existed)
    pytest.param(missing_file, id="missing-file"),
    pytest.param(truncated, id="truncated-file"),
    pytest.param(garbage, id="not-hdf5"),
    pytest.param(wrong_version, id="unknown-format-version"),
    pytest.param(missing_dataset, id="dataset-missing"),
    pytest.param(short_dataset, id="dataset-shorter-than-offsets"),
    pytest.param(counts_disagree, id="label-counts-disagree"),
    # bad values
    pytest.param(label_out_of_range("test", "first", 10), id="test-label-equal-to-classes"),
    pytest.param(label_out_of_range("train", "last", -1), id="negative-train-label"),
    pytest.param(label_out_of_range("train", "first", 1000), id="train-label-far-out"),
    pytest.param(images_as_float(nan=False), id="images-as-float-0-255"),
    pytest.param(images_as_float(nan=True), id="images-as-float-with-nan"),
    pytest.param(labels_as(np.float64), id="labels-as-float"),
    pytest.param(normalisation([0.5] * 3, [0.5] * 3, "attribute 'mean' holds 3 value(s) for 1 channel(s)"),
                 id="mean-per-channel-count"),
    pytest.param(normalisation([0.5], [0.0], "attribute 'std' holds 0.0: every value must be > 0"), id="std-zero"),
    pytest.param(normalisation([0.5], [-0.5], "attribute 'std' holds -0.5: every value must be > 0"), id="std-negative"),
    pytest.param(normalisation([np.nan], [0.5], "attribute 'mean' holds nan: every value must be finite"), id="mean-nan"),
    # in-place edits that keep every count
    pytest.param(permuted_labels(drop_digests=False), id="labels-permuted-in-place"),
    pytest.param(permuted_labels(drop_digests=True), id="labels-permuted-in-place-fingerprint-only"),
    pytest.param(flipped_pixel, id="one-pixel-changed"),
    pytest.param(moved_label_count, id="class-count-moved"),
]


@pytest.mark.parametrize("mutate", IMAGE_FAULTS)
def test_a_bad_shard_is_refused_before_training_in_one_line(mutate, digits6_16px, tmp_path, capsys):
    shard = tmp_path / "shard.h5"
    shutil.copy(digits6_16px, shard)
    fragments = mutate(shard)
    err = _refused(capsys, _args(shard, tmp_path / "run"), fragments)
    assert "shard.h5" in err


#: the failure table's examples (docs/checkpoints.md) and the faults that must print them
TABLE_EXAMPLES = [
    (label_out_of_range("test", "first", 10), "`error: shard file …: client …'s test_y holds label 10 (its row …), "
                                              "outside [0, 10) of the shard's num_classes; …`"),
    (images_as_float(nan=True), "`error: shard file …: dataset 'train_x' holds float32 values (0.0 to 255.0 in its "
                                "first rows, nan among them), but an image shard stores uint8 pixel values 0-255: …`"),
    (permuted_labels(drop_digests=False), "`error: shard file … does not hold what it was written with: its train_y "
                                          "(training labels) differ from the digests written with it (edited in place "
                                          "or damaged?); …`"),
    (truncated, "| a missing, truncated or corrupted HDF5 shard, a wrong format version | `error: …` naming the file, "
                "before any training, exit 2 |"),
]


def test_the_failure_table_quotes_what_a_bad_shard_gets(digits6_16px, tmp_path, capsys):
    for k, (mutate, example) in enumerate(TABLE_EXAMPLES):
        shard = tmp_path / f"shard{k}.h5"
        shutil.copy(digits6_16px, shard)
        mutate(shard)
        err = _refused(capsys, _args(shard, tmp_path / f"run{k}"), [str(shard)])
        documented("checkpoints.md", example, None if example.startswith("|") else err)
    data = "`error: config key 'data.source' is 'mnist' but … holds 'digits'`"
    err = _refused(capsys, _args(digits6_16px, tmp_path / "src", "data.source=mnist"), [])
    documented("checkpoints.md", data, err)
    err = _refused(capsys, _args(digits6_16px, tmp_path / "shape", "data.input_shape=[3, 32, 32]"), [])
    assert "config key 'data.input_shape' is [3, 32, 32] but" in err and "holds inputs of shape [1, 16, 16]" in err
    err = _refused(capsys, _args(digits6_16px, tmp_path / "n", "data.num_clients=20"), [])
    assert "config key 'data.num_clients' is 20 but" in err and "holds 6 clients" in err


@pytest.mark.parametrize("mean, std, fragment", [
    ([0.5] * 3, [0.5] * 3, "'mean' holds 3 value(s) for 1 channel(s): one per channel"),
    ([], [], "'mean' holds 0 value(s) for 1 channel(s)"),
    ([0.5], [np.inf], "'std' holds inf: every value must be finite"),
    ([0.5], [0.0], "'std' holds 0.0: every value must be > 0"),
])
def test_write_shard_refuses_a_normalisation_the_inputs_cannot_take(mean, std, fragment, tmp_path):
    rng = np.random.default_rng(0)
    clients = [(rng.integers(0, 256, (4, 1, 8, 8), dtype=np.uint8), rng.integers(0, 10, 4),
                rng.integers(0, 256, (2, 1, 8, 8), dtype=np.uint8), rng.integers(0, 10, 2))]
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        write_shard(tmp_path / "s.h5", clients, source="mine", num_classes=10, input_shape=(1, 8, 8), mean=mean,
                    std=std, partition="x", partition_params={}, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_the_unchanged_shard_passes_every_check(digits6_16px, tmp_path):
    """The harness's control: the shard the faults are made from verifies, its digest matching what
    was written with it, and a run starts on it."""
    info = read_info(digits6_16px)
    digest = verify_shard(info)
    assert digest.fingerprint == info.fingerprint and digest.differing(info.array_digests) == []
    assert run(CONFIG, [f"data.path={digits6_16px}", f"out_dir={tmp_path / 'run'}", "rounds=1", "threads=1"])["rounds"] == 1


# ----------------------------------------------------------------------------- tables


@pytest.fixture(scope="module")
def table_shard(tmp_path_factory):
    rng = np.random.default_rng(3)
    clients = [(rng.normal(size=(12, 3)).astype(np.float32), rng.integers(0, 2, 12),
                rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 2, 4)) for _ in range(3)]
    path = tmp_path_factory.mktemp("table") / "t.h5"
    write_shard(path, clients, source="csv", num_classes=2, input_shape=(3,), mean=[0.0] * 3, std=[1.0] * 3,
                partition="iid", partition_params={}, seed=0, kind="table", columns=["a", "b", "c"])
    return path


def table_value(split, value):
    def mutate(path):
        off = _offsets(path, split)
        row = int(off[1]) + 2  # client 1's third row
        with h5py.File(path, "a") as f:
            f[f"{split}_x"][row, 1] = value
        return [f"client 1's {split}_x holds {value} (its row 2, feature 1)", "must be finite numbers"]
    return mutate


def table_as_float64(path):
    with h5py.File(path, "a") as f:
        _replace(f, "train_x", f["train_x"][()].astype(np.float64))
    return ["dataset 'train_x' holds float64 values (", "but a table shard stores float32 feature values"]


@pytest.mark.parametrize("mutate", [pytest.param(table_value("train", np.nan), id="nan-feature"),
                                    pytest.param(table_value("test", np.inf), id="inf-feature"),
                                    pytest.param(table_value("train", -np.inf), id="minus-inf-feature"),
                                    pytest.param(table_as_float64, id="features-as-float64")])
def test_a_bad_table_is_refused_before_training_in_one_line(mutate, table_shard, tmp_path, capsys):
    shard = tmp_path / "t.h5"
    shutil.copy(table_shard, shard)
    fragments = mutate(shard)
    _refused(capsys, _args(shard, tmp_path / "run", "model=mlp", "data.source=csv"), fragments)


# ----------------------------------------------------------------------------- every rank's own clients


@pytest.mark.parametrize("version", [FORMAT_VERSION, IMAGE_FORMAT_VERSION])
def test_a_rank_refuses_a_bad_label_among_the_clients_it_loads(version, tmp_path):
    """The ranks that do not hash the shard check the clients they load: the same one line, in
    either layout (one array per split, or a group per client)."""
    rng = np.random.default_rng(0)
    clients = [(rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8), rng.integers(0, 3, n),
                rng.integers(0, 256, (2, 1, 4, 4), dtype=np.uint8), rng.integers(0, 3, 2)) for n in (3, 5, 4)]
    path = tmp_path / "s.h5"
    write_shard(path, clients, source="x", num_classes=3, input_shape=(1, 4, 4), mean=[0.5], std=[0.25],
                partition="iid", partition_params={}, seed=0, format_version=version)
    with h5py.File(path, "a") as f:
        ds = f["train_y"] if version == FORMAT_VERSION else f["clients/1/train_y"]
        ds[3 + 4 if version == FORMAT_VERSION else 4] = 7  # client 1's fifth training label
    assert set(load_clients(path, [0, 2])) == {0, 2}  # the clean clients load
    with pytest.raises(UserError, match=r"client 1's train_y holds label 7 \(its row 4\), outside \[0, 3\)"):
        load_clients(path, [1])
    with pytest.raises(UserError, match=r"client 1's train_y holds label 7 \(its row 4\), outside \[0, 3\)"):
        content_digest(read_info(path))  # and the first rank's pass over every client


@pytest.mark.parametrize("name, row, value, fragment", [
    ("train_x", (1, 3), 9, r"client 1 'train_x' holds token ids outside \[0, 4\): 9 \(its row 1, position 3\)"),
    ("test_x", (0, 0), -2, r"client 1 'test_x' holds token ids outside \[0, 4\): -2 \(its row 0, position 0\)"),
    ("train_len", 2, 6, r"client 1 'train_len' holds lengths outside \[0, 5\]: 6 \(its row 2\)"),
])
def test_a_text_shard_with_ids_or_lengths_out_of_range_is_refused_naming_them(name, row, value, fragment, tmp_path):
    rng = np.random.default_rng(2)
    clients = [(rng.integers(0, 4, (3, 5)).astype(np.int32), rng.integers(0, 2, 3), rng.integers(0, 4, (2, 5)).astype(
        np.int32), rng.integers(0, 2, 2), np.array([5, 3, 1]), np.array([2, 2])) for _ in range(2)]
    path = tmp_path / "t.h5"
    write_shard(path, clients, source="x", num_classes=2, input_shape=(5,), mean=[], std=[], partition="iid",
                partition_params={}, seed=0, kind="text", vocab=["<pad>", "<unk>", "a", "b"])
    start = int(_offsets(path, name.split("_")[0])[1])  # client 1's first row
    with h5py.File(path, "a") as f:
        if isinstance(row, tuple):
            f[name][start + row[0], row[1]] = value
        else:
            f[name][start + row] = value
    with pytest.raises(UserError, match=fragment):
        load_clients(path, [1])


# ----------------------------------------------------------------------------- the digest and its cache


def test_the_digest_is_the_writers_fingerprint_in_either_layout(tmp_path):
    rng = np.random.default_rng(1)
    clients = [(rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8), rng.integers(0, 3, n),
                rng.integers(0, 256, (1, 1, 4, 4), dtype=np.uint8), rng.integers(0, 3, 1)) for n in (0, 5, 9000)]
    digests = {}
    for version in (FORMAT_VERSION, IMAGE_FORMAT_VERSION):
        path = tmp_path / f"v{version}.h5"
        write_shard(path, clients, source="x", num_classes=3, input_shape=(1, 4, 4), mean=[0.5], std=[0.25],
                    partition="iid", partition_params={}, seed=0, format_version=version)
        info = read_info(path)
        digests[version] = d = content_digest(info)
        assert d.fingerprint == info.fingerprint and d.arrays == info.array_digests
    # the same content in either layout hashes alike, array by array
    assert digests[FORMAT_VERSION].arrays == digests[IMAGE_FORMAT_VERSION].arrays
    assert set(digests[FORMAT_VERSION].arrays) == {"train_x", "train_y", "test_x", "test_y", "train_offsets",
                                                   "test_offsets", "attributes"}


def test_the_digest_is_kept_beside_the_shard_and_read_back_until_the_file_changes(digits6_16px, tmp_path, monkeypatch):
    shard = tmp_path / "d.h5"
    shutil.copy(digits6_16px, shard)
    first = cached_digest(read_info(shard), cache_seconds=0)
    assert not first.cached and first.cache == str(shard) + ".digest.json" and Path(first.cache).is_file()

    def no_read(info):
        raise AssertionError("the digest was computed again")

    monkeypatch.setattr(verify, "content_digest", no_read)
    again = cached_digest(read_info(shard), cache_seconds=0)  # a re-read is free: no array is read
    assert again.cached and (again.fingerprint, again.arrays) == (first.fingerprint, first.arrays)
    monkeypatch.undo()
    with h5py.File(shard, "a") as f:  # any write makes the file another one
        f["train_y"][0] = (int(f["train_y"][0]) + 1) % 10
    changed = cached_digest(read_info(shard), cache_seconds=0)
    assert not changed.cached and changed.differing(first.arrays) == ["train_y"]
    # a copy is another file (another inode): its digest is computed, and equal
    copy = tmp_path / "copy.h5"
    shutil.copy(digits6_16px, copy)
    assert not cached_digest(read_info(copy), cache_seconds=0).cached
    # a damaged cache file is ignored
    Path(str(copy) + ".digest.json").write_text("{not json")
    assert cached_digest(read_info(copy), cache_seconds=0).fingerprint == first.fingerprint
    # fast digests are not cached (nothing written beside small shards)
    other = tmp_path / "small.h5"
    shutil.copy(digits6_16px, other)
    assert cached_digest(read_info(other)).cache == "" and not Path(str(other) + ".digest.json").exists()


def test_class_counts_the_labels_do_not_add_up_to_are_never_cached(digits6_16px, tmp_path):
    """A digest whose pass found the per-class counts wrong is not kept beside the shard: the next
    run would read it back and start on the edited counts."""
    shard = tmp_path / "d.h5"
    shutil.copy(digits6_16px, shard)
    fragments = moved_label_count(shard)
    for _ in range(2):
        with pytest.raises(UserError) as exc:
            verify_shard(read_info(shard), cache_seconds=0)
        assert all(f in str(exc.value) for f in fragments), exc.value
    assert not Path(str(shard) + ".digest.json").exists()


def test_a_slow_digest_is_said_on_the_start_line_and_kept_for_the_next_run(digits6_16px, tmp_path, monkeypatch):
    """Start-up itself: a pass of a second or more (a large shard; made slow here) is named on the
    run's start line and cached, and the next run on the same file reads it back."""
    shard = tmp_path / "d.h5"
    shutil.copy(digits6_16px, shard)
    real = verify.content_digest

    def slow(info):
        d = real(info)
        d.seconds = 2.0
        return d

    monkeypatch.setattr(verify, "content_digest", slow)
    said = []
    run(CONFIG, [f"data.path={shard}", f"out_dir={tmp_path / 'a'}", "rounds=1", "threads=1"], echo=said.append)
    start = next(line for line in said if line.startswith("fedcp_dist:"))
    assert f"(content verified in 2.00 s, kept in {shard}.digest.json)" in start
    monkeypatch.setattr(verify, "content_digest", lambda info: pytest.fail("computed again"))
    said = []
    run(CONFIG, [f"data.path={shard}", f"out_dir={tmp_path / 'b'}", "rounds=1", "threads=1"], echo=said.append)
    assert "content verified" not in next(line for line in said if line.startswith("fedcp_dist:"))
    documented("data.md", "The run's start line says `content verified in S s` when the pass took half a second or "
               "more")


def test_a_folder_that_cannot_be_written_keeps_no_cache(digits6_16px, tmp_path, monkeypatch):
    shard = tmp_path / "d.h5"
    shutil.copy(digits6_16px, shard)

    def refuse(path, data, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(verify, "atomic_write_bytes", refuse)
    d = cached_digest(read_info(shard), cache_seconds=0)
    assert d.cache == "" and d.fingerprint == read_info(shard).fingerprint


# ----------------------------------------------------------------------------- resume by content


def _stopped_after(shard, out, rounds, *extra):
    """A run of ``rounds`` rounds, checkpointed after each, as if stopped after its last checkpoint."""
    run(CONFIG, [f"data.path={shard}", f"out_dir={out}", f"rounds={rounds}", "checkpoint_every=1", "threads=1",
                 *extra])
    (out / "summary.json").unlink()


def test_a_copy_of_the_shard_elsewhere_resumes_bit_for_bit(digits6_16px, tmp_path):
    """What a job script does on every requeue: copy the shard to node-local scratch (a new path
    each time) and start the run again; it resumes, and ends as an uninterrupted run."""
    whole = tmp_path / "whole"
    run(CONFIG, [f"data.path={digits6_16px}", f"out_dir={whole}", "rounds=3", "threads=1"])
    out = tmp_path / "run"
    _stopped_after(digits6_16px, out, 2)
    scratch = tmp_path / "scratch" / "job-2" / "shard.h5"
    scratch.parent.mkdir(parents=True)
    shutil.copy(digits6_16px, scratch)
    said = []
    run(CONFIG, [f"data.path={scratch}", f"out_dir={out}", "rounds=3", "checkpoint_every=1", "threads=1"],
        echo=said.append)
    assert any("resuming from" in line and "round_0000002" in line for line in said), said
    a, b = (torch.load(d / "final_global.pt", weights_only=True) for d in (whole, out))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((whole / "summary.json").read_text())["final_acc"] == \
        json.loads((out / "summary.json").read_text())["final_acc"]
    # the checkpoint now names where the shard lay last, and its content
    meta = Checkpointer(str(out), 0, 1, 2).load(Checkpointer(str(out), 0, 1, 2).latest(), [], "cpu")[3]
    assert meta["data"]["path"] == str(scratch) and meta["data"]["content"] == read_info(digits6_16px).fingerprint


def _rewrite_with_labels(src, dst, shuffle_client: int):
    """``src`` written again at ``dst`` through the shard writer with one client's training labels
    rolled by one: every count the same, a consistent file (its own fingerprint and digests)."""
    info = read_info(src)
    data = load_clients(src, range(info.num_clients))
    clients = []
    for c in range(info.num_clients):
        a = data[c]
        y = np.roll(a["train_y"], 1) if c == shuffle_client else a["train_y"]
        clients.append((a["train_x"], y, a["test_x"], a["test_y"]))
    write_shard(dst, clients, source=info.source, num_classes=info.num_classes, input_shape=info.input_shape,
                mean=info.mean, std=info.std, partition=info.partition, partition_params=info.partition_params,
                seed=info.seed)


def test_a_shard_rewritten_with_permuted_labels_is_refused_by_what_differs(digits6_16px, tmp_path):
    """The same path, the same counts and a consistent file, other labels: resuming would train on
    other data; it is refused in one line naming the labels, and the checkpoints stay."""
    shard = tmp_path / "d.h5"
    shutil.copy(digits6_16px, shard)
    out = tmp_path / "run"
    _stopped_after(shard, out, 1)
    _rewrite_with_labels(digits6_16px, shard, shuffle_client=0)
    assert layout_digest(read_info(shard)) == layout_digest(read_info(digits6_16px))  # counts alone cannot tell
    with pytest.raises(UserError, match=r"d\.h5 holds other data than the checkpointed run in .*: its train_y "
                                        r"\(training labels\) differ from the checkpoint's") as refused:
        run(CONFIG, [f"data.path={shard}", f"out_dir={out}", "rounds=2", "checkpoint_every=1", "threads=1"])
    documented("checkpoints.md", "`error: data.path … holds other data than the checkpointed run in … was made on: its "
               "train_y (training labels) differ from the checkpoint's (partitioned again, or edited in place?); …`",
               f"error: {refused.value}")
    assert Checkpointer(str(out), 0, 1, 2).latest().name == "round_0000001"


def _record(fingerprint=None, layout="L", path="/a/d.h5", content=None, arrays=None):
    out = {"path": path, "fingerprint": fingerprint, "layout": layout}
    if content:
        out.update(content=content, arrays=arrays)
    return out


def test_resume_checks_by_what_each_checkpoint_recorded(tmp_path):
    """The data check against checkpoints of every age: array digests (named), a content fingerprint
    (an older checkpoint: it recorded the one written with the shard, which is verified when read),
    the layout of a shard without one (then a moved shard is not accepted), nothing."""
    said = []
    now = _record("sha256:" + "a" * 64, path="/scratch/d.h5", content="sha256:" + "a" * 64,
                  arrays={"train_y": "y1", "train_x": "x1"})
    assert check_same_data(_record(content="sha256:" + "a" * 64, arrays={"train_y": "y1", "train_x": "x1"}),
                           now, tmp_path, said.append)
    with pytest.raises(UserError, match=r"its train_x \(training samples\), train_y \(training labels\) differ"):
        check_same_data(_record(content="c", arrays={"train_y": "y0", "train_x": "x0"}), now, tmp_path, said.append)
    assert check_same_data(_record("sha256:" + "a" * 64), now, tmp_path, said.append)  # an older checkpoint
    with pytest.raises(UserError, match=r"its shard fingerprint is sha256:aaaaaaaaaaaa\.\.\., the checkpoint's "
                                        r"sha256:bbbbbbbbbbbb\.\.\."):
        check_same_data(_record("sha256:" + "b" * 64), now, tmp_path, said.append)
    assert not said
    assert check_same_data(_record(None, layout=now["layout"]), now, tmp_path, said.append) is False
    assert "checked only its clients' sample and label counts" in said[-1]
    with pytest.raises(UserError, match="its clients' sample or label counts differ"):
        check_same_data(_record(None, layout="other"), now, tmp_path, said.append)
    assert check_same_data(None, now, tmp_path, said.append) is False and "records no shard fingerprint" in said[-1]
    # data.path may change only when the content was verified to be the same
    old, new = {"data": {"path": "/a/d.h5"}}, {"data": {"path": "/scratch/d.h5"}}
    check_resume_config(old, new, tmp_path, same_data=True)
    with pytest.raises(UserError, match="config key 'data.path' is '/scratch/d.h5' but the checkpointed run"):
        check_resume_config(old, new, tmp_path, same_data=False)


# ----------------------------------------------------------------------------- what the docs promise


def test_data_md_promises_what_resume_does():
    """docs/data.md's paragraph on resuming, sentence by sentence, is what the tests above check."""
    text = " ".join((REPO / "docs" / "data.md").read_text(encoding="utf-8").split())
    for promise in (
        "A run records its shard's content in each checkpoint",
        "a copy of the shard at another path (node-local scratch, say) resumes",
        "a shard whose arrays differ from the checkpoint's is refused in one line naming them",
        "A shard whose content no longer matches what was written with it (edited in place, damaged) is refused "
        "when a run opens it, naming the arrays that differ",
        "kept beside the shard in `<shard>.digest.json`",
    ):
        assert promise in text, promise


def test_a_shard_another_process_has_open_for_writing_is_named_locked(digits6, tmp_path):
    """HDF5's file lock (another process holds the shard open with "r+"): the run says the file is
    locked, not that it may be truncated or corrupt."""
    import subprocess
    import sys

    shard = tmp_path / "shard.h5"
    shutil.copy(digits6, shard)
    holder = subprocess.Popen([sys.executable, "-c", f"import h5py, sys, time; f = h5py.File({str(shard)!r}, 'r+'); "
                               "print('open', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(UserError) as exc:
            read_info(shard)
    finally:
        holder.kill()
        holder.wait()
    assert str(exc.value).startswith(f"shard file {shard} is locked by another process that has it open for writing "
                                     "(HDF5: ") and str(exc.value).endswith("); let that process finish, or read a copy")
    assert read_info(shard).num_clients == 6  # the lock went with the process
