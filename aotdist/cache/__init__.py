"""Compile artifacts shared across ranks and across runs (``cache`` config section).

A *bundle* is one file: a JSON header (format, invalidation key, SHA-256 of the payload)
and a payload of PyTorch's Mega-Cache bytes (``torch.compiler.save_cache_artifacts``:
FX graph and AOTAutograd cache entries) plus the compiled C++ kernel files those
entries load (on CPU the Mega-Cache holds the kernels' source only; without the
binaries a warm start would still run the C++ compiler).

* :func:`load` (``parallelize`` calls it, before the first compile) reads the bundle,
  checks key and checksum, writes its kernel files into Inductor's cache directory and
  hot-loads the Mega-Cache. Any problem is a :class:`CacheWarning` and a normal compile.
* :func:`save` (after the first training step, when the backward is compiled too; the
  callbacks call it) writes the bundle atomically.
* ``shared`` mode: rank 0 reads the bundle and broadcasts it over the process group;
  rank 0 alone saves. In a cold run, :class:`_CompileSharing` lets the other ranks wait
  for rank 0's artifacts of each graph (through the process group's store) and load
  them instead of compiling; the graph's own FX cache key decides, so a graph whose key
  differs on this rank is compiled here, with a warning that says so.

Inductor's own cache keys (content hashes of graph, inputs, config and compiler) still
guard every entry, so a bundle can never serve a stale kernel: at worst it misses.

Modules: :mod:`~aotdist.cache.bundle` (the file format), :mod:`~aotdist.cache.artifacts`
(what a bundle holds: Mega-Cache bytes, kernel files, ISA probes),
:mod:`~aotdist.cache.share` (rank 0's compiles shared in a cold run) and
:mod:`~aotdist.cache.store` (``load`` / ``save``, the invalidation key). The cache takes
the model's region plan and config as inputs; it imports nothing above it.
"""

from aotdist.cache.store import STATE_ATTR, CacheLoad, cache_key, load, save
from aotdist.errors import CacheWarning

__all__ = ["STATE_ATTR", "CacheLoad", "CacheWarning", "cache_key", "load", "save"]
