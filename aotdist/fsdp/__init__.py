"""FSDP2 behind one interface: sharding per region instance (hooks mode) and graph-mode FSDP.

:mod:`~aotdist.fsdp.hooks`: ``fully_shard`` per region instance, then the root; FSDP2's
eager hooks gather and free parameters and aotdist compiles each region's forward inside
them (per-region frames). :mod:`~aotdist.fsdp.graph`: parameters become DTensor shards
and the all-gathers and reduce-scatters are functional collectives inside the one
whole-model graph. Ordering checks and the mesh (1-D, or 2-D HSDP) live in ``hooks``;
:mod:`~aotdist.fsdp.modes` puts each setting (off, hooks, graph-mode FSDP) behind one
interface, :class:`~aotdist.fsdp.modes.Sharding`, which ``aotdist.parallelize`` follows.
"""

from aotdist.fsdp.graph import (
    check_graph_config,
    graph_plan,
    local_shards,
    shard_graph,
    sharded_call,
)
from aotdist.fsdp.hooks import (
    check_not_sharded,
    default_mesh,
    fsdp_mesh,
    fsdp_modules,
    fsdp_params,
    is_fsdp_module,
    require_process_group,
    shard,
)
from aotdist.fsdp.modes import (
    CompileMode,
    GraphSharding,
    HooksSharding,
    NoSharding,
    Sharding,
    record_sharding,
    sharding_for,
    sharding_of,
)

__all__ = [
    "CompileMode",
    "GraphSharding",
    "HooksSharding",
    "NoSharding",
    "Sharding",
    "check_graph_config",
    "check_not_sharded",
    "default_mesh",
    "fsdp_mesh",
    "fsdp_modules",
    "fsdp_params",
    "graph_plan",
    "is_fsdp_module",
    "local_shards",
    "record_sharding",
    "require_process_group",
    "shard",
    "shard_graph",
    "sharded_call",
    "sharding_for",
    "sharding_of",
]
