"""``enum.StrEnum`` for Python 3.10 (aotdist supports 3.10; ``StrEnum`` is new in 3.11)."""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A ``str`` enum whose ``str()`` and ``format()`` are its value (as Python 3.11's
    ``StrEnum``; aotdist supports Python 3.10)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
