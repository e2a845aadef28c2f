"""How a config section is declared and parsed: a table of keys, each with its default and check.

A section is a dataclass; each field is one key, declared once with `key(default, check,
alias=..., acts=...)`. `Section.parse` builds the typed section from a JSON object with
those rows: unknown keys are an error that names the path and the accepted keys, each
value goes through its check, absent keys take their default. config/__init__.py and
zero.py declare DeepSpeed's sections with it. The checks below take (value, path) and return the cleaned
value or raise ConfigError with a message that says what to write instead.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field, fields


class ConfigError(ValueError):
    """A config key or value minizero does not accept. The message says what to do."""


def unknown_key(key: str, full: str, path: str, accepted) -> str:
    """The error for a key a section does not have, in one line. Most are typos of one it
    has: then the line says which, and nothing else (the accepted keys, dozens at the top
    level, would bury it). Otherwise it says so and lists the accepted keys, last."""
    where = f"in {path}" if path else "at the top level"
    near = difflib.get_close_matches(key, list(accepted), n=1, cutoff=0.75)
    if near:
        return f"unknown config key '{full}': did you mean '{f'{path}.' if path else ''}{near[0]}'?"
    return (f"unknown config key '{full}': minizero reads no such key {where} (a typo, or a DeepSpeed "
            f"feature minizero does not have); accepted keys {where}: {', '.join(sorted(accepted))}")


# ----------------------------------------------------------------------------- value checks
# Each takes (value, path) and returns the cleaned value or raises ConfigError.

def boolean(v, path):
    if not isinstance(v, bool):
        raise ConfigError(f"{path} must be true or false, got {v!r}")
    return v


def number(lo=None, lo_open=False):
    def check(v, path):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{path} must be a finite number, got {v!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ConfigError(f"{path} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
        return v
    return check


def real(lo=None):
    return lambda v, path: float(number(lo)(v, path))


def integer(lo=0):
    """Integers; integral floats such as 5e8 (JSON has no int exponent form) are accepted."""
    def check(v, path):
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{path} must be an integer, got {v!r}")
        if v < lo:
            raise ConfigError(f"{path} must be >= {lo}, got {v}")
        return v
    return check


def optional(check):
    return lambda v, path: None if v is None else check(v, path)


def only(value, why):
    """A DeepSpeed key minizero accepts only at the value matching what minizero does."""
    def check(v, path):
        if v != value:
            raise ConfigError(f"{path} = {v!r} is not implemented in minizero ({why}); "
                              f"remove it or set it to {json.dumps(value)}")
        return v
    return check


def list_of(check):
    """A JSON list whose every item passes `check`."""
    def check_list(v, path):
        if not isinstance(v, list):
            raise ConfigError(f"{path} must be a JSON list, got {v!r}")
        return [check(x, f"{path}[{i}]") for i, x in enumerate(v)]
    return check_list


def string(v, path):
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{path} must be a non-empty string, got {v!r}")
    return v


def anything(v, path):
    return v


# ----------------------------------------------------------------------------- tables

def key(default, check, *, alias=None, acts=True, name=None):
    """One row of a section's table, declared as a dataclass field.

    default: DeepSpeed 0.19.8's default (a Section class: that section's defaults; `dict`:
             an empty dict). check(value, path): the cleaned value, or a ConfigError.
    alias:   DeepSpeed's other spelling of the key. name: the JSON key, when the attribute
             is called otherwise (`zero` for "zero_optimization").
    acts:    False for a key accepted only so DeepSpeed configs load unchanged: any value
             is accepted and minizero does nothing with it.
    """
    default_kw = {"default_factory": default} if isinstance(default, type) else {"default": default}
    return field(**default_kw, metadata={"check": check, "alias": alias, "acts": acts, "name": name})


@dataclass
class Section:
    """A config section parsed by its table: every field declared with `key` is one key."""
    # the keys the config wrote; set at construction, so a section's __post_init__ checks can read it
    given: tuple = field(default=(), repr=False, compare=False, kw_only=True)

    @classmethod
    def rows(cls) -> dict:
        """{key as a config may spell it (aliases too): its field}."""
        out = {}
        for f in fields(cls):
            if "check" in f.metadata:
                out[f.metadata["name"] or f.name] = f
                if f.metadata["alias"]:
                    out[f.metadata["alias"]] = f
        return out

    @classmethod
    def parse(cls, d, path):
        """The section at `path` of a config; None (key absent or null) gives the defaults."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError(f"{path} must be a JSON object, got {d!r}")
        rows, values, spelled = cls.rows(), {}, {}
        for k, v in d.items():
            full = f"{path}.{k}" if path else k
            if k not in rows:
                raise ConfigError(unknown_key(k, full, path, rows))
            f = rows[k]
            if f.name in values:
                main = f.metadata["name"] or f.name
                raise ConfigError(f"'{spelled[f.name]}' and '{full}' are two spellings of one key (DeepSpeed "
                                  f"would silently read only one); keep only '{main}'")
            values[f.name], spelled[f.name] = f.metadata["check"](v, full), full
        return cls(**values, given=tuple(d))

    def to_dict(self) -> dict:
        """{JSON key: value} of a section whose values are plain JSON values."""
        return {f.metadata["name"] or f.name: getattr(self, f.name) for f in fields(self) if "check" in f.metadata}
