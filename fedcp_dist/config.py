"""Run configuration: dataclasses, YAML loading, ``key=value`` overrides, validation.

Every user mistake becomes a :class:`~fedcp_dist.errors.UserError` whose one-line message names
the key. The keys users touch most are flat (``method``, ``rounds``, ``lr``, ``lam`` ...); the data
set lives under ``data.`` (``data.path``).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from fedcp_dist.algorithms import ALGORITHMS, method_options, option_classes
from fedcp_dist.client_store import CLIENT_STATE_MODES
from fedcp_dist.errors import UserError
from fedcp_dist.models import FASTTEXT_FEATURES, FASTTEXT_MEANS, MODELS
from fedcp_dist.placement import PARTICIPATION_DRAWS, PLACEMENTS

METHODS = tuple(ALGORITHMS)
AMP_MODES = ("none", "bf16")
DEVICES = ("auto", "cpu", "cuda")
# SIGUSR1 is left alone: NCCL may use it
PREEMPT_SIGNALS = ("SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP")


@dataclass
class DataConfig:
    """Where the pre-sharded partition lives (an HDF5 file written by ``fedcp-partition``)."""

    path: str = ""
    #: expected number of clients; 0 takes the file's count, any other value must agree with it
    num_clients: int = 0
    #: expected source data set (digits, mnist, cifar10, ...); empty accepts any
    source: str = ""
    #: expected input shape [C, H, W]; null accepts any
    input_shape: Optional[list] = None
    #: the clients the run uses: null = all; K = a random K of them drawn once from the run seed;
    #: a list = those client ids of the shard. The others neither train nor are evaluated.
    clients: Optional[typing.Union[int, list]] = None


@dataclass
class _Experiment:
    """The keys every run has, before the methods' own options (the config file's order)."""

    #: federated method: fedcp | fedavg | fedprox | perfedavg | pfedme | fedamp | ditto | fedper | fedrep | fedrod | fedfomo | fedphp
    method: str = "fedcp"
    #: model: cnn (the paper's 4-layer CNN, sized from the shard's input shape) | resnet18 | fasttext (text shards)
    #: | mlp (table shards)
    model: str = "cnn"
    #: mlp: width H of its two hidden layers (the feature dimension K)
    mlp_hidden: int = 64
    #: fasttext: embedding and feature width K (32, as the FedCP authors' AG News runs)
    fasttext_dim: int = 32
    #: fasttext: padded averages the embeddings over all max_len positions, padding included (the authors'
    #: model); tokens over the real tokens only (this project's first variant)
    fasttext_mean: str = "padded"
    #: fasttext: where the head starts: linear = after Linear(K, K) (the authors' FedCP repository);
    #: log_softmax = after a log-softmax on it (PFLlib's fastText of 2021-2024 under its head split)
    fasttext_feature: str = "linear"
    #: BatchNorm running statistics (ResNet-18): false keeps each client's own (the reference's behaviour);
    #: true averages them across participants with the same sample weights as the parameters
    aggregate_bn_stats: bool = False
    #: communication rounds
    rounds: int = 100
    #: evaluate every this many rounds (before that round's training), and after the last round
    eval_every: int = 1
    #: fraction ρ of clients that train each round, in (0, 1]
    participation: float = 1.0
    #: if set, [ρ_min, ρ_max]: ρ is drawn uniformly from this range each round (drop-out study)
    participation_range: Optional[list] = None
    #: with participation_range: rho draws ρ uniformly and trains ⌊ρN⌋ clients; count draws the number of
    #: participants uniformly from {⌊ρ_min·N⌋ … ⌊ρ_max·N⌋} (the reference library's rule, which reaches N)
    participation_draw: str = "rho"
    #: run seed: model init, cohorts and every client's batch order and noise derive from it
    seed: int = 1
    #: local learning rate η (plain SGD, no momentum)
    lr: float = 0.005
    #: local batch size B
    batch_size: int = 10
    #: local epochs E
    local_epochs: int = 1
    #: drop a last incomplete batch each epoch (the reference's data loader does)
    drop_last: bool = True


@dataclass
class _Execution:
    """The keys of how and where a run executes and what it writes (after the methods' options)."""

    #: samples per forward pass at evaluation
    eval_batch_size: int = 1000
    #: train a group of a rank's clients at once (stacked parameters, one forward/backward): auto where the
    #: method and model can (else one by one) | true (the same; the start line says when it cannot) | false
    fused: typing.Union[bool, str] = "auto"
    #: clients per fused group (groups are fixed for the run and placed whole on ranks); 0 (auto): the
    #: device kind's slot cap (8 on a CPU, 256 on a GPU) × ⌈1 / participation⌉
    fused_group: int = 0
    #: CPU ranks: glibc's allocator keeps freed memory for reuse instead of returning large blocks to the
    #: system (whose pages then fault in again on every use): auto (on a CPU device under glibc) | true | false
    keep_freed_memory: typing.Union[bool, str] = "auto"
    #: fused groups trained side by side on a CPU rank, one thread each: auto (one per thread of the rank) | N
    #: (1: one group at a time over all the rank's threads)
    fused_workers: typing.Union[int, str] = "auto"
    #: what clients are weighted by when placed on ranks (largest first, to the least-loaded rank): samples |
    #: steps (local SGD steps: batches × local_epochs) | auto (steps unless fused=false)
    placement: str = "auto"
    #: where each client's persistent state lives between rounds: device | host (moved to the device when used) |
    #: disk (one file per client, read ahead, written back in the background) | auto (device when this rank's states
    #: fit client_state_budget_mb, disk otherwise)
    client_state: str = "device"
    #: client_state=auto: MiB this rank's client states may take in memory; 0: half the memory available at start
    client_state_budget_mb: float = 0.0
    #: client_state=disk: directory of the state files (a local scratch disk); empty: out_dir/client_state
    client_state_dir: str = ""
    #: each round's record gains rank 0's resident memory now and at its peak and the MiB of client state
    #: its store holds in memory (rss_mb, peak_rss_mb, client_state_held_mb): for soak runs
    record_memory: bool = False
    #: mixed precision of local training: none | bf16 (autocast; evaluation stays float32)
    amp: str = "none"
    #: run directory (rank 0 writes config.yaml, metrics.jsonl, summary.json, final_global.pt)
    out_dir: str = "runs/default"
    #: start afresh in an out_dir that holds a run (its checkpoints are removed); otherwise refused
    overwrite: bool = False
    #: auto: continue from the newest complete checkpoint in out_dir; never: refuse an out_dir with one
    resume: str = "auto"
    #: checkpoint every this many rounds (0: only on a preemption signal)
    checkpoint_every: int = 50
    #: complete checkpoints kept
    keep_checkpoints: int = 2
    #: probes for analysis.jsonl (FedCP): PIR and s histograms at every evaluation, PIR and the training loss
    #: before/after local learning of every trained client every analysis_every rounds; results are unchanged
    analysis: bool = False
    #: take the training probes every this many rounds (rounds 1, k+1, 2k+1, ...); > 0 also turns analysis on
    analysis_every: int = 0
    #: none | tensorboard: rank 0 also writes every round's metrics and the analysis means as TensorBoard
    #: events into out_dir/tensorboard/ (needs the tensorboard package)
    logger: str = "none"
    #: signal that asks the run to finish its round, checkpoint and exit with status 75 (SIGTERM too)
    preempt_signal: str = "SIGUSR2"
    #: a client's non-finite loss or update: error (stop every rank) | skip (leave it out of the round)
    on_nonfinite: str = "error"
    #: auto | cpu | cuda
    device: str = "auto"
    #: CPU threads per rank; 0 = cores / ranks on this node
    threads: int = 0
    #: seconds a collective may wait for a peer before the run fails
    collective_timeout: float = 600.0
    data: DataConfig = field(default_factory=DataConfig)


class _ConfigMethods:
    """What every Config does; the class itself is assembled below from the keys of the run, the
    options the methods declare next to their code (``options`` of each method class) and the keys
    of execution."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def probe_every(self) -> int:
        """Rounds between training probes (0: analysis off); ``analysis: true`` alone means every round."""
        return self.analysis_every or (1 if self.analysis else 0)

    def validate(self) -> "Config":
        """Raise :class:`UserError` naming the first impossible value."""

        def bad(key: str, why: str):
            raise UserError(f"config key '{key}': {why}")

        if self.method not in METHODS:
            bad("method", f"unknown method {self.method!r}; known: {', '.join(METHODS)}")
        if self.model not in MODELS:
            bad("model", f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        if self.device not in DEVICES:
            bad("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for key in ("rounds", "eval_every", "batch_size", "local_epochs", "eval_batch_size", "mlp_hidden",
                    "fasttext_dim"):
            if getattr(self, key) <= 0:
                bad(key, f"must be > 0, got {getattr(self, key)}")
        if self.fasttext_mean not in FASTTEXT_MEANS:
            bad("fasttext_mean", f"must be one of {', '.join(FASTTEXT_MEANS)}, got {self.fasttext_mean!r}")
        if self.fasttext_feature not in FASTTEXT_FEATURES:
            bad("fasttext_feature", f"must be one of {', '.join(FASTTEXT_FEATURES)}, got {self.fasttext_feature!r}")
        if self.on_nonfinite not in ("error", "skip"):
            bad("on_nonfinite", f"must be error or skip, got {self.on_nonfinite!r}")
        if self.resume not in ("auto", "never"):
            bad("resume", f"must be auto or never, got {self.resume!r}")
        if self.checkpoint_every < 0:
            bad("checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            bad("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        if self.preempt_signal not in PREEMPT_SIGNALS:
            bad("preempt_signal", f"must be one of {', '.join(PREEMPT_SIGNALS)}, got {self.preempt_signal!r}")
        if self.threads < 0:
            bad("threads", f"must be >= 0, got {self.threads}")
        if isinstance(self.fused, str) and self.fused != "auto":
            bad("fused", f"must be auto, true or false, got {self.fused!r}")
        if isinstance(self.keep_freed_memory, str) and self.keep_freed_memory != "auto":
            bad("keep_freed_memory", f"must be auto, true or false, got {self.keep_freed_memory!r}")
        if self.client_state not in CLIENT_STATE_MODES:
            bad("client_state", f"must be one of {', '.join(CLIENT_STATE_MODES)}, got {self.client_state!r}")
        if not (math.isfinite(self.client_state_budget_mb) and self.client_state_budget_mb >= 0):
            bad("client_state_budget_mb", f"must be a number >= 0 (MiB), got {self.client_state_budget_mb}")
        if self.placement not in PLACEMENTS:
            bad("placement", f"must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if not (self.fused_workers == "auto" or (isinstance(self.fused_workers, int) and not isinstance(self.fused_workers, bool)
                                                 and self.fused_workers >= 1)):
            bad("fused_workers", f"must be auto or an integer >= 1, got {self.fused_workers!r}")
        if self.fused_group < 0:
            bad("fused_group", f"must be >= 0, got {self.fused_group}")
        if self.analysis_every < 0:
            bad("analysis_every", f"must be >= 0, got {self.analysis_every}")
        from fedcp_dist.loggers import logger_problem  # loggers names its folder through rundir, which imports this

        logger_why = logger_problem(self.logger)
        if logger_why:
            bad("logger", logger_why)
        if self.probe_every and not ALGORITHMS[self.method].probes:
            with_probes = ", ".join(m for m, cls in ALGORITHMS.items() if cls.probes)
            bad("analysis" if self.analysis else "analysis_every",
                f"{self.method} has no probes (they measure FedCP's policy; methods with probes: {with_probes})")
        for key in ("lr", "participation", "collective_timeout"):
            if not math.isfinite(getattr(self, key)):
                bad(key, f"must be a finite number, got {getattr(self, key)}")
        if self.lr <= 0:
            bad("lr", f"must be > 0, got {self.lr}")
        if not 0 < self.participation <= 1:
            bad("participation", f"must lie in (0, 1], got {self.participation}")
        if self.collective_timeout <= 0:
            bad("collective_timeout", f"must be > 0, got {self.collective_timeout}")
        if self.participation_range is not None:
            r = self.participation_range
            if (
                len(r) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
                or not 0 < r[0] <= r[1] <= 1
            ):
                bad("participation_range", f"must be [rho_min, rho_max] with 0 < rho_min <= rho_max <= 1, got {r}")
        if self.participation_draw not in PARTICIPATION_DRAWS:
            bad("participation_draw", f"must be one of {', '.join(PARTICIPATION_DRAWS)}, got {self.participation_draw!r}")
        if self.participation_draw != "rho" and self.participation_range is None:
            bad("participation_draw", f"{self.participation_draw} draws from participation_range, which is not set")
        if self.amp not in AMP_MODES:
            bad("amp", f"must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        if not self.out_dir:
            bad("out_dir", "must not be empty")
        # the methods' own options: each its own check, then each class's checks across its keys
        for opt in method_options():
            value = getattr(self, opt.name)
            if isinstance(value, float) and not math.isfinite(value):
                bad(opt.name, f"must be a finite number, got {value}")
            why = opt.check(value) if opt.check is not None else None
            if why:
                bad(opt.name, why)
        for cls in option_classes():
            problem = cls.check_config(self)
            if problem:
                bad(*problem)
        # the data set last: a mistyped value is named even where the shard is not made yet
        if self.data.num_clients < 0:
            bad("data.num_clients", f"must be >= 0, got {self.data.num_clients}")
        clients = self.data.clients
        if isinstance(clients, int) and clients < 1:
            bad("data.clients", f"must be a client count >= 1 or a list of client ids, got {clients}")
        if isinstance(clients, list):
            if not clients or not all(type_ok(c, int) and c >= 0 for c in clients):
                bad("data.clients", f"must be a non-empty list of client ids >= 0, got {clients}")
            if len(set(clients)) != len(clients):
                dup = next(c for c in clients if clients.count(c) > 1)
                bad("data.clients", f"lists client {dup} twice")
        if not self.data.path:
            bad("data.path", "is required: the HDF5 partition written by fedcp-partition")
        if not os.path.isfile(self.data.path):
            bad("data.path", f"no such file: {self.data.path}")
        return self


def _assemble_config():
    parts = []
    for cls in (_Experiment, None, _Execution):
        if cls is None:
            parts += [(o.name, o.type, field(default=o.default, metadata={"help": o.help})) for o in method_options()]
            continue
        hints = typing.get_type_hints(cls)
        parts += [(f.name, hints[f.name], f) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass("Config", parts, bases=(_ConfigMethods,))


Config = _assemble_config()
Config.__module__ = __name__
Config.__doc__ = """A whole run: the keys of the run, every method's options, the keys of execution.

Defaults are the paper's for the 4-layer CNN. Flat keys (``method``, ``rounds``, ``lam`` ...) and
the data set under ``data.`` (``data.path``). A method's options are listed with its code
(``options`` of its class, :mod:`fedcp_dist.options`)."""


# ----------------------------------------------------------------------
# loading and overriding


def type_ok(value: Any, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[...]
        return any(type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list:
        return isinstance(value, list)
    return False


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else tp.__name__


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    # resolved once per class: typing.get_type_hints is slow, and a sweep loads a config per point
    return typing.get_type_hints(cls)


def _apply(obj, values: dict, prefix: str = "") -> None:
    if not isinstance(values, dict):
        raise UserError(f"config section {prefix.rstrip('.') or '<top>'!r} must be a mapping")
    hints = _type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise UserError(f"unknown config key {full!r}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _apply(getattr(obj, key), value, prefix=f"{full}.")
            continue
        if not type_ok(value, tp):
            raise UserError(f"config key '{full}': expected {_type_name(tp)}, got {value!r}")
        if tp is float:
            value = float(value)
        setattr(obj, key, value)


def parse_overrides(items: list[str]) -> dict:
    """``["lr=0.1", "data.path=x.h5"]`` → nested dict; values are parsed as YAML scalars."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise UserError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise UserError(f"override {item!r}: value is not valid YAML") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r} conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return out


def read_yaml_mapping(path, what: str = "config file") -> dict:
    """A YAML file that must hold a mapping (empty → {}); every problem is a one-line UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{what} {path} cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        loc = f" (line {where.line + 1})" if where is not None else ""
        raise UserError(f"{what} {path} is not valid YAML{loc}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError(f"{what} {path} must hold a mapping of keys to values")
    return values


def legacy_defaults(flat: dict) -> dict:
    """For a saved config (flat) written before a key existed, the keys whose behaviour then differs
    from today's default, with the value that was in effect: a fastText run made before
    ``fasttext_mean`` existed averaged over the real tokens."""
    if flat.get("model") == "fasttext" and "fasttext_mean" not in flat:
        return {"fasttext_mean": "tokens"}
    return {}


def flatten(values: dict, prefix: str = "") -> dict:
    """``{"data": {"path": x}, "lr": 1}`` → ``{"data.path": x, "lr": 1}``."""
    out = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, validate: bool = True,
                values: Optional[dict] = None) -> Config:
    """Defaults ← YAML file ← ``key=value`` overrides, then validation. ``values``: the file's
    mapping as already read (a sweep reads its base once for all its points); ``path`` is not read then."""
    cfg = Config()
    if values is not None:
        _apply(cfg, copy.deepcopy(values))
    elif path is not None:
        _apply(cfg, read_yaml_mapping(path))
    if overrides:
        _apply(cfg, parse_overrides(overrides))
    if validate:
        cfg.validate()
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
