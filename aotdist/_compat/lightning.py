"""Lightning internals (checked on lightning 2.6; the torch versions: each accessor's
``checked_on`` record)."""

from __future__ import annotations

from typing import Any

from torch import nn

from aotdist._compat._base import checked_on


@checked_on("2.11", "2.14", note="lightning 2.6")
def lightning_compiler_context(module: nn.Module) -> dict[str, Any] | None:
    """What Lightning's ``from_compiled`` recorded on a LightningModule that came from
    ``torch.compile`` (its private ``_compiler_ctx``: the compiler and its arguments),
    ``None`` for one that did not, or that ``to_uncompiled`` restored."""
    return getattr(module, "_compiler_ctx", None)
