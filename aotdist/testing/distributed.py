"""The multi-process runner, re-exported for tests: it lives in :mod:`aotdist.launch`."""

from aotdist.launch import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    run_distributed,
)

__all__ = ["DistributedTestError", "DistributedTimeoutError", "free_port", "run_distributed"]
