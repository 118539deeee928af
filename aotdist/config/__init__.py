"""``AOTDistConfig``: what ``aotdist.parallelize`` applies, as frozen dataclasses.

Every section is a frozen, keyword-only dataclass that validates itself in
``__post_init__``. :meth:`AOTDistConfig.from_dict` and :meth:`AOTDistConfig.from_yaml`
are strict: an unknown key or a bad value anywhere is one :class:`ConfigError` that lists
*every* problem, each with its dotted key and the fix. An option that would have no
effect (Float8 all-gather without FSDP) warns once with :class:`ConfigWarning`.

A YAML file holds the sections at top level, or under an ``aotdist:`` key (so the
section can live inside a Lightning or Accelerate config)::

    fsdp: {enabled: true, reshard_after_forward: true}
    float8: {enabled: true, fsdp_all_gather: true}
    compile: {backend: inductor}
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotdist.config.pipeline import PipelineConfig
from aotdist.config.validation import Section, did_you_mean, problems_message
from aotdist.errors import ConfigError, ConfigWarning
from aotdist.log import rank_zero_warn

__all__ = [
    "AOTDistConfig",
    "as_config",
    "compile_backends",
    "ACConfig",
    "CacheConfig",
    "CompileConfig",
    "FSDPConfig",
    "Float8Config",
    "PipelineConfig",
    "RegionsConfig",
]

_DTYPES = ("float32", "bfloat16", "float16")
# The values a mode key accepts (public: the CLI and ``aotdist check`` offer the same ones).
FSDP_MODES = ("hooks", "graph")  # fsdp.mode (aotdist.fsdp.modes)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OUTER_MODES = ("auto", "inductor", "fx", "eager")  # compile.outer (aotdist.backends.regional)
_COMMON_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")  # known without torch._dynamo
_FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends a user can choose: every registered one (a user's own
    ``torch._dynamo.register_backend`` included), less torch's ``*_TESTING_ONLY`` ones."""
    import torch

    return sorted(
        b for b in torch.compiler.list_backends(exclude_tags=()) if not b.endswith("_TESTING_ONLY")
    )


def torch_dtype(name: str | None) -> Any:
    """The ``torch.dtype`` a config dtype name (``fsdp.param_dtype``, ``fsdp.reduce_dtype``)
    names; ``None`` (keep the parameters' own) stays ``None``."""
    import torch

    return None if name is None else getattr(torch, name)


@dataclass(frozen=True, kw_only=True)
class RegionsConfig(Section):
    """Which submodules become regions (see ``aotdist.find_regions``).

    Attributes:
        include: Class names or FQN globs of the modules that may become region
            instances; ``None`` considers every module with children.
        exclude: Class names or FQN globs that never become instances.
        min_repeats: The fewest instances a region needs.
    """

    _key: typing.ClassVar[str] = "regions"
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    min_repeats: int = 2

    def _rule_problems(self) -> list[str]:
        if self.min_repeats < 1:
            return [f"regions.min_repeats: must be >= 1, got {self.min_repeats}"]
        return []


@dataclass(frozen=True, kw_only=True)
class CompileConfig(Section):
    """How the regions are compiled.

    Attributes:
        enabled: Compile at all; with ``false`` the other steps still apply (eager).
        backend: A ``torch.compile`` backend name: ``inductor``, ``aot_eager``, ...
        mode: ``torch.compile`` mode for ``inductor`` (``default``,
            ``reduce-overhead``, ``max-autotune``, ``max-autotune-no-cudagraphs``).
        dynamic: ``torch.compile``'s ``dynamic``; ``null`` lets Dynamo decide.
        options: Backend options (Inductor config keys), scoped to this model.
        verify: Check the first training step against eager from the same state and
            stop with ``RegionMismatchError`` naming the region on a mismatch.
        outer: How the code around the regions runs: ``fx`` (with ``inductor``)
            compiles each distinct region body once and runs the glue between them
            unlowered (a shorter cold compile), ``inductor`` lowers the whole graph,
            ``eager`` builds no graph around the regions: each region compiles as a
            function of its own, shared by its instances, and the code between them runs
            eagerly (the shortest cold compile, the slowest step; not with graph-mode
            FSDP). ``auto`` (default) takes ``fx`` unless the mode records CUDA graphs,
            the artifact cache is on, or ``expected_steps`` says the run is long or short.
        expected_steps: How many optimizer steps the run takes, ``0`` (default) when
            unknown; Lightning's and the Trainer's integrations fill it from their
            ``max_steps``. With ``outer: auto`` and ``inductor``, a run of at least 10,000
            steps lowers the whole graph (the faster step pays back its longer compile);
            one of fewer than 1,000 steps, not sharded, takes ``eager`` (the shorter
            compile is not paid back).
    """

    _key: typing.ClassVar[str] = "compile"
    enabled: bool = True
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    options: dict | None = None
    verify: bool = False
    outer: str = "auto"
    expected_steps: int = 0

    def _rule_problems(self) -> list[str]:
        modes = COMPILE_MODES
        out = []
        if isinstance(self.expected_steps, int) and self.expected_steps < 0:
            out.append(
                f"compile.expected_steps: {self.expected_steps} is negative. Fix: the run's "
                "optimizer steps, or 0 when unknown"
            )
        if self.outer not in OUTER_MODES:
            out.append(
                f"compile.outer: unknown value {self.outer!r}"
                f"{did_you_mean(self.outer, OUTER_MODES)}; use one of {list(OUTER_MODES)}"
            )
        names = (
            []
            if not isinstance(self.backend, str) or self.backend in _COMMON_BACKENDS
            else compile_backends()
        )  # (a bad type is reported already)
        if names and self.backend not in names:
            out.append(
                f"compile.backend: unknown backend {self.backend!r}"
                f"{did_you_mean(self.backend, names)}. Fix: one of {', '.join(names)}, "
                "or register yours with torch._dynamo.register_backend before building "
                "the config"
            )
        if self.mode is not None and self.mode not in modes:
            out.append(
                f"compile.mode: unknown mode {self.mode!r}"
                f"{did_you_mean(self.mode, modes)}; use one of {list(modes)}"
            )
        elif self.mode is not None and self.backend != "inductor":
            out.append(
                f"compile.mode: applies to the inductor backend only; got backend "
                f"{self.backend!r} with mode {self.mode!r}. Fix: drop compile.mode or use "
                "compile.backend: inductor"
            )
        return out


@dataclass(frozen=True, kw_only=True)
class FSDPConfig(Section):
    """FSDP2 (``fully_shard``) on each region instance, then on the root.

    Attributes:
        enabled: Shard parameters with FSDP2 over the mesh (needs a process group).
        reshard_after_forward: Free unsharded parameters after forward (less memory,
            one more all-gather in backward); ``false`` keeps them until backward.
        param_dtype: Mixed precision: the dtype parameters are all-gathered and
            computed in (``bfloat16``, ``float16``, ``float32``); ``null`` keeps theirs.
        reduce_dtype: Mixed precision: the dtype gradients are reduced in.
        mode: One of ``FSDP_MODES``. ``hooks``: FSDP2 ``fully_shard`` units, each region
            compiled as its own graph inside FSDP2's eager hooks. ``graph`` (graph-mode
            FSDP): aotdist shards the parameters as DTensors itself and puts the
            all-gather / reduce-scatter in the one whole-model graph, each region an
            ``invoke_subgraph`` fed its own shards (see ``aotdist.fsdp.graph``).
        bucket_mb: Graph-mode FSDP compiled with ``aot_eager`` or ``inductor``: merge each
            compiled graph's all-gathers (and reduce-scatters) into buckets of at most
            this many MiB, one collective per bucket (see ``aotdist.backends.bucketing``).
            The default, 2000, is one bucket per graph for most models: a region's
            subgraph gathers all its parameters at once, as an FSDP2 unit does.
            ``null`` or ``0``: one collective per parameter.
        overlap: Graph-mode FSDP with ``inductor`` on CUDA: turn on Inductor's
            compute/communication overlap (collective reordering), scoped to this
            model's compiles. The collectives are then not bucketed (torch's scheduler
            reorders merged ones wrongly): with ``bucket_mb`` set it warns
            (``ConfigWarning``). On CPU it has no effect (a ``ConfigWarning``).
        replicate_degree: HSDP (both modes): replicate over this many groups and shard
            within each, a 2-D mesh ``(replicate, shard)``; it must divide the world size.
            Gradients are reduce-scattered within a shard group, then all-reduced across
            the replicas. ``1``: shard over every rank.
        expert_params: Expert parallelism under FSDP2 (hooks mode): glob patterns of
            parameter FQNs (``layers.*.moe.experts.*``) that each rank holds its own slice
            of, its experts, sharded over the same ranks as FSDP2 by your all-to-all
            dispatch. FSDP2 leaves them whole on each rank (``ignored_params``), and their
            gradient, which the all-to-all's backward sums over every rank's tokens, is
            divided by the mesh's size: the average over the ranks FSDP2 takes of the rest.
    """

    _key: typing.ClassVar[str] = "fsdp"
    enabled: bool = False
    mode: str = "hooks"
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    bucket_mb: float | None = 2000.0
    overlap: bool = False
    replicate_degree: int = 1
    expert_params: tuple[str, ...] = ()

    def _rule_problems(self) -> list[str]:
        out = [
            f"fsdp.{name}: unknown dtype {value!r}{did_you_mean(value, _DTYPES)}; use one of "
            f"{list(_DTYPES)} or null"
            for name, value in (
                ("param_dtype", self.param_dtype),
                ("reduce_dtype", self.reduce_dtype),
            )
            if value is not None and value not in _DTYPES
        ]
        if self.mode not in FSDP_MODES:
            out.append(
                f"fsdp.mode: unknown mode {self.mode!r}{did_you_mean(self.mode, FSDP_MODES)}"
                f"; use one of {list(FSDP_MODES)}"
            )
        elif self.mode == "graph" and not self.enabled:
            out.append(
                "fsdp.mode: graph shards the model, but fsdp.enabled is false. Fix: set "
                "fsdp.enabled: true, or drop fsdp.mode"
            )
        if self.bucket_mb is not None and not self.bucket_mb >= 0:
            out.append(
                f"fsdp.bucket_mb: must be >= 0 (MiB per bucket), got {self.bucket_mb!r}. "
                "Fix: a positive cap, or null / 0 for one collective per parameter"
            )
        if self.replicate_degree < 1:
            out.append(f"fsdp.replicate_degree: must be >= 1, got {self.replicate_degree}")
        if self.overlap and self.mode != "graph":
            out.append(
                "fsdp.overlap: reorders the collectives inside compiled graphs, which only "
                f"fsdp.mode: graph has (mode is {self.mode!r}). Fix: set fsdp.mode: graph, "
                "or drop fsdp.overlap"
            )
        return out


@dataclass(frozen=True, kw_only=True)
class Float8Config(Section):
    """Float8 training with torchao (``convert_to_float8_training``).

    Attributes:
        enabled: Swap eligible ``nn.Linear`` layers for torchao ``Float8Linear``.
        recipe: torchao scaling recipe: ``tensorwise``, ``rowwise`` or
            ``rowwise_with_gw_hp``.
        fsdp_all_gather: All-gather weights in float8 (tensorwise only). Hooks mode:
            torchao's FSDP2 extension, then ``aotdist.precompute_float8_scales(model)``
            runs after each optimizer step; graph mode: cast and gathered inside the
            graph, the scales set before each forward (``aotdist.fsdp.graph``).
        exclude: FQN globs of ``Linear`` layers to keep in high precision (an output
            head, say). Layers whose dims are not multiples of 16 are always kept.
    """

    _key: typing.ClassVar[str] = "float8"
    enabled: bool = False
    recipe: str = "tensorwise"
    fsdp_all_gather: bool = False
    exclude: tuple[str, ...] = ()

    def _rule_problems(self) -> list[str]:
        out = []
        if self.recipe not in _FLOAT8_RECIPES:
            out.append(
                f"float8.recipe: unknown recipe {self.recipe!r}"
                f"{did_you_mean(self.recipe, _FLOAT8_RECIPES)}; use one of "
                f"{list(_FLOAT8_RECIPES)}"
            )
        elif self.fsdp_all_gather and self.recipe != "tensorwise":
            out.append(
                f"float8.fsdp_all_gather: needs float8.recipe tensorwise, got "
                f"{self.recipe!r}. Fix: set float8.recipe: tensorwise or "
                "float8.fsdp_all_gather: false"
            )
        return out


@dataclass(frozen=True, kw_only=True)
class ACConfig(Section):
    """Activation checkpointing of each region instance.

    Attributes:
        enabled: Recompute each region's activations in backward instead of saving
            them (non-reentrant ``torch.utils.checkpoint`` around the region).
    """

    _key: typing.ClassVar[str] = "ac"
    enabled: bool = False


_CACHE_MODES = ("off", "local", "shared")


@dataclass(frozen=True, kw_only=True)
class CacheConfig(Section):
    """The compile artifact cache (``aotdist.cache``): compile once, reuse across runs and ranks.

    Attributes:
        mode: ``off``; ``local``: each rank saves its artifacts to ``dir`` after the first
            training step and the next run loads them before its first compile;
            ``shared``: rank 0 saves, and at start reads and sends its artifacts to the
            other ranks through the process group (``dir`` need not be shared); in the
            first run the other ranks load rank 0's artifacts of each graph it compiles.
        dir: Directory of the artifact files; required unless ``mode`` is ``off``.
        share_timeout_s: ``shared``: seconds a rank waits for rank 0's artifacts of a
            graph before compiling it itself (with a warning).
        precompile: Also save the whole-model graph (torch 2.14+, a whole-model compile,
            graph-mode FSDP included, Inductor, one graph): a warm start runs it untraced;
            the save traces once more.
    """

    _key: typing.ClassVar[str] = "cache"
    mode: str = "off"
    dir: str | None = None
    share_timeout_s: int = 300
    precompile: bool = True

    def _rule_problems(self) -> list[str]:
        out = []
        if self.mode not in _CACHE_MODES:
            out.append(
                f"cache.mode: unknown mode {self.mode!r}"
                f"{did_you_mean(self.mode, _CACHE_MODES)}; use one of {list(_CACHE_MODES)}"
            )
        elif self.mode != "off" and not self.dir:
            out.append(
                f"cache.dir: required with cache.mode {self.mode!r}, got {self.dir!r}. "
                "Fix: set cache.dir to a writable directory, or cache.mode: off"
            )
        if self.share_timeout_s < 1:
            out.append(f"cache.share_timeout_s: must be >= 1, got {self.share_timeout_s}")
        return out


_SECTIONS: dict[str, type[Section]] = {
    "regions": RegionsConfig,
    "compile": CompileConfig,
    "fsdp": FSDPConfig,
    "float8": Float8Config,
    "ac": ACConfig,
    "cache": CacheConfig,
    "pipeline": PipelineConfig,
}


@dataclass(frozen=True, kw_only=True)
class AOTDistConfig:
    """Everything ``aotdist.parallelize`` applies, section by section.

    Attributes:
        regions: Region selection.
        compile: Compile backend and options.
        fsdp: FSDP2 sharding.
        float8: torchao Float8 training.
        ac: Activation checkpointing per region instance.
        cache: Compile artifacts saved and shared across runs and ranks.
        pipeline: Pipeline parallelism (``aotdist.pipeline``).
    """

    regions: RegionsConfig = field(default_factory=RegionsConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    ac: ACConfig = field(default_factory=ACConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        problems = [
            f"{key}: expected a {cls.__name__}, got {type(getattr(self, key)).__name__}"
            for key, cls in _SECTIONS.items()
            if not isinstance(getattr(self, key), cls)
        ]
        if problems:
            raise ConfigError(problems_message(problems), problems=problems)
        if self.float8.enabled and self.float8.fsdp_all_gather and not self.fsdp.enabled:
            rank_zero_warn(
                "float8.fsdp_all_gather has no effect without FSDP (fsdp.enabled is false); "
                "weights are cast to float8 locally. Fix: set fsdp.enabled: true, or drop "
                "float8.fsdp_all_gather.",
                ConfigWarning,
                stacklevel=3,
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AOTDistConfig:
        """Builds a config from nested mappings, strictly.

        Args:
            data: ``{"fsdp": {"enabled": True}, ...}``; an ``aotdist`` key holding the
                sections is accepted too. ``None`` or ``{}`` gives the defaults.

        Raises:
            ConfigError: Unknown sections or keys, or bad values; every problem listed.
        """
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"an aotdist config must be a mapping of sections; got {data!r}")
        if "aotdist" in data:  # a section of a larger (Lightning, Accelerate...) config
            mixed = sorted(k for k in data if k in _SECTIONS)
            if mixed:
                raise ConfigError(
                    f"the config has an aotdist: section and aotdist sections {mixed} at top "
                    "level; Fix: put them all under aotdist:, or none."
                )
            data = data["aotdist"] or {}
            if not isinstance(data, Mapping):
                raise ConfigError(f"aotdist: expected a mapping of sections; got {data!r}")
        problems: list[str] = []
        sections: dict[str, Section] = {}
        for key in data:
            if key not in _SECTIONS:
                problems.append(
                    f"{key}: unknown section{did_you_mean(key, _SECTIONS)}; known "
                    f"sections: {list(_SECTIONS)}"
                )
        for key, section_cls in _SECTIONS.items():
            values = data.get(key) or {}
            if not isinstance(values, Mapping):
                problems.append(f"{key}: expected a mapping of options, got {values!r}")
                continue
            names = [f.name for f in dataclasses.fields(section_cls)]
            unknown = [k for k in values if k not in names]
            for k in unknown:
                problems.append(
                    f"{key}.{k}: unknown key{did_you_mean(k, names)}; known keys of {key}: {names}"
                )
            try:
                sections[key] = section_cls(**{k: v for k, v in values.items() if k in names})
            except ConfigError as exc:
                problems.extend(exc.problems)
        if problems:
            raise ConfigError(problems_message(problems), problems=problems)
        return cls(**sections)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> AOTDistConfig:
        """Loads a YAML file strictly (see :meth:`from_dict`).

        Raises:
            ConfigError: The file is missing, is not YAML, or holds a bad config.
        """
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except FileNotFoundError:
            raise ConfigError(
                f"aotdist config file not found: {os.fspath(path)!r}{_shipped_hint(path)}"
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{os.fspath(path)} is not valid YAML: {exc}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"in {os.fspath(path)}: {exc}", problems=exc.problems) from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as plain nested dicts (lists for tuples); ``from_dict`` inverts it."""
        out = {}
        for key in _SECTIONS:
            section = dataclasses.asdict(getattr(self, key))
            out[key] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
        return out

    def replace(self, **sections: Mapping[str, Any]) -> AOTDistConfig:
        """A copy with some options changed: ``cfg.replace(fsdp={"enabled": True})``."""
        merged = self.to_dict()
        for key, values in sections.items():
            if key not in _SECTIONS:
                raise ConfigError(
                    f"{key}: unknown section{did_you_mean(key, _SECTIONS)}; "
                    f"known sections: {list(_SECTIONS)}"
                )
            merged[key] = {**merged[key], **dict(values)}
        return AOTDistConfig.from_dict(merged)


def _shipped_hint(path: str | os.PathLike) -> str:
    """Where aotdist's installed copy of a shipped config is, for a path like
    ``configs/aotdist/fsdp2.yaml`` run outside a clone of the repository."""
    parts = Path(path).parts
    if "configs" not in parts:
        return ""
    copy = _shipped_configs().joinpath(*parts[parts.index("configs") + 1 :])
    if not copy.is_file():
        return ""
    return f"; aotdist installs a copy of its shipped config. Fix: pass {str(copy)!r}"


def _shipped_configs() -> Path:
    """The folder of aotdist's shipped configs: ``aotdist/configs`` when installed, the
    repository's ``configs/`` in a clone (or an editable install)."""
    package = Path(__file__).resolve().parents[1]  # aotdist/
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def as_config(config: AOTDistConfig | Mapping | str | os.PathLike | None) -> AOTDistConfig:
    """An ``AOTDistConfig`` from itself, a mapping of sections, a YAML path, or ``None``.

    Raises:
        ConfigError: Any other type, or a bad config (every problem listed).
    """
    if config is None:
        return AOTDistConfig()
    if isinstance(config, AOTDistConfig):
        return config
    if isinstance(config, Mapping):
        return AOTDistConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return AOTDistConfig.from_yaml(config)
    raise ConfigError(
        f"config must be an AOTDistConfig, a mapping or a YAML path; got {type(config).__name__}"
    )
