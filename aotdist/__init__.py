"""aotdist: compile each distinct repeated region of a model once, in distributed training.

Importing aotdist does nothing but define names: torchao, lightning, accelerate and
torchvision are imported where they are used.
"""

from aotdist import cache, metrics
from aotdist.capture import Capture, capture
from aotdist.compile import compile_regions, restore
from aotdist.compile.configured import compile_from_config
from aotdist.config import AOTDistConfig
from aotdist.errors import (
    AOTDistError,
    CacheWarning,
    ConfigError,
    ConfigWarning,
    MissingDependencyError,
    OrderingError,
    RegionCaptureError,
    RegionCompileWarning,
    RegionMismatchError,
    TorchFeatureUnavailable,
)
from aotdist.float8 import precompute_float8_scales
from aotdist.parallelize import parallelize, parallelize_info
from aotdist.pipelining import Pipeline, pipeline
from aotdist.regions import Region, RegionPlan, find_regions
from aotdist.version import __version__

__all__ = [
    "__version__",
    "AOTDistConfig",
    "AOTDistError",
    "CacheWarning",
    "Capture",
    "ConfigError",
    "ConfigWarning",
    "MissingDependencyError",
    "OrderingError",
    "Pipeline",
    "Region",
    "RegionCaptureError",
    "RegionCompileWarning",
    "RegionMismatchError",
    "RegionPlan",
    "TorchFeatureUnavailable",
    "cache",
    "capture",
    "compile_from_config",
    "compile_regions",
    "find_regions",
    "metrics",
    "parallelize",
    "parallelize_info",
    "pipeline",
    "precompute_float8_scales",
    "restore",
]
