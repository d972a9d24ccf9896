"""Run configuration: the flat ``Config`` assembled from the options every component declares,
YAML loading, ``key=value`` overrides, validation.

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
import json
import math
import os
import re
import sys
import typing
from dataclasses import field
from typing import Any, Optional, Sequence, Union

import yaml

from fedcp_dist.algorithms import ALGORITHMS, acting_option_classes, algorithm_class, methods_using, option_classes
from fedcp_dist.engine.keys import Evaluation, Execution, LocalSGD, NonFinite, Probing
from fedcp_dist.errors import UserError
from fedcp_dist.fused.keys import Fusing
from fedcp_dist.models import ModelChoice
from fedcp_dist.options import Check, Component, Option, SEED_MAX, above, at_least, described, one_of, shown, type_ok
from fedcp_dist.rundir.keys import Logging
from fedcp_dist.state.keys import ClientStates, Participation

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


def _number(text: str, integer: bool):
    """``text`` as the number Python's ``int()`` (``integer``) or ``float()`` reads, else None. An
    integer also accepts a float's text whose value is a whole number exactly (``1e3``)."""
    try:
        return int(text) if integer else float(text)
    except ValueError:
        pass
    if integer:
        try:
            x = float(text)
        except ValueError:
            return None
        if math.isfinite(x) and x == int(x) and abs(x) < 2**53:
            return int(x)
    return None


def as_number(value: Any, tp) -> Any:
    """``value`` for a key of type ``tp``, with numbers written as text read as numbers.

    YAML 1.1 (PyYAML) reads ``1e-3`` and ``1E5`` as text (its floats need a dot and a signed
    exponent), so a numeric key also takes any text Python's ``float()`` reads (``int()`` for an
    integer key, or a float's text of a whole value), and an integer key takes a float of a whole
    value (``1000.0``); a list's items that read as numbers become numbers (every list a key takes
    holds numbers). Anything else is returned as it was, for :func:`type_ok` to judge.
    """
    args = typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,)
    if isinstance(value, str):
        for want in (int, float):
            number = _number(value.strip(), want is int) if want in args else None
            if number is not None:
                return float(number) if want is float else number
    if isinstance(value, float) and int in args and float not in args:
        number = _number(repr(value), True)
        return value if number is None else number
    if isinstance(value, list) and list in args:
        out = []
        for item in value:
            number = _number(item.strip(), True) if isinstance(item, str) else None
            if isinstance(item, str) and number is None:
                number = _number(item.strip(), False)
            out.append(item if number is None else number)
        return out
    return value


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


@dataclasses.dataclass(frozen=True)
class FromText:
    """A command-line override's value: YAML's reading of it and the text it was read from (a key
    that takes text is given the text itself: ``out_dir=2024`` names a folder, not a number)."""

    value: Any
    text: str

    def __repr__(self) -> str:  # shown in an error as the value read (``lr.x=1``: got {'x': 1})
        return repr(self.value)


def override_key(item: str) -> str:
    """The key of one ``key=value`` override (the whole text where there is no ``=``)."""
    return item.split("=", 1)[0].strip()


def given_once(items: Sequence[str]) -> list[str]:
    """``items`` as they are, where no key is given twice; a key given twice is refused, as a
    config file's key written twice is (for the overrides a user types: ``rounds=3 … rounds=5``
    would run 5 rounds silently)."""
    seen: dict = {}
    for item in items:
        key = override_key(item)
        if key in seen:
            raise UserError(f"override '{key}' is given twice ({seen[key]!r} and {item!r}); give it once")
        seen[key] = item
    return list(items)


def merged_overrides(*layers: Sequence[str]) -> list[str]:
    """``key=value`` overrides in layers, a later layer's key replacing an earlier one's (for tools
    that put their own defaults under the user's overrides); one list with each key once. Within a
    layer a key given twice is refused (:func:`given_once`)."""
    out: dict = {}
    for layer in layers:
        for item in given_once(layer):
            out.pop(override_key(item), None)
            out[override_key(item)] = item
    return list(out.values())


def parse_overrides(items: list[str], keep_text: bool = False) -> dict:
    """``["lr=0.1", "data.path=x.h5"]`` → nested dict; values are read as YAML scalars (with
    ``keep_text``, as :class:`FromText`, for :func:`load_config`). A ``#`` that YAML would read as a
    comment (and drop) is refused: quote the value. Overrides are layers: a key given again replaces
    its earlier value (tools put their own under a user's); the command line refuses a key a user
    gives twice before it gets here (:func:`given_once`)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            hint = (f" (a config file? give it as --config {item})" if str(item).endswith((".yaml", ".yml")) else "")
            raise UserError(f"override {item!r} is not of the form key=value{hint}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise UserError(f"override {item!r} has an empty key")
        bad = next((c for c in item if "\udc80" <= c <= "\udcff"), None)  # a byte the locale could not decode
        if bad is not None:
            encoding = sys.getfilesystemencoding()
            if encoding.replace("-", "").lower() != "utf8":  # a C locale without Python's UTF-8 mode
                raise UserError(f"override {key}=…: the value holds byte 0x{ord(bad) - 0xdc00:02x}, which this "
                                f"process's locale ({encoding}) cannot read; run with a UTF-8 locale "
                                f"(LC_ALL=C.UTF-8) or PYTHONUTF8=1")
            raise UserError(f"override {key}=…: the value holds byte 0x{ord(bad) - 0xdc00:02x}, which is not UTF-8 text "
                            f"(a path must be valid UTF-8 to be written in config.yaml)")
        if "\n" in raw.strip() or "\r" in raw.strip():  # YAML folds a plain scalar's line break into a space
            raise UserError(f"override {key}=…: the value holds a line break, which YAML would read as a space "
                            f"(out_dir=a<newline>b ran in 'a b'); a value of one line is taken")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise UserError(f"override {item!r}: value is not valid YAML") from None
        if re.search(r"(^|\s)#", raw) and "#" not in json.dumps(value, default=str):
            raise UserError(f"override {item!r}: YAML reads the ' #…' as a comment and would drop it; remove it, or "
                            f"quote the value to keep it as text: {key}='\"{raw.strip()}\"'")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r} conflicts with another override of '{part}'")
        node[parts[-1]] = FromText(value, raw.strip()) if keep_text else value
    return out


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first: int, again: int):
        super().__init__(f"key {key!r} appears twice")
        self.key, self.first, self.again = key, first, again


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (which it would otherwise
    resolve silently to the last value: two ``lr:`` lines, two ``grid:`` blocks)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base loader says so
                    break
        return super().construct_mapping(node, deep)


def from_here(path) -> str:
    """For a file that is not there: where a relative ``path`` was looked for. Paths in configs, sweep
    files and on the command line are read from the current directory, not from the file naming
    them, so a command run from another folder misses them."""
    if os.path.isabs(path):
        return ""
    try:
        return f" (a relative path, read from the current directory {os.getcwd()})"
    except OSError:  # the current directory was removed
        return " (a relative path, read from the current directory)"


def read_yaml_mapping(path, what: str = "config file") -> dict:
    """A YAML file that must hold a mapping (empty → {}); every problem is a one-line UserError,
    a key written twice in one mapping included."""
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=_UniqueKeys)
    except _DuplicateKey as exc:
        raise UserError(f"{what} {path}: key {exc.key!r} is set twice (lines {exc.first} and {exc.again}); "
                        f"keep one") from None
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}{from_here(path)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{what} {path} cannot be read: {exc}") from None
    except ValueError as exc:  # a name the system cannot take (a NUL byte)
        raise UserError(f"{what} {path!r} is not a usable file name: {exc}") from None
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


def unflatten(flat: dict) -> dict:
    """The inverse of :func:`flatten`: ``{"data.path": x, "lr": 1}`` → ``{"data": {"path": x}, "lr": 1}``."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


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
