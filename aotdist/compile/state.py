"""What aotdist did to a model, recorded on the model itself.

:func:`aotdist.compile_regions` / marking store a :class:`RegionState` on the root module
under :data:`STATE_ATTR`; :func:`aotdist.parallelize` stores its record
(``aotdist.parallelize.ParallelizeInfo``) under :data:`INFO_ATTR`. Both names live here,
below every module that reads them, so that reading a record never needs the module that
wrote it (``restore`` reads parallelize's record; ``metrics`` reads the region state).
The artifact cache keeps its own :class:`CacheRecord` there (``RegionState.hooks.cache``),
and hears of each compiled call through ``RegionState.hooks.watchers`` (a
:class:`CompiledCall`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from aotdist.fsdp.modes import CompileMode  # the sharding answers it; re-exported here
from aotdist.regions import RegionPlan

STATE_ATTR = "_aotdist_state"
INFO_ATTR = "_aotdist_parallelized"  # aotdist.parallelize's ParallelizeInfo
# metrics.fixes of a region whose host values (.tolist(), .item()) are traced symbolically
HOST_SCALARS = "capture_scalar_outputs"


@dataclass
class RegionState:
    """What aotdist did to a model; stored on the root module under ``_aotdist_state``.

    Split by who writes each part: marking and the first step's fixes write ``applied``;
    ``compile_regions`` writes ``settings`` once; the compiled calls write ``log``, which
    ``metrics`` and the warnings read; the cache and compile_regions hang their calls on
    ``hooks``."""

    plan: RegionPlan
    backend: Callable | None = None  # aotdist.backends.recording.RecordingBackend
    compiled: bool = False
    applied: Applied = field(default_factory=lambda: Applied())
    settings: CompileSettings = field(default_factory=lambda: CompileSettings())
    log: RunLog = field(default_factory=lambda: RunLog())
    hooks: CallHooks = field(default_factory=lambda: CallHooks())


@dataclass
class Applied:
    """What was done to the regions: marking, then the first step's fixes and demotions."""

    checkpoint: bool = False  # activation checkpointing around each region instance
    marked: dict[str, str] = field(default_factory=dict)  # instance fqn -> region name
    classes: dict[str, type] = field(default_factory=dict)  # region name -> its class
    fixes: dict[str, str] = field(default_factory=dict)  # region name -> fix applied
    demoted: dict[str, str] = field(default_factory=dict)  # region name -> reason


@dataclass(frozen=True)
class CompileSettings:
    """How ``compile_regions`` compiled the model; set once, before the first call."""

    mode: CompileMode = CompileMode.GRAPH  # see aotdist.compile
    backend_name: str = ""  # the backend asked for (a name), for the check's tolerance
    verify: bool = False  # compile.verify: the first training call checked against eager
    dynamic_inputs: bool = False  # dynamic=True: inputs' dims marked dynamic at each call
    dynamic: bool | None = None  # torch.compile's dynamic (verify and precompile trace again)


@dataclass
class RunLog:
    """What the compiled calls found; ``metrics`` and the warnings read it."""

    eager: dict[str, str] = field(default_factory=dict)  # region -> why it ran uncompiled
    reuse: dict[str, str] = field(default_factory=dict)  # region -> why it has >1 subgraph
    # region code name -> torch's reason for not reusing its subgraph (first compile)
    refusals: dict[str, str] = field(default_factory=dict)
    frame_calls: dict[str, set[int]] = field(default_factory=dict)  # region -> id(instance)
    # region -> why its host scalars are now traced, until announced (compile.guard)
    scalars: dict[str, str] = field(default_factory=dict)
    # the first calls' one-shot checks, each done once
    fsdp_checked: bool = False  # no FSDP2 unit added after compiling
    verified: bool = False  # compile.verify's check against eager ran
    frames_checked: bool = False  # frames mode: the first forward's eager check ran
    reuse_checked: bool = False  # whole-model compile: reuse reported after the first call


@dataclass
class CallHooks:
    """What others hang on the compiled calls: the function compiled (graph mode), which
    compile.verify and ``aotdist.cache.precompile`` trace again, and the artifact cache's
    record and watchers."""

    # graph mode: the function compiled, called as call_fn(*call_bound, *args, **kwargs)
    call_fn: Callable | None = None
    call_bound: tuple = ()
    # set by aotdist.cache.load (None: no cache): what the cache keeps of the calls
    cache: CacheRecord | None = None
    # told of each compiled call as it starts (aotdist.cache's watcher: CallWatcher)
    watchers: list[CallWatcher] = field(default_factory=list)

    def calling(self, call: CompiledCall) -> list[Callable[[], None]]:
        """Tells the watchers that ``call`` starts; returns what each wants run once the
        compiled function returned (a call a saved graph served is not told)."""
        return [done for watch in self.watchers if (done := watch(call)) is not None]


@dataclass(frozen=True)
class CompiledCall:
    """A compiled call about to run: the whole model's, or a region frame's (frames mode)."""

    module: nn.Module  # the root module, or the region instance whose frame runs
    args: tuple
    kwargs: dict
    frame: str | None = None  # frames mode: the region's name


# called as a compiled call starts; returns what to run once it returned, or None
CallWatcher = Callable[[CompiledCall], "Callable[[], None] | None"]


@dataclass
class CacheRecord:
    """What ``aotdist.cache`` keeps on a compiled model (``RegionState.hooks.cache``): the
    calls its save traces again and the saved graphs it loaded. The cache fills it
    (``aotdist.cache.examples``); compiling reads only the saved graphs, to run a call one
    covers."""

    keep_example: bool = False  # set by aotdist.cache.load: keep a training call's inputs
    # set by aotdist.cache.save when no eval call came before it: keep the first eval call
    # after the save (when it compiled), for a second save that adds its graph and kernels
    keep_eval: bool = False
    # (args, kwargs) of the first training call (grad enabled, train mode: not a validation
    # step before it), until the cache saves; example_from: graphs compiled before that call
    example: tuple | None = None
    example_from: int = 0
    # the first eval call (grad off, inference mode or the model in eval mode: a validation
    # step), saved as a second graph: an aotdist.cache.examples.EvalExample, until the save
    eval_example: Any = None
    precompiled: Any = None  # aotdist.cache.loaded.Precompiled, loaded from a bundle
    # frames mode: the same per region frame (aotdist.compile.frames.FrameExample kept)
    frame_examples: dict[str, Any] = field(default_factory=dict)
    frame_eval_examples: dict[str, Any] = field(default_factory=dict)
    frame_precompiled: dict[str, Any] = field(default_factory=dict)
