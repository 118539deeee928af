"""Classes aotdist makes in each process, and how a saved graph pickles their instances.

Four kinds of module get a class made at run time from the user's (or a library's): a
region class (:mod:`aotdist.compile.marking`), a fix's class (:mod:`aotdist.fixes`)
and graph-mode FSDP's gathering class (:mod:`aotdist.fsdp.gather`). :func:`made_class`
makes each of them; :func:`pickled_with_region_depth` is the protocol by which
``aotdist.cache.precompile`` saves guards that name them and loads them in another process.
"""

from __future__ import annotations

import contextlib
import copyreg
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn


def made_class(
    base: type,
    namespace: dict[str, Any],
    *,
    remake: tuple[Callable, tuple] | None = None,
    pickles_as_base: bool = False,
) -> type:
    """A subclass of ``base`` made in this process, named and placed as ``base`` (so that
    errors, guards and ``repr`` name the user's class).

    ``remake = (make, args)``: how another process makes it again (``make(*args)``), for a
    saved graph's guards. ``pickles_as_base``: ``pickle`` and ``deepcopy`` give an
    instance of ``base`` (a region class, a gathering class: a copy is the user's model).
    """
    made = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_aotdist_made_from": base,
        **namespace,
    }
    if remake is not None:
        made["_aotdist_remake"] = remake
    if pickles_as_base:
        made["__reduce_ex__"] = _reduce_as_base
    return type(base.__name__, (base,), made)


def _reduce_as_base(self, protocol):
    """Pickle and deepcopy an instance as an instance of the class it was made from."""
    return (
        copyreg._reconstructor,
        (type(self)._aotdist_made_from, object, None),
        vars(self).copy(),
    )


_STAND_INS: dict[tuple[type, tuple[str, ...]], type] = {}


def _stand_in_instance(base: type, names: tuple[str, ...] = ()) -> nn.Module:
    """An empty instance of a class made in this process, as many subclasses below
    ``base`` as ``names`` (the names of the classes above it, bottom first; default: one,
    named as ``base``): a region instance unpickled with its class's depth and name (see
    :func:`pickled_with_region_depth`)."""
    names = names or (base.__name__,)
    if (base, names) not in _STAND_INS:
        cls = base
        for name in reversed(names):
            cls = type(name, (cls,), {"__module__": base.__module__, "__qualname__": name})
        _STAND_INS[base, names] = cls
    return object.__new__(_STAND_INS[base, names])


def _reduce_keeping_depth(self, protocol):
    base = type(self)._aotdist_base
    above = type(self).__mro__[: type(self).__mro__.index(base)]
    return (_stand_in_instance, (base, tuple(c.__name__ for c in above)), vars(self).copy())


def _remade_instance(make: Callable, args: tuple) -> nn.Module:
    return object.__new__(make(*args))


def _reduce_remade(self, protocol):
    make, args = type(self)._aotdist_remake
    return (_remade_instance, (make, args), vars(self).copy())


def made_per_process(cls: type) -> bool:
    """A class aotdist makes in each process: a region class (or one made from it, such
    as FSDP2's ``FSDP<cls>``), or a class that says how to make it again
    (``_aotdist_remake``: a fix's class, graph-mode FSDP's gathering classes)."""
    return (
        getattr(cls, "_aotdist_region", None) is not None
        or getattr(cls, "_aotdist_remake", None) is not None
    )


@contextlib.contextmanager
def pickled_with_region_depth(model: nn.Module) -> Iterator[None]:
    """Inside, region instances of ``model`` pickle as instances of a class as many
    subclasses below their user class as theirs (the region class; FSDP2's ``FSDP<cls>``
    above it), made anew where they are unpickled: Dynamo's saved guards name class
    attributes by position in the class's MRO (``__mro__[2]``), which the user class alone
    would shift (aotdist.cache.precompile saves such guards). Instances of another class
    made per process that says how to make it again (``_aotdist_remake = (make, args)``:
    a fix's class, graph-mode FSDP's gathering classes) pickle as instances of
    ``make(*args)``."""
    classes = {
        type(m): vars(type(m)).get("__reduce_ex__")
        for m in model.modules()
        if made_per_process(type(m))
    }
    for cls in classes:
        remake = "_aotdist_remake" in vars(cls) or getattr(cls, "_aotdist_region", None) is None
        cls.__reduce_ex__ = _reduce_remade if remake else _reduce_keeping_depth
    try:
        yield
    finally:
        for cls, own in classes.items():
            if own is not None:
                cls.__reduce_ex__ = own
            else:  # a class made from a region class (FSDP<cls>): inherits it again
                del cls.__reduce_ex__
