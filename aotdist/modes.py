"""Modes and outcomes as string-valued enums.

Each member *is* its string (``CompileMode.FRAMES == "frames"``), prints as it
(``f"{mode}"`` gives ``frames``) and is written to JSON and YAML as it, so configs,
reports and existing string comparisons stay readable and keep working.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ApplyHow", "CacheStatus", "CompileMode"]


class _StrEnum(str, Enum):
    """A ``str`` enum whose ``str()`` and ``format()`` are its value (as Python 3.11's
    ``StrEnum``; aotdist supports Python 3.10)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class CompileMode(_StrEnum):
    """How a model was compiled (:mod:`aotdist.compile`).

    Attributes:
        GRAPH: No FSDP2: the whole model is one graph, each region an ``invoke_subgraph``.
        FRAMES: FSDP2 units: each region's forward is one compiled graph shared by its
            instances, inside FSDP2's eager hooks.
    """

    GRAPH = "graph"
    FRAMES = "frames"


class ApplyHow(_StrEnum):
    """How the Lightning callback / Accelerate hook applied aotdist to a model.

    Attributes:
        PARALLELIZE: aotdist applied ``aotdist.parallelize``.
        USER: The user had applied aotdist already; left as it is.
        COMPILE_IN_USER_FSDP: The user sharded with FSDP2; aotdist compiled inside the units.
    """

    PARALLELIZE = "parallelize"
    USER = "user"
    COMPILE_IN_USER_FSDP = "compile_in_user_fsdp"


class CacheStatus(_StrEnum):
    """What ``aotdist.cache.load`` did with a bundle.

    Attributes:
        OFF: ``cache.mode: off``.
        MISSING: No bundle yet (the first run); this run compiles and saves one.
        LOADED: The bundle was loaded.
        STALE: Made for another setup (key mismatch); ignored.
        CORRUPT: Unreadable or failed to install; ignored.
    """

    OFF = "off"
    MISSING = "missing"
    LOADED = "loaded"
    STALE = "stale"
    CORRUPT = "corrupt"
