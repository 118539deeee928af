"""Keeping aotdist's own older call forms working for one release, with a warning."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def positional_after_first_deprecated(fn: F) -> F:
    """Lets ``fn``'s keyword-only arguments still be passed positionally, in order, with a
    ``DeprecationWarning`` naming the keywords to use (the form goes in the next release)."""
    names = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]

    @functools.wraps(fn)
    def wrapper(first, *args, **kwargs):
        if not args:
            return fn(first, **kwargs)
        if len(args) > len(names):
            raise TypeError(
                f"{fn.__name__}() takes 1 positional argument and at most "
                f"{len(names)} keyword arguments ({', '.join(names)})"
            )
        given = names[: len(args)]
        twice = [n for n in given if n in kwargs]
        if twice:
            raise TypeError(f"{fn.__name__}() got multiple values for {twice}")
        warnings.warn(
            f"{fn.__name__}: passing {', '.join(given)} by position is deprecated and stops "
            f"working in the next release. Fix: pass {', '.join(f'{n}=...' for n in given)}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return fn(first, **dict(zip(given, args, strict=True)), **kwargs)

    return wrapper  # type: ignore[return-value]
