"""Reading a run's configuration text: ``key=value`` overrides (their layers, a key given once, a
value read as YAML, the text it was typed as), YAML files that must hold a mapping (a key written
twice refused), numbers written as text, and nested keys flattened and back. It knows nothing of
the keys themselves (:mod:`fedcp_dist.config` applies what it reads to the ``Config``); every
mistake is a one-line :class:`~fedcp_dist.errors.UserError`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import typing
from typing import Any, Sequence

import yaml

from fedcp_dist.errors import UserError


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
