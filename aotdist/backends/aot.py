"""AOTAutograd backends with aotdist's graph passes and a hook on every graph they compile.

:func:`aot_backend` rebuilds ``aot_eager`` or ``inductor`` from their AOTAutograd parts
so that aotdist sees each forward and backward graph *after* functionalization and
partitioning (the capture pipeline records them there) and can repair them before the
real compiler runs. The repair, :func:`fix_storage_resizes`, moves the final
``resize_storage_bytes_(copy, 0)`` of the FSDP storage-resize pattern onto the input
itself and drops the copy-back that would crash, as eager does. Backends aotdist cannot
rebuild run such graphs eagerly. :func:`resolve_conjugate_inputs` materializes a complex
tensor's lazy conjugate (or negative) view before it enters a region call, which
``invoke_subgraph`` has no kernel for. Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from aotdist import _compat
from aotdist.backends.named import add_joint_pass, inductor_options
from aotdist.backends.partition import inductor_partitioner, region_partition
from aotdist.backends.recompute import boundaries_saved
from aotdist.backends.regional import regional_inner_compile

# on_graph(gm, kind) with kind "forward", "backward" or "inference"
GraphHook = Callable[[torch.fx.GraphModule, str], None]


def storage_resized_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Placeholders of ``gm`` whose storage is resized inside it (the FSDP pattern),
    directly or in the body of a higher-order op it calls with them (the region call
    and its moved resizes under activation checkpointing sit in such a body).

    Works on Dynamo graphs (before AOTAutograd) and on AOTAutograd graphs.
    """
    found: list[str] = []
    for node in gm.graph.nodes:
        if (
            _compat.is_storage_resize(node)
            and node.args
            and isinstance(node.args[0], torch.fx.Node)
        ):
            targets = [node.args[0]]
        elif node.op == "call_function" and node.args and _body(gm, node.args[0]) is not None:
            inner = storage_resized_inputs(_body(gm, node.args[0]))
            names = [n.name for n in _body(gm, node.args[0]).graph.find_nodes(op="placeholder")]
            operands = node.args[1:]
            targets = [operands[names.index(n)] for n in inner if names.index(n) < len(operands)]
        else:
            continue
        for target in targets:
            if (
                isinstance(target, torch.fx.Node)
                and target.op == "placeholder"
                and target.name not in found
            ):
                found.append(target.name)
    return found


def _body(gm: torch.fx.GraphModule, arg: object) -> torch.fx.GraphModule | None:
    """The graph module a higher-order op's first argument names, if it is one."""
    if not (isinstance(arg, torch.fx.Node) and arg.op == "get_attr"):
        return None
    sub = getattr(gm, str(arg.target), None)
    return sub if isinstance(sub, torch.fx.GraphModule) else None


def fix_storage_resizes(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[str]:
    """Applies a final ``resize_storage_bytes_(copy, 0)`` to the input, not its copy.

    Pattern (functionalized graph, input mutations kept in the graph)::

        copy = aten.copy(primal, src)                 # functional copy_ into the input
        ...uses of copy...
        resize_storage_bytes_(copy, 0)                # meant for the input
        copy_(primal, copy)                           # copy-back from zero bytes: segfault

    becomes ``...uses of copy...; resize_storage_bytes_(primal, 0)``.

    Args:
        gm: A graph module, or a bare graph (Inductor's joint-graph pass hands one).

    Returns:
        The placeholders repaired (empty when the pattern is absent; ``gm`` unchanged).
    """
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    fixed = []
    for node in list(graph.nodes):
        if not (_compat.is_storage_resize(node) and len(node.args) >= 2 and node.args[1] == 0):
            continue
        value = node.args[0]
        if not isinstance(value, torch.fx.Node) or value.op == "placeholder":
            continue
        copy_back = next(
            (
                u
                for u in value.users
                if u.op == "call_function"
                and u.target is torch.ops.aten.copy_.default
                and u.args[1] is value
                and isinstance(u.args[0], torch.fx.Node)
                and u.args[0].op == "placeholder"
                and not u.users
            ),
            None,
        )
        if copy_back is None:
            continue
        primal = copy_back.args[0]
        with graph.inserting_before(copy_back):
            graph.call_function(node.target, (primal, 0))
        graph.erase_node(copy_back)
        graph.erase_node(node)
        fixed.append(primal.name)
    if fixed:
        graph.lint()
        if isinstance(gm, torch.fx.GraphModule):
            gm.recompile()
    return fixed


_RESOLVE = (
    ("is_conj", torch.ops.aten.resolve_conj.default),
    ("is_neg", torch.ops.aten.resolve_neg.default),
)


def resolve_conjugate_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Materializes each ``invoke_subgraph`` operand that is a lazy conjugate (or negative)
    view, as ``torch.resolve_conj`` does, in a partitioned forward or backward graph.

    Complex math saves such views for its backward (``mul``'s gradient takes
    ``other.conj()``), and the partitioner passes them from a region's forward subgraph
    to its backward one; ``invoke_subgraph`` has no kernel for the ``Conjugate`` dispatch
    key, so the backward failed (transformers' Llama 4, DeepSeek-V2). The values are the
    same; only the lazy bit is resolved, outside the subgraph, at each call.

    Returns:
        The names of the operands resolved (none: ``gm`` is unchanged).
    """
    invoke = torch.ops.higher_order.invoke_subgraph
    graph, fixed = gm.graph, []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not invoke:
            continue
        args = list(node.args)
        for i, arg in enumerate(args[2:], start=2):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            for check, resolve in _RESOLVE:
                if not (isinstance(val, torch.Tensor) and getattr(val, check)()):
                    continue
                with graph.inserting_before(node):
                    arg = graph.call_function(resolve, (arg,))
                mode = getattr(val, "fake_mode", None)
                with mode if mode is not None else contextlib.nullcontext():
                    val = arg.meta["val"] = resolve(val)
                fixed.append(args[i].name)
            args[i] = arg
        node.args = tuple(args)
    if fixed:
        graph.lint()
        gm.recompile()
    return fixed


def _joint_pass():
    """:func:`fix_storage_resizes` as an Inductor joint-graph pass (before its no-op
    removal, which would otherwise turn the functional copy into the source tensor)."""

    class FixStorageResizes(_compat.custom_graph_pass_base()):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fix_storage_resizes(graph)

        def uuid(self) -> str:
            return "aotdist.fix_storage_resizes.v1"

    return FixStorageResizes()


def _hooked(compiler: Callable, kind: str | None, on_graph: GraphHook | None) -> Callable:
    @functools.wraps(compiler)
    def compile_graph(gm, example_inputs, *args, **kwargs):
        fixed = fix_storage_resizes(gm)
        if fixed:
            gm.meta["aotdist_fixed_resizes"] = fixed
        resolve_conjugate_inputs(gm)
        if on_graph is not None:
            which = kind
            if which is None:  # inductor's inner compile says which graph it is
                which = (
                    "backward"
                    if kwargs.get("is_backward")
                    else "inference"
                    if kwargs.get("is_inference")
                    else "forward"
                )
            on_graph(gm, which)
        return compiler(gm, example_inputs, *args, **kwargs)

    return compile_graph


REBUILT = ("aot_eager", "inductor")  # the backends aot_backend rebuilds


def backend_name(backend: str | Callable) -> str | None:
    """``"aot_eager"``, ``"inductor"`` or another name; ``None`` for an unnamed callable."""
    if isinstance(backend, str):
        return backend
    return getattr(backend, "compiler_name", None)


def aot_backend(
    backend: str | Callable, *, on_graph: GraphHook | None = None, outer: str = "inductor"
) -> Callable | None:
    """``backend`` rebuilt on AOTAutograd with aotdist's passes and ``on_graph`` hook.

    Args:
        backend: ``"aot_eager"``, ``"inductor"``, or ``torch.compile``'s wrapper of either
            (an Inductor wrapper keeps its mode and options; graph-mode FSDP's bucketing
            ``aot_eager`` keeps its bucketing).
        on_graph: Called with each forward/backward/inference graph before it is compiled
            (with Inductor, AOTAutograd's cache is off for these compiles so that it is).
        outer: With Inductor, ``"fx"`` compiles each distinct region body once and runs the
            graph around them unlowered (:mod:`aotdist.backends.regional`).

    Returns:
        A ``torch.compile`` backend, or ``None`` when ``backend`` is not one of those.
    """
    name = backend_name(backend)
    if name == "aot_eager":
        _, boxed_nop = _compat.aot_eager_parts()
        # the graph compiler of aotdist's own aot_eager (fsdp.bucket_mb's bucketing) stays
        inner = getattr(backend, "aotdist_graph_compiler", boxed_nop)
        # a graph around regions saves what its backward needs (aotdist.backends.partition)
        return boundaries_saved(
            _compat.aot_eager_with_partitioner(
                region_partition,
                fw_compiler=_hooked(inner, "forward", on_graph),
                bw_compiler=_hooked(inner, "backward", on_graph),
            )
        )
    if name == "inductor":
        compile_fx, compile_fx_inner = _compat.inductor_compile_fx()
        # Options of a wrapper built by aotdist or by torch.compile, completed with
        # aotdist's defaults: the same decision as compile_regions (a bare name: defaults).
        patches = inductor_options(getattr(backend, "config", None), warn=False)
        add_joint_pass(patches, _joint_pass())
        if outer == "fx" and patches.get("custom_partitioner_fn") is None:
            patches["custom_partitioner_fn"] = inductor_partitioner()  # glue left unlowered
        inner = (
            compile_fx_inner if outer == "inductor" else regional_inner_compile(compile_fx_inner)
        )
        inner = _hooked(inner, None, on_graph)

        def inductor(gm, example_inputs):
            # A hit in AOTAutograd's cache skips inner_compile: the hook would see no graph
            # (an empty capture, a region call left in a graph meant to be inlined); an FX
            # outer graph is not a cache entry AOTAutograd can save.
            with (
                _compat.autograd_cache_off()
                if on_graph is not None or outer != "inductor"
                else contextlib.nullcontext()
            ):
                return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

        return inductor
    return None
