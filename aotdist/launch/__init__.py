"""Running a function on several ranks of a real process group (a library module).

:func:`run_distributed` spawns one process per rank, sets up ``torch.distributed`` in
each, runs the function and returns every rank's result; a failure on any rank is raised
in the caller naming the rank, and the other ranks are stopped at once. The benchmark
(``aotdist bench``), ``aotdist inspect --nproc`` and the multi-process tests use it;
``aotdist.testing`` re-exports it. :func:`exit_without_teardown` ends a training process
without the interpreter teardown that torch's gloo worker threads can abort; the recipes
call it last.

- :mod:`aotdist.launch.runner`: the parent side (spawn, watch, stop, report).
- :mod:`aotdist.launch.rank`: the rank side (environment, process group, the call).
- :mod:`aotdist.launch.teardown`: :func:`exit_without_teardown`.
"""

from aotdist.errors import DistributedTestError, DistributedTimeoutError
from aotdist.launch.runner import free_port, run_distributed
from aotdist.launch.teardown import exit_without_teardown

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "exit_without_teardown",
    "free_port",
    "run_distributed",
]
