"""Running a function on several ranks of a real process group (a library module).

:func:`run_distributed` spawns one process per rank, sets up ``torch.distributed`` in
each, runs the function and returns every rank's result; a failure on any rank is raised
in the caller naming the rank, and the other ranks are stopped at once. The benchmark
(``aotdist bench``), ``aotdist inspect --nproc`` and the multi-process tests use it;
``aotdist.testing`` re-exports it.

- :mod:`aotdist.launch.runner`: the parent side (spawn, watch, stop, report).
- :mod:`aotdist.launch.rank`: the rank side (environment, process group, the call).
"""

from aotdist.errors import DistributedTestError, DistributedTimeoutError
from aotdist.launch.runner import free_port, run_distributed

__all__ = ["DistributedTestError", "DistributedTimeoutError", "free_port", "run_distributed"]
