"""How :func:`aotdist.parallelize` shards: one :class:`Sharding` strategy per FSDP setting.

:class:`NoSharding` (``fsdp.enabled: false``), :class:`HooksSharding` (``fsdp.mode: hooks``:
FSDP2 units per region instance) and :class:`GraphSharding` (``fsdp.mode: graph``:
graph-mode FSDP, DTensor shards and the collectives inside the compiled graph) are siblings
that answer the same steps, so ``parallelize`` is the recipe with no branch on the mode;
the mesh (1-D, or HSDP's 2-D) is one of those steps. Each also answers how a model so
sharded is compiled (:class:`CompileMode`) and how its call sees its parameters
(:meth:`Sharding.local_view`); :func:`sharding_of` tells which one a model has, so
compile, capture and the cache ask it instead of looking for FSDP themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch import nn

from aotdist._compat.enums import StrEnum
from aotdist.config import AOTDistConfig, Float8Config
from aotdist.errors import ConfigWarning
from aotdist.fsdp.graph import (
    check_graph_config,
    graph_plan,
    local_shards,
    shard_graph,
    sharded_call,
)
from aotdist.fsdp.hooks import (
    check_not_sharded,
    fsdp_mesh,
    fsdp_modules,
    held_expert_regions,
    shard,
)
from aotdist.log import rank_zero_warn
from aotdist.regions import RegionPlan

SHARDING_ATTR = "_aotdist_sharding"  # the Sharding that parallelize sharded a model with


class CompileMode(StrEnum):
    """How a model is compiled (:mod:`aotdist.compile`), as its sharding asks.

    Attributes:
        GRAPH: No FSDP2: the whole model is one graph, each region an ``invoke_subgraph``.
        FRAMES: FSDP2 units: each region's forward is one compiled graph shared by its
            instances, inside FSDP2's eager hooks.
    """

    GRAPH = "graph"
    FRAMES = "frames"


class Sharding(ABC):
    """The steps ``parallelize`` takes for one FSDP setting, in its order; the defaults
    leave the plan, the backend and the compiled model as they are."""

    compile_mode: ClassVar[CompileMode] = CompileMode.GRAPH

    @abstractmethod
    def check(self, model: nn.Module, config: AOTDistConfig) -> None:
        """Refuses, before anything changes, a model this setting cannot take."""

    @abstractmethod
    def mesh(self, model: nn.Module, mesh: Any, config: AOTDistConfig) -> Any:
        """The mesh to shard over (``None``: no sharding)."""

    def float8(self, config: AOTDistConfig) -> Float8Config:
        """The Float8 conversion this setting takes (the config's own by default)."""
        return config.float8

    def plan(self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig) -> RegionPlan:
        """The region plan this setting can compile."""
        return plan

    @abstractmethod
    def shard(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig, mesh: Any
    ) -> list[str]:
        """Shards the marked model; the FQNs of the modules sharded."""

    def backend(self, config: AOTDistConfig, mesh: Any) -> tuple[Any, dict | None]:
        """The ``(backend, options)`` to compile with."""
        return config.compile.backend, config.compile.options

    def finish(self, model: nn.Module, config: AOTDistConfig) -> None:
        """The last step, after compile."""
        return None  # nothing by default

    def host_scalar_regions(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig
    ) -> list[str]:
        """The regions whose host scalars (an all-to-all's split sizes) compile must trace
        as symbolic values from the first call, where it cannot see them fail."""
        return []

    def local_view(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Within: the parameters as the model's compiled call reads them."""
        return contextlib.nullcontext()


class NoSharding(Sharding):
    """FSDP off: nothing sharded; the user's own ``fully_shard`` units are kept (aotdist
    compiles inside them) unless Float8 must convert first."""

    def check(self, model: nn.Module, config: AOTDistConfig) -> None:
        check_not_sharded(model, allow_fsdp2=not config.float8.enabled)

    def mesh(self, model: nn.Module, mesh: Any, config: AOTDistConfig) -> Any:
        if mesh is not None:
            rank_zero_warn(
                "parallelize(mesh=...) has no effect with fsdp.enabled: false.",
                ConfigWarning,
                stacklevel=4,
            )
        return None

    def shard(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig, mesh: Any
    ) -> list[str]:
        return []


class HooksSharding(Sharding):
    """FSDP2 (``fully_shard``) per region instance, then the root; compiled inside its
    hooks (:mod:`aotdist.fsdp.hooks`)."""

    compile_mode = CompileMode.FRAMES

    def check(self, model: nn.Module, config: AOTDistConfig) -> None:
        check_not_sharded(model, allow_fsdp2=False)

    def mesh(self, model: nn.Module, mesh: Any, config: AOTDistConfig) -> Any:
        return fsdp_mesh(model, mesh, config.fsdp)

    def shard(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig, mesh: Any
    ) -> list[str]:
        return shard(model, plan, config.fsdp, mesh)

    def host_scalar_regions(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig
    ) -> list[str]:
        # an expert-parallel block runs in its own frame, where a .tolist() breaks the graph
        return held_expert_regions(model, plan, config.fsdp)


class GraphSharding(Sharding):
    """Graph-mode FSDP (:mod:`aotdist.fsdp.graph`): DTensor shards, the gathers and
    reduce-scatters in the one graph, bucketed by the backend, local shards put in place
    around each call."""

    def check(self, model: nn.Module, config: AOTDistConfig) -> None:
        check_not_sharded(model, allow_fsdp2=False)
        check_graph_config(config, model)

    def mesh(self, model: nn.Module, mesh: Any, config: AOTDistConfig) -> Any:
        return fsdp_mesh(model, mesh, config.fsdp)  # the same 1-D or HSDP mesh as hooks

    def float8(self, config: AOTDistConfig) -> Float8Config:
        # It gathers in float8 itself (aotdist.fsdp.graph): the weights stay plain.
        return dataclasses.replace(config.float8, fsdp_all_gather=False)

    def plan(self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig) -> RegionPlan:
        return graph_plan(model, plan, config)  # drops (with a warning) what it cannot feed

    def shard(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig, mesh: Any
    ) -> list[str]:
        checkpointed = tuple(f for r in plan for f in r.fqns) if config.ac.enabled else ()
        return shard_graph(model, config, mesh, checkpointed)

    def backend(self, config: AOTDistConfig, mesh: Any) -> tuple[Any, dict | None]:
        from aotdist.backends.named import graph_fsdp_backend

        return graph_fsdp_backend(
            config.compile.backend,
            config.compile.options,
            bucket_mb=config.fsdp.bucket_mb,
            overlap=config.fsdp.overlap,
            device_type=mesh.device_type,
        )

    def host_scalar_regions(
        self, model: nn.Module, plan: RegionPlan, config: AOTDistConfig
    ) -> list[str]:
        # else the one graph's first trace fails at the block's .tolist(), and is redone
        return held_expert_regions(model, plan, config.fsdp)

    def finish(self, model: nn.Module, config: AOTDistConfig) -> None:
        sharded_call(model, config)  # outermost, eager: local shards for each forward

    def local_view(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return local_shards(model)  # the regions read local shards, as ShardedCall runs


def sharding_for(config: AOTDistConfig) -> Sharding:
    """The :class:`Sharding` strategy for ``config.fsdp``."""
    if not config.fsdp.enabled:
        return NoSharding()
    return GraphSharding() if config.fsdp.mode == "graph" else HooksSharding()


def record_sharding(model: nn.Module, sharding: Sharding, sharded: list[str]) -> None:
    """Records on ``model`` the sharding it was sharded with (none if nothing was)."""
    if sharded:
        model.__dict__[SHARDING_ATTR] = sharding


def sharding_of(model: nn.Module) -> Sharding:
    """The sharding ``model`` has now: the one ``parallelize`` recorded, else hooks mode
    for a model holding FSDP2 units (the user's own ``fully_shard``), else none."""
    recorded = vars(model).get(SHARDING_ATTR)
    if recorded is not None:
        return recorded
    return HooksSharding() if fsdp_modules(model) else NoSharding()
