"""What a run directory records, read for analysis: ``metrics.jsonl`` and the probes of ``analysis.jsonl``.

``analysis.jsonl`` (written by the engine's probes), one object per line:

* ``{"kind": "train", "round": R, "client": c, "samples": n, "pir": p, "loss_bef": a, "loss_aft": b}``
  — client c trained in round R (1-based); PIR over the n training samples it saw; its training
  loss before and after local learning;
* ``{"kind": "eval", "evaluated_after": R, "client": c, "samples": m, "pir": p, "s_hist": [50 ints]}``
  — the evaluation after R rounds: PIR over its m test samples and the histogram of s over them in
  50 equal bins on [0, 1].

PIR_i = (1/K) Σ_k s̄_i^k, the mean share of the features that the policy sends to the personal head.
A line that is not such a record is an error naming the file and line, except a last line that was
cut short (a run still writing), which is skipped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fedcp_dist.errors import UserError
from fedcp_dist.rundir.directory import ANALYSIS, METRICS, contradiction, read_jsonl
from fedcp_dist.options import shown

S_BINS = 50


def _number(obj: dict, key: str, where: str, lo: float = -math.inf, hi: float = math.inf,
            finite: bool = True) -> float:
    """``obj[key]`` as a number in [lo, hi]; ``finite=False``: NaN and ±inf too (a loss of a client
    whose training diverged under ``on_nonfinite=skip``, as the run wrote it)."""
    v = obj.get(key)
    if not finite and isinstance(v, float) and not math.isfinite(v):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        bound = f" in [{lo:g}, {hi:g}]" if math.isfinite(lo) or math.isfinite(hi) else ""
        raise UserError(f"{where}: '{key}' must be a finite number{bound}, got {shown(v)}")
    return float(v)


def _count(obj: dict, key: str, where: str, lo: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise UserError(f"{where}: '{key}' must be an integer >= {lo}, got {shown(v)}")
    return v


@dataclass
class TrainProbe:
    round: int
    client: int
    samples: int
    pir: float
    loss_bef: float
    loss_aft: float


@dataclass
class EvalProbe:
    evaluated_after: int
    client: int
    samples: int
    pir: float
    s_hist: list


def read_probes(path: Path) -> tuple[list, list]:
    """(train probes, eval probes) of an ``analysis.jsonl``, each record checked."""
    train, evals = [], []
    for i, obj in read_jsonl(path):
        where = f"{path}:{i}"
        kind = obj.get("kind")
        if kind == "train":
            train.append(TrainProbe(_count(obj, "round", where, 1), _count(obj, "client", where),
                                    _count(obj, "samples", where), _number(obj, "pir", where, 0.0, 1.0),
                                    _number(obj, "loss_bef", where, finite=False),
                                    _number(obj, "loss_aft", where, finite=False)))
        elif kind == "eval":
            hist = obj.get("s_hist")
            if (not isinstance(hist, list) or len(hist) != S_BINS
                    or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hist)):
                raise UserError(f"{where}: 's_hist' must be a list of {S_BINS} non-negative integers")
            evals.append(EvalProbe(_count(obj, "evaluated_after", where), _count(obj, "client", where),
                                   _count(obj, "samples", where), _number(obj, "pir", where, 0.0, 1.0), hist))
        else:
            raise UserError(f"{where}: 'kind' must be 'train' or 'eval', got {kind!r}")
    return train, evals


@dataclass
class Run:
    """One run directory's records."""

    path: Path
    label: str
    config: dict
    rounds: list  # the "round" records of metrics.jsonl
    evals: list  # every record with an accuracy (evaluated rounds and the final evaluation), by evaluated_after
    summary: Optional[dict]
    train_probes: list = field(default_factory=list)
    eval_probes: list = field(default_factory=list)

    @property
    def has_probes(self) -> bool:
        return bool(self.train_probes or self.eval_probes)

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))

    @property
    def model(self) -> str:
        return str(self.config.get("model", "?"))


def read_run(path, label: Optional[str] = None) -> Run:
    """Read a run directory (``config.yaml`` and ``metrics.jsonl`` required, the rest if present)."""
    import yaml

    from fedcp_dist.config import flatten

    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise UserError(f"{path} is not a run directory (no config.yaml)")
    if not (path / METRICS).is_file():
        raise UserError(f"{path} has no {METRICS}: the run has not started")
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{path / 'config.yaml'} cannot be read: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path / 'config.yaml'} is not a mapping")
    rounds, points = [], {}
    for i, obj in read_jsonl(path / METRICS):
        if obj.get("kind") == "round":
            rounds.append(obj)
        if "acc" in obj and "evaluated_after" in obj:
            points[int(obj["evaluated_after"])] = obj
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = None
    flat = flatten(config)
    contradicted = contradiction(flat, summary)
    if contradicted:  # a model would be read as another method's
        raise UserError(f"{path}: {contradicted}")
    train, evals = read_probes(path / ANALYSIS) if (path / ANALYSIS).is_file() else ([], [])
    rounds.sort(key=lambda r: r.get("round", 0))
    return Run(path, label or path.name, flat, rounds, [points[k] for k in sorted(points)], summary,
               train, evals)


def weighted_mean(pairs) -> float:
    """Σ n·v / Σ n over (n, v) pairs (nan when Σ n = 0)."""
    pairs = list(pairs)
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total > 0 else float("nan")


def pir_by_round(probes: list, key: str = "round") -> dict:
    """{round: sample-weighted mean PIR over that round's clients} of train (or eval, with
    ``key="evaluated_after"``) probes."""
    groups: dict = {}
    for p in probes:
        groups.setdefault(getattr(p, key), []).append((p.samples, p.pir))
    return {r: weighted_mean(groups[r]) for r in sorted(groups)}


def loss_by_round(probes: list) -> dict:
    """{round: (mean loss before, mean loss after local learning)}, weighted by samples."""
    groups: dict = {}
    for p in probes:
        groups.setdefault(p.round, []).append(p)
    return {r: (weighted_mean((p.samples, p.loss_bef) for p in ps), weighted_mean((p.samples, p.loss_aft) for p in ps))
            for r, ps in sorted(groups.items())}
