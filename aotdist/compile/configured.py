"""``compile_from_config``: the one path from a config's ``compile`` section to a compile.

``parallelize`` and every integration (Lightning, Accelerate, the Hugging Face Trainer)
compile through it, so a ``compile`` key means the same everywhere: the backend and its
options as the FSDP setting asks (:meth:`aotdist.fsdp.Sharding.backend`), ``compile.outer``
resolved with the artifact cache in mind, ``dynamic`` and ``verify`` as written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from aotdist.backends.regional import configured_outer
from aotdist.compile import compile_callable, compile_regions
from aotdist.config import AOTDistConfig, as_config
from aotdist.fsdp.modes import sharding_for
from aotdist.regions import RegionPlan


def compile_from_config(
    model: nn.Module,
    config: AOTDistConfig | Mapping | str | os.PathLike | None = None,
    *,
    plan: RegionPlan | None = None,
    fn: Callable | None = None,
    mesh: Any = None,
) -> Any:
    """Compiles ``model``'s regions as ``config.compile`` says.

    Args:
        model: The module to compile in place (already converted and sharded, if the
            config asks for it: :func:`aotdist.parallelize` does both, then calls this).
        config: An :class:`~aotdist.AOTDistConfig`, a mapping or a YAML path; ``None``:
            the defaults.
        plan: Regions to use; ``aotdist.find_regions(model)`` when ``None``.
        fn: A callable that runs ``model`` (an integration's saved forward): compiled
            with :func:`aotdist.compile.compile_callable` instead of in place.
        mesh: The FSDP mesh, where graph-mode FSDP's backend needs its device type.

    Returns:
        ``model`` (compiled in place), or the compiled ``fn``; unchanged when
        ``compile.enabled`` is false.

    Raises:
        OrderingError: As :func:`aotdist.compile_regions`.
        ConfigError: A bad config, or as :func:`aotdist.compile_regions`.
    """
    config = as_config(config)
    cc = config.compile
    if not cc.enabled:
        return model if fn is None else fn
    backend, options = sharding_for(config).backend(config, mesh)
    settings = dict(
        plan=plan,
        backend=backend,
        mode=cc.mode,
        dynamic=cc.dynamic,
        options=options,
        verify=cc.verify,
        outer=configured_outer(config),
    )
    if fn is not None:
        return compile_callable(model, fn, **settings)
    return compile_regions(model, **settings)
