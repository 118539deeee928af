"""aotdist: compile each distinct repeated region of a model once, in distributed training.

Importing aotdist does nothing but define names: torchao, lightning, accelerate and
torchvision are imported where they are used.
"""

from aotdist import cache
from aotdist.capture import Capture, capture
from aotdist.compile import compile_regions, restore
from aotdist.config import AOTDistConfig
from aotdist.errors import (
    AOTDistError,
    ConfigError,
    ConfigWarning,
    OrderingError,
    RegionCompileWarning,
)
from aotdist.float8 import precompute_float8_scales
from aotdist.parallelize import parallelize, parallelize_info
from aotdist.regions import Region, RegionPlan, find_regions
from aotdist.version import __version__

__all__ = [
    "__version__",
    "AOTDistConfig",
    "AOTDistError",
    "Capture",
    "ConfigError",
    "ConfigWarning",
    "OrderingError",
    "Region",
    "RegionCompileWarning",
    "RegionPlan",
    "cache",
    "capture",
    "compile_regions",
    "find_regions",
    "parallelize",
    "parallelize_info",
    "precompute_float8_scales",
    "restore",
]
