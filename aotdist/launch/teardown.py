"""Ending a training process without the interpreter teardown that can abort it.

On CPU with gloo a run that trained and saved can still exit with SIGABRT ("terminate
called without an active exception"), on every supported torch: a gloo worker thread
releases a finished collective's tensors after ``wait()`` returned, which needs the GIL,
and once Python finalizes, a thread asking for the GIL is ended by ``pthread_exit``, whose
unwind through torch's C++ frames calls ``std::terminate``. ``destroy_process_group()``
does not prevent it: the worker threads outlive it. :func:`exit_without_teardown` does
what interpreter exit does up to that point (threading's exit hooks and non-daemon joins,
the ``atexit`` handlers, flushing stdout and stderr), then leaves with ``os._exit``. The
recipes call it after training returns. More: docs/guide/limits.md.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Ends this process with ``code`` after its work, skipping interpreter finalization.

    Call it last, once the training function has returned (on an exception, let Python
    exit as usual: the run failed either way), with what trained still referenced:
    freeing a DDP model frees its gloo process group with the GIL held, and that can hang
    (docs/guide/limits.md). What normal exit does first still happens,
    in the same order: threading's exit hooks run (``concurrent.futures`` executors shut
    down) and non-daemon threads are joined, then ``atexit`` handlers run. Then
    stdout and stderr are flushed and the process leaves with ``os._exit(code)``: no
    module teardown, no garbage collection of what is left, no C++ static destructors.

    Args:
        code: The exit status, 0 for success.

    Raises:
        TypeError: ``code`` is not an ``int``.

    Example::

        from aotdist.launch import exit_without_teardown

        if __name__ == "__main__":
            trainer = main()  # returns the trainer or model: keep it referenced
            exit_without_teardown()
    """
    if not isinstance(code, int) or isinstance(code, bool):
        raise TypeError(
            f"exit_without_teardown(code=...) takes an int exit status; got "
            f"{code!r} ({type(code).__name__}). Fix: pass 0 for success."
        )
    me = threading.current_thread()
    if me is threading.main_thread() and hasattr(threading, "_shutdown"):
        # What interpreter exit runs first: threading's exit hooks (concurrent.futures
        # shuts its executors down there; an atexit handler of multiprocessing would
        # otherwise wait for their worker processes forever), then the non-daemon joins.
        threading._shutdown()
    else:
        for thread in threading.enumerate():
            if thread is not me and not thread.daemon and thread is not threading.main_thread():
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
    os._exit(code)
