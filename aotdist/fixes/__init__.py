"""The fixes aotdist applies to modules inside a region instance, in the order every path
applies them (marking a region, demoting it, restoring the model).

Each fix is one module with ``swap(module) -> list`` (the modules it changed under
``module``) and ``restore(module)``; it changes a module only where the module's forward is
exactly the code it reproduces (docs/design.md lists each fix and its guarantee). A new
fix is one module here and one entry in :data:`FIXES`.
"""

from __future__ import annotations

from torch import nn

from aotdist.fixes import batchnorm, droppath

__all__ = ["FIXES", "apply_fixes", "restore_fixes"]

FIXES = (batchnorm, droppath)


def apply_fixes(module: nn.Module) -> list[nn.Module]:
    """Every fix applied under ``module`` (a region instance); the modules changed."""
    return [changed for fix in FIXES for changed in fix.swap(module)]


def restore_fixes(module: nn.Module) -> None:
    """Every fix undone under ``module``."""
    for fix in FIXES:
        fix.restore(module)
