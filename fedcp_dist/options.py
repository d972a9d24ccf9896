"""Config options that a method declares next to its code.

A method class lists its own keys in ``options`` (name, default, one line of help, a check); the
config loader gathers every registered method's options into the flat ``Config``, so adding a
method (or a switch of one) touches that method's file only. A check returns why a value is
impossible (``None``: it is fine); the loader turns that into a one-line error naming the key.
"""
from __future__ import annotations

import difflib
import math
import reprlib
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional


#: how an error message shows a value: as repr() does, cut short where it is long or deep (a YAML
#: alias bomb of 9**9 items took minutes and gigabytes to be shown whole)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 2, 6, 6, 6, 6
_SHORT.maxstring = _SHORT.maxother = 160


def shown(value) -> str:
    """``repr(value)``, cut short where it is long or nested deep (for error messages)."""
    return _SHORT.repr(value)

Check = Callable[[Any], Optional[str]]

#: the largest seed (a run's, a partition's): torch's generators take 64 bits, numpy's seeds no
#: negative number
SEED_MAX = 2**63 - 1


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    check: Optional[Check] = None
    #: the accepted type where the default's own type is not it (``Optional[float]`` for a default
    #: of None, ``Union[float, str]`` for a number or a word)
    kind: Any = None

    @property
    def type(self) -> type:
        return self.kind if self.kind is not None else type(self.default)


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``word``, else ""."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def repeated(values) -> Any:
    """The first of ``values`` that an earlier one equals (None: each is there once)."""
    seen: list = []
    for v in values:
        if v in seen:
            return v
        seen.append(v)
    return None


def type_ok(value: Any, tp) -> bool:
    """Whether ``value`` (as YAML reads it) has the type ``tp`` a key takes: bool, int, float (an int
    too), str, list, None, or a Union of them (``Optional[...]``)."""
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


def described(text: str, check: Check) -> Check:
    """``check`` with the one-line description of what it accepts that the configuration reference shows."""
    check.accepts = text
    return check


def accepts(opt: "Option") -> str:
    """What ``opt`` accepts, in words: its check's description (a bound or range of a numeric key
    with the kind of number it takes: ``an integer > 0``, ``a number in (0, 1]``), else its type."""
    args = typing.get_args(opt.type) if typing.get_origin(opt.type) is typing.Union else (opt.type,)
    text = getattr(opt.check, "accepts", None)
    if text:
        noun = "an integer" if int in args else "a number" if float in args else ""
        if not noun:
            return text
        return " | ".join(f"{noun} in {part}" if part[:1] in "[(" else f"{noun} {part}" if part[:1] in "<>" else part
                          for part in text.split(" | "))
    names = {bool: "true | false", int: "an integer", float: "a number", str: "text", list: "a list"}
    return " or ".join("null" if a is type(None) else names.get(a, getattr(a, "__name__", str(a))) for a in args)


def at_least(lo: float) -> Check:
    check = described(f">= {lo}", lambda v: None if v >= lo else f"must be >= {lo}, got {v}")
    check.lowest = lo  # the boundary a test of combinations tries
    return check


def above(lo: float) -> Check:
    return described(f"> {lo}", lambda v: None if v > lo else f"must be > {lo}, got {v}")


def within(lo: float, hi: float, *, low_open: bool = False, high_open: bool = False) -> Check:
    """lo ≤ v ≤ hi, with either end open on request."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def check(v):
        ok = (v > lo if low_open else v >= lo) and (v < hi if high_open else v <= hi)
        return None if ok else f"must lie in {left}{lo}, {hi}{right}, got {v}"

    check.ends = tuple(end for end, open_ in ((lo, low_open), (hi, high_open)) if not open_)  # the accepted ends
    return described(f"{left}{lo}, {hi}{right}", check)


def one_of(*values) -> Check:
    check = described(" | ".join(map(str, values)),
                      lambda v: None if v in values else f"must be one of {', '.join(map(str, values))}, got {shown(v)}")
    check.choices = values
    return check


def auto_or(check: Check) -> Check:
    """The word ``auto`` or a value ``check`` accepts."""
    return described(f"auto | {getattr(check, 'accepts', 'a value')}",
                     lambda v: None if v == "auto" else check(v))


def boolean_or_auto(v) -> Optional[str]:
    return None if v == "auto" or isinstance(v, bool) else f"must be auto, true or false, got {shown(v)}"


described("auto | true | false", boolean_or_auto)


def finite(v) -> Optional[str]:
    return None if math.isfinite(v) else f"must be a finite number, got {v}"


class Component:
    """A piece of the engine or of a method that owns config keys: ``options`` lists them next to its
    code, :meth:`check_config` refuses the combinations of them that cannot work."""

    options: tuple = ()

    @classmethod
    def check_config(cls, cfg) -> Optional[tuple]:
        """(key, why) when this component's keys contradict each other (or other keys) in ``cfg``, else None."""
        return None

    @classmethod
    def inert_keys(cls, cfg) -> dict:
        """{key: why} of this component's keys that have no effect in a run of ``cfg`` whatever their
        value (the run's start line names those set to another value than their default)."""
        return {}
