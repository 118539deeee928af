"""Strict validation of config sections: types from annotations, rules, every problem.

A section is a frozen keyword-only dataclass deriving from :class:`Section`; in
``__post_init__`` it checks each field against its annotation, then the section's own
rules, and raises one ``ConfigError`` that lists every problem with its dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from aotdist.errors import ConfigError


def _type_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the annotation ``hint`` (the few kinds configs use)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if any(_type_problem(value, h) is None for h in options):
            return None
        return "expected " + " or ".join(_type_name(h) for h in options)
    if hint is type(None):
        return None if value is None else "expected null"
    if origin is tuple:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            return "expected a list of strings"
        return None
    if origin is dict or hint is dict:
        return None if isinstance(value, dict) else "expected a mapping"
    if hint is bool:
        return None if isinstance(value, bool) else "expected true or false"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "expected an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "expected a number"
    if hint is str:
        return None if isinstance(value, str) else "expected a string"
    return None


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is tuple:
        return "a list of strings"
    if typing.get_origin(hint) is dict or hint is dict:
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, str(hint)
    )


class Section:
    """Validation shared by the config sections: types from annotations, then rules."""

    _key: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # lists from YAML become tuples (frozen, hashable)
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        problems = self._type_problems()
        try:  # rules read values of the right type; a bad type is reported above already
            problems += self._rule_problems()
        except TypeError:
            pass
        if problems:
            raise ConfigError(problems_message(problems), problems=problems)

    def _type_problems(self) -> list[str]:
        hints = typing.get_type_hints(type(self))
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            why = _type_problem(value, hints[f.name])
            if why:
                out.append(f"{self._key}.{f.name}: {why}, got {value!r}")
        return out

    def _rule_problems(self) -> list[str]:
        return []


def problems_message(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"invalid aotdist config: {problems[0]}"
    return "invalid aotdist config, {} problems:\n  - {}".format(
        len(problems), "\n  - ".join(problems)
    )


def did_you_mean(word: object, choices: typing.Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` naming the choice closest to ``word``, or ``""`` when none
    is close (``difflib``'s ratio of at least 0.75: ``indcutor`` finds ``inductor``, a
    long unrelated name finds nothing)."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""
