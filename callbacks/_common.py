"""What the Lightning callback and the Accelerate hook share: config merging, turning
FSDP2 on where the host shards, choosing the module to compile, and applying aotdist once,
in cooperation with what the user did.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from aotdist import RegionPlan, compile_from_config, find_regions, parallelize, parallelize_info
from aotdist._compat.enums import StrEnum
from aotdist.compile import is_compiled
from aotdist.config import AOTDistConfig, as_config
from aotdist.errors import ConfigError, OrderingError
from aotdist.fsdp import fsdp_modules
from aotdist.log import get_logger


class ApplyHow(StrEnum):
    """How the Lightning callback / Accelerate hook applied aotdist to a model.

    Attributes:
        PARALLELIZE: aotdist applied ``aotdist.parallelize``.
        USER: The user had applied aotdist already; left as it is.
        COMPILE_IN_USER_FSDP: The user sharded with FSDP2; aotdist compiled inside the units.
    """

    PARALLELIZE = "parallelize"
    USER = "user"
    COMPILE_IN_USER_FSDP = "compile_in_user_fsdp"


def merge_config(
    config: AOTDistConfig | Mapping | str | os.PathLike | None,
    *,
    include: list[str] | str | None = None,
    exclude: list[str] | str | None = None,
    backend: str | None = None,
    mode: str | None = None,
) -> AOTDistConfig:
    """``config`` (object, mapping or YAML path) with the keyword arguments given applied.

    Raises:
        ConfigError: A bad config or argument (every problem listed).
    """
    cfg = as_config(config)
    regions: dict[str, Any] = {}
    if include is not None:
        regions["include"] = [include] if isinstance(include, str) else list(include)
    if exclude is not None:
        regions["exclude"] = [exclude] if isinstance(exclude, str) else list(exclude)
    compile_: dict[str, Any] = {}
    if backend is not None:
        compile_["backend"] = backend
    if mode is not None:
        compile_["mode"] = mode
    return cfg.replace(regions=regions, compile=compile_) if regions or compile_ else cfg


def compile_only_config(
    config: AOTDistConfig | Mapping | str | os.PathLike | None,
    *,
    include: list[str] | str | None,
    exclude: list[str] | str | None,
    backend: str | None,
    what: str,
    why: str,
    fix: str,
) -> AOTDistConfig:
    """:func:`merge_config` for an integration that compiles only (a hook, a callback that
    gets the model after the optimizer or the host's wrapping).

    Raises:
        ConfigError: A bad config, or ``fsdp`` / ``float8`` enabled: ``what`` compiles
            only, ``why`` it cannot replace the parameters, and the ``fix``.
    """
    cfg = merge_config(config, include=include, exclude=exclude, backend=backend)
    if cfg.fsdp.enabled or cfg.float8.enabled:
        raise ConfigError(
            f"{what} compiles only; fsdp.enabled / float8.enabled replace the "
            f"model's parameters, {why}. Fix: {fix}."
        )
    return cfg


def enable_fsdp_for_host(
    config: AOTDistConfig, *, host: str, over: str, log: Callable[[str], Any]
) -> AOTDistConfig:
    """``config`` with FSDP2 on (``fsdp.enabled``), logged with ``log`` once, when the host
    (Lightning's ``ModelParallelStrategy``, Accelerate's ``ParallelismConfig``) shards over
    data-parallel ranks and leaves the sharding to aotdist; ``config`` itself if it is on.

    ``host`` and ``over`` complete the message: "aotdist: <host>, enabling FSDP2
    (fsdp.enabled) over its data-parallel <over>."
    """
    if config.fsdp.enabled:
        return config
    log(f"aotdist: {host}, enabling FSDP2 (fsdp.enabled) over its data-parallel {over}.")
    return config.replace(fsdp={"enabled": True})


def with_run_length(config: AOTDistConfig, max_steps: Any, *, host: str) -> AOTDistConfig:
    """``config`` with ``compile.expected_steps`` from the host's ``max_steps`` (Lightning's
    ``Trainer(max_steps=)``, ``TrainingArguments(max_steps=)``), which ``compile.outer:
    auto`` reads; ``config`` itself where the user set it, or the host does not know (-1 or
    unset: an epoch-bound run)."""
    if config.compile.expected_steps or not isinstance(max_steps, int) or max_steps <= 0:
        return config
    get_logger(__name__).debug("aotdist: compile.expected_steps %d from %s", max_steps, host)
    return config.replace(compile={"expected_steps": max_steps})


def expert_checkpoint_error(what: str) -> ConfigError:
    """The refusal of a full-state checkpoint of a model whose experts are per rank
    (``fsdp.expert_params``): a full state dict would hold one rank's experts."""
    return ConfigError(
        f"{what} saves a full state dict, but each rank holds its own experts "
        "(fsdp.expert_params): the checkpoint would keep one rank's experts and lose the "
        "others. aotdist does not gather experts into one checkpoint yet. Fix: turn it off "
        f"({what}) and save the experts on every rank yourself (torch.save of the expert "
        "parameters per rank, next to the rest)"
    )


@dataclass
class Applied:
    """What :func:`apply_aotdist` found or did.

    Attributes:
        target: The module aotdist compiled (the child of the root holding every region
            instance, or the root itself).
        target_fqn: Its FQN in the root (``""`` for the root).
        how: An :class:`~aotdist.callbacks._common.ApplyHow`: ``parallelize`` (aotdist applied it),
            ``user`` (the user had called ``aotdist.parallelize``/``compile_regions``: left
            as it is) or ``compile_in_user_fsdp`` (the user sharded; aotdist compiled inside).
        config: The config in effect.
    """

    target: nn.Module
    target_fqn: str
    how: ApplyHow
    config: AOTDistConfig

    def describe(self, root_name: str) -> str:
        """One line for the log: what was done to which module, in a user's words."""
        where = repr(self.target_fqn) if self.target_fqn else root_name
        if self.how == ApplyHow.USER:
            return f"aotdist: {where} was set up by your own aotdist call; left as it is"
        if self.how == ApplyHow.COMPILE_IN_USER_FSDP:
            return f"aotdist: compiled the regions of {where} inside your FSDP2 units"
        c = self.config
        done = [
            "converted its Linear layers to Float8" if c.float8.enabled else "",
            "checkpointed activations" if c.ac.enabled else "",
            f"sharded it with FSDP2 ({c.fsdp.mode} mode)" if c.fsdp.enabled else "",
            "compiled its regions" if c.compile.enabled else "",
        ]
        return f"aotdist: {', '.join(d for d in done if d) or 'nothing to do'} ({where})"


def _find_user_applied(root: nn.Module) -> tuple[str, nn.Module] | None:
    for fqn, m in root.named_modules():
        if parallelize_info(m) is not None or is_compiled(m):
            return fqn, m
    return None


def _target(root: nn.Module, plan: RegionPlan) -> str:
    """The first-level child of ``root`` holding every region instance, else ``""``.

    That child is what a ``training_step`` calls (``self.model(x)``), so compiling it in
    place and putting the FSDP root unit on it makes both take effect.
    """
    heads = {fqn.split(".", 1)[0] for fqn in plan.fqns if "." in fqn}
    if len(heads) == 1 and all("." in fqn for fqn in plan.fqns):
        return heads.pop()
    return ""


def apply_aotdist(
    root: nn.Module,
    config: AOTDistConfig,
    *,
    mesh: Any = None,
    what: str = "aotdist",
    child_target: bool = True,
) -> Applied:
    """Applies ``config`` to ``root`` once, cooperating with what the user already did.

    - The user called ``aotdist.parallelize`` / ``compile_regions`` on ``root`` or a
      submodule: nothing is applied again.
    - The user sharded with ``fully_shard`` (and Float8/FSDP are off in ``config``): the
      regions are compiled inside the user's FSDP units.
    - Otherwise ``aotdist.parallelize`` runs on the target module.

    Args:
        root: The LightningModule or the model handed to Accelerate.
        config: What to apply.
        mesh: FSDP2's mesh, when ``config.fsdp.enabled``.
        what: Name used in error messages (the callback's or hook's).
        child_target: Compile the first-level child holding every region (a
            LightningModule's ``self.model``) rather than ``root`` itself.

    Raises:
        ConfigError: No repeated regions, or a bad config.
        OrderingError: The user sharded and ``config`` asks for FSDP or Float8 (both must
            come before sharding), or the model was compiled already.
    """
    found = _find_user_applied(root)
    if found is not None:
        fqn, module = found
        info = parallelize_info(module)
        return Applied(module, fqn, ApplyHow.USER, info.config if info else config)
    rc = config.regions
    plan = find_regions(root, include=rc.include, exclude=rc.exclude, min_repeats=rc.min_repeats)
    if len(plan) == 0:
        raise ConfigError(
            f"{what} found no repeated regions in {type(root).__name__}. Fix: pass "
            "include=[<block class name>] (or min_repeats=1), or remove it."
        )
    fqn = _target(root, plan) if child_target else ""
    target = root.get_submodule(fqn) if fqn else root
    prefix = f"{fqn}." if fqn else ""
    # Patterns were matched against the root's FQNs; the target sees them without prefix.
    exact = {"include": [f[len(prefix) :] for f in plan.fqns], "exclude": None}
    sharded = fsdp_modules(root)
    if sharded:
        if config.fsdp.enabled or config.float8.enabled:
            raise OrderingError(
                f"{what}: the model was already sharded with fully_shard ({sharded[:3]}), but "
                "fsdp/float8 are enabled: Float8 conversion and region marking must come "
                "before sharding. Fix: call aotdist.parallelize(model, config=config) where you "
                "shard now (e.g. in configure_model) instead of fully_shard."
            )
        compile_from_config(target, config, plan=find_regions(target, include=exact["include"]))
        return Applied(target, fqn, ApplyHow.COMPILE_IN_USER_FSDP, config)
    effective = config.replace(regions=exact)
    parallelize(target, config=effective, mesh=mesh if config.fsdp.enabled else None)
    return Applied(target, fqn, ApplyHow.PARALLELIZE, effective)


def metric_values(m: Any) -> dict[str, float]:
    """A metrics window (``aotdist.metrics.CompileMetrics``) as the flat ``aotdist/...``
    values the integrations log: compile time by phase, graphs, breaks, recompiles, and
    per region its instances, call sites and subgraphs."""
    values: dict[str, float] = {
        "aotdist/compile_seconds": m.compile_seconds,
        "aotdist/dynamo_seconds": m.dynamo_seconds,
        "aotdist/aot_autograd_seconds": m.aot_autograd_seconds,
        "aotdist/backend_seconds": m.backend_seconds,
        "aotdist/graphs": m.graphs,
        "aotdist/graph_breaks": m.num_graph_breaks,
        "aotdist/recompiles": len(m.recompiles),
    }
    for name, st in m.regions.items():
        values[f"aotdist/{name}/instances"] = st.instances
        values[f"aotdist/{name}/call_sites"] = st.call_sites
        values[f"aotdist/{name}/subgraphs"] = st.subgraphs
    return values
