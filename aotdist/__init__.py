"""aotdist: compile each distinct repeated region of a model once, in distributed training.

Importing aotdist does nothing but define names: torchao, lightning, accelerate and
torchvision are imported where they are used.
"""

from aotdist.compile import compile_regions, restore
from aotdist.errors import AOTDistError, ConfigError, OrderingError, RegionCompileWarning
from aotdist.regions import Region, RegionPlan, find_regions

__version__ = "0.1.0"

__all__ = [
    "AOTDistError",
    "ConfigError",
    "OrderingError",
    "Region",
    "RegionCompileWarning",
    "RegionPlan",
    "compile_regions",
    "find_regions",
    "restore",
]
