"""Run configuration: the flat ``Config`` assembled from the options every component declares,
values applied to it from YAML and ``key=value`` overrides (read by :mod:`fedcp_dist.config.text`),
validation.

Each component of the engine and each method declares its own keys next to its code
(:class:`fedcp_dist.options.Option` in a :class:`~fedcp_dist.options.Component`'s ``options``: name,
default, check, one help text); this module walks them in :data:`ENGINE_BEFORE`, the methods'
(:func:`fedcp_dist.algorithms.option_classes`), :data:`ENGINE_AFTER` order, then the data set's keys
under ``data.``. The configuration reference in the docs is generated from the same declarations
(:mod:`fedcp_dist.cli.config_reference`). Every user mistake becomes a
:class:`~fedcp_dist.errors.UserError` whose one-line message names the key.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import typing
from dataclasses import field
from typing import Optional, Union

import yaml

from fedcp_dist.algorithms import ALGORITHMS, acting_option_classes, algorithm_class, methods_using, option_classes
from fedcp_dist.engine.keys import Evaluation, Execution, LocalSGD, NonFinite, Probing
from fedcp_dist.errors import UserError
from fedcp_dist.fused.keys import Fusing
from fedcp_dist.models import ModelChoice
from fedcp_dist.options import Check, Component, Option, SEED_MAX, above, at_least, described, one_of, shown, type_ok
from fedcp_dist.rundir.keys import Logging
from fedcp_dist.state.keys import ClientStates, Participation
from fedcp_dist.config.text import (FromText, as_number, flatten, from_here, given_once, legacy_defaults,
                                    merged_overrides, override_key, parse_overrides, read_yaml_mapping, unflatten)

#: what the package gives its importers: the Config and its loading (here), the reading of config
#: text (:mod:`fedcp_dist.config.text`)
__all__ = ["Config", "DataConfig", "METHODS", "SEED_MAX", "components", "load_config", "dump_config", "FromText",
           "as_number", "flatten", "from_here", "given_once", "legacy_defaults", "merged_overrides", "override_key",
           "parse_overrides", "read_yaml_mapping", "unflatten"]

METHODS = tuple(ALGORITHMS)


def _known(kind: str, names) -> Check:
    return described(" | ".join(names), lambda v: None if v in names else f"unknown {kind} {v!r}; known: {', '.join(names)}")


class Experiment(Component):
    """The experiment: the method, how long it runs and its seed."""

    options = (
        Option("method", "fedcp", "the federated method: FedCP or one of the paper's eleven baselines (the Methods "
               "page)", _known("method", ALGORITHMS)),
        Option("rounds", 100, "communication rounds", above(0)),
        Option("seed", 1, "run seed: model init, cohorts and every client's batch order and noise derive from it",
               described("an integer in [0, 2^63 - 1]", lambda v: None if 0 <= v <= SEED_MAX else
                         f"must be an integer in [0, {SEED_MAX}] (a seed torch and numpy both take), got {v}")),
    )


class Output(Component):
    """What a run writes, where, and how it resumes."""

    options = (
        Option("out_dir", "runs/default", "run directory (rank 0 writes config.yaml, metrics.jsonl, summary.json, "
               "final_global.pt)", described("a path", lambda v: None if v else "must not be empty")),
        Option("overwrite", False, "start afresh in an out_dir that holds a run (its checkpoints, run files and the "
               "reports fedcp-report and fedcp-analyze wrote there are removed; other files are kept); otherwise refused"),
        Option("resume", "auto", "auto: continue from the newest complete checkpoint in out_dir; never: refuse an "
               "out_dir with one", one_of("auto", "never")),
        Option("checkpoint_every", 50, "checkpoint every this many rounds (0: only on a preemption signal)", at_least(0)),
        Option("keep_checkpoints", 2, "complete checkpoints kept (the newest verified ones)", at_least(1)),
        Option("record_memory", False, "each round's record gains rank 0's resident memory now and at its peak and the "
               "MiB of client state its store holds in memory (rss_mb, peak_rss_mb, client_state_held_mb): for soak "
               "runs"),
    )


def _clients(v) -> Optional[str]:
    if isinstance(v, int) and v < 1:
        return f"must be a client count >= 1 or a list of client ids, got {v}"
    if isinstance(v, list):
        if not v or not all(type_ok(c, int) and c >= 0 for c in v):
            return f"must be a non-empty list of client ids >= 0, got {v}"
        if len(set(v)) != len(v):
            return f"lists client {next(c for c in v if v.count(c) > 1)} twice"
    return None


class Data(Component):
    """The data set: the pre-sharded partition (an HDF5 file written by `fedcp-partition`), keys under `data.`."""

    prefix = "data."
    options = (
        Option("path", "", "the HDF5 partition written by fedcp-partition (required)"),
        Option("num_clients", 0, "expected number of clients; 0 takes the file's count, any other value must agree "
               "with it", at_least(0)),
        Option("source", "", "expected source data set (digits, mnist, cifar10, ...); empty accepts any"),
        Option("input_shape", None, "expected input shape [C, H, W]; null accepts any", kind=Optional[list]),
        Option("clients", None, "the clients the run uses: null = all; K = a random K of them drawn once from the run "
               "seed; a list = those client ids of the shard. The others neither train nor are evaluated.",
               described("null, a count >= 1 or a list of client ids", _clients), kind=Optional[Union[int, list]]),
    )


#: the engine's components whose keys come before the methods' in a config (the experiment) and after
#: them (its execution), in the order a config file lists them
ENGINE_BEFORE = (Experiment, ModelChoice, LocalSGD, Participation)
ENGINE_AFTER = (Evaluation, Fusing, ClientStates, NonFinite, Probing, Logging, Output, Execution)


def components() -> list:
    """Every component that declares config keys, in the config's order (the data set's last)."""
    return [*ENGINE_BEFORE, *option_classes(), *ENGINE_AFTER, Data]


def _fields(options) -> list:
    def one(o):
        meta = {"help": o.help, "option": o}
        if isinstance(o.default, (list, dict)):
            return field(default_factory=lambda d=o.default: copy.deepcopy(d), metadata=meta)
        return field(default=o.default, metadata=meta)

    return [(o.name, o.type, one(o)) for o in options]


DataConfig = dataclasses.make_dataclass("DataConfig", _fields(Data.options))
DataConfig.__module__ = __name__
DataConfig.__doc__ = Data.__doc__


class _ConfigMethods:
    """What every Config does; the class itself is assembled below from every component's options."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def method_class(self) -> type:
        """The class of the configured method (an option class asks it what the method does)."""
        return algorithm_class(self.method, self)

    @property
    def probe_every(self) -> int:
        """Rounds between training probes (0: analysis off); ``analysis: true`` alone means every round."""
        return self.analysis_every or (1 if self.analysis else 0)

    def validate(self, data_file: bool = True) -> "Config":
        """Raise :class:`UserError` naming the first impossible value; ``data_file=False`` leaves out
        the check that ``data.path`` names an existing file (printing a config needs no data).

        One walk over the components: every option's own check (in the config's order, the data set's
        last, so a mistyped value is named even where the shard is not made yet), then each
        component's checks across keys: the engine's, and those of the configured method's own
        classes and parts (another method's keys act on nothing here, whatever they say)."""

        def bad(key: str, why: str):
            raise UserError(f"config key '{key}': {why}")

        idle = self._other_methods_classes()
        for comp in components():
            prefix = getattr(comp, "prefix", "")
            holder = self.data if prefix else self
            for opt in comp.options:
                value = getattr(holder, opt.name)
                if isinstance(value, float) and not math.isfinite(value):
                    bad(prefix + opt.name, f"must be a finite number, got {value}")
                if isinstance(value, str) and "\x00" in value:  # no file name or label holds one
                    bad(prefix + opt.name, f"holds a NUL character: {value!r}")
                why = opt.check(value) if opt.check is not None else None
                if why:
                    bad(prefix + opt.name, why)
            if comp is not Data and comp not in idle:
                problem = comp.check_config(self)
                if problem:
                    bad(*problem)
        if data_file and not self.data.path:
            bad("data.path", "is required: the HDF5 partition written by fedcp-partition")
        if data_file and os.path.isdir(self.data.path):
            bad("data.path", f"{self.data.path} is a directory; name the HDF5 partition file in it")
        if data_file and os.path.islink(self.data.path) and not os.path.exists(self.data.path):
            bad("data.path", f"{self.data.path} is a symbolic link to {os.readlink(self.data.path)}, which does not exist")
        if data_file and os.path.exists(self.data.path) and not os.path.isfile(self.data.path):
            bad("data.path", f"{self.data.path} is not a regular file (a device, a pipe or a socket); name the HDF5 "
                             f"partition file")
        if data_file and not os.path.isfile(self.data.path):
            bad("data.path", f"no such file: {self.data.path}{from_here(self.data.path)}")
        return self

    def _other_methods_classes(self) -> list:
        """The option classes of methods other than the configured one (and its bases and parts)."""
        if self.method not in ALGORITHMS:
            return []
        acting = set(acting_option_classes(self.method))
        return [c for c in option_classes() if c not in acting]

    def keys_without_effect(self) -> list:
        """[(key, why)] of the keys set to another value than their default that act on nothing in a
        run of this config: another method's options, a model's keys with another model (and what
        each component's ``inert_keys`` names). A run starts with them all the same, and its start
        line names them, so that none is dropped without a word."""
        out = []
        for comp in self._other_methods_classes():
            why = f"an option of {', '.join(methods_using(comp))}, not {self.method}"
            out += [(o.name, why) for o in comp.__dict__["options"] if getattr(self, o.name) != o.default]
        for comp in components():
            inert = comp.inert_keys(self) if hasattr(comp, "inert_keys") and comp is not Data else {}
            out += [(o.name, inert[o.name]) for o in comp.options
                    if o.name in inert and getattr(self, o.name) != o.default]
        return out


def _assemble_config():
    parts = []
    for comp in components():
        if comp is Data:
            parts.append(("data", DataConfig, field(default_factory=DataConfig)))
        else:
            parts += _fields(comp.options)
    return dataclasses.make_dataclass("Config", parts, bases=(_ConfigMethods,))


Config = _assemble_config()
Config.__module__ = __name__
Config.__doc__ = """A whole run: every component's keys (the experiment, every method's options, the
execution) and the data set under ``data.``. Defaults are the paper's for the 4-layer CNN."""


# ----------------------------------------------------------------------
# loading and overriding


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
        hint = ""
        if isinstance(value, FromText):  # a command-line override: a text key takes its text as typed
            text, value = value.text, value.value
            if not type_ok(value, tp) and type_ok(text, tp) and isinstance(value, (bool, int, float)):
                value = text  # out_dir=2024, client_state_dir=0755 (YAML: an int, an octal int)
            elif value is None and type_ok(text, tp):  # quoting helps only a key that takes the text
                hint = f" (YAML reads {text!r} as {value!r}; quote it, {full}='\"{text}\"', for the text)"
            elif value is None or isinstance(value, bool):  # yes, on, ~: not what they look like
                hint = f" (YAML reads {text!r} as {value!r})"
        value = as_number(value, tp)
        if not type_ok(value, tp):
            raise UserError(f"config key '{full}': expected {_type_name(tp)}, got {shown(value)}{hint}")
        if tp is float:
            value = float(value)
        setattr(obj, key, value)


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, validate: bool = True,
                values: Optional[dict] = None) -> Config:
    """Defaults ← YAML file ← ``key=value`` overrides, then validation. ``values``: the file's
    mapping as already read (a sweep reads its base once for all its points); ``path`` is not read then."""
    cfg = Config()
    if values is not None:
        _apply(cfg, copy.deepcopy(values))
    elif path is not None:
        values = read_yaml_mapping(path)
        if {"name", "base"} <= set(values) and {"grid", "variants"} & set(values):
            raise UserError(f"{path} is a sweep file (name, base, grid), not a run's config: run it with "
                            f"fedcp-sweep {path}")
        _apply(cfg, values)
    if overrides:
        _apply(cfg, parse_overrides(overrides, keep_text=True))
    if validate:
        cfg.validate()
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
