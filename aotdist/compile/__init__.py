"""Compiling a model in place: ``compile_regions``, ``compile_callable``, ``restore``.

Regions are marked by :mod:`aotdist.compile.marking`; the backend is wrapped by
:mod:`aotdist.backends.recording`, and region failures are fixed or demoted by
:mod:`aotdist.compile.guard`. The model is compiled in place (as ``nn.Module.compile``
does): ``state_dict()`` keys, ``named_parameters()`` and hooks are unchanged.

Two compile modes (:class:`aotdist.compile.state.CompileMode`), chosen from the model:
``graph`` (no FSDP2: the whole model is one graph, each region an ``invoke_subgraph``
call in it) and ``frames`` (FSDP2 units, whose hooks Dynamo does not trace, regions
holding tensor-parallel DTensors, which ``invoke_subgraph`` cannot take, and
``outer="eager"``: each region's forward is one compiled function shared by its
instances, run from eager code).
Details: docs/internals.md.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aotdist import _compat
from aotdist._compat.deprecation import positional_after_first_deprecated
from aotdist.backends.named import make_backend
from aotdist.backends.recording import RecordingBackend
from aotdist.backends.regional import resolve_outer
from aotdist.compile.frames import compile_frames
from aotdist.compile.guard import RefusedModuleCompile, RegionGuardedCall
from aotdist.compile.marking import is_compiled, mark_regions, unmark_regions
from aotdist.compile.state import (
    INFO_ATTR,
    STATE_ATTR,
    CompileMode,
    CompileSettings,
    RegionState,
)
from aotdist.compile.verify import install_frames_check
from aotdist.errors import ConfigError, OrderingError, RegionCompileWarning
from aotdist.fsdp import NoSharding, sharding_of
from aotdist.log import rank_zero_warn
from aotdist.regions import RegionPlan

__all__ = [
    "check_not_compiled",
    "compile_callable",
    "compile_regions",
    "is_compiled",
    "mark_regions",
    "restore",
    "unmark_regions",
]


def check_not_compiled(model: nn.Module) -> None:
    """Refuses a model that ``torch.compile`` already wrapped or compiled, in whole or part.

    Raises:
        OrderingError: ``model`` is an ``OptimizedModule``, was ``.compile()``-d, or holds
            compiled submodules.
    """
    optimized = _compat.optimized_module_type() or ()  # () matches nothing
    if isinstance(model, optimized):
        raise OrderingError(
            "got a torch.compile wrapper (OptimizedModule); aotdist compiles in place, inside "
            "FSDP's hooks, and keeps your module's keys (no `_orig_mod.`). Fix: pass the "
            "original module (`compiled._orig_mod`), not the result of torch.compile(model)."
        )
    if _compat.compiled_call(model) is not None:
        raise OrderingError(
            "model.compile() was already called on this module; aotdist would compound it. "
            "Fix: pass the uncompiled module; aotdist compiles it."
        )
    wrapped = [
        n
        for n, m in model.named_modules()
        if isinstance(m, optimized) or _compat.compiled_call(m) is not None
    ]
    if wrapped:
        raise OrderingError(
            f"submodules {wrapped[:4]} are already compiled (torch.compile / .compile(), e.g. "
            "by accelerate.utils.compile_regions); aotdist would compile them twice. Fix: "
            "apply aotdist to the uncompiled model."
        )


@positional_after_first_deprecated
def compile_regions(
    model: nn.Module,
    *,
    plan: RegionPlan | None = None,
    backend: str | Callable = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
    verify: bool = False,
    outer: str = "auto",
) -> nn.Module:
    """Marks ``model``'s regions for ``invoke_subgraph`` and compiles it in place.

    The whole model stays one graph where it allows; each distinct region is traced and
    compiled once and every instance calls that subgraph with its own parameters.

    Args:
        model: The module to compile; modified in place and returned.
        plan: Regions to use; ``aotdist.find_regions(model)`` when ``None``.
        backend: A ``torch.compile`` backend name or callable.
        mode: ``torch.compile`` mode (named backends only).
        dynamic: ``True``: input shapes are dynamic from the first compile (module
            constants stay static); ``False``: static shapes; ``None``: torch's automatic
            dynamic (recompile once when a shape changes).
        options: Backend options (named backends only).
        verify: Check the first training call against eager from the same state
            (outputs and gradients; :mod:`aotdist.compile.verify`) and raise
            ``RegionMismatchError`` naming the regions on a mismatch. Costs one eager
            and one compiled forward and backward more in the first step.
        outer: How the code around the regions runs. With Inductor: ``"inductor"``
            lowers the whole graph (region bodies once each, inside it), ``"fx"`` compiles
            only the region bodies and runs the glue between them unlowered
            (:mod:`aotdist.backends.regional`), ``"auto"`` picks
            (:func:`aotdist.backends.regional.resolve_outer`). Any backend: ``"eager"``
            builds no whole-model graph; each region compiles as a function of its own,
            shared by its instances, and the code between them runs eagerly
            (:mod:`aotdist.compile.frames`; the shortest compile, the slowest step).

    Returns:
        ``model`` itself.

    Raises:
        OrderingError: ``model`` is a ``torch.compile`` wrapper, was compiled already, or
            aotdist was applied to it already.
        ConfigError: a bad backend, mode/options with a callable backend, or a plan that
            does not fit ``model``.

    Example::

        import torch
        from torch import nn

        import aotdist

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

            def forward(self, x):
                return x + self.fc(self.norm(x))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.stem = nn.Linear(8, 16)
                self.blocks = nn.ModuleList(Block() for _ in range(4))

            def forward(self, x):
                x = self.stem(x)
                for block in self.blocks:
                    x = block(x)
                return x

        model = aotdist.compile_regions(Net(), backend="aot_eager")
        with aotdist.metrics.track(model) as m:
            model(torch.randn(2, 8)).sum().backward()
        assert (m.regions["Block"].call_sites, m.regions["Block"].subgraphs) == (4, 1)
    """
    state = _prepare(model, plan, backend, mode, dynamic, options, verify, outer)
    if state.settings.mode is CompileMode.FRAMES:  # FSDP2 hooks, DTensor regions, eager
        _compile_frames(model, state)
    else:
        # Through an aotdist function, not model._call_impl: see _compat.root_call_function
        # (torch 2.11 does not trace an nn.Sequential root's _call_impl); its code is this
        # model's own, so Dynamo's per-code state (automatic dynamic) is never shared.
        root = _compat.root_call_function(type(model).__name__)
        compiled = torch.compile(root, backend=state.backend, dynamic=_torch_dynamic(dynamic))
        compiled = functools.partial(compiled, model)  # compiled(model, *args, **kwargs)
        state.hooks.call_fn, state.hooks.call_bound = root, (model,)
        _compat.wrap_compiled_call(model, RegionGuardedCall(model, state, compiled))
    # model.compile() would overwrite the compiled call silently: refused, with the fix
    # (a model class with a compile method of its own keeps it)
    if type(model).compile is nn.Module.compile:
        model.compile = RefusedModuleCompile(type(model).__name__)
    state.compiled = True
    return model


def compile_callable(
    model: nn.Module,
    fn: Callable,
    *,
    plan: RegionPlan | None = None,
    backend: str | Callable = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
    verify: bool = False,
    outer: str = "auto",
) -> Callable:
    """Like :func:`compile_regions`, but compiles ``fn``, a callable that runs ``model``.

    For integrations that own the call path: Accelerate's hooks wrap ``model.forward``
    with ``torch.compiler.disable``-d pre/post hooks, which would break a compiled
    ``_call_impl``; compiling the forward they wrap keeps them outside the graph.
    ``model._compiled_call_impl`` is not touched; :func:`restore` unmarks ``model``.

    Returns:
        The compiled ``fn``, with region failures fixed or demoted as in
        :func:`compile_regions`.

    Raises:
        OrderingError: As :func:`compile_regions`; also when ``model`` holds FSDP2 units
            (use :func:`compile_regions`, which compiles inside them).
        ConfigError: As :func:`compile_regions`.
    """
    if sharding_of(model).compile_mode is CompileMode.FRAMES:
        raise OrderingError(
            "compile_callable compiles a whole call path, which FSDP2's hooks would break; "
            "use aotdist.compile_regions(model), which compiles inside the FSDP units."
        )
    state = _prepare(model, plan, backend, mode, dynamic, options, verify, outer)
    if state.settings.mode is CompileMode.FRAMES:  # outer "eager", DTensor regions
        _compile_frames(model, state)
        state.compiled = True
        return fn
    # A bound method (Accelerate's saved forward) is compiled as its function, its object
    # bound outside: torch 2.11 compiles a bound method through one shared wrapper code
    # (external_utils' ``inner``), whose cached graph a later compile of another method
    # can hit, since 2.11 does not guard on the instance's class (the first-step check's
    # trials then ran the graph they were meant to replace).
    bound = (fn.__self__,) if isinstance(fn, types.MethodType) else ()
    fn = _compat.unique_code_function(fn.__func__ if bound else fn, type(model).__name__)
    compiled = torch.compile(fn, backend=state.backend, dynamic=_torch_dynamic(dynamic))
    if bound:
        compiled = functools.partial(compiled, *bound)
    state.hooks.call_fn, state.hooks.call_bound = fn, bound
    state.compiled = True
    return RegionGuardedCall(model, state, compiled)


def _prepare(
    model: nn.Module,
    plan: RegionPlan | None,
    backend: str | Callable,
    mode: str | None,
    dynamic: bool | None,
    options: dict[str, Any] | None,
    verify: bool = False,
    outer: str = "auto",
) -> RegionState:
    """Checks, marks (unless marked) and attaches the recording backend; no compile yet.
    The compile mode is the sharding's, made ``frames`` for tensor-parallel regions and
    for ``outer="eager"``."""
    eager_outer = outer == "eager"
    if eager_outer:
        _check_eager_outer(model)
    state = vars(model).get(STATE_ATTR)
    if state is not None and state.compiled:
        raise OrderingError(
            "aotdist already compiled this model; applying twice would compound it. "
            "Fix: call aotdist.restore(model) first, or use the model as it is."
        )
    check_not_compiled(model)
    inner = make_backend(backend, mode, options, _torch_dynamic(dynamic))
    if state is None:  # parallelize marks before fully_shard, then compiles here
        state = mark_regions(model, plan)
    elif plan is not None and plan is not state.plan:
        raise OrderingError(
            "this model was marked with another region plan; call aotdist.restore(model) "
            "and compile again with the plan you want."
        )
    if len(state.plan) == 0:
        rank_zero_warn(
            f"aotdist found no repeated regions in {type(model).__name__}; the whole model is "
            "compiled as usual (no subgraph reuse). Pass include=[...] or min_repeats=1 to "
            "choose regions.",
            RegionCompileWarning,
            stacklevel=3,
        )
    state.backend = RecordingBackend(
        inner,
        model=model,
        plan=state.plan,
        outer=resolve_outer(outer, backend, mode, options),
        recompute_reductions=not eager_outer,  # the shortest compile (docs/internals.md)
    )
    frames = len(state.plan) > 0 and (eager_outer or _tensor_parallel_regions(model, state))
    state.settings = CompileSettings(
        mode=CompileMode.FRAMES if frames else sharding_of(model).compile_mode,
        backend_name=backend if isinstance(backend, str) else "",
        verify=verify,
        dynamic_inputs=dynamic is True,
        dynamic=_torch_dynamic(dynamic),
    )
    return state


def _check_eager_outer(model: nn.Module) -> None:
    """``outer="eager"``: no graph around the regions, each compiled as a frame of its own
    (as under FSDP2's hooks). Refused, before anything changes, where the sharding needs
    the whole graph (graph-mode FSDP's collectives live in it).

    Raises:
        ConfigError: ``model`` is sharded by graph-mode FSDP.
    """
    sharding = sharding_of(model)
    if sharding.compile_mode is CompileMode.GRAPH and not isinstance(sharding, NoSharding):
        raise ConfigError(
            "compile.outer: eager builds no graph around the regions, but graph-mode FSDP "
            "(fsdp.mode: graph) gathers and reduces parameters inside that graph. Fix: "
            "compile.outer: auto (or fx), or fsdp.mode: hooks, whose regions compile as "
            "frames already."
        )


def _compile_frames(model: nn.Module, state: RegionState) -> None:
    """Each region's forward compiled once, shared by its instances, run from eager code
    (:mod:`aotdist.compile.frames`), with the first-step check where asked."""
    compile_frames(
        model,
        state,
        functools.partial(torch.compile, backend=state.backend, dynamic=state.settings.dynamic),
    )
    if state.settings.verify:
        install_frames_check(model, state)


def _tensor_parallel_regions(model: nn.Module, state: RegionState) -> bool:
    """Whether a region instance holds DTensor parameters outside any FSDP2 unit (tensor
    parallelism without FSDP2). torch's AOTAutograd cannot take an ``invoke_subgraph``
    call whose operands are DTensors (torch 2.14: "got mixed torch.Tensor and DTensor"
    building its schema; 2.11: "Expected FakeTensor, got DTensor"), so such regions are
    compiled as frames of their own, which take the DTensors as inputs. A model sharded
    by FSDP2 compiles as frames already; graph-mode FSDP's DTensors are its own shards,
    which its call swaps for plain local tensors before any region runs."""
    if not torch.distributed.is_available() or not isinstance(sharding_of(model), NoSharding):
        return False
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(p, DTensor)
        for region in state.plan
        for fqn in region.fqns
        for p in model.get_submodule(fqn).parameters()
    )


def _torch_dynamic(dynamic: bool | None) -> bool | None:
    """``dynamic=True`` becomes automatic dynamic with every input dimension marked dynamic
    at each call: shapes become symbolic, module constants (a norm's ``eps``) stay
    constants, so each region stays one reusable subgraph (torch's ``dynamic=True`` would
    make those floats symbolic inputs of the subgraph)."""
    return None if dynamic else dynamic


def restore(model: nn.Module) -> nn.Module:
    """Undoes :func:`compile_regions` / marking: ``model`` runs plain eager again.

    After ``aotdist.parallelize`` that only marked and compiled (no Float8, no FSDP), the
    model is as before it, and ``parallelize`` may be applied again; Float8 conversion and
    sharding cannot be undone, so such a model stays recorded as parallelized.
    A no-op on a model aotdist never touched. Returns ``model``.
    """
    info = vars(model).get(INFO_ATTR)
    if info is not None and not info.float8_fqns and not info.sharded_fqns:
        del model.__dict__[INFO_ATTR]
    state = vars(model).get(STATE_ATTR)
    if state is None:
        return model
    # Instances sharded after marking keep FSDP's class; their forward becomes plain eager.
    unmark_regions(model, neutralize=True)
    # every aotdist wrapper of the call goes (graph-mode FSDP's shards stay, around eager)
    _compat.unwrap_compiled_call(model)
    if isinstance(vars(model).get("compile"), RefusedModuleCompile):
        del model.__dict__["compile"]
    del model.__dict__[STATE_ATTR]
    return model
