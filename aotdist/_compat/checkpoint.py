"""torch's notice for a checkpoint given a ``context_fn`` under ``torch.compile``, kept off
the checkpoints aotdist itself writes.

Graph-mode FSDP recomputes each all-gather in backward through selective activation
checkpointing (a ``context_fn``; plain checkpointing saves the gathered parameters on
torch 2.11). torch then logs "Detected that context_fn is passed to torch.utils.checkpoint
under torch.compile" at WARNING, per rank, to users who asked for no checkpointing. The
filter drops that record only where the checkpoint being traced carries one of aotdist's
own ``context_fn``s; a user's own selective checkpoint is announced as before (torch says
it once a process: after aotdist's, a user's is not said again).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from aotdist._compat._base import checked_on

# checked on torch 2.11 and 2.14.1: the logger of torch._higher_order_ops.wrap, the function
# that logs the notice, and where it reads the context_fn (gmod.meta) before logging
_LOGGER = "torch._higher_order_ops.wrap"
_NOTICE = "context_fn is passed to torch.utils.checkpoint under torch.compile"
_LOGGED_IN = "tag_activation_checkpoint_impl"
_META_KEY = "_checkpoint_context_fn"


class _OwnCheckpointNotice(logging.Filter):
    """Drops the notice where the checkpoint traced now carries one of ``context_fns``."""

    def __init__(self) -> None:
        super().__init__()
        self.context_fns: list[Callable] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if _NOTICE not in str(record.msg):
            return True
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != _LOGGED_IN:
            frame = frame.f_back
        meta = getattr(frame.f_locals.get("gmod"), "meta", None) if frame is not None else None
        return not (isinstance(meta, dict) and meta.get(_META_KEY) in self.context_fns)


@checked_on("2.11", "2.14")
def quiet_checkpoint_notice(context_fn: Callable) -> None:
    """torch's notice is not logged for checkpoints passed ``context_fn`` (idempotent; a
    filter on torch's logger that lets every other record through)."""
    logger = logging.getLogger(_LOGGER)
    own = next((f for f in logger.filters if isinstance(f, _OwnCheckpointNotice)), None)
    if own is None:
        own = _OwnCheckpointNotice()
        logger.addFilter(own)
    if context_fn not in own.context_fns:
        own.context_fns.append(context_fn)
