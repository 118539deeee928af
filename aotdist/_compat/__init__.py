"""Every private torch / Accelerate internal aotdist touches, in one place.

Each accessor names the torch versions it was checked on (2.11 and 2.15), probes for the
feature (``hasattr`` / try-import) rather than comparing versions, and when the internal
is missing it says so: it returns ``None`` (the caller reports "unavailable" / "n/a") or
raises :class:`~aotdist.errors.TorchFeatureUnavailable` naming the versions it works
on, never a guessed value. ``tests/unit/test_architecture.py`` fails on a private access
anywhere else in the library. Public APIs are used where they exist
(``torch.compiler.list_backends``, ``torch.distributed.fsdp.FSDPModule``...).

Grouped by what they reach into: :mod:`~aotdist._compat.compiler` (``nn.Module``'s
compiled call, Dynamo, AOTAutograd, Inductor), :mod:`~aotdist._compat.caches` (compile
caches, FSDP2, the process group's store), :mod:`~aotdist._compat.subgraphs` (a scoped
fix in Dynamo's subgraph dedup), :mod:`~aotdist._compat.precompile` (``aot_compile``),
:mod:`~aotdist._compat.autograd` (the engine), :mod:`~aotdist._compat.accelerate`.
"""

from aotdist._compat._base import CHECKED_ON
from aotdist._compat.accelerate import (
    accelerate_old_forward,
    accelerator_state_initialized,
    is_accelerate_prepared,
    mark_accelerate_prepared,
    set_accelerate_old_forward,
)
from aotdist._compat.autograd import in_autograd_backward
from aotdist._compat.caches import (
    autograd_cache_off,
    cacheable_autograd_functions,
    cpp_code_cache_keys,
    default_store,
    fsdp_params_of,
    inductor_cache_dir,
    isa_probe_keys,
    merge_mega_cache,
    remembered_isa_loads,
    rerooted_autotune_lookups,
    wrap_fx_graph_cache,
)
from aotdist._compat.codes import (
    dynamo_error_types,
    is_region_code,
    maybe_mark_dynamic,
    region_options,
    reuse_refusals,
    unique_code_function,
)
from aotdist._compat.compiler import (
    aot_eager_parts,
    call_impl,
    compilation_metric_fields,
    compilation_metrics,
    compilation_time_metrics,
    compiled_call,
    current_frame_locals,
    custom_graph_pass_base,
    dynamo_config_patch,
    dynamo_counters,
    functional_collectives,
    fx_bucketing,
    higher_order_operator_type,
    import_compiler_stack,
    inductor_buffer_reuse_default,
    inductor_compile_fx,
    inductor_config_keys,
    inductor_disable_buffer_reuse,
    inductor_joint_pre_pass,
    inductor_post_grad_post_pass,
    inductor_takes_pass_lists,
    inductor_wrapper,
    is_traceable_wrapper_subclass,
    lookup_backend,
    named_backend_wrapper,
    optimized_module_type,
    param_slots,
    probe_cpu_isa,
    root_call_function,
    set_compiled_call,
    stable_topological_sort,
    tracing_context,
    tree_leaves,
    tree_map,
)
from aotdist._compat.precompile import (
    PrecompiledFunction,
    aot_compile,
    precompile_unavailable,
    stand_in_parameters,
    unsaved_in_guards,
    unserializable_guard_types,
)
from aotdist._compat.subgraphs import (
    cached_subgraph_schemas,
    recomputable_reductions,
    tolerant_subgraph_dedup,
)

__all__ = [
    "unique_code_function",
    "is_region_code",
    "reuse_refusals",
    "region_options",
    "maybe_mark_dynamic",
    "dynamo_error_types",
    "CHECKED_ON",
    "PrecompiledFunction",
    "aot_compile",
    "precompile_unavailable",
    "stand_in_parameters",
    "unsaved_in_guards",
    "unserializable_guard_types",
    "accelerate_old_forward",
    "accelerator_state_initialized",
    "aot_eager_parts",
    "autograd_cache_off",
    "cacheable_autograd_functions",
    "cached_subgraph_schemas",
    "call_impl",
    "compilation_metric_fields",
    "compilation_metrics",
    "compilation_time_metrics",
    "compiled_call",
    "functional_collectives",
    "fx_bucketing",
    "param_slots",
    "probe_cpu_isa",
    "recomputable_reductions",
    "remembered_isa_loads",
    "rerooted_autotune_lookups",
    "cpp_code_cache_keys",
    "current_frame_locals",
    "custom_graph_pass_base",
    "default_store",
    "dynamo_config_patch",
    "dynamo_counters",
    "fsdp_params_of",
    "higher_order_operator_type",
    "import_compiler_stack",
    "in_autograd_backward",
    "inductor_cache_dir",
    "inductor_compile_fx",
    "inductor_config_keys",
    "inductor_disable_buffer_reuse",
    "inductor_joint_pre_pass",
    "inductor_post_grad_post_pass",
    "inductor_buffer_reuse_default",
    "inductor_takes_pass_lists",
    "inductor_wrapper",
    "is_accelerate_prepared",
    "is_traceable_wrapper_subclass",
    "isa_probe_keys",
    "lookup_backend",
    "mark_accelerate_prepared",
    "merge_mega_cache",
    "named_backend_wrapper",
    "optimized_module_type",
    "root_call_function",
    "set_accelerate_old_forward",
    "set_compiled_call",
    "stable_topological_sort",
    "tolerant_subgraph_dedup",
    "tracing_context",
    "tree_leaves",
    "tree_map",
    "wrap_fx_graph_cache",
]
