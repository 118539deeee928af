"""Compile artifacts shared across ranks and across runs (``cache`` config section).

A *bundle* is one file: a JSON header (format, invalidation key, SHA-256 of the payload)
and PyTorch's Mega-Cache bytes plus the compiled C++ kernel files they load.

* :func:`load` (``parallelize`` calls it, before the first compile) checks and installs a
  bundle; any problem is a :class:`CacheWarning` and a normal compile.
* :func:`save` (after the first training step; the callbacks call it) writes it atomically;
  :func:`save_after_first_step` hooks it onto an optimizer's first step.
* ``shared`` mode: rank 0 reads, broadcasts and alone saves the bundle; in a cold run the
  other ranks load rank 0's artifacts instead of compiling (:mod:`~aotdist.cache.share`).

Inductor's own cache keys still guard every entry, so a bundle never serves a stale
kernel. Modules: ``bundle`` (file format), ``artifacts`` (contents), ``share``, ``store``
(``load`` / ``save``, invalidation key). Details: docs/internals.md.
"""

from aotdist.cache.store import STATE_ATTR, CacheLoad, cache_key, load, save, save_after_first_step
from aotdist.errors import CacheWarning

__all__ = [
    "STATE_ATTR",
    "CacheLoad",
    "CacheWarning",
    "cache_key",
    "load",
    "save",
    "save_after_first_step",
]
