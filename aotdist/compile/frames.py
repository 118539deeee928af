"""Per-region frames (FSDP2 hooks mode): one compiled forward per region, and proof it ran.

FSDP2's hooks are ``torch._dynamo.disable``-d, so under ``fully_shard`` each region's
forward is compiled as a graph of its own, shared by its instances, inside FSDP's eager
hooks. It is installed as the region class's ``_aotdist_impl``, which the region class's
``forward`` reads at call time, so it reaches instances whose class another library made
later (``FSDP<cls>``, a wrapper snapshotting ``forward``). After the first forward every
region instance that ran is checked to have run compiled; one that did not is named in a
``RegionCompileWarning`` and in ``metrics`` (``eager``), never silently eager; a region
frame compiled more than once (its instances differ) is named too (``reuse``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from aotdist import _compat
from aotdist.compile.collector import older_objects_frozen
from aotdist.compile.guard import CallModes, captured_scalars, mark_dynamic_inputs
from aotdist.compile.state import CompiledCall, RegionState
from aotdist.compile.subgraph_reuse import report_reuse
from aotdist.errors import RegionCompileWarning
from aotdist.log import rank_zero_warn


def compile_frames(model: nn.Module, state: RegionState, compile_fn) -> None:
    """Installs one compiled forward per region and the first-forward check.

    Args:
        model: The root module (holding FSDP2 units).
        state: Its region state; ``state.applied.classes`` are the region classes.
        compile_fn: ``torch.compile`` with the backend and options bound.
    """
    for region in state.plan:
        cls = state.applied.classes[region.name]
        compiled = compile_fn(cls._aotdist_plain_forward)
        calls = state.log.frame_calls.setdefault(region.name, set())

        def forward(
            self, *args, _compiled=compiled, _calls=calls, _state=state, _name=region.name, **kwargs
        ):
            first = not _calls  # the region class's first call compiles its frame
            _calls.add(id(self))
            if _state.settings.dynamic_inputs:
                mark_dynamic_inputs(args, kwargs)
            cache = _state.hooks.cache
            if cache is not None and (saved := cache.frame_precompiled.get(_name)) is not None:
                hit, out = saved.run((self, *args), kwargs, _state.backend)  # aotdist.cache's
                if hit:
                    return out
            with (
                captured_scalars(_state),  # only where a region asked (trace_host_scalars)
                older_objects_frozen() if first else contextlib.nullcontext(),
            ):
                if _state.hooks.watchers:  # aotdist.cache keeps calls to save
                    called = _state.hooks.calling(CompiledCall(self, args, kwargs, frame=_name))
                    out = _compiled(self, *args, **kwargs)
                    for done in called:
                        done()
                    return out
                return _compiled(self, *args, **kwargs)

        cls._aotdist_impl = forward
    _watch_first_forward(model, state)


@dataclass(frozen=True)
class TensorMeta:
    """What a trace needs of an input tensor: an empty one like it is made from this."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(
            self.shape, self.stride, dtype=self.dtype, device=self.device
        ).requires_grad_(self.requires_grad)


@dataclass
class FrameExample:
    """A region frame's first call, kept for :mod:`aotdist.cache.precompile` to trace it
    again at save time: the instance, its inputs (tensors as :class:`TensorMeta`), and
    the metadata of the parameters it saw (FSDP2's unsharded ones, gone by then). No
    tensor memory is held."""

    instance: nn.Module
    args: tuple
    kwargs: dict
    params: dict[str, TensorMeta]  # "submodule.name" -> the parameter's metadata
    subclass: str | None  # a parameter that is a tensor subclass (Float8): not saved
    compiled_before: int = 0  # the region's frame graphs compiled before this call
    modes: CallModes | None = None  # an eval call's modes (None: a training call)
    graphs: int = 0  # an eval call's: the frame graphs compiled during it

    def inputs(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with an empty tensor for each :class:`TensorMeta`."""
        return _compat.tree_map(
            lambda x: x.empty() if isinstance(x, TensorMeta) else x, (self.args, self.kwargs)
        )

    def stand_in_parameters(self):
        """Inside, the instance holds empty parameters like those its call saw."""
        return _compat.stand_in_parameters(
            self.instance, {name: meta.empty() for name, meta in self.params.items()}
        )


def frame_example(
    instance: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    compiled_before: int = 0,
    modes: CallModes | None = None,
) -> FrameExample:
    """What :class:`FrameExample` keeps of a call."""

    def meta(t):
        return TensorMeta(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)

    params, subclass = {}, None
    for name, p in instance.named_parameters():
        if type(p) not in (torch.Tensor, nn.Parameter):
            subclass = subclass or f"{name} is a {type(p).__name__}"
        params[name] = meta(p)
    args, kwargs = _compat.tree_map(
        lambda t: meta(t) if type(t) in (torch.Tensor, nn.Parameter) else t, (args, kwargs)
    )
    return FrameExample(instance, args, kwargs, params, subclass, compiled_before, modes)


def _watch_first_forward(model: nn.Module, state: RegionState) -> None:
    """Forward pre-hooks on the instances record which ran; after the root's first forward
    the ones that ran but never entered their compiled forward are reported."""
    ran: dict[str, set[int]] = {}
    handles = []
    for region in state.plan:
        seen = ran.setdefault(region.name, set())
        for fqn in region.fqns:
            handles.append(
                model.get_submodule(fqn).register_forward_pre_hook(
                    lambda mod, args, _seen=seen: _seen.add(id(mod))
                )
            )

    def check(module, args, output):
        for handle in handles:
            handle.remove()
        state.log.frames_checked = True
        for region in state.plan:
            missed = ran[region.name] - state.log.frame_calls.get(region.name, set())
            if not missed or region.name in state.applied.demoted:
                continue
            fqn_of = {id(model.get_submodule(f)): f for f in region.fqns}
            names = sorted(fqn_of.get(i, "?") for i in missed)
            cls = type(model.get_submodule(names[0])) if names[0] != "?" else None
            why = (
                f"{len(missed)} of {region.count} instances ran uncompiled ({names[:3]}); "
                f"their class {getattr(cls, '__qualname__', '?')} does not reach aotdist's "
                "region forward (a wrapper or class created after marking replaced "
                "forward)"
            )
            state.log.eager[region.name] = why
            rank_zero_warn(
                f"aotdist region {region.name!r} ran EAGER, not compiled: {why}. Fix: apply "
                "aotdist.parallelize(model, config=...) to the unwrapped model (it marks, "
                "then shards), or exclude the region and use torch.compile on it.",
                RegionCompileWarning,
                stacklevel=2,
            )
        if not state.log.reuse_checked:  # every region frame compiled by now
            state.log.reuse_checked = True
            report_reuse(model, state)
        root_handle.remove()
        return output

    root_handle = model.register_forward_hook(check)
