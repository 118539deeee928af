"""Compile caches (Mega-Cache, C++ kernels, ISA probes, FX graph and AOTAutograd caches),
FSDP2, the store."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from aotdist._compat._base import attr, checked_on, unavailable

# --------------------------------------------------------------------- AOTAutograd


@checked_on("2.11", "2.14")
def autograd_cache_off() -> contextlib.AbstractContextManager:
    """A scope in which AOTAutograd's cache is neither read nor written
    (``torch._functorch.config.enable_autograd_cache = False``). A hit in that cache skips
    the graph compiler, so a hook on the compiler sees no graph; its key does not cover a
    custom ``inner_compile``. Where the key is missing: a no-op."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "enable_autograd_cache"):
        return contextlib.nullcontext()
    return functorch_config.patch(enable_autograd_cache=False)


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def loading_kernels_only():
    """A scope for loading saved C++ kernels: Inductor precompiles no shared header in it.

    Loading a cached C++ kernel, Inductor first precompiles its prefix header, once per
    process (``torch._inductor.codecache._precompile_header``): a preprocessor run and a
    checksum in child processes, 0.15 s of a 0.65 s warm start on a 2-core CPU, for a
    header only a kernel that compiles reads. The header is not part of a kernel's key
    (``cpp_cache_precompile_headers`` stays on: its define is), so in this scope the
    libraries load as they would; a kernel missing from the cache still compiles, from
    the same source and flags, without the precompiled copy of the header. Where torch
    has no such function: a no-op."""
    original = attr("torch._inductor.codecache", "_precompile_header")
    if original is None:
        yield
        return
    import torch._inductor.codecache as codecache

    def no_header(header: str, *args: Any, **kwargs: Any) -> str:
        return ""  # falsy: the build option's ``precompiled_header`` stays unused

    codecache._precompile_header = no_header
    try:
        yield
    finally:
        codecache._precompile_header = original


# --------------------------------------------------------------------- FSDP2


@checked_on("2.11", "2.14")
def fsdp_params_of(module: nn.Module) -> list[dict] | None:
    """FSDP2 parameters of one ``fully_shard``-ed module: for each, the unsharded tensor,
    the owning module and parameter name, and sharded / unsharded shapes.

    Reads ``module._get_fsdp_state()._fsdp_param_group.fsdp_params`` and each
    ``FSDPParam``'s ``_unsharded_param``, ``_module_info``, ``sharded_size`` and
    ``_orig_size``. ``None`` when these internals are missing;
    parameters not yet unsharded are left out.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    group = getattr(get_state(), "_fsdp_param_group", None)
    params = getattr(group, "fsdp_params", None)
    if group is not None and params is None:
        return None
    out = []
    for fp in params or []:
        unsharded = getattr(fp, "_unsharded_param", None)
        info = getattr(fp, "_module_info", None)
        if unsharded is None or info is None:
            continue
        out.append(
            {
                "unsharded": unsharded,
                "module": info.module,
                "param_name": info.param_name,
                "sharded_shape": list(getattr(fp, "sharded_size", ())),
                "unsharded_shape": list(getattr(fp, "_orig_size", ())),
            }
        )
    return out


@checked_on("2.11", "2.14")
def default_store() -> Any:
    """The default process group's key-value store
    (``torch.distributed.distributed_c10d._get_default_store``).

    Raises:
        TorchFeatureUnavailable: It is missing.
    """
    fn = attr("torch.distributed.distributed_c10d", "_get_default_store")
    if fn is None:
        raise unavailable("torch.distributed.distributed_c10d._get_default_store")
    return fn()


# --------------------------------------------------------------------- compile caches


@checked_on("2.11", "2.14")
def inductor_cache_dir() -> str:
    """Inductor's cache directory (``torch._inductor.runtime.cache_dir_utils.cache_dir``).

    Raises:
        TorchFeatureUnavailable: It is missing.
    """
    fn = attr("torch._inductor.runtime.cache_dir_utils", "cache_dir")
    if fn is None:
        raise unavailable("torch._inductor.runtime.cache_dir_utils.cache_dir")
    return fn()


@checked_on("2.11", "2.14")
def cpp_code_cache_keys() -> set[str] | None:
    """Keys of the C++ kernels this process compiled or loaded: the ``cache`` dicts of
    ``torch._inductor.codecache.CppCodeCache`` and its subclasses; a key's files are
    ``<cache_dir>/<key[1:3]>/<key>*``. ``None`` when missing."""
    root = attr("torch._inductor.codecache", "CppCodeCache")
    if root is None:
        return None
    keys: set[str] = set()
    todo = [root]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        keys.update(vars(cls).get("cache", {}))
    return keys


_PROBE_SYMBOL = b"_chk_kernel"  # every probe program defines __<isa>_chk_kernel*()
PROBE_LOAD_MARKER = ".so.load_ok"


@checked_on("2.11", "2.14")
def isa_probe_keys(root: str) -> set[str]:
    """Keys of the vector-ISA probe programs built in the Inductor cache dir ``root``: the
    ``<key>.cpp`` files that define one of ``torch._inductor.cpu_vec_isa``'s
    ``__*_chk_kernel`` functions (AVX2/AVX512 and the bf16, VNNI and AMX checks), plus
    the keys with a ``<key>.so.load_ok`` marker (torch 2.11 writes markers only inside
    :func:`remembered_isa_loads`)."""
    keys: set[str] = set()
    for sub in os.listdir(root) if os.path.isdir(root) else ():
        folder = os.path.join(root, sub)
        if len(sub) != 2 or not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name.endswith(PROBE_LOAD_MARKER):
                keys.add(name[: -len(PROBE_LOAD_MARKER)])
            elif name.endswith(".cpp") and os.path.getsize(os.path.join(folder, name)) < 8192:
                with open(os.path.join(folder, name), "rb") as fh:
                    if _PROBE_SYMBOL in fh.read():
                        keys.add(name[:-4])
    return keys


def _probe_library(isa: Any, code: str) -> str | None:
    """The ``.so`` path ``VecISA.check_build(isa, code)`` builds and loads (``None`` where
    this torch computes it differently): the same calls as that method."""
    try:
        from torch._inductor.codecache import write
        from torch._inductor.cpp_builder import (
            CppBuilder,
            CppTorchOptions,
            normalize_path_separator,
        )
        from torch._inductor.cpu_vec_isa import _get_isa_dry_compile_fingerprint

        # torch 2.11 keys the probe by ``_arch_flags``, which its AVX512 and AMX checks
        # extend while they run (bf16, fp16); ``build_arch_flags()`` would not say so.
        flags = getattr(isa, "_arch_flags", None)
        flags = isa.build_arch_flags() if flags is None else flags
        key, source = write(code, "cpp", extra=_get_isa_dry_compile_fingerprint(flags))
        builder = CppBuilder(
            key, [source], CppTorchOptions(vec_isa=isa, warning_all=False), os.path.dirname(source)
        )
        return normalize_path_separator(builder.get_target_file_path())
    except Exception:  # noqa: BLE001 - another torch: its own check runs unchanged
        return None


@checked_on("2.11", "2.14", note="2.11: wraps the check; 2.14: a no-op, torch remembers")
@contextlib.contextmanager
def remembered_isa_loads():
    """A scope in which Inductor's CPU vector-ISA load check is remembered across
    processes, as torch 2.14 and later do themselves.

    Before its first CPU kernel, Inductor builds a probe library per vector ISA and loads
    each in a child Python (which imports torch: 1-2 s each, about 8 per process on a
    2-core machine). torch 2.14+ skip the child once a ``<probe>.so.load_ok`` marker sits
    beside the library; torch 2.11 starts it in every process, a warm start included.
    On a torch whose ``VecISA.check_build`` writes no marker, this scope wraps it: a
    library with its marker passes, and a check that passes writes the marker, the same
    file the newer torch writes (the cache bundle carries it to machines with the same
    CPU only). A check that fails writes nothing. On torch 2.11 the scope wraps the check;
    on 2.14 torch remembers itself and the scope is a no-op.
    """
    cls = attr("torch._inductor.cpu_vec_isa", "VecISA")
    check = vars(cls).get("check_build") if cls is not None else None
    torch_remembers = ".load_ok" in getattr(getattr(check, "__code__", None), "co_consts", ())
    if check is None or torch_remembers or getattr(check, "_aotdist_remembers", False):
        yield
        return

    def check_build(self, code: str) -> bool:
        library = _probe_library(self, code)
        marker = os.path.splitext(library)[0] + PROBE_LOAD_MARKER if library else None
        if marker and os.path.isfile(library) and os.path.isfile(marker):
            return True
        passed = check(self, code)
        if passed and marker and os.path.isfile(library):
            with contextlib.suppress(OSError), open(marker, "w"):
                pass
        return passed

    check_build._aotdist_remembers = True
    cls.check_build = check_build
    try:
        yield
    finally:
        cls.check_build = check


@checked_on("2.11", "2.14", note="the same code on both")
@contextlib.contextmanager
def rerooted_autotune_lookups():
    """A scope in which a Triton kernel loaded from a cache entry looks up its autotuning
    result in this process's Inductor cache dir, not in the dir of the run that saved it.

    An FX graph cache entry carries its Triton kernels as pickled ``CachingAutotuner``s
    whose ``filename`` is the kernel's path in the saving run's cache dir. Loading one,
    ``recheck_autotune_cache`` reads the best config from ``dirname(filename)``; torch
    re-roots the kernel's binary (``reload_cubin_path``) but not that path. So a bundle
    loaded under another cache dir (another machine's, or a temporary one) misses the
    autotuning result the Mega-Cache installed under this one, benchmarks every config
    again, and writes the result back under the old path. This scope re-roots
    ``filename`` to ``<cache dir>/<its folder>/<its name>``, where the Mega-Cache installs
    it (``AutotuneCacheArtifact.populate_cache``). A no-op where the method is missing.
    """
    cls = attr("torch._inductor.runtime.triton_heuristics", "CachingAutotuner")
    recheck = vars(cls).get("recheck_autotune_cache") if cls is not None else None
    if recheck is None or getattr(recheck, "_aotdist_reroots", False):
        yield
        return

    def recheck_autotune_cache(self, *args, **kwargs):
        _reroot_kernel_file(self)
        return recheck(self, *args, **kwargs)

    recheck_autotune_cache._aotdist_reroots = True
    cls.recheck_autotune_cache = recheck_autotune_cache
    try:
        yield
    finally:
        cls.recheck_autotune_cache = recheck


def _reroot_kernel_file(kernel: Any) -> None:
    """Moves ``kernel.filename`` under this process's Inductor cache dir (its last two
    path parts kept) when it points elsewhere; see :func:`rerooted_autotune_lookups`."""
    filename = getattr(kernel, "filename", None)
    if not isinstance(filename, str) or not filename:
        return
    root = os.path.abspath(inductor_cache_dir())
    path = os.path.abspath(filename)
    if os.path.commonpath([root, path]) == root:
        return
    folder, name = os.path.split(path)
    kernel.filename = os.path.join(root, os.path.basename(folder), name)


@checked_on("2.11", "2.14")
def merge_mega_cache(saved: bytes) -> bytes:
    """``torch.compiler.save_cache_artifacts()`` bytes with the records merged by kind.

    Those bytes append one ``(kind, artifacts)`` record per call since the process began,
    and ``load_cache_artifacts`` keeps only the *last* record of each kind; merging keeps
    every artifact. Uses ``torch.compiler._cache`` (``AppendingByteSerializer``,
    ``CacheArtifactManager``, ``_(de)serialize_single_cache``).

    Raises:
        TorchFeatureUnavailable: Those internals are missing.
    """
    try:
        from torch.compiler._cache import (
            AppendingByteSerializer,
            CacheArtifactManager,
            _deserialize_single_cache,
            _serialize_single_cache,
        )
    except ImportError as exc:
        raise unavailable("torch.compiler._cache serializers", exc) from exc
    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, list] = {}
    for kind, artifacts in AppendingByteSerializer.to_list(
        saved, deserialize_fn=_deserialize_single_cache
    ):
        seen = merged.setdefault(kind, [])
        seen.extend(a for a in artifacts if a not in seen)
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend(merged.items())
    return out.to_bytes()


@checked_on("2.11", "2.14")
def wrap_fx_graph_cache(
    wrap_lookup: Callable[[Callable], Callable],
    wrap_save: Callable[[Callable], Callable] | None = None,
) -> Callable[[], None]:
    """Wraps Inductor's FX graph cache lookup (``FxGraphCache.load_with_key``) and, if
    given, its save (``FxGraphCache._save_graph``), process-wide until the returned
    function puts the originals back.

    Raises:
        TorchFeatureUnavailable: The class or those static methods are missing.
    """
    cls = attr("torch._inductor.codecache", "FxGraphCache")
    names = ("load_with_key", "_save_graph")
    if cls is None or not all(n in vars(cls) for n in names):
        raise unavailable("FxGraphCache.load_with_key / _save_graph")
    originals = {n: vars(cls)[n] for n in names}
    cls.load_with_key = staticmethod(wrap_lookup(cls.load_with_key))
    if wrap_save is not None:
        cls._save_graph = staticmethod(wrap_save(cls._save_graph))

    def restore() -> None:
        for name, original in originals.items():
            setattr(cls, name, original)

    return restore


_AUTOGRAD_FUNCTION_HOP = "torch.ops.higher_order.autograd_function_apply"


@checked_on("2.11", "2.14")
def cacheable_autograd_functions(tag: str) -> dict:
    """Inductor options under which graphs that hold custom ``autograd.Function``s (traced
    as the ``autograd_function_apply`` higher-order op, forward and backward subgraphs in
    the graph) are cached by AOTAutograd and the FX graph cache, which otherwise bypass
    them; ``tag`` goes into the cache key. Keeps what Inductor's config marks already.
    ``{}`` where this torch has no such option."""
    config = attr("torch._inductor", "config")
    marked = getattr(config, "unsafe_marked_cacheable_functions", None)
    if not isinstance(marked, dict):
        return {}
    return {"unsafe_marked_cacheable_functions": {**marked, _AUTOGRAD_FUNCTION_HOP: tag}}
