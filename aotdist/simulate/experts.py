"""What a plan of an expert-parallel job (``fsdp.expert_params``) adds: each rank's
experts (held whole, not sharded by FSDP2) and the all-to-alls of its step, forward and
backward, counted as the traced step issues them under balanced routing
(:mod:`aotdist.simulate.routing`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from aotdist.errors import ConfigError
from aotdist.simulate.report import Collective, Plan
from aotdist.simulate.routing import ASSUMPTION, BalancedRouting, imbalanced


def _check_imbalance(config: dict, world: int, imbalance: float) -> None:
    """``plan``'s ``expert_imbalance``: 1, or up to ``world`` for an expert-parallel job."""
    expert_parallel = bool((config.get("fsdp") or {}).get("expert_params"))
    if imbalance != 1.0 and not (expert_parallel and 1.0 < imbalance <= world):
        raise ConfigError(
            f"plan: expert_imbalance {imbalance:g} "
            + (
                f"is outside 1 to {world}: the hottest of {world} ranks receives between "
                f"the mean and every token. Fix: --expert-imbalance between 1 and {world}"
                if expert_parallel
                else "without expert parallelism: there is no routing to skew. Fix: add "
                "--expert-params (fsdp.expert_params), or drop --expert-imbalance"
            )
        )


def _routing(
    config: dict, groups: dict[str, str], world: int, per_node: int, imbalance: float = 1.0
) -> BalancedRouting | None:
    """The routing values of an expert-parallel job's trace (balanced, or ``imbalance``
    times the mean tokens to the traced rank), else ``None``."""
    if not (config.get("fsdp") or {}).get("expert_params"):
        return None
    import torch.distributed as dist

    # a user's all-to-all over the default group spans every rank
    default = dist.distributed_c10d.GroupMember.WORLD.group_name
    return BalancedRouting({default: "world", **groups}, imbalance)


@contextlib.contextmanager
def _phase(routing: Any, phase: str) -> Iterator[None]:
    """Within: what ``routing`` counts (the all-to-alls; context parallelism's
    :class:`~aotdist.simulate.context.AttentionCalls`: the SDPA calls) is ``phase``'s."""
    if routing is None:
        yield
        return
    routing.phase = phase
    try:
        yield
    finally:
        routing.phase = None


def _expert_parallel(
    out: Plan,
    model: nn.Module,
    routing: BalancedRouting,
    fsdp: Any,
    span: dict[str, bool],
    world_spans_nodes: bool,
    world: int,
) -> None:
    from aotdist.fsdp.hooks import expert_params

    experts = expert_params(model, fsdp.expert_params)
    if not routing.all_to_all:  # every rank would hold, and compute, every expert
        names = ", ".join(list(experts)[:2]) + (", ..." if len(experts) > 2 else "")
        raise ConfigError(
            f"plan: fsdp.expert_params names {len(experts)} parameters ({names}) but the "
            "traced step sends no all-to-all: the model's MoE computes its tokens with the "
            "experts this rank holds (as transformers' MoE layers do, every expert on every "
            "rank), so leaving them unsharded is not expert parallelism. Fix: shard the "
            "experts over the ranks with an all-to-all dispatch (aotdist.testing.moe has "
            "one), or drop fsdp.expert_params (--expert-params) to let FSDP2 shard them"
        )
    out.expert_param_bytes = sum(p.numel() * p.element_size() for p in experts.values())
    out.routing = ASSUMPTION if routing.imbalance == 1.0 else imbalanced(routing.imbalance, world)
    out.all_to_all = [
        Collective(
            "all_to_all",
            dim,
            count,
            nbytes,
            network=world_spans_nodes if dim == "world" else span.get(dim, False),
            phase=phase,
        )
        for (phase, dim), (count, nbytes) in sorted(routing.all_to_all.items(), reverse=True)
    ]
