"""FSDP2 application and awareness: ordering checks, the default mesh, sharding by region.

FSDP2 (``fully_shard``) keeps each parameter sharded and all-gathers it right before the
module that owns it runs; between uses the unsharded storage is resized to 0. Its hooks
are ``torch._dynamo.disable``-d, so they never enter a compiled graph: aotdist shards each
region instance (one all-gather per instance) and compiles inside those hooks.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn

from aotdist import _compat
from aotdist.config import FSDPConfig, torch_dtype
from aotdist.config.validation import did_you_mean
from aotdist.errors import ConfigError, OrderingError
from aotdist.regions import RegionPlan


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``module`` itself."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp_modules(model: nn.Module) -> list[str]:
    """FQNs of the modules of ``model`` that ``fully_shard`` was applied to (root is "")."""
    return [fqn for fqn, m in model.named_modules() if is_fsdp_module(m)]


def check_not_sharded(model: nn.Module, *, allow_fsdp2: bool = False) -> None:
    """Refuses a model some other data-parallel wrapper already owns.

    Args:
        model: The model handed to aotdist.
        allow_fsdp2: Accept units the user sharded with ``fully_shard`` (aotdist then
            only compiles inside them).

    Raises:
        OrderingError: ``model`` holds FSDP1 or DDP wrappers, or FSDP2 was applied already
            and ``allow_fsdp2`` is false.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for fqn, m in model.named_modules():
        where = repr(fqn) if fqn else "the model"
        if isinstance(m, FullyShardedDataParallel):
            raise OrderingError(
                f"{where} is wrapped in FSDP1 (FullyShardedDataParallel); aotdist shards with "
                "FSDP2 and cannot compile through FSDP1's flat parameters. Fix: pass the "
                "unwrapped model and set fsdp.enabled: true."
            )
        if isinstance(m, DistributedDataParallel):
            raise OrderingError(
                f"{where} is wrapped in DistributedDataParallel; aotdist must see the module "
                "itself. Fix: call aotdist.parallelize first, then wrap (or use fsdp.enabled)."
            )
    sharded = fsdp_modules(model)
    if sharded and not allow_fsdp2:
        raise OrderingError(
            f"fully_shard was already applied to {sharded[:4]}; aotdist must mark regions and "
            "convert to float8 before sharding, so it shards itself. Fix: pass the unsharded "
            "model with fsdp.enabled: true, or keep your sharding and set fsdp.enabled: false "
            "and float8.enabled: false (aotdist then compiles the regions inside your units)."
        )


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def require_process_group() -> None:
    """Raises, before anything touches ``torch.distributed``, when FSDP has no process group
    (a plain ``python`` run: a notebook, a first try).

    Raises:
        ConfigError: No process group is initialized; the message names the launchers.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "fsdp.enabled needs an initialized process group, and none is. Fix: launch "
            "with torchrun / accelerate launch and call torch.distributed.init_process_group"
            "() before aotdist.parallelize, or pass mesh=..., or set fsdp.enabled: false."
        )


def default_mesh(model: nn.Module, *, replicate_degree: int = 1):
    """The device mesh over the default process group, on the model's device type: 1-D,
    or with ``replicate_degree > 1`` the 2-D HSDP mesh ``(replicate, shard)``.

    Raises:
        ConfigError: No process group is initialized, or ``replicate_degree`` does not
            divide the world size.
    """
    require_process_group()
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if replicate_degree == 1:
        return init_device_mesh(_device_type(model), (world,))
    if world % replicate_degree:
        raise ConfigError(
            f"fsdp.replicate_degree: {replicate_degree} does not divide the world size "
            f"{world} (rank {dist.get_rank()}). Fix: a divisor of {world}, or 1 to shard "
            "over every rank."
        )
    return init_device_mesh(
        _device_type(model),
        (replicate_degree, world // replicate_degree),
        mesh_dim_names=("replicate", "shard"),
    )


def fsdp_mesh(model: nn.Module, mesh, config: FSDPConfig):
    """The mesh FSDP shards over: ``mesh`` checked against ``config``, or the default one.

    Raises:
        ConfigError: ``mesh`` contradicts ``fsdp.replicate_degree``, has more than 2 dims,
            or (hooks mode) is a 2-D mesh without dim names (FSDP2's HSDP needs them).
    """
    degree = config.replicate_degree
    if mesh is None:
        return default_mesh(model, replicate_degree=degree)
    if degree > 1 and (mesh.ndim != 2 or mesh.shape[0] != degree):
        raise ConfigError(
            f"fsdp.replicate_degree: {degree} asks for a ({degree}, shard) HSDP mesh, but "
            f"parallelize(mesh=...) got a mesh of shape {tuple(mesh.shape)}. Fix: drop "
            "fsdp.replicate_degree (the mesh decides), or drop mesh=..."
        )
    if mesh.ndim > 2:
        raise ConfigError(
            f"FSDP takes a 1-D mesh or a 2-D (replicate, shard) HSDP mesh; got the "
            f"{mesh.ndim}-D mesh {mesh.mesh_dim_names or tuple(mesh.shape)}. Fix: pass the "
            "data-parallel part, e.g. mesh[('dp_replicate', 'dp_shard')] (tensor-parallel "
            "dims stay with your parallelize_module plan)."
        )
    if config.mode == "hooks" and mesh.ndim == 2 and not mesh.mesh_dim_names:
        raise ConfigError(
            f"a 2-D mesh {tuple(mesh.shape)} is HSDP for FSDP2, which needs its dims named. "
            "Fix: init_device_mesh(device_type, (replicas, shards), mesh_dim_names="
            "('replicate', 'shard')), or set fsdp.replicate_degree and drop mesh=..."
        )
    return mesh


def shard(model: nn.Module, plan: RegionPlan, config: FSDPConfig, mesh) -> list[str]:
    """``fully_shard`` on every region instance, then on the root.

    One FSDP unit per instance gives one all-gather per instance, issued (and, with
    ``reshard_after_forward``, freed) as that instance runs; the root unit collects the
    parameters outside any region (embeddings, head).

    Returns:
        FQNs of the modules sharded, root last as ``""``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(config.param_dtype), reduce_dtype=torch_dtype(config.reduce_dtype)
    )
    kwargs = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward, "mp_policy": mp}
    experts = expert_params(model, config.expert_params)
    if experts:
        kwargs["ignored_params"] = set(experts.values())
        average_expert_grads(experts, mesh.size() if mesh is not None else dist.get_world_size())
    done = []
    # Deepest first: a region nested in another (Siglip's MLP in its encoder layer) must be
    # a unit before its parent, whose fully_shard would otherwise take its parameters as
    # DTensors already, and fail ("value was None", from the mesh of a 2-D sharding).
    fqns = [fqn for region in plan for fqn in region.fqns]
    for fqn in sorted(fqns, key=lambda f: -f.count(".")):
        fully_shard(model.get_submodule(fqn), **kwargs)
        done.append(fqn)
    # The root's parameters (head, final norm) are the first backward needs: resharding
    # them after forward would only all-gather them again at once (FSDP2's own heuristic).
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    done.append("")
    return done


def expert_params(model: nn.Module, patterns: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """The parameters ``fsdp.expert_params`` names, by FQN.

    Raises:
        ConfigError: A pattern that matches no parameter (named with the closest one).
    """
    params = dict(model.named_parameters())
    found: dict[str, nn.Parameter] = {}
    for pattern in patterns:
        hits = {n: p for n, p in params.items() if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            raise ConfigError(
                f"fsdp.expert_params: {pattern!r} matches no parameter of the model"
                f"{did_you_mean(pattern, list(params))}. Fix: a glob over the parameter "
                "names (model.named_parameters()), such as 'layers.*.moe.experts.*'"
            )
        found.update(hits)
    return found


def average_expert_grads(experts: dict[str, nn.Parameter], ranks: int) -> None:
    """Divides each expert's gradient by ``ranks``: the all-to-all's backward sums it over
    every rank's tokens, and FSDP's average over the rest of the model is this one. A
    hook on each backward's contribution, so gradient accumulation stays right."""
    for p in experts.values():
        p.register_hook(lambda grad, ranks=ranks: grad / ranks)


def held_expert_regions(model: nn.Module, plan: RegionPlan, config: FSDPConfig) -> list[str]:
    """The regions holding a parameter of ``fsdp.expert_params``: an expert-parallel block,
    whose all-to-all split sizes are read on the host (``.tolist()``)."""
    held = expert_params(model, config.expert_params)
    return [r.name for r in plan if any(n.startswith(f + ".") for f in r.fqns for n in held)]


def fsdp_params(model: nn.Module) -> dict[str, dict]:
    """FQN -> sharded/unsharded shapes (and the unsharded tensor) of FSDP2 parameters."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    fqn_of = {id(m): f for f, m in model.named_modules()}
    found = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for p in _compat.fsdp_params_of(m) or []:  # None: internals missing, none reported
            fqn = ".".join(x for x in (fqn_of.get(id(p["module"]), "?"), p["param_name"]) if x)
            found[fqn] = {
                "unsharded": p["unsharded"],
                "sharded_shape": p["sharded_shape"],
                "unsharded_shape": p["unsharded_shape"],
                "storage_nbytes_now": p["unsharded"].untyped_storage().nbytes(),
            }
    return found
