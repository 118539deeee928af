"""aotdist for Lightning and Accelerate (installed as ``aotdist.callbacks``).

Names load on first use, so importing this package imports neither Lightning nor
Accelerate:

- :class:`RegionalCompile` — a ``lightning.pytorch.Callback`` (``callbacks/lightning.py``).
- :class:`RegionalCompileHook` and :func:`prepare` — Accelerate (``callbacks/accelerate.py``);
  :func:`prepare_pipeline` — a pipelined model under Accelerate
  (``callbacks/_accelerate_pipeline.py``).
- :class:`TrainerRegionalCompile` — a Hugging Face ``TrainerCallback`` (``callbacks/trainer.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

from aotdist._compat.extras import require

__all__ = [
    "RegionalCompile",
    "RegionalCompileHook",
    "TrainerRegionalCompile",
    "prepare",
    "prepare_pipeline",
]

_WHERE = {
    "RegionalCompile": "aotdist.callbacks.lightning",
    "RegionalCompileHook": "aotdist.callbacks.accelerate",
    "prepare": "aotdist.callbacks.accelerate",
    "prepare_pipeline": "aotdist.callbacks._accelerate_pipeline",
    "TrainerRegionalCompile": "aotdist.callbacks.trainer",
}
_NEEDS = {
    "aotdist.callbacks.lightning": "lightning.pytorch",
    "aotdist.callbacks.accelerate": "accelerate.hooks",
    "aotdist.callbacks._accelerate_pipeline": "accelerate.hooks",
    "aotdist.callbacks.trainer": "transformers",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        require(_NEEDS[_WHERE[name]], feature=f"aotdist.callbacks.{name}")
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aotdist.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_WHERE))
