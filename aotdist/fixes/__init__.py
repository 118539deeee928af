"""Every change aotdist makes in or around a region, in one ordered list: :data:`FIXES`.

Each entry names its :class:`Stage`, where it applies, the guarantee it keeps, how it is
undone and the test that proves it. The code that owns a stage iterates the list:
marking swaps modules and wraps forwards (:func:`apply_fixes`, :func:`wrap_forward`;
restore and demotion undo them), the recording backend runs the graph passes on each
Dynamo graph (:func:`run_graph_passes`), and the compiled call, capture and the cache's
save enter the scoped Dynamo patches of their scope (:func:`dynamo_patches`).
docs/design.md's table is this list (:func:`table`; a test compares them). A new fix is
one module here and one entry in :data:`FIXES`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import fx, nn

from aotdist import _compat
from aotdist._compat.enums import StrEnum
from aotdist.fixes import batchnorm, droppath, kernel_funcs
from aotdist.fixes.forward import (
    INSIDE,
    OUTSIDE,
    ForwardFix,
    checkpointed,
    clone_aliasing_outputs,
    contiguous_stream,
    dealiased_inputs,
    detach_no_grad_outputs,
)
from aotdist.fixes.hoist import hoist_buffer_updates
from aotdist.fixes.layouts import merge_layout_variants

__all__ = [
    "CAPTURE",
    "COMPILE",
    "FIXES",
    "SAVE",
    "INSIDE",
    "OUTSIDE",
    "Fix",
    "Stage",
    "apply_fixes",
    "dynamo_patches",
    "restore_fixes",
    "run_graph_passes",
    "table",
    "wrap_forward",
]


class Stage(StrEnum):
    """Where a fix runs, in the order :data:`FIXES` lists them."""

    MODULE_SWAP = "module swap"  # marking swaps a module's class; restore swaps it back
    FORWARD = "forward wrapper"  # the region's forward wrapped, inside or around its call
    GRAPH_PASS = "graph pass"  # the recording backend rewrites each Dynamo graph
    DYNAMO_PATCH = "scoped Dynamo patch"  # entered around a compile, restored after it


# Scopes of a Dynamo patch: the compiled call, capture's trace, the cache's saved trace.
COMPILE, CAPTURE, SAVE = "compile", "capture", "save"


@dataclass(frozen=True)
class Fix:
    """One change aotdist makes in or around a region, and what answers for it.

    ``run`` is what the stage's owner calls: a module with ``swap(module) -> list`` and
    ``restore(module)`` (module swap), a :class:`~aotdist.fixes.forward.ForwardFix`
    (forward wrapper), ``pass(gm)`` (graph pass) or ``() -> context manager`` (Dynamo
    patch, entered in the ``scopes`` named). ``test`` is ``path::function`` of the test
    that proves the guarantee.
    """

    name: str
    stage: Stage
    run: ModuleType | ForwardFix | Callable
    change: str
    applies: str
    guarantee: str
    undo: str
    test: str
    scopes: frozenset[str] = frozenset()


def _hoist_in_training(gm: fx.GraphModule) -> None:
    if torch.is_grad_enabled():  # a training graph: buffer updates leave the regions
        hoist_buffer_updates(gm)


_SWAP_UNDO = "`restore` and demotion swap the original class back"
_WRAP_UNDO = "`restore` drops the region class; a demoted region runs its plain forward"
_PASS_UNDO = "nothing to undo: it rewrites the graph being compiled, which `restore` drops"
_PATCH_UNDO = "a context manager around the compile: torch's own code after it"

FIXES: tuple[Fix, ...] = (
    Fix(
        "batchnorm",
        Stage.MODULE_SWAP,
        batchnorm,
        change="BatchNorm in training: batch statistics, running statistics through "
        "`aotdist::update_batch_norm_stats`",
        applies="a module whose `forward` is torch's `_BatchNorm.forward` (function identity)",
        guarantee="torch's own forward, reproduced op for op; any subclass with its own "
        "forward (timm `BatchNormAct2d`, SyncBatchNorm) runs as written",
        undo=_SWAP_UNDO,
        test="tests/unit/test_compile.py::"
        "test_batchnorm_training_region_is_reused_and_its_running_stats_follow_eager",
    ),
    Fix(
        "droppath",
        Stage.MODULE_SWAP,
        droppath,
        change="stochastic-depth rate as a tensor",
        applies="torchvision `StochasticDepth.forward`, timm `DropPath.forward` (identity) "
        "and transformers `*DropPath.forward` (same bytecode as the copy), and the library "
        "function each calls equal to the copy in `fixes/droppath_reference.py`",
        guarantee="the library's draw (same distribution; transformers' the same stream); a "
        "subclass with its own forward or a changed release runs as written",
        undo=_SWAP_UNDO,
        test="tests/unit/test_stochastic_depth.py::"
        "test_torchvision_stochastic_depth_rates_are_data_and_every_block_shares_its_subgraph",
    ),
    Fix(
        "hub-kernel wrappers",
        Stage.MODULE_SWAP,
        kernel_funcs,
        change="kernels' `use_kernelized_func` wrapper (transformers 5.25+) skipped while "
        "compiling: the forward it wraps runs",
        applies="a module whose `forward` is kernels' wrapper (function identity by code) and "
        "none of whose functions `kernels.kernelize` replaced",
        guarantee="kernels' own rule: an un-kernelized function runs as the plain function; "
        "the wrapper's context-variable write, a side effect that stops reuse, is not made; "
        "outside a compile the wrapper runs",
        undo=_SWAP_UNDO,
        test="tests/integration/test_finetune_stacks.py::"
        "test_hub_kernel_wrappers_keep_a_region_reused_and_traced_once",
    ),
    # Forward wrappers, in the order they wrap (the first is innermost).
    Fix(
        "aliasing outputs",
        Stage.FORWARD,
        ForwardFix(clone_aliasing_outputs, INSIDE, when="clone_aliases", inline=True),
        change="an output that aliases an input cloned, inside the region",
        applies="a region torch refuses for an aliasing output",
        guarantee="values unchanged (copies)",
        undo=_WRAP_UNDO,
        test="tests/unit/test_compile.py::test_aliasing_output_is_fixed_with_a_warning",
    ),
    Fix(
        "contiguous stream",
        Stage.FORWARD,
        ForwardFix(contiguous_stream, INSIDE, frames=True),
        change="residual stream returned contiguous",
        applies="a non-contiguous output of the first input's shape, while compiling (the "
        "region's subgraph, and its frame under FSDP2's hooks)",
        guarantee="values unchanged (strides only)",
        undo=_WRAP_UNDO,
        test="tests/unit/test_robustness.py::"
        "test_a_block_that_hands_the_next_a_transposed_layout_stays_one_reused_subgraph",
    ),
    Fix(
        "no-gradient outputs",
        Stage.FORWARD,
        ForwardFix(detach_no_grad_outputs, INSIDE),
        change="outputs that need no gradient detached",
        applies="while grad is enabled",
        guarantee="values and gradients unchanged",
        undo=_WRAP_UNDO,
        test="tests/unit/test_fixes.py::"
        "test_a_region_returning_a_mask_that_needs_no_gradient_trains_as_eager",
    ),
    Fix(
        "inputs sharing storage",
        Stage.FORWARD,
        ForwardFix(dealiased_inputs, OUTSIDE, when="clone_aliases"),
        change="inputs sharing storage cloned before the call",
        applies="a later input that is, or views the same base as, an earlier one",
        guarantee="values unchanged (copies)",
        undo=_WRAP_UNDO,
        test="tests/unit/test_compile.py::"
        "test_inputs_that_share_storage_are_cloned_before_the_region_and_keep_reuse",
    ),
    Fix(
        "activation checkpointing",
        Stage.FORWARD,
        ForwardFix(checkpointed, OUTSIDE, when="checkpoint", inline=True, frames=True),
        change="activation checkpointing around an instance",
        applies="`ac.enabled`",
        guarantee="torch's non-reentrant checkpoint (RNG state restored in the recompute)",
        undo=_WRAP_UNDO,
        test="tests/unit/test_parallelize.py::"
        "test_activation_checkpointing_recomputes_and_still_reuses_the_region",
    ),
    # Graph passes, in the order the recording backend runs them on each Dynamo graph.
    Fix(
        "layout merge",
        Stage.GRAPH_PASS,
        merge_layout_variants,
        change="call sites whose inputs differ only in layout merged into one subgraph, the "
        "differing inputs copied into its layout before the call",
        applies="region subgraphs with the same ops on inputs of the same shapes, dtypes and "
        "`requires_grad`; only inputs that need a gradient are copied; not where a body "
        "reads its inputs' memory or the outputs' layouts differ",
        guarantee="the same ops on the same values (copies); gradients through the copy",
        undo=_PASS_UNDO,
        test="tests/unit/test_layouts.py::"
        "test_an_expanded_first_input_shares_the_subgraph_of_the_later_calls",
    ),
    Fix(
        "single-use inlining",
        Stage.GRAPH_PASS,
        _compat.inline_single_use_regions,
        change="a region subgraph called once inlined, as torch does where it is not deferred",
        applies="torch 2.14 and newer, after the layout merge has seen every call site",
        guarantee="torch's own pass, on the graph it would have run on",
        undo=_PASS_UNDO,
        test="tests/unit/test_capture.py::"
        "test_a_block_dynamo_inlined_is_not_reported_as_a_call_site",
    ),
    Fix(
        "buffer writes out of the regions",
        Stage.GRAPH_PASS,
        _hoist_in_training,
        change="an in-place buffer update taken out of the region and applied after its "
        "call; any other buffer write run on a copy made in the region, copied back by the "
        "caller",
        applies="training graphs; an input that needs no gradient which an aten op writes; "
        "an update moves out when its operands need no gradient, its result is unused and "
        "the region reads the buffer no more after it",
        guarantee="the same op on the same values, at the same point for every later "
        "reader; the buffer after the call is eager's",
        undo=_PASS_UNDO,
        test="tests/unit/test_compile.py::"
        "test_a_buffer_update_in_training_leaves_the_region_which_stays_reused",
    ),
    # Dynamo patches, entered in this order (the first outermost) in their scopes.
    Fix(
        "tolerant subgraph dedup",
        Stage.DYNAMO_PATCH,
        lambda: _compat.tolerant_subgraph_dedup(),
        change="Dynamo's subgraph comparison tolerates placeholders without metadata",
        applies="the compiled call",
        guarantee="reuse where torch's comparison would crash; bodies still compared op for op",
        undo=_PATCH_UNDO,
        test="tests/unit/test_compat.py::"
        "test_subgraph_dedup_tolerates_unused_placeholders_without_metadata",
        scopes=frozenset({COMPILE}),
    ),
    Fix(
        "cached subgraph schemas",
        Stage.DYNAMO_PATCH,
        lambda: _compat.cached_subgraph_schemas(),
        change="`invoke_subgraph`'s schema built once per subgraph and operand metadata",
        applies="the compiled call",
        guarantee="the schema torch builds, memoized on what it depends on",
        undo=_PATCH_UNDO,
        test="tests/unit/test_compat.py::"
        "test_region_schema_memo_keys_on_operand_metadata_and_restores",
        scopes=frozenset({COMPILE}),
    ),
    Fix(
        "single-use inlining deferred",
        Stage.DYNAMO_PATCH,
        lambda: _compat.single_use_inlining_deferred(),
        change="torch's inlining of region subgraphs called once put off to the backend",
        applies="the compiled call, capture and the cache's saved trace",
        guarantee="the backend sees every region call; the single-use pass then runs there",
        undo=_PATCH_UNDO,
        test="tests/unit/test_capture.py::"
        "test_a_block_dynamo_inlined_is_not_reported_as_a_call_site",
        scopes=frozenset({COMPILE, CAPTURE, SAVE}),
    ),
    Fix(
        "subclass intermediates inside",
        Stage.DYNAMO_PATCH,
        lambda: _compat.subclass_intermediates_inside(),
        change="a tensor subclass a region's body makes stays inside the region (torch 2.11)",
        applies="the compiled call, capture and the cache's saved trace",
        guarantee="no output may alias such an intermediate, as torch filters them",
        undo=_PATCH_UNDO,
        test="tests/distributed/test_graph_fsdp.py::test_float8_layers_in_graph_mode",
        scopes=frozenset({COMPILE, CAPTURE, SAVE}),
    ),
    Fix(
        "graph text only when logged",
        Stage.DYNAMO_PATCH,
        lambda: _compat.graph_text_when_logged(),
        change="AOTAutograd's joint / forward / backward graph text is built only when a "
        "log or a structured trace reads it",
        applies="the compiled call",
        guarantee="what computes is unchanged; `TORCH_LOGS` / `TORCH_TRACE` get the text as "
        "torch builds it",
        undo=_PATCH_UNDO,
        test="tests/unit/test_compat.py::test_graph_text_is_built_only_when_a_logger_reads_it",
        scopes=frozenset({COMPILE}),
    ),
)


def _of(stage: Stage) -> list[Fix]:
    return [fix for fix in FIXES if fix.stage is stage]


def apply_fixes(module: nn.Module) -> list[nn.Module]:
    """Every module swap applied under ``module`` (a region instance); the modules changed."""
    return [changed for fix in _of(Stage.MODULE_SWAP) for changed in fix.run.swap(module)]


def restore_fixes(module: nn.Module) -> None:
    """Every module swap undone under ``module``."""
    for fix in _of(Stage.MODULE_SWAP):
        fix.run.restore(module)


def wrap_forward(
    fn: Callable, where: str, on: dict[str, bool], *, nested: bool = True, frames: bool = False
) -> Callable:
    """``fn`` wrapped by every forward wrapper that runs ``where`` (``INSIDE`` or
    ``OUTSIDE``) on this kind of forward, with its option in ``on``."""
    for fix in _of(Stage.FORWARD):
        wrap = fix.run
        applies = wrap.frames if frames else wrap.subgraph if nested else wrap.inline
        if wrap.where == where and applies and (wrap.when is None or on.get(wrap.when)):
            fn = wrap.wrap(fn)
    return fn


def run_graph_passes(gm: fx.GraphModule) -> None:
    """Every graph pass on ``gm`` (a Dynamo graph), in place, in order."""
    for fix in _of(Stage.GRAPH_PASS):
        fix.run(gm)


@contextlib.contextmanager
def dynamo_patches(scope: str) -> Iterator[None]:
    """Within: every Dynamo patch of ``scope`` (``"compile"``, ``"capture"``, ``"save"``)."""
    with contextlib.ExitStack() as stack:
        for fix in _of(Stage.DYNAMO_PATCH):
            if scope in fix.scopes:
                stack.enter_context(fix.run())
        yield


def table() -> str:
    """docs/design.md's table of fixes, from :data:`FIXES` (Markdown)."""
    rows = ["| change | stage | where it applies | guarantee | undone | tested by |"]
    rows.append("|---|---|---|---|---|---|")
    for fix in FIXES:
        test = fix.test.split("::")
        rows.append(
            f"| {fix.change} | {fix.stage} | {fix.applies} | {fix.guarantee} | {fix.undo} "
            f"| `{test[0].removeprefix('tests/')}` `{test[1]}` |"
        )
    return "\n".join(rows) + "\n"
