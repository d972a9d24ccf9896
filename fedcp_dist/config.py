"""Run configuration: dataclasses, YAML loading, ``key=value`` overrides, validation.

Every user mistake becomes a :class:`~fedcp_dist.errors.UserError` whose one-line message names
the key. The keys users touch most are flat (``method``, ``rounds``, ``lr``, ``lam`` ...); the data
set lives under ``data.`` (``data.path``).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from fedcp_dist.errors import UserError

METHODS = (
    "fedcp", "fedavg", "fedprox", "perfedavg", "pfedme", "fedamp", "ditto", "fedper", "fedrep", "fedrod", "fedfomo",
    "fedphp",
)
MODELS = ("cnn", "resnet18", "fasttext")
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


@dataclass
class Config:
    """A whole run. Defaults are the paper's for the 4-layer CNN."""

    #: federated method: fedcp | fedavg | fedprox | perfedavg | pfedme | fedamp | ditto | fedper | fedrep | fedrod | fedfomo | fedphp
    method: str = "fedcp"
    #: model: cnn (the paper's 4-layer CNN, sized from the shard's input shape) | resnet18 | fasttext (text shards)
    model: str = "cnn"
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
    #: FedCP: weight λ of the MMD term
    lam: float = 5.0
    #: FedCP: Gumbel-softmax temperature τ of the policy during training
    tau: float = 1.0
    #: FedCP: add Gumbel noise to the policy during training (the reference does)
    cpn_train_gumbel: bool = True
    #: FedCP: add Gumbel noise at evaluation too (the reference's stochastic evaluation)
    cpn_eval_gumbel: bool = False
    # -- baselines' hyperparameters (names and defaults from each method's paper)
    #: FedProx: weight μ of the proximal term (μ/2)·‖w − w_global‖² (0 reproduces FedAvg exactly)
    prox_mu: float = 1.0
    #: Per-FedAvg: step size α of the inner (adaptation) step, also used for the one-step adaptation at evaluation
    perfedavg_alpha: float = 0.005
    #: Per-FedAvg: step size β of the outer (meta) step (first-order variant)
    perfedavg_beta: float = 0.001
    #: pFedMe: weight λ of (λ/2)·‖θ − w‖² in the personalized problem; also scales the local step w ← w − η·λ·(w − θ)
    pfedme_lam: float = 15.0
    #: pFedMe: K, steps that approximately solve the personalized problem on each batch
    pfedme_k: int = 5
    #: pFedMe: personal learning rate of those K steps (η, the local rate of w, is `lr`)
    pfedme_lr: float = 0.09
    #: pFedMe: server mixing β: new global = (1 − β)·old + β·average of the local w (1: plain averaging)
    pfedme_beta: float = 1.0
    #: Ditto: weight λ of (λ/2)·‖v − w_global‖² on the personal model v
    ditto_lam: float = 0.1
    #: Ditto: local epochs of the personal model v each round (the global model trains `local_epochs`)
    ditto_epochs: int = 1
    #: FedRep: local epochs of the personal head (extractor frozen) before the extractor's `local_epochs`
    fedrep_head_epochs: int = 10
    #: FedPHP: λ: local loss = (1 − λ)·CE + λ·MMD²(local features, inherited private model's features)
    fedphp_lam: float = 0.1
    #: FedPHP: μ̄: the inherited model's moving-average weight μ rises from 0 to μ̄ over a client's expected participations
    fedphp_mu: float = 0.9
    #: FedAMP: α_K, step size of the attention update; the local proximal weight is fedamp_lam / α_K
    fedamp_alpha_k: float = 1.0
    #: FedAMP: λ, weight of the proximal term (λ / (2·α_K))·‖w − u_i‖² toward the client's aggregated model u_i
    fedamp_lam: float = 1.0
    #: FedAMP: σ of the attention function: ξ_ij = α_K · exp(−‖w_i − w_j‖² / σ) / σ for j ≠ i
    fedamp_sigma: float = 1.0
    #: FedFomo: M, other clients' models each participant downloads and weighs every round
    fedfomo_m: int = 5
    #: FedFomo: fraction of each client's training samples held out as its validation split
    fedfomo_val_ratio: float = 0.2
    #: FedFomo: ε of the ε-greedy choice of models (random with probability ε, else the highest affinity)
    fedfomo_eps: float = 0.3
    #: FedFomo: ε falls by this much every round (not below 0)
    fedfomo_eps_decay: float = 0.05
    #: FedAMP/FedFomo: MiB per rank that the models exchanged between clients may use; a run above it is refused
    peer_memory_mb: float = 4096.0
    #: FedCP variant: CPN input: both (v̂ ⊙ h, the paper's) | sample (h) | client (v̂) | none (a fixed random vector)
    cpn_input: str = "both"
    #: FedCP variant: fully connected layers in the CPN, 1–4 (each Linear → norm → activation; 1 is the paper's)
    cpn_layers: int = 1
    #: FedCP variant: normalisation in the CPN: layernorm (the paper's) | batchnorm | groupnorm (2 groups) | none
    cpn_norm: str = "layernorm"
    #: FedCP variant: activation in the CPN: relu (the paper's) | tanh | sigmoid
    cpn_act: str = "relu"
    #: FedCP ablation: false drops the frozen global feature extractor module and its MMD term (λ ignored)
    fedcp_gfm: bool = True
    #: FedCP ablation: false drops the CPN: the whole feature goes to both heads
    fedcp_cpn: bool = True
    #: FedCP ablation: false drops the frozen global head (needs fedcp_cpn=false; only the extractor is shared)
    fedcp_global_head: bool = True
    #: samples per forward pass at evaluation
    eval_batch_size: int = 1000
    #: train a group of a rank's clients at once (stacked parameters, one vmapped forward/backward)
    fused: bool = False
    #: clients per fused group; 0 picks it from free memory
    fused_group: int = 0
    #: mixed precision of FedAvg's and FedCP's local training: none | bf16 (autocast; evaluation stays float32)
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

    # ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
        for key in ("rounds", "eval_every", "batch_size", "local_epochs", "eval_batch_size"):
            if getattr(self, key) <= 0:
                bad(key, f"must be > 0, got {getattr(self, key)}")
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
        for key in ("lr", "lam", "tau", "participation", "collective_timeout"):
            if not math.isfinite(getattr(self, key)):
                bad(key, f"must be a finite number, got {getattr(self, key)}")
        if self.lr <= 0:
            bad("lr", f"must be > 0, got {self.lr}")
        if self.lam < 0:
            bad("lam", f"must be >= 0, got {self.lam}")
        if self.tau <= 0:
            bad("tau", f"must be > 0, got {self.tau}")
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
        if not self.out_dir:
            bad("out_dir", "must not be empty")
        if not self.data.path:
            bad("data.path", "is required: the HDF5 partition written by fedcp-partition")
        if not os.path.isfile(self.data.path):
            bad("data.path", f"no such file: {self.data.path}")
        if self.data.num_clients < 0:
            bad("data.num_clients", f"must be >= 0, got {self.data.num_clients}")
        # -- baselines' hyperparameters
        for key in ("prox_mu", "perfedavg_alpha", "perfedavg_beta", "pfedme_lam", "pfedme_lr", "pfedme_beta",
                    "ditto_lam", "fedphp_lam", "fedphp_mu"):
            if not math.isfinite(getattr(self, key)):
                bad(key, f"must be a finite number, got {getattr(self, key)}")
        for key in ("prox_mu", "pfedme_lam", "ditto_lam"):
            if getattr(self, key) < 0:
                bad(key, f"must be >= 0, got {getattr(self, key)}")
        for key in ("perfedavg_alpha", "perfedavg_beta", "pfedme_lr", "pfedme_k", "ditto_epochs", "fedrep_head_epochs"):
            if getattr(self, key) <= 0:
                bad(key, f"must be > 0, got {getattr(self, key)}")
        if self.pfedme_beta <= 0:
            bad("pfedme_beta", f"must be > 0, got {self.pfedme_beta}")
        if not 0 <= self.fedphp_lam <= 1:
            bad("fedphp_lam", f"must lie in [0, 1], got {self.fedphp_lam}")
        if not 0 <= self.fedphp_mu < 1:
            bad("fedphp_mu", f"must lie in [0, 1), got {self.fedphp_mu}")
        for key in ("fedamp_alpha_k", "fedamp_lam", "fedamp_sigma", "fedfomo_val_ratio", "fedfomo_eps",
                    "fedfomo_eps_decay", "peer_memory_mb"):
            if not math.isfinite(getattr(self, key)):
                bad(key, f"must be a finite number, got {getattr(self, key)}")
        for key in ("fedamp_alpha_k", "fedamp_sigma", "fedfomo_m", "peer_memory_mb"):
            if getattr(self, key) <= 0:
                bad(key, f"must be > 0, got {getattr(self, key)}")
        for key in ("fedamp_lam", "fedfomo_eps_decay", "fused_group"):
            if getattr(self, key) < 0:
                bad(key, f"must be >= 0, got {getattr(self, key)}")
        if not 0 < self.fedfomo_val_ratio < 1:
            bad("fedfomo_val_ratio", f"must lie in (0, 1), got {self.fedfomo_val_ratio}")
        if not 0 <= self.fedfomo_eps <= 1:
            bad("fedfomo_eps", f"must lie in [0, 1], got {self.fedfomo_eps}")
        if self.amp not in AMP_MODES:
            bad("amp", f"must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.cpn_input not in ("both", "sample", "client", "none"):
            bad("cpn_input", f"must be one of both, sample, client, none, got {self.cpn_input!r}")
        if not 1 <= self.cpn_layers <= 4:
            bad("cpn_layers", f"must lie in 1..4, got {self.cpn_layers}")
        if self.cpn_norm not in ("layernorm", "batchnorm", "groupnorm", "none"):
            bad("cpn_norm", f"must be one of layernorm, batchnorm, groupnorm, none, got {self.cpn_norm!r}")
        if self.cpn_act not in ("relu", "tanh", "sigmoid"):
            bad("cpn_act", f"must be one of relu, tanh, sigmoid, got {self.cpn_act!r}")
        if not self.fedcp_global_head and self.fedcp_cpn:
            bad("fedcp_global_head", "false needs fedcp_cpn=false too: the CPN splits features between the two heads")
        return self


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


def _apply(obj, values: dict, prefix: str = "") -> None:
    if not isinstance(values, dict):
        raise UserError(f"config section {prefix.rstrip('.') or '<top>'!r} must be a mapping")
    hints = typing.get_type_hints(type(obj))
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


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, validate: bool = True) -> Config:
    """Defaults ← YAML file ← ``key=value`` overrides, then validation."""
    cfg = Config()
    if path is not None:
        _apply(cfg, read_yaml_mapping(path))
    if overrides:
        _apply(cfg, parse_overrides(overrides))
    if validate:
        cfg.validate()
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
