"""The strategies ``aotdist bench`` compares, in a registry.

A strategy turns a freshly built model into the module the training loop calls, in one
of two settings: a single process, or FSDP2 over a process group (``fsdp=True``). Every
strategy sees the same model, the same Float8 conversion (when asked) and, under FSDP2,
the same sharding units (one ``fully_shard`` per repeated block instance, then the root),
so the only difference is how it compiles.

New strategies (``aotdist+cache``: the artifact cache) register themselves
with :func:`register_strategy`; the CLI and the report pick them up from
:data:`STRATEGIES`. A strategy that needs something this build may lack says so through
``unavailable`` (its cells are then skipped with that note, not failed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from aotdist._compat.extras import require
from aotdist._compat.models import declared_repeated_blocks
from aotdist.bench.stats import WHOLE_MODEL_NOTE
from aotdist.errors import ConfigError

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # Inductor's modes with CUDA graphs


@dataclass(frozen=True)
class Setup:
    """What a strategy is applied under, the same for every strategy of a measurement.

    Attributes:
        backend: The ``torch.compile`` backend (``inductor``, ``aot_eager``...).
        fsdp: Shard with FSDP2 over the default process group.
        float8: Convert eligible ``nn.Linear`` layers to torchao ``Float8Linear``.
        replicate: With ``fsdp``: HSDP over ``(replicate, world / replicate)`` (``--mesh``).
        mode: The ``torch.compile`` mode of every compiling strategy (``--mode``;
            ``None``: the default). ``reduce-overhead`` and ``max-autotune`` add CUDA graphs.
    """

    backend: str = "inductor"
    fsdp: bool = False
    float8: bool = False
    replicate: int = 1
    mode: str | None = None

    def compile_kwargs(self) -> dict:
        """``backend`` and, when set, ``mode``: what a strategy passes to ``torch.compile``,
        and the ``compile`` section of an aotdist config with the same choices."""
        return {"backend": self.backend, **({"mode": self.mode} if self.mode else {})}


@dataclass(frozen=True)
class Strategy:
    """One way to compile a model for training.

    Attributes:
        name: The name used on the command line and in the report.
        apply: ``apply(model, setup) -> module to call``; may change ``model`` in place.
        description: One line for ``--help`` and the report.
        compiles: ``False`` for eager (its compile time is 0 by definition).
        notes: ``notes(model) -> str``: what the strategy did on this model, when it
            differs from what its name promises (empty otherwise).
        unavailable: ``unavailable() -> str``: why this build cannot run the strategy
            (empty when it can); the bench skips its cells with that note.
    """

    name: str
    apply: Callable[[nn.Module, Setup], nn.Module]
    description: str
    compiles: bool = True
    notes: Callable[[nn.Module], str] | None = None
    unavailable: Callable[[], str] | None = None


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(
    name: str,
    *,
    description: str,
    compiles: bool = True,
    notes: Callable[[nn.Module], str] | None = None,
    unavailable: Callable[[], str] | None = None,
):
    """Decorator registering ``apply(model, setup)`` as strategy ``name``.

    Raises:
        ConfigError: ``name`` is registered already.
    """

    def decorator(fn: Callable[[nn.Module, Setup], nn.Module]):
        if name in STRATEGIES:
            raise ConfigError(f"bench strategy {name!r} is registered twice; pick another name")
        STRATEGIES[name] = Strategy(
            name=name,
            apply=fn,
            description=description,
            compiles=compiles,
            notes=notes,
            unavailable=unavailable,
        )
        return fn

    return decorator


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``.

    Raises:
        ConfigError: No strategy has that name.
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown bench strategy {name!r}; choose from "
            f"{', '.join(STRATEGIES)} (--strategies a,b,...)"
        ) from None


def _float8(model: nn.Module, setup: Setup) -> None:
    if setup.float8:
        from aotdist.config import Float8Config
        from aotdist.float8 import convert_to_float8

        convert_to_float8(model, Float8Config(enabled=True))


def _shard(model: nn.Module, setup: Setup) -> None:
    """The sharding every FSDP2 strategy shares: each block instance, then the root."""
    import aotdist
    from aotdist.config import FSDPConfig
    from aotdist.fsdp import default_mesh, shard

    shard(
        model,
        aotdist.find_regions(model),
        FSDPConfig(enabled=True),
        default_mesh(model, replicate_degree=setup.replicate),
    )


@register_strategy(
    "eager", description="no compile (FSDP2 units per block under --nproc)", compiles=False
)
def _eager(model: nn.Module, setup: Setup) -> nn.Module:
    _float8(model, setup)
    if setup.fsdp:
        _shard(model, setup)
    return model


@register_strategy(
    "full",
    description="torch.compile of the whole model (model.compile(), "
    "in place; under FSDP2 after fully_shard, as users do)",
)
def _full(model: nn.Module, setup: Setup) -> nn.Module:
    _float8(model, setup)
    if setup.fsdp:
        _shard(model, setup)
    model.compile(**setup.compile_kwargs())
    return model


def _accelerate_notes(model: nn.Module) -> str:
    other = require("accelerate.utils.other", feature="the bench strategy 'accelerate'")
    if other.has_repeated_blocks(model):
        return ""
    return (
        f"no nn.ModuleList of repeated blocks: Accelerate's compile_regions "
        f"{WHOLE_MODEL_NOTE} (same as full)"
    )


@register_strategy(
    "accelerate",
    description="accelerate.utils.compile_regions (per-block "
    "torch.compile of nn.ModuleList blocks); under FSDP2 Accelerate's own order: "
    "compile_regions_fsdp2, then fully_shard",
    notes=_accelerate_notes,
)
def _accelerate(model: nn.Module, setup: Setup) -> nn.Module:
    _float8(model, setup)
    if setup.fsdp:
        # Accelerator.prepare with FSDP2 + regional compile: in-place per-block .compile()
        # first, then fully_shard (fsdp2_prepare_model), so FSDP's hooks still fire.
        other = require("accelerate.utils.other", feature="the bench strategy 'accelerate'")
        other.compile_regions_fsdp2(model, **setup.compile_kwargs())
        _shard(model, setup)
        return model
    utils = require("accelerate.utils", feature="the bench strategy 'accelerate'")
    return utils.compile_regions(model, **setup.compile_kwargs())


@register_strategy(
    "aotdist",
    description="aotdist.parallelize: regions compiled once through "
    "invoke_subgraph (frames mode under FSDP2)",
)
def _aotdist(model: nn.Module, setup: Setup) -> nn.Module:
    return _parallelize(model, setup)


def _parallelize(
    model: nn.Module, setup: Setup, *, graph: bool = False, outer: str | None = None
) -> nn.Module:
    """``aotdist.parallelize`` with the bench's settings; ``graph``: graph-mode FSDP under
    --nproc; ``outer``: ``compile.outer`` (default: aotdist's)."""
    import aotdist

    compile_ = {**setup.compile_kwargs(), **({"outer": outer} if outer else {})}
    return aotdist.parallelize(
        model,
        config={
            "compile": compile_,
            "fsdp": {
                "enabled": setup.fsdp,
                "mode": "graph" if graph and setup.fsdp else "hooks",
                "replicate_degree": setup.replicate,
            },
            "float8": {"enabled": setup.float8},
        },
    )


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: every instance of the regions aotdist's plan finds."""
    import aotdist

    return [
        model.get_submodule(fqn) for region in aotdist.find_regions(model) for fqn in region.fqns
    ]


@register_strategy(
    "per_block",
    description="block.compile(fullgraph=True) on each repeated "
    "block (those aotdist's plan finds, wherever they live), in place, as "
    "torchtitan applies it; under FSDP2 before fully_shard, torchtitan's order",
)
def _per_block(model: nn.Module, setup: Setup) -> nn.Module:
    _float8(model, setup)
    blocks = _blocks(model)
    if not blocks:
        raise ConfigError(
            "bench strategy per_block found no repeated blocks in the model. "
            "Fix: use a model with repeated blocks, or strategy full."
        )
    for block in blocks:  # nn.Module.compile: the module stays, its call is compiled
        block.compile(fullgraph=True, **setup.compile_kwargs())
    if setup.fsdp:
        _shard(model, setup)
    return model


def _declaring(model: nn.Module) -> list[nn.Module]:
    """The diffusers models inside ``model`` that declare ``_repeated_blocks``."""
    return [
        m
        for m in model.modules()
        if declared_repeated_blocks(m) and hasattr(m, "compile_repeated_blocks")
    ]


def _no_diffusers() -> str:
    import importlib.util

    return (
        "" if importlib.util.find_spec("diffusers") else "needs diffusers (pip install diffusers)"
    )


@register_strategy(
    "repeated_blocks",
    description="diffusers' compile_repeated_blocks(fullgraph=True): block.compile() on "
    "each block class a diffusers model declares in _repeated_blocks (the regional "
    "compile diffusers documents); no FSDP2 or Float8 here",
    unavailable=_no_diffusers,
)
def _repeated_blocks(model: nn.Module, setup: Setup) -> nn.Module:
    declaring = _declaring(model)
    if not declaring:
        raise ConfigError(
            "bench strategy repeated_blocks found no diffusers model declaring "
            "_repeated_blocks. Fix: use --model flux, or strategy per_block."
        )
    if setup.fsdp or setup.float8:
        raise ConfigError(
            "bench strategy repeated_blocks runs in one process without Float8 (diffusers' "
            "own regional compile). Fix: drop --nproc / --float8 for it, or use per_block."
        )
    for m in declaring:
        m.compile_repeated_blocks(fullgraph=True, **setup.compile_kwargs())
    return model


@register_strategy(
    "aotdist-graph",
    description="aotdist.parallelize with fsdp.mode: graph "
    "under --nproc: DTensor shards, all-gather / reduce-scatter inside the one "
    "whole-model graph, regions invoke_subgraph (as aotdist in one process)",
    notes=lambda model: (
        "" if _graph_sharded(model) else "one process: no sharding, same as aotdist"
    ),
)
def _aotdist_graph(model: nn.Module, setup: Setup) -> nn.Module:
    return _parallelize(model, setup, graph=True)


@register_strategy(
    "aotdist+lowered",
    description="aotdist.parallelize with compile.outer: "
    "inductor (the whole graph lowered by Inductor, region bodies inside it; "
    "aotdist's default compiles the bodies only)",
)
def _aotdist_lowered(model: nn.Module, setup: Setup) -> nn.Module:
    return _parallelize(model, setup, outer="inductor")


@register_strategy(
    "aotdist+frames",
    description="aotdist.parallelize with compile.outer: "
    "eager (what a run of under 1,000 steps gets): each region compiled once as a "
    "function of its own, shared by its instances; the code between them eager",
)
def _aotdist_frames(model: nn.Module, setup: Setup) -> nn.Module:
    return _parallelize(model, setup, outer="eager")


@register_strategy(
    "aotdist-graph+lowered",
    description="aotdist-graph with compile.outer: "
    "inductor (the whole sharded step lowered by Inductor, bucket copies and "
    "root work included; the default compiles the region bodies only)",
    notes=lambda model: (
        "" if _graph_sharded(model) else "one process: no sharding, same as aotdist+lowered"
    ),
)
def _aotdist_graph_lowered(model: nn.Module, setup: Setup) -> nn.Module:
    return _parallelize(model, setup, graph=True, outer="inductor")


def _graph_sharded(model: nn.Module) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


ARTIFACTS_ENV = "AOTDIST_BENCH_ARTIFACTS"


@register_strategy(
    "aotdist+cache",
    description="aotdist with cache.mode shared: rank 0 "
    "compiles and shares its artifacts, and a second fresh run starts from "
    f"the saved bundle (directory from ${ARTIFACTS_ENV})",
)
def _aotdist_cache(model: nn.Module, setup: Setup, *, graph: bool = False) -> nn.Module:
    import os

    import aotdist

    where = os.environ.get(ARTIFACTS_ENV)
    if not where:
        raise ConfigError(
            f"bench strategy aotdist+cache needs ${ARTIFACTS_ENV} (the bundle "
            "directory); `aotdist bench` sets it. Fix: set it to a directory."
        )
    graph = graph and setup.fsdp
    return aotdist.parallelize(
        model,
        config={
            "compile": setup.compile_kwargs(),
            "fsdp": {
                "enabled": setup.fsdp,
                "replicate_degree": setup.replicate,
                "mode": "graph" if graph else "hooks",
            },
            "float8": {"enabled": setup.float8},
            "cache": {"mode": "local" if graph else "shared", "dir": where},
        },
    )


@register_strategy(
    "aotdist-graph+cache",
    description="aotdist-graph with cache.mode local: "
    "each rank saves its bundle (with the whole sharded step's saved graph), "
    "and a second fresh run starts from it",
    notes=lambda model: (
        "" if _graph_sharded(model) else "one process: no sharding, same as aotdist+cache"
    ),
)
def _aotdist_graph_cache(model: nn.Module, setup: Setup) -> nn.Module:
    return _aotdist_cache(model, setup, graph=True)
