"""Region bodies compiled by Inductor once each; the graph around them not lowered.

With ``compile.outer: fx`` a graph that calls regions still goes through AOTAutograd with
Inductor's decompositions, joint-graph passes and partitioner (aotdist's repairs
included, :mod:`aotdist.backends.aot`), but Inductor's inner compile is asked for each
*distinct* region body only: :func:`compile_region_bodies` compiles the forward or
backward body of every ``invoke_subgraph`` once (call sites whose operands have the same
shapes, strides and dtypes share it), puts the compiled callable at each call site, and
leaves the outer graph an FX graph run as it is (graph-mode FSDP's collective bucketing
applied to it). Inductor's lowering, scheduling and code generation of the outer graph,
the part of a cold compile that grows with the depth, are not done; the glue between
regions runs op by op. A graph without region calls is lowered whole, as before.
torch's ``torch.fx.passes.regional_inductor_invoke_subgraph`` has the same idea; this one
runs inside aotdist's pipeline on every torch aotdist supports. The measured trade and
``auto``'s rule: docs/guide/performance.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

from aotdist import _compat
from aotdist.config import OUTER_MODES
from aotdist.config.validation import did_you_mean
from aotdist.errors import ConfigError, ConfigWarning
from aotdist.log import get_logger, rank_zero_info, rank_zero_warn

_GRAPHED_MODES = ("reduce-overhead", "max-autotune")  # CUDA graphs: one graph, lowered
_OVERLAP_KEYS = (
    "aten_distributed_optimizations.enable_overlap_scheduling",
    "reorder_for_compute_comm_overlap",
)  # see backends.named.overlap_options


def resolve_outer(
    outer: str, backend: str | Callable, mode: str | None, options: dict | None = None
) -> str | None:
    """``"inductor"`` or ``"fx"``: how Inductor compiles the graph around the regions;
    ``None`` for a backend that is not Inductor (``outer`` does not apply). ``eager``
    (no graph around the regions: :func:`aotdist.compile_regions` compiles frames) resolves
    as ``auto`` for what still compiles whole (a model without regions).

    ``auto`` is ``fx`` unless the mode records CUDA graphs (``reduce-overhead``,
    ``max-autotune``: one lowered graph to replay) or ``options`` turn on Inductor's
    compute/communication overlap (``fsdp.overlap``: it reorders the lowered graph).

    Raises:
        ConfigError: ``outer`` is not one of :data:`OUTER_MODES`.
    """
    if outer not in OUTER_MODES:
        raise ConfigError(
            f"compile.outer: unknown value {outer!r}{did_you_mean(outer, OUTER_MODES)}"
            f". Fix: one of {', '.join(OUTER_MODES)}"
        )
    name = backend if isinstance(backend, str) else getattr(backend, "compiler_name", None)
    if name != "inductor":
        return None
    if outer == "eager":
        outer = "auto"
    overlap = any(options.get(key) for key in _OVERLAP_KEYS) if options else False
    if outer == "auto":
        return "inductor" if mode in _GRAPHED_MODES or overlap else "fx"
    if outer == "fx" and (mode in _GRAPHED_MODES or overlap):
        what = (
            f"compile.mode {mode!r} (CUDA graphs)"
            if mode in _GRAPHED_MODES
            else "Inductor's compute/communication overlap (fsdp.overlap)"
        )
        rank_zero_warn(
            f"compile.outer: fx leaves the graph around the regions unlowered, so {what} "
            "applies to the region bodies only, not to the whole step. Fix: compile.outer: "
            "auto (or inductor) lowers the whole graph for it.",
            ConfigWarning,
            stacklevel=4,
        )
    return outer


# A run this long lowers the whole graph under ``auto``: the lowered step (4-13% faster on
# CPU, depths 8-64) pays back its longer cold compile within 2,000-8,000 steps there
# (docs/guide/performance.md), so past this the fastest step wins.
LONG_RUN_STEPS = 10_000
# A run shorter than this compiles each region as a function of its own (``eager``): the
# whole graph's faster step pays back its longer compile from about 950 steps (GPT depth
# 64) to 4,000 (depth 8) on CPU (docs/guide/performance.md), so below it the start wins.
SHORT_RUN_STEPS = 1_000


def configured_outer(config) -> str:
    """``compile.outer`` of an :class:`~aotdist.AOTDistConfig`, with ``auto`` made
    ``inductor`` where the artifact cache is on (``cache.mode``): torch's caches keep
    Inductor's lowered output only (AOTAutograd's cache entry, the saved whole-model
    graph), so the first run lowers the graph once and warm starts skip its trace; and
    where ``compile.expected_steps`` is at least :data:`LONG_RUN_STEPS`; ``eager`` for an
    unsharded Inductor run shorter than :data:`SHORT_RUN_STEPS`. Each choice logged once."""
    cc = config.compile
    if cc.outer != "auto":
        return cc.outer
    if config.cache.mode != "off":
        return "inductor"
    if 0 < cc.expected_steps < SHORT_RUN_STEPS and _short_run_eager(config):
        rank_zero_info(
            get_logger(__name__),
            f"aotdist: compile.outer auto -> eager: a run of {cc.expected_steps} steps "
            f"(compile.expected_steps, under {SHORT_RUN_STEPS}) compiles each region as a "
            "function of its own and runs the code between them eagerly: the shortest "
            "compile, which a longer run would pay back with the whole graph's faster step. "
            "Set compile.outer: fx to keep the whole graph",
        )
        return "eager"
    if cc.expected_steps >= LONG_RUN_STEPS:
        if cc.backend == "inductor":
            rank_zero_info(
                get_logger(__name__),
                f"aotdist: compile.outer auto -> inductor: a run of {cc.expected_steps} steps "
                f"(compile.expected_steps, at least {LONG_RUN_STEPS}) gets the whole graph "
                "lowered, whose faster step pays back its longer compile. Set compile.outer: "
                "fx to keep the shorter compile",
            )
        return "inductor"
    return "auto"


def _short_run_eager(config) -> bool:
    """Whether ``auto`` may take ``eager`` for a short run: Inductor (the compile it
    shortens), no CUDA graphs (one graph to replay), nothing sharded or pipelined (FSDP2's
    hooks compile frames already; graph-mode FSDP needs the whole graph)."""
    cc = config.compile
    return (
        cc.backend == "inductor"
        and cc.mode not in _GRAPHED_MODES
        and not config.fsdp.enabled
        and not config.pipeline.enabled
    )


class RegionBody:
    """A region body's compiled forward or backward, called at each of its call sites
    with the ``invoke_subgraph`` operands (the compiled code takes them as one list)."""

    def __init__(self, compiled: Callable, name: str):
        self.compiled = compiled
        self.run = None  # after the first call: the compiled code itself
        self.__name__ = f"aotdist_region_{name}"  # how the FX graph's code names the call

    def __call__(self, *operands):
        if self.run is not None:
            return self.run(list(operands))
        out = self.compiled(list(operands))  # the first call ends the compile's bookkeeping
        self.run = _compat.compiled_graph_callable(self.compiled)
        return out

    def __repr__(self) -> str:
        return self.__name__


def _signature(value: Any) -> Any:
    """What a call site's operand must share with another's for one compiled body to
    serve both (sizes and strides as text: under dynamic shapes they are symbols)."""
    if isinstance(value, torch.Tensor):
        return (
            tuple(map(str, value.shape)),
            tuple(map(str, value.stride())),
            value.dtype,
            str(value.device),
            value.requires_grad,
        )
    return type(value).__name__, str(value)


def compile_region_bodies(
    gm: torch.fx.GraphModule, inner_compile: Callable, *, is_backward: bool
) -> int:
    """Compiles each distinct ``invoke_subgraph`` body of ``gm`` with ``inner_compile``
    (Inductor's ``compile_fx_inner``) and calls it at every call site, in place.

    Returns:
        How many bodies were compiled (0: ``gm`` has no region call and is unchanged).
    """
    invoke = torch.ops.higher_order.invoke_subgraph
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=invoke):
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[2:]]
        key = (str(node.args[0].target), tuple(_signature(v) for v in vals))
        groups.setdefault(key, []).append(node)
    for (name, _), nodes in groups.items():
        inputs = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in nodes[0].args[2:]]
        body = copy.deepcopy(getattr(gm, name))  # Inductor's passes change what they get
        # A tracing context of its own: AOTAutograd restrides the backward's inputs by the
        # output strides the forward's compile reports, and a body's are not the graph's.
        with _compat.own_tracing_context():
            compiled = inner_compile(
                body, inputs, static_input_idxs=[], is_backward=is_backward, is_inference=False
            )
        call = RegionBody(compiled, name)
        for node in nodes:
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(
                    call, args=tuple(node.args[2:]), kwargs=dict(node.kwargs)
                )
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    if groups:
        for node in list(gm.graph.find_nodes(op="get_attr")):
            if not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return len(groups)


def _outer_passes() -> Iterable[Callable]:
    """The post-grad passes of this compile that must see the outer graph too: aotdist's
    collective bucketing (graph-mode FSDP's ``fsdp.bucket_mb``)."""
    from aotdist.backends.bucketing import is_bucketing_pass

    passes = _compat.inductor_post_grad_post_pass()
    for p in passes if isinstance(passes, (list, tuple)) else [passes]:
        for q in getattr(p, "passes", [p]):  # aotdist's chain of passes, or one
            if is_bucketing_pass(q):
                yield q


def regional_inner_compile(compile_inner: Callable) -> Callable:
    """An ``inner_compile`` for Inductor's ``compile_fx``: a graph that calls regions gets
    its region bodies compiled (:func:`compile_region_bodies`) and the rest runs as FX; a
    graph without region calls goes to ``compile_inner`` whole."""

    def inner(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        if not compile_region_bodies(
            gm, compile_inner, is_backward=bool(kwargs.get("is_backward"))
        ):
            return compile_inner(gm, example_inputs, **kwargs)
        for graph_pass in _outer_passes():
            graph_pass(gm.graph)
            gm.recompile()
        return _compat.boxed_function(gm.forward)

    return inner
