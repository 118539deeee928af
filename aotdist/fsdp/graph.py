"""Graph-mode FSDP (``fsdp.mode: graph``): the collectives inside the one whole-model graph.

Following the SimpleFSDP design, aotdist shards every parameter itself as a DTensor
(``Shard(0)`` on a 1-D mesh; ``(Replicate(), Shard(0))`` on a 2-D HSDP mesh) and gathers
it with differentiable functional collectives that the compiler sees (all-gather over the
shard group; the gradient reduce-scattered there, then all-reduced over the replicas), so
the model stays one Dynamo graph and each region stays one reused ``invoke_subgraph``,
fed its own local shards. ``named_parameters()``, ``state_dict()`` and the optimizer see
the DTensors, as under FSDP2.

Entry points: :func:`shard_graph` (shards the model), :func:`sharded_call` (installs
:class:`ShardedCall`, which puts local shards in place during a forward); the gathering
itself: :mod:`aotdist.fsdp.gather`. ``reshard_after_forward``, ``param_dtype`` /
``reduce_dtype`` and bucketing (:mod:`aotdist.backends.bucketing`) apply as configured.
How a region sees its parameters, and why: docs/internals.md.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from aotdist import _compat
from aotdist._compat.checkpoint import quiet_checkpoint_notice
from aotdist.config import AOTDistConfig, torch_dtype
from aotdist.errors import ConfigError, RegionCompileWarning
from aotdist.float8 import float8_linears
from aotdist.fsdp.gather import (
    FLOAT8_SCALE,
    GatherSpec,
    _all_reduce,
    _gather_class,
    _pack_gathered,
    _recompute_context,
    _unpack_gathered,
)
from aotdist.fsdp.hooks import average_expert_grads, expert_params
from aotdist.log import rank_zero_warn
from aotdist.regions import RegionPlan, find_regions


def check_graph_config(config: AOTDistConfig, model: nn.Module | None = None) -> None:
    """Refuses what graph-mode FSDP cannot do, before anything changes.

    Raises:
        ConfigError: ``compile.verify`` with ``fsdp.mode: graph``, or
            ``model`` holds DTensor parameters (tensor parallelism).
    """
    from torch.distributed.tensor import DTensor

    dtensors = [
        n
        for n, p in (model.named_parameters() if model is not None else ())
        if isinstance(p, DTensor)
    ]
    if dtensors:
        raise ConfigError(
            f"fsdp.mode: graph shards plain parameters, but {len(dtensors)} are DTensors "
            f"already, e.g. {dtensors[:3]} (tensor parallelism, or a model sharded before). "
            "Graph-mode FSDP does not compose with tensor parallelism: its regions would take "
            "DTensors into a reused invoke_subgraph, which torch cannot trace yet "
            "(docs/internals.md, 'Tensor parallelism and graph-mode FSDP'). Fix: use "
            "fsdp.mode: hooks (FSDP2 on the data-parallel mesh dim composes with your "
            "parallelize_module plan, every region still reused), or pass the unsharded model."
        )
    if config.compile.verify:
        raise ConfigError(
            "compile.verify is not supported with fsdp.mode: graph yet: the check reads each "
            "parameter's gradient, and graph-mode FSDP swaps the parameters for gathered "
            "shards inside the call. Fix: run the check once with fsdp.mode: hooks (the "
            "regions compile the same way), or set compile.verify: false."
        )


def graph_plan(model: nn.Module, plan: RegionPlan, config: AOTDistConfig) -> RegionPlan:
    """The plan without regions whose instances own parameters themselves (not in a child).

    Such an instance would need the gathering property on its own class, which the region
    marking swaps on demotion; it is left unmarked instead: compiled inline in the one
    graph, collectives included, with a warning naming it.
    """
    experts = {id(p) for p in expert_params(model, config.fsdp.expert_params).values()}
    owning = sorted(
        {
            r.module_type.__name__
            for r in plan
            for f in r.fqns
            if any(  # an expert parameter is not gathered: the region reads it as it is
                p is not None and id(p) not in experts
                for p in _compat.param_slots(model.get_submodule(f)).values()
            )
        }
    )
    if not owning:
        return plan
    rank_zero_warn(
        f"fsdp.mode: graph: region(s) {owning} hold parameters on the region module itself, "
        "which graph-mode FSDP cannot feed to a reused subgraph; they are compiled inline in "
        "the one graph instead (correct, no reuse). Fix: move those parameters into a child "
        "module, or use fsdp.mode: hooks.",
        RegionCompileWarning,
        stacklevel=3,
    )
    rc = config.regions
    return find_regions(
        model,
        include=rc.include,
        exclude=(*(rc.exclude or ()), *owning),
        min_repeats=rc.min_repeats,
    )


def shard_graph(
    model: nn.Module, config: AOTDistConfig, mesh, checkpointed: tuple[str, ...] = ()
) -> list[str]:
    """Shards every parameter of ``model`` as a ``Shard(0)`` DTensor for graph-mode FSDP
    (``(Replicate(), Shard(0))`` on a 2-D HSDP mesh: sharded along dim 1, replicated along 0).

    No communication: every rank keeps its chunk of the (identically initialized) full
    parameter, as ``fully_shard`` does. Shared parameters stay shared.

    Args:
        model: The marked (not yet compiled) model; its parameter-owning modules change class.
        config: The config (``fsdp`` section used).
        mesh: A 1-D device mesh, or a 2-D ``(replicate, shard)`` one.
        checkpointed: FQNs of the region instances run under activation checkpointing.
            Their modules' gathers are not recomputed on their own: the checkpoint
            recomputes the region's forward in backward, gathers included, and its
            backward uses those gathered parameters (else the backward gathered each one
            twice more, once for the recomputed forward and once for itself: 1.5x the
            all-gather bytes of hooks mode).

    Returns:
        FQNs of the modules whose parameters were sharded.

    Raises:
        ConfigError: ``mesh`` has more than 2 dims, or parameters sit on another device
            type (DTensor parameters are refused earlier, by :func:`check_graph_config`).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if mesh.ndim not in (1, 2):
        raise ConfigError(
            f"fsdp.mode: graph takes a 1-D or a 2-D (replicate, shard) device "
            f"mesh; got {mesh.ndim}-D {mesh}. Fix: pass mesh=init_device_mesh("
            "device_type, (replicas, shards))."
        )
    fc = config.fsdp
    if fc.reshard_after_forward:  # the gathers' checkpoint: torch's notice is not the user's
        quiet_checkpoint_notice(_recompute_context)
    shard_dim = mesh.ndim - 1
    group = mesh.get_group(shard_dim)
    replicate = mesh.get_group(0).group_name if mesh.ndim == 2 else None
    world, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    replicas = [Replicate()] * (mesh.ndim - 1)
    float8 = (
        {id(m): m.config.cast_config_weight.target_dtype for m in float8_linears(model)}
        if config.float8.enabled and config.float8.fsdp_all_gather
        else {}
    )
    experts = expert_params(model, fc.expert_params)  # each rank's own: left as they are
    average_expert_grads(experts, mesh.size())
    kept = {id(p) for p in experts.values()}
    done, new_params = [], {}
    for fqn, mod in list(model.named_modules()):
        specs = []
        reshard = fc.reshard_after_forward and not any(
            fqn == c or fqn.startswith(c + ".") for c in checkpointed
        )
        for name, p in list(_compat.param_slots(mod).items()):
            if p is None or id(p) in kept:
                continue
            spec = GatherSpec(
                shape=tuple(p.shape),
                group=group.group_name,
                world=world,
                reshard=reshard,
                param_dtype=torch_dtype(fc.param_dtype),
                reduce_dtype=torch_dtype(fc.reduce_dtype),
                replicate_group=replicate,
                float8=float8.get(id(mod)) if name == "weight" else None,
            )
            if spec.float8 is not None:  # set before each forward (ShardedCall)
                mod.register_buffer(FLOAT8_SCALE, torch.ones((), device=p.device), persistent=False)
            specs.append((name, spec))
            if id(p) not in new_params:
                if p.device.type != mesh.device_type:
                    raise ConfigError(
                        f"parameter {fqn}.{name} is on {p.device}, the mesh on "
                        f"{mesh.device_type}. Fix: move the model to the mesh's device first."
                    )
                if p.ndim == 0:
                    local, placement = p.detach(), Replicate()
                else:
                    chunk = spec.padded // world
                    lo, hi = min(rank * chunk, p.shape[0]), min((rank + 1) * chunk, p.shape[0])
                    local, placement = p.detach()[lo:hi].clone(), Shard(0)
                dt = DTensor.from_local(
                    local,
                    mesh,
                    [*replicas, placement],
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
                new_params[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            _compat.param_slots(mod)[name] = new_params[id(p)]
        if specs:
            mod.__class__ = _gather_class(type(mod), tuple(specs))
            done.append(fqn)
    return done


def _slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [
        (m, n)
        for _, m in model.named_modules(remove_duplicate=False)
        for n, p in _compat.param_slots(m).items()
        if isinstance(p, torch.distributed.tensor.DTensor)
    ]


@contextlib.contextmanager
def local_shards(model: nn.Module, slots: list[tuple[nn.Module, str]] | None = None):
    """Within: each DTensor parameter's module holds its local shard (``p.to_local()``,
    whose gradient returns to the DTensor as ``Shard(0)``), which the module's gathering
    property all-gathers where it is read. A no-op on a model that graph-mode FSDP did
    not shard."""
    slots = _slots(model) if slots is None else slots
    saved, locals_ = [], {}
    try:
        for mod, name in slots:
            p = _compat.param_slots(mod)[name]
            if id(p) not in locals_:  # a shared parameter: one local shard, one gradient
                locals_[id(p)] = p.to_local()
            saved.append((mod, name, p))
            _compat.param_slots(mod)[name] = locals_[id(p)]
        yield
    finally:
        for mod, name, p in saved:
            _compat.param_slots(mod)[name] = p


class ShardedCall(_compat.CallWrapper):
    """The model's call under graph-mode FSDP: :func:`local_shards` around ``inner``.

    Runs eagerly, outside the compiled graph, around ``inner`` (the compiled call, or the
    eager ``_call_impl`` when ``None``); the DTensor parameters are back in place when it
    returns or raises. It stays when ``aotdist.restore`` undoes compiling (the DTensor
    parameters need it), around the eager call.
    """

    __reduce_ex__ = _compat.unsaved_in_guards  # run state, not in a saved graph's guards
    stays = True

    def __init__(
        self, model: nn.Module, *, param_dtype: torch.dtype | None = None, reshard: bool = True
    ):
        self._eager = _compat.call_impl(model)
        self._param_dtype = param_dtype
        self._reshard = reshard
        self._slots = _slots(model)
        self._float8 = float8_gathered(model, self._slots)
        self.rewrap(None)

    def rewrap(self, inner) -> None:
        """Wraps ``inner`` (``None``: the eager call, resharding its gathers eagerly)."""
        self.inner = inner
        self._run = self._eager if inner is None else inner
        self._eager_reshard = self._reshard and inner is None

    def __call__(self, *args, **kwargs):
        if self._float8:
            refresh_float8_scales(self._float8)
        with local_shards(None, self._slots):
            if self._param_dtype is not None:  # as FSDP2's root casts its forward inputs
                args, kwargs = _compat.tree_map(self._cast, (args, kwargs))
            if self._eager_reshard:  # compiled graphs recompute the gathers themselves
                with torch.autograd.graph.saved_tensors_hooks(_pack_gathered, _unpack_gathered):
                    return self._run(*args, **kwargs)
            return self._run(*args, **kwargs)

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self._param_dtype)
        return x


def float8_gathered(
    model: nn.Module, slots: list[tuple[nn.Module, str]] | None = None
) -> list[tuple[nn.Module, str]]:
    """The ``(module, name)`` of every weight graph-mode FSDP gathers in float8."""
    return [
        (m, n)
        for m, n in (_slots(model) if slots is None else slots)
        if type(m)._aotdist_gather[n].float8 is not None
    ]


@torch.no_grad()
def refresh_float8_scales(slots: list[tuple[nn.Module, str]]) -> None:
    """Sets the scale of every weight gathered in float8 from its full tensor's amax, as
    torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does under FSDP2: one
    all-reduce (max) of the local amaxes, then torchao's ``amax_to_scale``. Runs eagerly
    before each forward, so the scales always match the weights the forward gathers."""
    from torchao.float8.float8_utils import amax_to_scale

    specs = [type(m)._aotdist_gather[n] for m, n in slots]
    shards = [_compat.param_slots(m)[n].to_local() for m, n in slots]
    amax = torch.stack(
        [
            t.detach().abs().max().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
            for t in shards
        ]
    )
    amax = _all_reduce(amax, specs[0].group, "max")  # one shard group, one float8 dtype
    for (m, _), scale in zip(slots, amax_to_scale(amax, specs[0].float8), strict=True):
        getattr(m, FLOAT8_SCALE).copy_(scale)


def sharded_call(model: nn.Module, config: AOTDistConfig) -> None:
    """Wraps ``model``'s call (compiled or not) in :class:`ShardedCall`."""
    _compat.wrap_compiled_call(
        model,
        ShardedCall(
            model,
            param_dtype=torch_dtype(config.fsdp.param_dtype),
            reshard=config.fsdp.reshard_after_forward,
        ),
    )
