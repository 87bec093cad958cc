"""Python's cyclic garbage collector, paused while a process builds what it keeps until it ends.

Importing torch, and the ``torch._dynamo`` that ``torch.optim`` and ``DistributedDataParallel``
import on first use, creates about 280,000 objects that live as long as the process. While they
are being created, CPython's collector walks all of them again and again (five full passes that
free a few hundred objects): on this project's 2-core test machine, about 0.1 CPU-second of
``import torch`` and 0.3 of ``import torch._dynamo``, in every process of a run. A run of two
workers pays it on both cores at once, right at the start, where the launch is waited for
(``benchmarks/launch``).

So a worker pauses the collector while it imports torch, and every run while it builds its
model, strategy and optimizer (``loop.training``), then turns it back on. Nothing is lost: the
garbage made meanwhile (a few hundred objects) waits for the next collection, as garbage always
waits for one. No collection is forced at the end: it would cost one more pass, and ``scaleloop
bench overhead`` (which builds a run for each repetition) read higher with it
(``benchmarks/2026-12-02_cpu-2core_launch-collector.md``).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """While inside, the cyclic garbage collector does not run; after, it is as it was before.

    Only around work that creates long-lived objects (imports, building a model). Reference
    counting still frees everything that is not in a cycle.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
