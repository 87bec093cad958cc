"""The end of a process that imported torch: exit without the interpreter's slow last clean-up.

When CPython exits it clears every module and frees what that leaves unreferenced, running the
garbage collector over it. Once torch is imported (with the ``torch._dynamo`` and sympy that
``torch.optim`` and ``DistributedDataParallel`` pull in), that is a few hundred thousand objects
in reference cycles: about half a CPU-second a process on this project's 2-core test machine,
spent freeing memory the operating system takes back anyway. A run of two processes has three
such processes (torchrun's agent and its workers), and ``scaleloop train --nproc 2`` took 1.58x
a bare torchrun script without this, 1.23x-1.32x with it (``benchmarks/launch``).

So the entry point of a process that runs the user's code (the ``scaleloop`` command, a worker)
ends with :func:`exit_process`, which leaves the interpreter nothing slow to do and still does
what an exit is relied on for (torchrun's agent, which runs no user code, simply flushes its
logs and leaves: ``scaleloop.launching.agent.leave``):

1. one ordinary collection: garbage already unreachable is finalized as at any exit;
2. every file object still open is flushed: what a program wrote and never closed reaches the
   file, as clearing the modules would have done;
3. ``gc.freeze()``: the objects still alive are put out of the collector's reach, so the
   interpreter's last passes have nothing to walk;
4. ``sys.exit(code)``: exit handlers (``atexit``, ``logging.shutdown``) run as usual.

What is skipped: the finalizers of objects still alive at that point, and the flush of a file that
an exit handler writes to without closing. scaleloop closes every file it writes before this
point. This is not the fork-era ``gc.freeze()`` (which kept forked workers' memory shared):
nothing forks here, and it runs last, as the process ends.
"""
from __future__ import annotations

import contextlib
import gc
import io
import sys
from typing import NoReturn, Optional


def exit_process(code: Optional[int]) -> NoReturn:
    """``sys.exit(code)`` for a process's entry point, without the slow final collection (above).

    Only for the end of a whole process (``python -m ...``, the console script), never for a
    function a caller goes on after.
    """
    gc.collect()
    objects = gc.get_objects()
    # By type, a few hundred checks, not one for each of the ~300,000 objects: type(), never a
    # lazy proxy's __class__.
    file_types = {kind for kind in {type(obj) for obj in objects} if issubclass(kind, io.IOBase)}
    for obj in objects:
        if type(obj) in file_types:
            with contextlib.suppress(Exception):   # closed, or a pipe whose reader is gone
                obj.flush()
    del objects
    gc.freeze()
    sys.exit(code)
