"""AOTAutograd's graph text, built only when a logger reads it.

``graph_compile._log_joint_graph`` and ``_log_fw_bw_graphs`` run on every AOTAutograd
compile (``aot_config.enable_log`` is on by default) and ``print_readable`` the joint,
forward and backward graphs into strings, whether or not a log or a structured trace
(``TORCH_LOGS``, ``TORCH_TRACE``) will read them. The strings go to those logs and into
AOTAutograd's cache entry, which replays them to the same logs on a hit (``None`` is
handled there: nothing is replayed). aotdist compiles one such graph per region body
and one around them at every depth, so the text is built per compile for nothing when
no one logs. Within :func:`graph_text_when_logged` the two functions run as torch wrote
them when ``aot_joint_log`` / ``aot_graphs_log`` are on at INFO or a structured trace has
a handler that writes (:func:`_tracing`), and return ``None`` otherwise. Nothing that computes changes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator

from aotdist._compat._base import checked_on

_MODULE = "torch._functorch._aot_autograd.graph_compile"


def _tracing() -> bool:
    """Whether a structured trace (``TORCH_TRACE``, tlparse) will write what torch emits.
    torch installs a ``LazyTraceHandler`` on its trace logger whether or not one is asked
    for; without a directory it drops itself at its first record outside Meta's cluster
    (a torch with ``git_version`` and no ``MAST_HPC_JOB_NAME``), so that one does not
    count. Any other handler does."""
    import torch.version

    internal = not hasattr(torch.version, "git_version") or os.getenv("MAST_HPC_JOB_NAME")
    for handler in logging.getLogger("torch.__trace").handlers:
        lazy = type(handler).__name__ == "LazyTraceHandler"
        idle = lazy and getattr(handler, "root_dir", 0) is None and not handler.stream
        if not idle or internal:
            return True
    return False


def _read(log: logging.Logger | None) -> bool:
    """Whether ``log`` (the module's artifact logger) or a structured trace reads what the
    graph-text functions emit; unknown (no such logger) counts as read."""
    return log is None or log.isEnabledFor(logging.INFO) or _tracing()


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def graph_text_when_logged() -> Iterator[None]:
    """Within: AOTAutograd's joint / forward / backward graph text is built only when a
    logger reads it (module docstring). Restored on exit; a no-op where torch has no such
    functions."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        yield
        return
    joint = getattr(module, "_log_joint_graph", None)
    fw_bw = getattr(module, "_log_fw_bw_graphs", None)
    if joint is None or fw_bw is None or hasattr(joint, "_aotdist_original"):
        yield
        return

    joint_log = getattr(module, "aot_joint_log", None)
    graphs_log = getattr(module, "aot_graphs_log", None)

    def log_joint_graph(*args, **kwargs):
        return joint(*args, **kwargs) if _read(joint_log) else None

    def log_fw_bw_graphs(*args, **kwargs):
        return fw_bw(*args, **kwargs) if _read(graphs_log) else (None, None)

    log_joint_graph._aotdist_original = joint
    module._log_joint_graph, module._log_fw_bw_graphs = log_joint_graph, log_fw_bw_graphs
    try:
        yield
    finally:
        module._log_joint_graph, module._log_fw_bw_graphs = joint, fw_bw
