"""Every option of every method in pairwise combinations: the option universe, a pairwise covering
array per method, and what each row must end in.

The universe is every config key: the keys of a run and of its execution (``Config``'s own fields,
``data.*`` flattened) and every option a method, a part of FedCP, upload compression, client
selection or differential privacy declares (:func:`fedcp_dist.algorithms.method_options`). Each key is either varied or
held (:data:`FIXED`, with the reason it cannot vary in a tiny in-process run). A varied key's values
besides its default come from its declaration where they can (:func:`declared_values`: a boolean's
other value, ``one_of``'s other choices, ``within``'s ends, ``at_least``'s bound) and from
:data:`VALUES` where they cannot or others are wanted; a key with neither and not held fails
``tests/test_combinations.py``, so the array grows with the options.

A method's array (:func:`array`) is an allpairspy pairwise covering array over the keys that act on
it: the engine's keys, its own options and those of the parts it is made of, compression,
selection and privacy, the training path (``fused``) and the pseudo-key ``ranks`` (1: in this
process; 2: two ranks under torchrun). Its filter keeps the rows the config accepts and in which
every key set acts (a key the run would name as having no effect, such as ``dp_clip`` while ``dp`` is
none, runs nothing there: :func:`accepted`), so every pair of values the config allows together is
run in some row, and every value that runs at all (some need two other keys set: ``dp_clip_lr``
needs ``dp=central`` and ``dp_clip=adaptive``) in some row. The pairs the config refuses are rows of their own
(:func:`refused_pairs`): each must be refused in one line that names both keys. Values that pass the
config but are refused at start-up (they depend on the shard: :data:`START_REFUSED`) are rows of
their own too. :func:`run_row` runs a row and classifies it: ``ran`` (the summary's accuracies
finite, in [0, 1]), ``refused`` (one line, exit 2, no traceback) or ``failed``.

``python bench/combinations.py`` runs the whole array and prints a row per row.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import numpy as np

from fedcp_dist.algorithms import ALGORITHMS, acting_option_classes, method_options
from fedcp_dist.capabilities import Probes, supports
from fedcp_dist.config import Config, DataConfig, components, load_config, unflatten
from fedcp_dist.errors import RunFailure, UserError

REPO = Path(__file__).resolve().parents[1]

#: the tiny run every row starts from (a key a row does not vary keeps this value, else its default)
BASE = {"rounds": 2, "threads": 1, "device": "cpu", "overwrite": True}

#: the values besides its default of each varied key whose declaration gives none or other ones
#: (the default of a row is BASE's, else Config's; declared_values gives the rest)
VALUES = {
    # -- the run
    "rounds": [1],
    "eval_every": [2],
    "participation": [0.5, 0.1],  # 0.1 of 5 clients: ⌊ρN⌋ = 0
    "participation_range": [[0.1, 0.6]],
    "seed": [0],
    "lr": [0.05],
    "batch_size": [1, 64],  # 64: more than any client's training samples (no full batch)
    "local_epochs": [2],
    # -- FedCP's parts
    "mmd_sigma": [2.0],
    "mmd_bandwidths": [[1.0]],
    "policy_entropy": [0.1, -0.1],
    "cpn_distill": [0.5],
    "tau": [0.1],
    "cpn_hidden": [1, 16],
    "cpn_groups": [4, 512],  # 512: K itself, one feature per group
    "cpn_layers": [2, 4],
    "cpn_lr": [0.01],
    "cpn_lr_min": [0.001],
    "tau_final": [0.1],
    "cpn_warmup_rounds": [1],
    "policy_refresh_every": [2],
    "cpn_upload_every": [2],
    "cpn_async_min_rate": [0.5, 1.0],
    # -- the baselines
    "prox_mu": [0.0, 10.0],
    "perfedavg_alpha": [0.05],
    "perfedavg_beta": [0.05],
    "pfedme_k": [1],
    "pfedme_lr": [0.01],
    "pfedme_beta": [0.5, 2.0],
    "peer_memory_mb": [16.0],
    "fedamp_alpha_k": [0.1],
    "fedamp_sigma": [100.0],
    "ditto_lam": [0.0, 1.0],
    "ditto_epochs": [2],
    "fedrep_head_epochs": [1],
    "fedfomo_m": [1, 100],
    "fedfomo_val_ratio": [0.01, 0.9],
    # -- compression and selection (every method)
    "compress_ratio": [0.01],
    # -- user-level differential privacy (every method that averages its uploads)
    "dp_clip": ["adaptive", 0.01],
    "dp_noise_multiplier": [0.0, 0.5],  # larger σ on 1-5 clients is noise that no model survives, not a bug
    "dp_delta": [0.01],
    "dp_target_epsilon": [50.0],  # calibrated for the row's rounds at start-up
    "dp_clip_init": [0.01],
    "dp_clip_quantile": [0.9],
    "dp_clip_lr": [1.0],
    "dp_clip_count_stddev": [0.0, 2.0],  # 0.0: refused with noise (the count alone would be noise-free)
    "dp_noise_cohort_size": [10],
    # -- execution
    "eval_batch_size": [1],
    "eval_clients": [3],  # a sample of the tiny shard's 5 clients
    "fused": [False, True],
    "fused_group": [1, 2],
    "fused_workers": [1, 2],
    "fused_join": [True],
    "client_state_budget_mb": [0.01],  # client_state=auto: too little for any state, so disk
    "checkpoint_every": [0, 1],
    "analysis_every": [2],
    "logger": ["tensorboard"],
    "data.clients": [2, [0, 3, 4]],
}

#: values the config accepts that the start-up refuses on the tiny shard (one row each)
START_REFUSED = {
    "cpn_groups": [3],  # does not divide K = 512
    "peer_memory_mb": [0.01],  # less than the models exchanged between 5 clients
}

#: keys held at one value in every row, and why they cannot vary here
FIXED = {
    "method": "the array's axis: one array per method",
    "model": "cnn: the tiny shard holds 16x16 images; mlp, fasttext and lstm read table and text shards "
             "(tests/test_models.py, tests/test_fasttext_ref.py, tests/test_lstm.py), resnet18 is too slow for a row",
    "mlp_hidden": "acts on model=mlp only (a table shard)",
    "fasttext_dim": "acts on model=fasttext only (a text shard)",
    "fasttext_mean": "acts on model=fasttext only (a text shard)",
    "fasttext_feature": "acts on model=fasttext only (a text shard)",
    "lstm_embed": "acts on model=lstm only (a text shard; tests/test_lstm.py, tests/test_leaf.py)",
    "lstm_hidden": "acts on model=lstm only (a text shard; tests/test_lstm.py, tests/test_leaf.py)",
    "lstm_layers": "acts on model=lstm only (a text shard; tests/test_lstm.py, tests/test_leaf.py)",
    "keep_freed_memory": "a process-wide allocator setting made once at start-up, not per in-process run "
                         "(tests/test_runtime.py)",
    "client_state_dir": "a directory path; client_state=disk rows use its default, out_dir/client_state",
    "out_dir": "each row's own fresh directory",
    "overwrite": "true: rows start fresh; an out_dir holding a run is tests/test_rundir.py's",
    "resume": "acts on an out_dir holding a run; rows start fresh (tests/test_resume.py)",
    "preempt_signal": "acts on a signal only (tests/test_failures.py, tests/test_resume.py)",
    "device": "cpu: the machine the array runs on has no GPU",
    "collective_timeout": "acts when a peer stops answering only (tests/test_failures.py)",
    "rendezvous_timeout": "acts when the ranks of a job do not meet at start-up only (tests/test_faults_env.py)",
    "threads": "1: two threads per rank on the array's shared 2-core machine only slow each row; fused_workers=2 "
               "still trains groups side by side (tests/test_fused.py covers several threads)",
    "data.path": "the tiny shard",
    "data.num_clients": "a check of the shard's client count, not a setting (tests/test_failures.py)",
    "data.source": "a check of the shard's source, not a setting (tests/test_failures.py)",
    "data.input_shape": "a check of the shard's input shape, not a setting (tests/test_failures.py)",
}

#: keys that act on methods with probes only (the others refuse them alone)
PROBE_KEYS = ("analysis", "analysis_every")
#: the pseudo-key of the number of ranks
RANKS = "ranks"


def declared_values(key: str) -> list:
    """The values a row gives ``key`` besides its default, derived from the key's declaration: the
    other truth value of a boolean, the other choices of ``one_of``, the accepted ends of ``within``,
    the bound of ``at_least``; [] where none derive (a row then needs :data:`VALUES`)."""
    opt = {o.name: o for comp in components() for o in comp.options}.get(key)
    if opt is None or key in FIXED:
        return []
    d, check = default(key), opt.check
    if opt.type is bool:
        return [not d]
    if hasattr(check, "choices"):
        return [v for v in check.choices if v != d]
    as_type = float if opt.type is float else (lambda v: v)  # a float key's bound as a float (0.0, not 0)
    if hasattr(check, "ends"):
        return [as_type(v) for v in check.ends if v != d]
    if hasattr(check, "lowest"):
        return [as_type(check.lowest)] if check.lowest != d else []
    return []


def values(key: str) -> list:
    """The values a row gives ``key`` besides its default: :data:`VALUES`' where it lists the key,
    else those its declaration gives (:func:`declared_values`); none for a key held in :data:`FIXED`."""
    return [] if key in FIXED else VALUES.get(key) or declared_values(key)


def universe() -> list:
    """Every config key, ``data.*`` flattened, in Config's order."""
    keys = [f.name for f in dataclasses.fields(Config) if f.name != "data"]
    return keys + [f"data.{f.name}" for f in dataclasses.fields(DataConfig)]


def default(key: str):
    """The value a row gives ``key`` unless it varies it."""
    if key in BASE:
        return BASE[key]
    if key.startswith("data."):
        return getattr(DataConfig(), key[5:])
    return getattr(Config(), key)


def method_keys(method: str) -> list:
    """The keys of the classes whose options act on ``method``: its own (bases first), its parts', and
    those that apply to every method (compression's and selection's)."""
    return [o.name for c in acting_option_classes(method) for o in c.__dict__["options"]]


def keys_for(method: str) -> list:
    """The varied keys that act on ``method``, in the array's order: ``fused`` first (a part refuses
    some of its own values with fused=true), then Config's order, which puts every key that enables
    another before it (compress before compress_ratio, participation_range before participation_draw ...)."""
    own = set(method_keys(method))
    all_options = {o.name for o in method_options()}
    keys = []
    for k in universe():
        if not values(k):
            continue
        if k in all_options and k not in own:
            continue  # another method's option
        if k in PROBE_KEYS and not supports(ALGORITHMS[method], Probes):
            continue
        keys.append(k)
    return ["fused"] + [k for k in keys if k != "fused"]


def parameters(method: str) -> "OrderedDict":
    """{key: [default, other values...]} of the method's array, with the pseudo-key ``ranks`` first."""
    params = OrderedDict([(RANKS, [1, 2])])
    for k in keys_for(method):
        params[k] = [default(k), *values(k)]
    return params


# ---------------------------------------------------------------- the config's verdict

def config_of(method: str, row: dict, shard: str = "", out_dir: str = "runs/combinations"):
    """The validated Config of a row ({key: value}, ``ranks`` ignored) over BASE, or the UserError
    the config refuses it with."""
    flat = {**BASE, "method": method, "out_dir": out_dir, "data.path": shard,
            **{k: v for k, v in row.items() if k != RANKS}}
    try:
        return load_config(values=unflatten(flat), validate=False).validate(data_file=bool(shard))
    except UserError as exc:
        return exc


def accepted(method: str, row: dict) -> bool:
    """Whether the config accepts the row and every key it sets acts in it (none is named among the
    keys with no effect: ``dp_clip`` while ``dp`` is none runs nothing)."""
    cfg = config_of(method, row)
    return not isinstance(cfg, UserError) and not cfg.keys_without_effect()


def inert_alone_ok(method: str, key: str, value) -> bool:
    """A value the config accepts alone but names as having no effect, because of another key's
    value, which the reason names (``dp_clip`` with ``dp`` none: 'applies with dp=central only')."""
    cfg = config_of(method, {key: value})
    if isinstance(cfg, UserError):
        return False
    why = dict(cfg.keys_without_effect()).get(key)
    return why is not None and bool(names_keys(why, [k for k in universe() if k != key]))


@functools.lru_cache(maxsize=None)
def array(method: str) -> list:
    """The method's pairwise covering array: rows {key: value} holding each key (its default where
    the row does not vary it), every row one the config accepts, every pair of values that the
    config accepts together in some row.

    allpairspy builds the rows, its filter keeping those the config accepts; it stops once a row it
    finds adds no pair, which under the filter leaves pairs out, so each pair still missing then
    gets a row of its own, filled greedily with values that cover other missing pairs."""
    from allpairspy import AllPairs

    params = parameters(method)
    names = list(params)

    def ok(values):
        return accepted(method, dict(zip(names, values)))

    rows_ = [dict(zip(names, row)) for row in AllPairs(list(params.values()), filter_func=ok)]
    missing = uncovered_pairs(method, rows_)
    todo = {_pair_key(p) for p in missing}
    for pair in missing:
        if _pair_key(pair) not in todo:
            continue
        row = {k: params[k][0] for k in names}
        row.update(pair)
        for k in names:
            if k in pair:
                continue
            best, gain = row[k], -1
            for v in params[k]:
                n = sum(_pair_key({k: v, k2: row[k2]}) in todo for k2 in names if k2 != k)
                if n > gain and (v == params[k][0] or accepted(method, {**row, k: v})):
                    best, gain = v, n
            row[k] = best
        assert accepted(method, row), (method, pair)
        todo -= {_pair_key({k1: row[k1], k2: row[k2]}) for k1, k2 in itertools.combinations(names, 2)}
        rows_.append(row)
    # a value that only works with two other keys off their defaults (dp_clip_lr needs dp=central and
    # dp_clip=adaptive) is in no pair the config accepts: it gets a row of its own where it can run at all
    for k in names:
        for v in params[k][1:]:
            if not any(r[k] == v for r in rows_):
                row = _enabling_row(method, params, k, v)
                if row is not None:
                    rows_.append(row)
    return rows_


def _enabling_row(method: str, params: "OrderedDict", key: str, value) -> Optional[dict]:
    """A row the config accepts that gives ``key`` its ``value``, with one or two other keys off their
    defaults (the first such in the array's order); None when none does."""
    base = {k: vals[0] for k, vals in params.items()}
    options = [(k, v) for k, vals in params.items() if k not in (key, RANKS) for v in vals[1:]]
    for extra in itertools.chain(([o] for o in options), itertools.combinations(options, 2)):
        if len({k for k, _ in extra}) == len(extra):
            row = {**base, key: value, **dict(extra)}
            if accepted(method, row):
                return row
    return None


def _pair_key(pair: dict) -> tuple:
    return tuple(sorted((k, json.dumps(v)) for k, v in pair.items()))


def varied(row: dict) -> dict:
    """The row's values other than its defaults (ranks included when 2)."""
    return {k: v for k, v in row.items() if (k == RANKS and v != 1) or (k != RANKS and v != default(k))}


def refused_singles(method: str) -> list:
    """[(key, value, UserError)]: values the config refuses on their own for this method."""
    out = []
    for k, values in parameters(method).items():
        if k == RANKS:
            continue
        for v in values[1:]:
            err = config_of(method, {k: v})
            if isinstance(err, UserError):
                out.append((k, v, err))
    return out


def refused_pairs(method: str) -> list:
    """[({k1: v1, k2: v2}, UserError)]: pairs of values the config accepts alone and refuses together."""
    params = parameters(method)
    single_bad = {(k, json.dumps(v)) for k, v, _ in refused_singles(method)}
    candidates = [(k, v) for k, values in params.items() if k != RANKS for v in values[1:]
                  if (k, json.dumps(v)) not in single_bad]
    out = []
    for (k1, v1), (k2, v2) in itertools.combinations(candidates, 2):
        if k1 == k2:
            continue
        err = config_of(method, {k1: v1, k2: v2})
        if isinstance(err, UserError):
            out.append(({k1: v1, k2: v2}, err))
    return out


def refused_key(message: str) -> Optional[str]:
    """The key of a refusal ``config key 'X': ...`` (None: another form)."""
    prefix = "config key '"
    if not message.startswith(prefix):
        return None
    return message[len(prefix):].split("'", 1)[0]


def names_keys(message: str, keys) -> list:
    """Which of ``keys`` a one-line refusal names: the one in its ``config key 'X'`` prefix, the
    others anywhere in the text as a whole word."""
    import re

    return [k for k in keys if k == refused_key(message)
            or re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message)]


# ---------------------------------------------------------------- the tiny shard

def tiny_shard(folder: Path, clients: int = 5, per_client: int = 32, seed: int = 3) -> Path:
    """scikit-learn's digits at 16x16 (the smallest input the 4-layer CNN takes), ``clients``
    clients of ``per_client`` samples with skewed labels (Dir(0.5) class shares), 3/4 for
    training, as ``folder/digits16.h5``."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    from fedcp_dist.cli.partition import main

    bunch = load_digits()
    t = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) * (255.0 / 16.0)).unsqueeze(1)
    x = F.interpolate(t, size=(16, 16), mode="bilinear", align_corners=False).round().clamp_(0, 255)
    x = x.to(torch.uint8).numpy()
    y = np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(seed)
    by_class = [list(rng.permutation(np.flatnonzero(y == c))) for c in range(10)]
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    for i in range(clients):
        shares = rng.dirichlet([0.5] * 10)
        take = []
        for c in rng.choice(10, size=per_client, p=shares):
            take.append(by_class[c].pop() if by_class[c] else by_class[int(np.argmax([len(b) for b in by_class]))].pop())
        take = np.asarray(take)
        n_train = per_client * 3 // 4
        for split, idx in (("train", take[:n_train]), ("test", take[n_train:])):
            np.savez_compressed(folder / split / f"{i}.npz", x=x[idx], y=y[idx])
    out = folder / "digits16.h5"
    main(["--from-npz", str(folder), "--out", str(out), "--source", "digits", "--num-classes", "10", "--force"])
    return out


# ---------------------------------------------------------------- running a row

@dataclasses.dataclass
class Outcome:
    kind: str  # ran | refused | failed
    detail: str  # the accuracies, the refusal's line or what failed
    seconds: float


def _overrides(flat: dict) -> list:
    return [f"{k}={json.dumps(v)}" for k, v in flat.items()]


def _finite_accuracies(summary: dict) -> Optional[str]:
    """Why the summary's accuracies are not finite numbers in [0, 1] (None: they are)."""
    for key in ("best_acc", "final_acc", "final_acc_client_mean"):
        v = summary.get(key)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1):
            return f"{key} = {v!r}"
    return None


def _ran(summary: dict, t0: float) -> Outcome:
    why = _finite_accuracies(summary)
    if why:
        return Outcome("failed", why, time.time() - t0)
    return Outcome("ran", f"acc {summary['final_acc']:.3f} (best {summary['best_acc']:.3f})", time.time() - t0)


def run_row(method: str, row: dict, shard: Path, out_dir: Path, timeout: float = 900) -> Outcome:
    """Run one row ({key: value}; ``ranks`` 2: under torchrun) on ``shard`` into ``out_dir``."""
    flat = {**BASE, "method": method, "out_dir": str(out_dir), "data.path": str(shard),
            **{k: v for k, v in row.items() if k != RANKS}}
    t0 = time.time()
    if row.get(RANKS, 1) == 1:
        return _run_here(flat, t0)
    return run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "fedcp_dist.run", *_overrides(flat)], out_dir, t0, timeout)


def _run_here(flat: dict, t0: float) -> Outcome:
    import torch

    from fedcp_dist.runtime import init_runtime
    from fedcp_dist.engine.simulator import Simulator

    threads = torch.get_num_threads()
    try:
        cfg = load_config(values=unflatten(flat))
        rt = init_runtime(cfg.device, cfg.threads, cfg.collective_timeout, env={})
        try:
            summary = Simulator(cfg, rt, echo=lambda *_: None).run()
        finally:
            rt.close()
    except UserError as exc:
        msg = str(exc)
        kind = "refused" if msg and "\n" not in msg else "failed"
        return Outcome(kind, msg, time.time() - t0)
    except (RunFailure, Exception) as exc:  # anything else is a failure of the combination
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return Outcome("failed", f"{type(exc).__name__}: {exc} | {''.join(tb[-3:]).strip()}", time.time() - t0)
    finally:
        torch.set_num_threads(threads)
    return _ran(summary, t0)


def run_command(cmd: list, out_dir: Path, t0: float, timeout: float = 900) -> Outcome:
    """A ``fedcp-run`` (or torchrun) command's outcome: ran (exit 0, summary.json's accuracies
    finite), refused (fedcp-run: exit 2, one ``error:`` line, no traceback; torchrun: every rank's
    same ``error:`` line and exit 2, no traceback from the project) or failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("FEDCP_LAUNCHER", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome("failed", f"no end within {timeout:.0f} s", time.time() - t0)
    seconds = time.time() - t0
    torchrun = "torch.distributed.run" in cmd
    errors = sorted({l for l in r.stderr.splitlines() if l.startswith("error: ")})
    if torchrun and r.returncode != 0 and len(errors) == 1 and "exitcode  : 2 " in r.stderr \
            and "/fedcp_dist/" not in r.stderr and "Traceback" not in r.stdout:
        # every rank refused in the same line and exited 2; torchrun reports a failed worker with a
        # traceback of its own (ChildFailedError) and exit 1, whatever the worker said
        return Outcome("refused", errors[0][len("error: "):], seconds)
    if "Traceback" in r.stderr or "Traceback" in r.stdout:
        tail = [l for l in r.stderr.splitlines() if l.strip()][-3:]
        return Outcome("failed", f"exit {r.returncode}, traceback: {' | '.join(tail)}", seconds)
    if r.returncode == 0:
        summary_path = out_dir / "summary.json"
        if not summary_path.exists():
            return Outcome("failed", "exit 0 without summary.json", seconds)
        return _ran(json.loads(summary_path.read_text()), t0)
    if len(errors) == 1 and r.returncode == 2 and not torchrun:
        if len(r.stderr.strip().splitlines()) != 1:
            return Outcome("failed", f"exit 2 with more than one line: {r.stderr.strip()[-300:]}", seconds)
        return Outcome("refused", errors[0][len("error: "):], seconds)
    return Outcome("failed", f"exit {r.returncode}: {r.stderr.strip()[-300:]}", seconds)


# ---------------------------------------------------------------- the whole array

def rows(methods=None) -> list:
    """[(method, label, row, expected)] of every method: its array's rows (expected ``ran``), the
    pairs the config refuses and the values the start-up refuses (expected ``refused``)."""
    out = []
    for method in methods or ALGORITHMS:
        for i, row in enumerate(array(method)):
            out.append((method, f"{method}#{i}", row, "ran"))
        for k, vs in START_REFUSED.items():
            if k in keys_for(method):
                for v in vs:
                    out.append((method, f"{method}:{k}", {k: v}, "refused"))
    return out


def describe(row: dict) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in varied(row).items()) or "(defaults)"


def uncovered_pairs(method: str, rows_: Optional[list] = None) -> list:
    """The pairs of values (at least one not a default) that the config accepts together but no
    row of the method's array holds."""
    rows_ = array(method) if rows_ is None else rows_
    params = parameters(method)
    seen = {(k1, json.dumps(r[k1]), k2, json.dumps(r[k2])) for r in rows_
            for k1, k2 in itertools.combinations(params, 2)}
    out = []
    for k1, k2 in itertools.combinations(params, 2):
        for v1 in params[k1]:
            for v2 in params[k2]:
                if (k1, json.dumps(v1), k2, json.dumps(v2)) in seen:
                    continue
                if v1 == params[k1][0] and v2 == params[k2][0]:
                    continue
                if accepted(method, {k1: v1, k2: v2}):
                    out.append({k1: v1, k2: v2})
    return out


def single_refusal_ok(method: str, key: str, message: str) -> bool:
    """A value the config refuses alone for ``method``: one line, ``key`` in its prefix, and what it
    conflicts with named (another key, or the method where the method is the other side)."""
    others = [k for k in universe() if k != key]
    return ("\n" not in message and refused_key(message) == key
            and bool(names_keys(message, others) or method in message.replace(f"'{key}'", "")))
