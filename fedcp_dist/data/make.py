"""Make a client shard from a partition spec: the library behind ``fedcp-partition`` and sweeps.

    spec = PartitionSpec(source="digits", partition="dir", beta=0.1, num_clients=20, seed=1)
    make_shard(spec, "data/digits_dir0.1_n20.h5")

A :class:`PartitionSpec` holds the options of ``fedcp-partition``'s partition mode under the same
names and with the same defaults; a sweep's ``partition`` block is one. Every mistake is a one-line
:class:`~fedcp_dist.errors.UserError` that names the option as the command line spells it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fedcp_dist.data.sources import check_source_name
from fedcp_dist.data.text import (DEFAULT_MAX_LEN, DEFAULT_MIN_FREQ, DEFAULT_TEXT_PIPELINE, DEFAULT_VOCAB_SIZE,
                                  TEXT_PIPELINES)
from fedcp_dist.errors import UserError
from fedcp_dist.fileio import folder_above_problem
from fedcp_dist.options import SEED_MAX, shown, type_ok

SCHEMES = ("dir", "pat", "iid", "folders", "column")
#: the natural partitions (the data say which client holds each sample) and the source of each
NATURAL = {"folders": "imagefolder", "column": "csv"}
#: sources that come with their own clients (LEAF's users, the synthetic benchmark's clients): no
#: partition scheme applies, and the shard records the source's name as its partition
OWN_CLIENTS = ("leaf", "synthetic")
#: the options of the split schemes, which sources with their own clients refuse
SPLIT_OPTIONS = ("partition", "beta", "classes_per_client", "unbalanced", "batch_size", "max_tries")


def flag(option: str) -> str:
    """``num_clients`` → ``--num-clients``: an option as the command line spells it."""
    return f"--{option.replace('_', '-')}"


@dataclass
class PartitionSpec:
    """What to partition and how: the options of ``fedcp-partition`` (partition mode)."""

    #: data source: digits (offline), mnist, fmnist, cifar10, cifar100, tinyimagenet, agnews (text),
    #: imagefolder, csv (your own data)
    source: str = "digits"
    #: directory holding the source's files
    root: Optional[str] = None
    #: let torchvision download the source
    download: bool = False
    #: partition scheme: dir | pat | iid | folders (imagefolder) | column (csv with client_col)
    partition: str = "dir"
    #: number of clients (required, except for the natural partitions folders and column)
    num_clients: Optional[int] = None
    #: Dirichlet concentration (dir)
    beta: float = 0.1
    #: classes per client (pat)
    classes_per_client: int = 2
    #: pat: draw unequal share sizes
    unbalanced: bool = False
    #: batch size, only used for the minimum client size
    batch_size: int = 10
    #: fraction of each client's samples used for training
    train_ratio: float = 0.75
    #: random seed of the partition
    seed: int = 1
    #: dir: redraws before giving up
    max_tries: int = 10000
    #: text sources: tokens kept per text (None: the default)
    max_len: Optional[int] = None
    #: text sources: most token ids, padding and unknown included (None: the pipeline's, i.e. no cap for
    #: reference, 50,000 for alnum)
    vocab_size: Optional[int] = None
    #: text sources: fewest occurrences for a token to get its own id (None: the default)
    min_freq: Optional[int] = None
    #: text sources: reference (the FedCP authors' pipeline: basic_english tokens, vocabulary of train + test,
    #: uncapped) | alnum (runs of [a-z0-9], vocabulary of the training texts, 50,000 ids)
    text_pipeline: str = DEFAULT_TEXT_PIPELINE
    #: tinyimagenet: add the val folder's images after the train folder's (default: train only, as the paper)
    include_val: bool = False
    #: imagefolder: N or HxW every image is resized to (None: the first image's size)
    image_size: Optional[str] = None
    #: imagefolder: 1 (greyscale) or 3 (RGB) (None: 1 when the first image is greyscale, else 3)
    channels: Optional[int] = None
    #: csv: the column holding the labels (required for csv)
    label_col: Optional[str] = None
    #: csv: the column naming each row's client (needs partition column)
    client_col: Optional[str] = None
    #: csv: comma-separated columns to ignore
    drop_cols: Optional[str] = None
    #: leaf: femnist | shakespeare (None: told from the files' content)
    leaf_task: Optional[str] = None
    #: synthetic: alpha, the spread of the clients' models (required unless synthetic_iid)
    synthetic_alpha: Optional[float] = None
    #: synthetic: beta, the spread of the clients' input means (required unless synthetic_iid)
    synthetic_beta: Optional[float] = None
    #: synthetic: Synthetic-IID (one model for all clients, inputs N(0, Sigma))
    synthetic_iid: bool = False
    #: synthetic: the fewest samples of a client (the 50 of n = floor(lognormal(4, 2)) + 50)
    synthetic_min_samples: int = 50
    #: synthetic: the most samples of a client (None: no cap)
    synthetic_max_samples: Optional[int] = None

    def __post_init__(self) -> None:
        # an integer given for a float option is that float (as the command line reads "1" as 1.0),
        # so that the same partition always gets the same file name
        types = _option_types()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if types[f.name] in (float, Optional[float]) and value is not None and type_ok(value, float):
                setattr(self, f.name, float(value))

    @classmethod
    def from_dict(cls, values: dict) -> "PartitionSpec":
        """A spec from ``{option: value}``; an unknown option or a value of the wrong type is a UserError."""
        types = option_types()
        for key, value in values.items():
            if key not in types:
                raise UserError(f"'{key}' is not a fedcp-partition option; known: {', '.join(types)}")
            check_option(key, value)
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_scheme_options(self, given: Optional[set] = None) -> None:
        """An option of one split scheme given with another is refused: it would be ignored (with
        ``--partition iid`` a ``--beta 0.5`` wrote the same shard as none). For the command line: a
        sweep's partition block holds the options of every scheme its grid names. ``given``: the
        options the command line names (at their default value too; None: those that differ from it)."""
        defaults = _defaults()
        if self.source == "leaf" and _named(self, "seed", defaults, given):  # the shard recorded seed -1
            raise UserError("--seed: --source leaf keeps LEAF's own users and train/test split and draws nothing")
        if self.source in OWN_CLIENTS:  # their own check names the options they refuse
            return
        for key, scheme in (("beta", "dir"), ("max_tries", "dir"), ("classes_per_client", "pat"), ("unbalanced", "pat")):
            if _named(self, key, defaults, given) and self.partition != scheme:
                raise UserError(f"{flag(key)} applies to --partition {scheme} only, not to --partition {self.partition}")
        if self.source == "digits" and (self.root is not None or self.download):
            raise UserError(f"{'--root' if self.root is not None else '--download'}: --source digits is embedded "
                            f"(scikit-learn's) and reads no files")

    def check(self, given: Optional[set] = None) -> None:
        """Refuse impossible values (before any data is loaded). ``given``: as for
        :meth:`check_scheme_options`."""
        if self.source not in OWN_CLIENTS:  # an unknown source first: it says what else is wrong
            check_source_name(self.source)
        check_option_values(self)
        if not 0 <= self.seed <= SEED_MAX:
            raise UserError(f"--seed must be an integer in [0, {SEED_MAX}] (a seed torch and numpy both take), "
                            f"got {self.seed}")
        if not 0 < self.train_ratio < 1:
            raise UserError(f"--train-ratio must be between 0 and 1 (exclusive), got {self.train_ratio}")
        _check_own_clients(self, given)
        if self.partition not in SCHEMES:
            raise UserError(f"--partition must be one of {', '.join(SCHEMES)}, got {self.partition!r}")
        natural = NATURAL.get(self.partition)
        if natural and self.source != natural:
            raise UserError(f"--partition {self.partition} applies to --source {natural} only, "
                            f"not to '{self.source}'")
        if self.client_col is not None and self.partition != "column":
            raise UserError(f"--client-col needs --partition column (each value of the column is one client), "
                            f"got --partition {self.partition}")
        if self.num_clients is None and not natural and self.source != "leaf":
            raise UserError("--num-clients is required")
        if self.num_clients is not None and self.num_clients < 1:
            raise UserError(f"--num-clients must be >= 1, got {self.num_clients}")
        if not (math.isfinite(self.beta) and self.beta > 0):  # inf: NaN Dirichlet draws, a degenerate partition
            raise UserError(f"--beta must be a finite number > 0, got {self.beta}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_tries < 1:
            raise UserError(f"--max-tries must be >= 1, got {self.max_tries}")
        if self.classes_per_client < 1:
            raise UserError(f"--classes-per-client must be >= 1, got {self.classes_per_client}")
        if self.text_pipeline not in TEXT_PIPELINES:
            raise UserError(f"--text-pipeline must be one of {', '.join(TEXT_PIPELINES)}, got {self.text_pipeline!r}")
        if self.include_val and self.source != "tinyimagenet":
            raise UserError(f"--include-val applies to --source tinyimagenet only, not to '{self.source}'")
        own = {"image_size": "imagefolder", "channels": "imagefolder", "label_col": "csv",
               "client_col": "csv", "drop_cols": "csv"}
        for key, source in own.items():
            if getattr(self, key) is not None and self.source != source:
                raise UserError(f"{flag(key)} applies to --source {source} only, not to '{self.source}'")
        if self.channels is not None and self.channels not in (1, 3):
            raise UserError(f"--channels must be 1 or 3, got {self.channels}")
        if self.image_size is not None:
            from fedcp_dist.data.owndata import parse_image_size

            parse_image_size(self.image_size)

    def synthetic(self):
        """The :class:`~fedcp_dist.data.synthetic.SyntheticSpec` of a synthetic source."""
        from fedcp_dist.data.synthetic import SyntheticSpec

        return SyntheticSpec(alpha=self.synthetic_alpha or 0.0, beta=self.synthetic_beta or 0.0,
                             num_clients=self.num_clients, seed=self.seed, iid=self.synthetic_iid,
                             train_ratio=self.train_ratio, min_samples=self.synthetic_min_samples,
                             max_samples=self.synthetic_max_samples)

    def own_options(self, say) -> dict:
        """The keyword arguments of the own-data loaders (imagefolder, csv)."""
        natural = self.partition in NATURAL
        if self.source == "imagefolder":
            return {"image_size": self.image_size, "channels": self.channels, "natural": natural, "say": say}
        if self.source == "csv":
            return {"label_col": self.label_col, "client_col": self.client_col, "drop_cols": self.drop_cols,
                    "natural": natural, "say": say}
        return {}


def _named(spec: PartitionSpec, key: str, defaults: dict, given: Optional[set]) -> bool:
    """Whether option ``key`` is set: named on the command line (``given``, at its default value
    too), else (None) given a value other than its default."""
    return key in given if given is not None else getattr(spec, key) != defaults[key]


def _check_own_clients(spec: PartitionSpec, given: Optional[set] = None) -> None:
    """Sources with their own clients (:data:`OWN_CLIENTS`) refuse the split schemes' options, and
    their own options belong to them alone."""
    defaults = _defaults()
    split = [key for key in SPLIT_OPTIONS if _named(spec, key, defaults, given)]
    if spec.source in OWN_CLIENTS and split:
        what = "LEAF's users" if spec.source == "leaf" else "its generated clients"
        raise UserError(f"{flag(split[0])} applies to sources split among clients; --source {spec.source} keeps "
                        f"{what} as the clients")
    if spec.leaf_task is not None and spec.source != "leaf":
        raise UserError(f"--leaf-task applies to --source leaf only, not to '{spec.source}'")
    own = [f.name for f in dataclasses.fields(spec) if f.name.startswith("synthetic_")
           and _named(spec, f.name, defaults, given)]
    if own and spec.source != "synthetic":
        raise UserError(f"{flag(own[0])} applies to --source synthetic only, not to '{spec.source}'")
    if spec.source == "leaf":
        if _named(spec, "train_ratio", defaults, given):
            raise UserError("--train-ratio: LEAF's files hold their own train/test split (preprocess.sh --tf); "
                            "--source leaf keeps it")
        if spec.download:
            raise UserError("--source leaf cannot be downloaded: make LEAF's files with its preprocess.sh")
        from fedcp_dist.data.leaf import TASKS

        if spec.leaf_task is not None and spec.leaf_task not in TASKS:
            raise UserError(f"--leaf-task must be one of {', '.join(TASKS)}, got {spec.leaf_task!r}")
    if spec.source == "synthetic":
        if spec.root is not None or spec.download:
            raise UserError(f"{'--root' if spec.root is not None else '--download'}: --source synthetic generates "
                            f"its data and reads no files")
        ab = [k for k in ("synthetic_alpha", "synthetic_beta") if getattr(spec, k) is not None]
        if spec.synthetic_iid and ab:
            raise UserError(f"{flag(ab[0])} does not apply to --synthetic-iid (one model for every client)")
        if not spec.synthetic_iid and len(ab) < 2:
            missing = "--synthetic-alpha" if "synthetic_alpha" not in ab else "--synthetic-beta"
            raise UserError(f"--source synthetic needs {missing} (Synthetic(alpha, beta)), or --synthetic-iid")
        if spec.num_clients is None:
            raise UserError("--num-clients is required")
        spec.synthetic().check()


def _defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(PartitionSpec)}


def option_types() -> dict:
    """option → the type its value must have (bool options are command-line flags)."""
    return dict(_option_types())


@functools.lru_cache(maxsize=None)
def _option_types() -> dict:
    # resolved once: typing.get_type_hints is slow, and a sweep's points check every option
    hints = typing.get_type_hints(PartitionSpec)
    return {f.name: hints[f.name] for f in dataclasses.fields(PartitionSpec)}


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0] if args else tp).__name__


def check_option(key: str, value) -> None:
    """A UserError when ``value`` has the wrong type for option ``key``."""
    tp = _option_types()[key]
    if not type_ok(value, tp):
        raise UserError(f"expected {_type_name(tp)}, got {shown(value)}")


def check_option_values(spec: PartitionSpec) -> None:
    for key in option_types():
        try:
            check_option(key, getattr(spec, key))
        except UserError as exc:
            raise UserError(f"{flag(key)}: {exc}") from None


def text_options(max_len: Optional[int], vocab_size: Optional[int], min_freq: Optional[int], kind: str,
                 source_name: str, text_pipeline: str = DEFAULT_TEXT_PIPELINE) -> dict:
    """The text options given, defaults filled in, for a text source; an error if given for another.

    ``text_pipeline`` is checked by :meth:`PartitionSpec.check`; a pipeline other than the default
    is an error for a source that is not text."""
    given = {"max_len": max_len, "vocab_size": vocab_size, "min_freq": min_freq}
    if kind != "text":
        for key, value in given.items():
            if value is not None:
                raise UserError(f"{flag(key)} applies to text sources (agnews) only, not to '{source_name}'")
        if text_pipeline != DEFAULT_TEXT_PIPELINE:
            raise UserError(f"--text-pipeline applies to text sources (agnews) only, not to '{source_name}'")
        return {}
    defaults = {"max_len": DEFAULT_MAX_LEN, "min_freq": DEFAULT_MIN_FREQ,
                "vocab_size": DEFAULT_VOCAB_SIZE if text_pipeline == "alnum" else None}
    opts = {k: (defaults[k] if v is None else v) for k, v in given.items()}
    opts["text_pipeline"] = text_pipeline
    if opts["max_len"] < 1:
        raise UserError(f"--max-len must be >= 1, got {opts['max_len']}")
    if opts["vocab_size"] is not None and opts["vocab_size"] < 3:
        raise UserError(f"--vocab-size must be >= 3 (it counts the padding and unknown ids), got {opts['vocab_size']}")
    if opts["min_freq"] < 1:
        raise UserError(f"--min-freq must be >= 1, got {opts['min_freq']}")
    return opts


def check_out(out, force: bool) -> Path:
    """The shard file to write: not a directory, and not an existing file unless ``force``."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name")
    if out.exists() and not force:
        raise UserError(f"--out {out} already exists; pass --force to overwrite it")
    problem = folder_above_problem(out)
    if problem:
        raise UserError(f"--out {out}: {problem}")
    return out


def with_progress(clients, total: int):
    """Yield ``clients`` unchanged under a progress bar (shown once writing takes 2 s)."""
    from fedcp_dist.data.sources import progress

    return progress(clients, total=total, desc="writing clients", unit="client")


def say_written(path: Path, say: Callable[[str], None]) -> None:
    """One line on what the shard at ``path`` holds."""
    from fedcp_dist.data.shards import read_info

    info = read_info(path)
    vocab = f", vocabulary of {info.vocab_size} tokens" if info.kind == "text" else ""
    say(f"wrote {path}: {info.num_clients} clients, {int(info.train_counts.sum())} train / "
        f"{int(info.test_counts.sum())} test samples, input {info.input_shape}, "
        f"{info.num_classes} classes{vocab}")


def _say(msg: str) -> None:
    print(msg, flush=True)


def make_shard(spec: PartitionSpec, out, *, force: bool = False, say: Callable[[str], None] = _say) -> Path:
    """Load ``spec.source``, partition it among ``spec.num_clients`` clients and write the shard ``out``.

    The file appears only once it is complete (an existing one is replaced only with ``force``).
    Progress goes to ``say``, one line at a time. Returns ``out`` as a Path.
    """
    from fedcp_dist.data.partition import client_rows, least_samples, partition_clients
    from fedcp_dist.data.shards import write_shard
    from fedcp_dist.data.sources import load_source, source_kind

    spec.check()
    if spec.source in OWN_CLIENTS:
        return _make_own_clients(spec, out, force, say)
    text_opts = text_options(spec.max_len, spec.vocab_size, spec.min_freq, source_kind(spec.source), spec.source,
                             spec.text_pipeline)
    source_opts = {"include_val": True} if spec.include_val else {}
    out = check_out(out, force)

    say(f"loading source {spec.source}" + (f" from {spec.root}" if spec.root else ""))
    src = load_source(spec.source, root=spec.root, download=spec.download, **text_opts, **source_opts,
                      own_options=spec.own_options(say))
    vocab = f", vocabulary of {src.vocab_size} tokens" if src.kind == "text" else ""
    say(f"  {len(src.y)} samples, input {src.input_shape}, {src.num_classes} classes{vocab}")
    if src.num_classes < 2:
        column = src.params.get("label_col")
        raise UserError(f"source {spec.source}: {'its label column ' + repr(column) if column else 'the data'} "
                        f"holds {src.num_classes} class{'es' if src.num_classes != 1 else ''}; "
                        f"a classifier needs at least two")

    if spec.partition in NATURAL:
        shares, params = _natural_partition(spec, src, say)
    else:
        say(f"partitioning: {spec.partition}, {spec.num_clients} clients, seed {spec.seed}")
        part = partition_clients(src.y, src.num_classes, spec.partition, spec.num_clients, spec.seed,
                                 beta=spec.beta, classes_per_client=spec.classes_per_client,
                                 balance=not spec.unbalanced, batch_size=spec.batch_size,
                                 train_ratio=spec.train_ratio, max_tries=spec.max_tries)
        shares = part.shares
        say(f"  {part.report.summary()}")
        params = {"train_ratio": spec.train_ratio, "batch_size": spec.batch_size,
                  "least_samples": least_samples(spec.batch_size, spec.train_ratio, len(src.y), spec.num_clients)}
        if spec.partition == "dir":
            params.update(beta=spec.beta, max_tries=spec.max_tries)
        elif spec.partition == "pat":
            params.update(classes_per_client=spec.classes_per_client, balance=not spec.unbalanced)
        params.update(part.report.params())
    params.update(src.params)
    mean, std = src.mean, src.std
    if src.kind == "table":
        from fedcp_dist.data.owndata import train_statistics

        mean, std = train_statistics(src.x, shares)
        say(f"  features standardised with the mean and std of the {sum(len(tr) for tr, _ in shares)} "
            f"training rows")
    if spec.root:
        params["root"] = os.path.abspath(spec.root)

    clients = client_rows(src.x, src.y, shares, src.lengths)
    say(f"writing {len(shares)} clients to {out}")
    write_shard(out, with_progress(clients, len(shares)), source=src.name,
                num_classes=src.num_classes, input_shape=src.input_shape, mean=mean,
                std=std, partition=spec.partition, partition_params=params, seed=spec.seed,
                kind=src.kind, vocab=src.vocab, columns=src.feature_names, replace=force)
    say_written(out, say)
    return out


def _make_own_clients(spec: PartitionSpec, out, force: bool, say) -> Path:
    """LEAF's users or the synthetic benchmark's clients, written as they come (no partition)."""
    from fedcp_dist.data.leaf import write_leaf_shard
    from fedcp_dist.data.synthetic import write_synthetic_shard

    text_options(spec.max_len, spec.vocab_size, spec.min_freq, "image", spec.source, spec.text_pipeline)
    out = check_out(out, force)
    if spec.source == "leaf":
        write_leaf_shard(spec.root, out, spec.leaf_task, CLIENT_NAMES_CHARS, say, spec.num_clients, replace=force)
    else:
        write_synthetic_shard(spec.synthetic(), out, say, replace=force)
    say_written(out, say)
    return out


#: client names recorded in partition_params up to this many characters in all (an HDF5
#: attribute holds at most 64 KiB); beyond it only their number is
CLIENT_NAMES_CHARS = 16000


def _natural_partition(spec: PartitionSpec, src, say) -> tuple[list, dict]:
    """Each client folder's (or client column value's) own train/test split, and the record."""
    from fedcp_dist.data.owndata import natural_shares

    names = src.group_names
    if spec.num_clients is not None and spec.num_clients != len(names):
        raise UserError(f"--num-clients is {spec.num_clients} but the data name {len(names)} clients "
                        f"(leave --num-clients out for --partition {spec.partition})")
    what = "client folder" if spec.partition == "folders" else f"client '{spec.client_col}' value"
    say(f"partitioning: {spec.partition} (the data's own {len(names)} clients), each its own "
        f"{spec.train_ratio:g} train split, seed {spec.seed}")
    shares = natural_shares(src.groups, names, spec.train_ratio, spec.seed, what)
    sizes = [len(tr) + len(te) for tr, te in shares]
    say(f"  samples per client: min {min(sizes)}, max {max(sizes)}")
    params = {"train_ratio": spec.train_ratio, "num_clients": len(names)}
    if sum(len(str(n)) + 4 for n in names) <= CLIENT_NAMES_CHARS:
        params["clients"] = [str(n) for n in names]
    return shares, params
