"""Compiler internals: ``nn.Module``'s call, Dynamo, AOTAutograd, Inductor (its compiled call
slot: :mod:`aotdist._compat.calls`)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

try:  # graph-mode FSDP's traceable collectives (see functional_collectives)
    import torch.distributed._functional_collectives as _funcol
except ImportError:  # a torch built without distributed support
    _funcol = None

from aotdist._compat._base import attr, checked_on, unavailable

# --------------------------------------------------------------------- nn.Module internals


def _root_call(self, *args, **kwargs):
    return self._call_impl(*args, **kwargs)


@checked_on("2.11", "2.14")
def root_call_function(label: str = "model") -> Callable:
    """A fresh function ``f(model, *args, **kwargs)`` calling ``model._call_impl``: what
    graph mode compiles.

    ``torch.compile(model._call_impl)`` only traces the root when Dynamo traces the root's
    ``forward``. A root whose ``forward`` lives in torch (``nn.Sequential``) is in Dynamo's
    skip files: torch 2.14 wraps such a ``_call_impl`` in a traceable frame itself
    (``OptimizedModule._should_wrap_module_call_impl``), torch 2.11 does not, so there the
    root ran eagerly and each region instance was compiled as a frame of its own. Tracing
    from a function of ours, which calls ``_call_impl``, makes the whole model one graph on
    both. Each call returns a function with a code object and name of its own (Dynamo keys
    frames and automatic-dynamic profiles by code), and the model is its ``self``, so graph sources read
    ``L['self'].<fqn>``.
    """
    from aotdist._compat.codes import unique_code_function

    return unique_code_function(_root_call, label)


@checked_on("2.11", "2.14")
def functional_collectives():
    """``torch.distributed._functional_collectives``: the traceable collectives graph-mode
    FSDP puts in the graph. ``all_gather_single`` / ``reduce_scatter_single``
    are the newer names (2.14); 2.11 has ``all_gather_tensor`` /
    ``reduce_scatter_tensor`` only: :mod:`aotdist._compat.distributed` picks one.
    Imported with this module, not here: Dynamo cannot trace ``importlib`` inside the
    graph that calls this."""
    if _funcol is None:
        raise unavailable(
            "torch.distributed._functional_collectives (a torch built with distributed support)"
        )
    return _funcol


@checked_on("2.11", "2.14")
def tree_map(fn: Callable, tree: Any) -> Any:
    """``torch.utils._pytree.tree_map``: maps over nested outputs."""
    return _pytree.tree_map(fn, tree)


@checked_on("2.11", "2.14")
def param_slots(module: nn.Module) -> dict:
    """``module._parameters``: the module's own parameter dict, read and written in place
    (graph-mode FSDP swaps DTensor parameters and their local shards there). A plain
    function, so Dynamo traces through it."""
    return module._parameters


# --------------------------------------------------------------------- Dynamo


@checked_on("2.11", "2.14")
def optimized_module_type() -> type | None:
    """``torch._dynamo.eval_frame.OptimizedModule``, or ``None``."""
    return attr("torch._dynamo.eval_frame", "OptimizedModule")


@checked_on("2.11", "2.14")
def lookup_backend(name: str) -> Callable:
    """``torch._dynamo.lookup_backend(name)``.

    Raises:
        TorchFeatureUnavailable: The lookup function is missing.
    """
    fn = attr("torch._dynamo", "lookup_backend")
    if fn is None:
        raise unavailable("torch._dynamo.lookup_backend")
    return fn(name)


@checked_on("2.11", "2.14")
def inductor_wrapper(mode: str | None, options: dict | None, dynamic: bool | None) -> Callable:
    """``torch._TorchCompileInductorWrapper``: Inductor with options as config patches
    scoped to this backend's compiles, what ``torch.compile`` builds.

    Raises:
        TorchFeatureUnavailable: The wrapper class is missing.
    """
    cls = getattr(torch, "_TorchCompileInductorWrapper", None)
    if cls is None:
        raise unavailable("torch._TorchCompileInductorWrapper")
    return cls(mode, options, dynamic)


@checked_on("2.11", "2.14")
def named_backend_wrapper(
    backend: str, mode: str | None, options: dict | None, dynamic: bool | None
) -> Callable:
    """``torch._TorchCompileWrapper`` for a registered backend name.

    Raises:
        TorchFeatureUnavailable: The wrapper class is missing.
    """
    cls = getattr(torch, "_TorchCompileWrapper", None)
    if cls is None:
        raise unavailable("torch._TorchCompileWrapper")
    return cls(backend, mode, options, dynamic)


@checked_on("2.11", "2.14")
def higher_order_operator_type() -> type | None:
    """``torch._ops.HigherOrderOperator``, or ``None``."""
    return attr("torch._ops", "HigherOrderOperator")


@checked_on("2.11", "2.14")
def current_frame_locals() -> dict | None:
    """The locals of the frame Dynamo is compiling now
    (``InstructionTranslator.current_tx().f_locals``); ``None`` outside a frame compile or
    when the internal is missing."""
    translator = attr("torch._dynamo.symbolic_convert", "InstructionTranslator")
    try:
        return translator.current_tx().f_locals
    except Exception:  # noqa: BLE001 - not inside a Dynamo frame compile, or renamed
        return None


@checked_on("2.11", "2.14")
def fake_mode_of(values: list) -> Any:
    """The ``FakeTensorMode`` the first fake tensor in ``values`` belongs to (its
    ``fake_mode``; not the tracing context's, which can be another), or
    ``None``."""
    fake = attr("torch._subclasses.fake_tensor", "FakeTensor")
    for value in values:
        if fake is not None and isinstance(value, fake):
            return value.fake_mode
    return None


@checked_on("2.11", "2.14")
def fresh_unbacked_ignored(mode: Any) -> contextlib.AbstractContextManager:
    """Within: the unbacked symbols that ``mode``'s ``ShapeEnv`` creates (a ``.tolist()``
    run on fake tensors outside any trace) are not left pending, for the next trace in
    that ``ShapeEnv`` to fail on (``PendingUnbackedSymbolNotFound``); a no-op without
    one."""
    ignore = getattr(getattr(mode, "shape_env", None), "ignore_fresh_unbacked_symbols", None)
    return ignore() if ignore is not None else contextlib.nullcontext()


@checked_on("2.11", "2.14")
def fake_constant(value: Any) -> torch.Tensor | None:
    """The real tensor a fake tensor made from a constant (``torch.tensor(2.0)`` under a
    ``FakeTensorMode``) carries beside it (its ``constant``), or ``None``."""
    fake = attr("torch._subclasses.fake_tensor", "FakeTensor")
    if fake is None or not isinstance(value, fake):
        return None
    return getattr(value, "constant", None)


class _Writes:
    """The storages the aten ops run under :func:`recorded_writes` wrote."""

    def __init__(self) -> None:
        self.keys: set = set()

    @staticmethod
    def key(tensor: torch.Tensor) -> Any:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(tensor.untyped_storage())

    def wrote(self, tensor: torch.Tensor) -> bool:
        """Whether an op wrote ``tensor``'s storage (through it or through a view)."""
        return self.key(tensor) in self.keys


# Ops whose schema does not declare the running statistics they update in training
# (arguments 3 and 4, when argument 5, ``training``, is true); torch's functionalization
# special-cases them the same way.
_UNDECLARED_BATCH_NORM_WRITES = ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def recorded_writes() -> Iterator[_Writes]:
    """Records every tensor an aten op writes in place, as its schema declares
    (``Tensor(a!)``: ``add_``, ``copy_``...), and the running statistics of the batch-norm
    ops whose schema does not declare them (``native_batch_norm``; neither moves a version
    counter), with a ``TorchDispatchMode``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    writes = _Writes()

    def note(value: object) -> None:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                writes.keys.add(writes.key(t))

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            schema = getattr(func, "_schema", None)
            for i, arg in enumerate(schema.arguments if schema is not None else ()):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    note(args[i] if i < len(args) else kwargs.get(arg.name))
            name = getattr(schema, "name", "").split("::")[-1]
            if name in _UNDECLARED_BATCH_NORM_WRITES and len(args) > 5 and args[5]:
                note(args[3:5])
            return func(*args, **kwargs)

    with Recorder():
        yield writes


@checked_on("2.11", "2.14")
def compilation_metrics() -> list | None:
    """``torch._dynamo.utils.get_compilation_metrics()`` records, or ``None``
    when that function is missing."""
    fn = attr("torch._dynamo.utils", "get_compilation_metrics")
    return None if fn is None else list(fn())


@checked_on("2.11", "2.14", note="every field aotdist reads is present on both")
def compilation_metric_fields() -> frozenset[str] | None:
    """The field names of ``torch._dynamo.utils.CompilationMetrics`` on this torch, or
    ``None`` when the class is missing. aotdist reads ``dynamo_``, ``aot_autograd_``,
    ``inductor_`` and ``backward_cumulative_compile_time_us``, ``is_forward``,
    ``recompile_reason``, ``fail_type`` and ``fail_reason``; a figure
    whose field is missing is reported as unavailable, never as 0."""
    cls = attr("torch._dynamo.utils", "CompilationMetrics")
    fields = getattr(cls, "__dataclass_fields__", None)
    return frozenset(fields) if fields is not None else None


@checked_on("2.11", "2.14")
def dynamo_counters(kind: str) -> dict[str, int]:
    """A copy of ``torch._dynamo.utils.counters[kind]`` (``graph_break``,
    ``unimplemented``); empty when the counters are missing."""
    counters = attr("torch._dynamo.utils", "counters")
    return dict(counters[kind]) if counters is not None else {}


@checked_on("2.11", "2.14")
def compilation_time_metrics() -> dict | None:
    """``torch._dynamo.utils.compilation_time_metrics`` (phase name -> seconds list),
    or ``None``."""
    return attr("torch._dynamo.utils", "compilation_time_metrics")


@checked_on("2.11", "2.14")
def import_compiler_stack() -> None:
    """Imports Dynamo, AOTAutograd and Inductor's compile path, so that a measurement
    after it does not count their import time."""
    for name in (
        "torch._dynamo.utils",
        "torch._functorch.aot_autograd",
        "torch._inductor.compile_fx",
    ):
        importlib.import_module(name)


@checked_on("2.11", "2.14")
def probe_cpu_isa() -> bool:
    """Runs Inductor's CPU vector-ISA probes now (``torch._inductor.cpu_vec_isa.
    pick_vec_isa``): a few small C++ builds and loads, once per process
    and Inductor cache dir, which the first CPU kernel would otherwise run (a passed load
    check remembered: :func:`~aotdist._compat.caches.remembered_isa_loads`). Returns
    whether this torch has the probe function."""
    from aotdist._compat.caches import remembered_isa_loads

    fn = attr("torch._inductor.cpu_vec_isa", "pick_vec_isa")
    if fn is None:
        return False
    with remembered_isa_loads():
        fn()
    return True


@checked_on("2.11", "2.14")
def dynamo_config_patch(**changes: Any) -> contextlib.AbstractContextManager:
    """``torch._dynamo.config.patch(**changes)``: scoped, restored on exit."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(**changes)


@checked_on("2.11", "2.14")
def functorch_joint_pass(fn: Callable) -> contextlib.AbstractContextManager:
    """Within, AOTAutograd runs ``fn(joint_module, joint_inputs) -> joint_module`` on every
    joint graph before partitioning it, after a pass already set there
    (``torch._functorch.config.joint_custom_pass``): scoped, restored on
    exit. Any backend built on AOTAutograd (``aot_eager``) runs it."""
    import torch._functorch.config as functorch_config

    user = functorch_config.joint_custom_pass
    if callable(user):

        def chained(joint, inputs):
            return fn(user(joint, inputs), inputs)

        return functorch_config.patch(joint_custom_pass=chained)
    return functorch_config.patch(joint_custom_pass=fn)


@checked_on("2.11", "2.14")
def tracing_context() -> Any | None:
    """``torch._guards.TracingContext.try_get()``: the AOTAutograd tracing context of the
    graph being compiled, or ``None``."""
    cls = attr("torch._guards", "TracingContext")
    return cls.try_get() if cls is not None else None


@checked_on("2.11", "2.14")
def own_tracing_context() -> contextlib.AbstractContextManager:
    """A fresh AOTAutograd tracing context on the current one's fake mode, entered for
    the block: what a graph compiled inside another's compile reports (output strides)
    stays its own (``torch._guards.tracing``).

    Raises:
        TorchFeatureUnavailable: ``TracingContext`` or ``tracing`` is missing.
    """
    cls, enter = attr("torch._guards", "TracingContext"), attr("torch._guards", "tracing")
    if cls is None or enter is None:
        raise unavailable("torch._guards.TracingContext / tracing")
    outer = cls.try_get()
    return enter(cls(outer.fake_mode if outer is not None else None))


@checked_on("2.11", "2.14")
def boxed_function(fn: Callable) -> Callable:
    """``fn`` called with one list of arguments, as AOTAutograd calls a compiled graph
    (``torch._functorch.aot_autograd.make_boxed_func``)."""
    make = attr("torch._functorch.aot_autograd", "make_boxed_func")
    if make is not None:
        return make(fn)

    def boxed(args):
        return fn(*args)

    boxed._boxed_call = True
    return boxed


@checked_on("2.11", "2.14")
def compiled_graph_callable(compiled: Callable) -> Callable:
    """The generated code inside an Inductor ``CompiledFxGraph`` (its
    ``current_callable``), called with the same list of inputs without the per-call
    bookkeeping of the first call's compile; ``compiled`` itself for
    any other kind of output."""
    run = getattr(compiled, "current_callable", None)
    return run if callable(run) else compiled


@checked_on("2.11", "2.14")
def is_storage_resize(node: torch.fx.Node) -> bool:
    """Whether ``node`` resizes a storage (``inductor.resize_storage_bytes_``, matched by
    name)."""
    return node.op == "call_function" and "resize_storage_bytes_" in str(node.target)


@checked_on("2.11", "2.14")
def is_traceable_wrapper_subclass(t: Any) -> bool:
    """Whether ``t`` is a traceable tensor subclass (``__tensor_flatten__``).
    Probes the protocol if the helper is missing."""
    fn = attr("torch.utils._python_dispatch", "is_traceable_wrapper_subclass")
    if fn is not None:
        return fn(t)
    return isinstance(t, torch.Tensor) and hasattr(t, "__tensor_flatten__")


@checked_on("2.11", "2.14")
def tree_leaves(tree: Any) -> list:
    """``torch.utils._pytree.tree_leaves``."""
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tree)


# --------------------------------------------------------------------- AOTAutograd / Inductor


@checked_on("2.11", "2.14")
def aot_eager_parts() -> tuple[Callable, Callable]:
    """``(aot_eager, boxed_nop)`` from ``torch._dynamo.backends.debugging``: the
    ``aot_eager`` backend and its no-op graph compiler.

    Raises:
        TorchFeatureUnavailable: Either is missing.
    """
    aot_eager = attr("torch._dynamo.backends.debugging", "aot_eager")
    boxed_nop = attr("torch._dynamo.backends.debugging", "boxed_nop")
    if aot_eager is None or boxed_nop is None:
        raise unavailable("torch._dynamo.backends.debugging.aot_eager / boxed_nop")
    return aot_eager, boxed_nop


@checked_on("2.11", "2.14")
def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass``.

    Raises:
        TorchFeatureUnavailable: It is missing.
    """
    cls = attr("torch._inductor.custom_graph_pass", "CustomGraphPass")
    if cls is None:
        raise unavailable("torch._inductor.custom_graph_pass.CustomGraphPass")
    return cls


@checked_on("2.11", "2.14")
def inductor_joint_pre_pass() -> Any:
    """The current ``torch._inductor.config.joint_custom_pre_pass``."""
    config = importlib.import_module("torch._inductor.config")
    return getattr(config, "joint_custom_pre_pass", None)


@checked_on("2.11", "2.14")
def inductor_joint_post_pass() -> Any:
    """The current ``torch._inductor.config.joint_custom_post_pass``: Inductor runs it on
    the joint graph after its own joint passes, just before partitioning."""
    config = importlib.import_module("torch._inductor.config")
    return getattr(config, "joint_custom_post_pass", None)


@checked_on("2.11", "2.14")
def inductor_post_grad_post_pass() -> Any:
    """The current ``torch._inductor.config.post_grad_custom_post_pass``:
    ``None``, one pass, or (torch 2.14) a list of passes."""
    config = importlib.import_module("torch._inductor.config")
    return getattr(config, "post_grad_custom_post_pass", None)


@checked_on("2.11", "2.14")
def inductor_buffer_reuse_default() -> bool:
    """The current ``torch._inductor.config.allow_buffer_reuse``."""
    config = importlib.import_module("torch._inductor.config")
    return bool(getattr(config, "allow_buffer_reuse", True))


@checked_on("2.11", "2.14")
def inductor_takes_pass_lists() -> bool:
    """Whether Inductor's custom-pass slots take a list of passes
    (``torch._inductor.custom_graph_pass.get_custom_graph_passes``: torch 2.14; absent in
    2.11)."""
    return attr("torch._inductor.custom_graph_pass", "get_custom_graph_passes") is not None


@checked_on("2.11", "2.14")
def inductor_disable_buffer_reuse() -> None:
    """Sets ``torch._inductor.config.allow_buffer_reuse = False`` in the config scope
    being compiled.

    Meant for a post-grad pass of a backend whose options set ``allow_buffer_reuse``:
    ``compile_fx`` wraps every inner compile (forward, and the backward compiled later)
    in ``config.patch(options)``, so the value goes back when that one graph is compiled.
    """
    config = importlib.import_module("torch._inductor.config")
    config.allow_buffer_reuse = False


@checked_on("2.11", "2.14")
def inductor_config_keys() -> frozenset[str]:
    """Every key of ``torch._inductor.config`` (a nested config's as ``outer.inner``), read
    from the config module's ``_config`` table; to probe for options."""
    config = importlib.import_module("torch._inductor.config")
    table = getattr(config, "_config", None)
    if not isinstance(table, dict):
        raise unavailable("torch._inductor.config._config")
    return frozenset(table)


@checked_on("2.11", "2.14", note="the signatures aotdist calls are the same on both")
def fx_bucketing() -> Any:
    """``torch._inductor.fx_passes.bucketing``: ``bucket_all_gather_by_mb``,
    ``merge_all_gather``, ``bucket_reduce_scatter_by_mb``, ``merge_reduce_scatter``,
    ``bucket_all_reduce_by_mb``, ``merge_all_reduce_bucket``.

    Raises:
        TorchFeatureUnavailable: The module or one of those is missing.
    """
    try:
        mod = importlib.import_module("torch._inductor.fx_passes.bucketing")
    except ImportError:
        mod = None
    names = (
        "bucket_all_gather_by_mb",
        "merge_all_gather",
        "bucket_reduce_scatter_by_mb",
        "merge_reduce_scatter",
        "bucket_all_reduce_by_mb",
        "merge_all_reduce_bucket",
    )
    if mod is None or not all(hasattr(mod, n) for n in names):
        raise unavailable("torch._inductor.fx_passes.bucketing." + " / ".join(names))
    return mod


@checked_on("2.11", "2.14")
def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """``torch._inductor.pattern_matcher.stable_topological_sort``.

    Raises:
        TorchFeatureUnavailable: It is missing.
    """
    fn = attr("torch._inductor.pattern_matcher", "stable_topological_sort")
    if fn is None:
        raise unavailable("torch._inductor.pattern_matcher.stable_topological_sort")
    fn(graph)


@checked_on("2.11", "2.14")
def inductor_compile_fx() -> tuple[Callable, Callable]:
    """``(compile_fx, compile_fx_inner)`` from ``torch._inductor.compile_fx``; aotdist
    calls ``compile_fx(gm, inputs, inner_compile=..., config_patches=...)``.

    Raises:
        TorchFeatureUnavailable: Either is missing.
    """
    outer = attr("torch._inductor.compile_fx", "compile_fx")
    inner = attr("torch._inductor.compile_fx", "compile_fx_inner")
    if outer is None or inner is None:
        raise unavailable("torch._inductor.compile_fx.compile_fx / compile_fx_inner")
    return outer, inner
