"""The autograd engine: whether a backward pass is running now."""

from __future__ import annotations

from aotdist._compat._base import attr, checked_on


@checked_on("2.11", "2.14")
def in_autograd_backward() -> bool | None:
    """Whether the autograd engine is running a backward pass on this thread now
    (``torch._C._current_graph_task_id() != -1``), or ``None`` where this torch cannot
    say."""
    task_id = attr("torch._C", "_current_graph_task_id")
    return None if task_id is None else task_id() != -1
