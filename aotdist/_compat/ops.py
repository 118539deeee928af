"""ATen operators by their private names, and an operator's schema."""

from __future__ import annotations

from typing import Any

import torch

from aotdist._compat._base import checked_on


@checked_on("2.11", "2.14")
def aten_to_copy() -> torch._ops.OpOverload:
    """``aten._to_copy.default``, what a dtype or device cast decomposes to in graphs
    (an underscore ATen operator: internal to torch, no compatibility promise)."""
    return torch.ops.aten._to_copy.default


@checked_on("2.11", "2.14")
def op_schema(target: Any) -> Any | None:
    """The ``FunctionSchema`` of an operator a graph node calls (``OpOverload._schema``),
    ``None`` for a target that is no operator (a Python function, a higher-order op)."""
    return getattr(target, "_schema", None)
