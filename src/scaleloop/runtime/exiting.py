"""The end of a process that imported torch: exit without the interpreter's last garbage collection.

When CPython exits it looks for garbage once more, over every object still alive. Once torch is
imported (with the ``torch._dynamo`` and sympy that ``torch.optim`` pulls in) that is a few
million objects: about 0.8 CPU-seconds a process here, a third of what importing them cost, spent
on memory the operating system takes back anyway. A run of two processes has three such
processes (torchrun's agent and its workers). ``gc.freeze()`` moves every live object out of the
collector's reach, so that pass finds nothing to walk. Exit handlers still run, and whatever
reference counting frees at exit (files, log handlers) is still closed; only garbage in reference
cycles is left to the operating system, and nothing scaleloop writes waits on such a cycle.
"""
from __future__ import annotations

import gc
import sys
from typing import NoReturn, Optional


def exit_process(code: Optional[int]) -> NoReturn:
    """``sys.exit(code)`` for a process's entry point, skipping the final collection (see above).

    Only for the end of a whole process (``python -m ...``, the console script), never for a
    function a caller goes on after.
    """
    gc.freeze()
    sys.exit(code)
