"""``--async-checkpoint``: a checkpoint's files written by a thread while training goes on.

The step that checkpoints still does, on the training thread and at the same point on every rank,
everything that talks to the other ranks (the RNG all-gather, the loss sums' all-reduce, the
free-space all-reduce of a sharded checkpoint, DCP's planning): only the writing rank's file I/O
moves to a thread, and only once the state is a copy in host memory (:func:`host_copy`; for a
sharded checkpoint DCP's own staging copy), since training goes on to change the tensors in place.

A sharded checkpoint (``writes_sharded``) is written by ``torch.distributed.checkpoint.async_save``,
whose writes and collectives run in DCP's own thread on a Gloo group made for checkpoints alone
(:func:`checkpoint_group`), so they never interleave with training's collectives. The strategy
hands back what to wait on in a :class:`ShardedSave`.

One write is in flight at most: the checkpointer waits for it (``Checkpointer.wait``) before the
next save, at the run's end, on a stop signal, before a resume, and when an exception leaves the
loop. This module holds only the thread and the copies; the checkpointer decides what is written.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from scaleloop.runtime.dist import DistEnv

#: What a write gives back: the checkpoint's final path (None if none was written) and the one-line
#: error that ends the run (None when it was written). ``refused``: the error is a CheckpointError
#: (a sharded checkpoint's shards missing), not a file that could not be written.
Outcome = tuple[Optional[Path], Optional[str], bool]


#: What Gloo's and NCCL's errors say when another rank went away in the middle of a collective:
#: its process ended (killed, crashed) or its connection closed.
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket closed",
              "remote process exited", "ncclremoteerror")
#: The place in the library's own source a C++ error begins with: ``[.../pair.cc:537] ``.
_SOURCE_PLACE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def why_not_written(exc: BaseException) -> str:
    """Why a background write ended in ``exc``, in one line of plain words. A rank lost during the
    write (DCP's collectives raise the library's own text, with its source file, advice and
    emoji) is said as such; another error keeps its type and first line."""
    text = str(exc).strip()
    if any(marker in text.lower() for marker in _PEER_LOST):
        return "another rank was lost during the write (its process ended or its connection closed)"
    first = _SOURCE_PLACE.sub("", text.splitlines()[0]) if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass
class ShardedSave:
    """Handed to a sharded strategy's ``save_checkpoint`` by an ``--async-checkpoint`` run.

    The strategy starts DCP's ``async_save`` on ``group`` and sets ``wait``: a callable that blocks
    until this rank's shards are written (and, on the rank that finishes the checkpoint, every
    rank's, checked to be there); it raises OSError when a write failed on any rank, and
    CheckpointError when shards are missing from the directory.
    """

    group: Any
    wait: Optional[Callable[[], None]] = None


def checkpoint_group(env: DistEnv) -> Any:
    """A new Gloo group of every rank, for DCP's collectives in its background thread (every rank
    makes it at the same point: making a group is itself collective). Gloo, also on GPUs: DCP's
    collectives exchange Python objects on the CPU. With the run's ``--timeout``, as every group
    of the run. None without a process group (one process: DCP then needs none)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=env.group_timeout)


def host_copy(value: Any) -> Any:
    """``value`` (a state: tensors in nested dicts, lists and tuples of plain values) with every
    tensor copied into host memory of its own, so that training can go on changing the originals.

    A CPU tensor is copied too, not referenced: the optimizer updates it in place. Tensors that
    share a storage (tied weights) share one copy, as ``torch.save`` keeps them. The plain values
    of a weights-only checkpoint (numbers, strings, None) are immutable and kept as they are.
    """
    copies: dict[tuple[str, int], torch.UntypedStorage] = {}

    def copy(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            source = item.detach()
            storage = source.untyped_storage()
            key = (str(source.device), storage.data_ptr())
            if key not in copies:
                copies[key] = torch.UntypedStorage(storage.nbytes())   # host memory
                copies[key].copy_(storage)
            return torch.empty(0, dtype=source.dtype).set_(copies[key], source.storage_offset(), source.size(),
                                                           source.stride())
        if isinstance(item, dict):
            return {key: copy(v) for key, v in item.items()}
        if isinstance(item, list):
            return [copy(v) for v in item]
        if isinstance(item, tuple):
            return tuple(copy(v) for v in item)
        return item

    return copy(value)


@dataclass
class InFlight:
    """A checkpoint being written in the background: its step, the ``last_step`` before it (restored
    if it fails), what gives its outcome (the writing rank's thread; another rank's DCP shards), and
    the thread itself, on the writing rank."""

    step: int
    previous: Optional[int]
    outcome: Callable[[], Outcome]
    write: Optional[BackgroundWrite] = None


def other_ranks_shards(sharded: Optional[ShardedSave]) -> Outcome:
    """A rank that does not finish the checkpoint: wait for its own shards, if any. A failed write is
    raised by DCP on every rank; the writing rank's outcome reports it for all."""
    from scaleloop.checkpoint.store import CheckpointError

    if sharded is not None and sharded.wait is not None:
        try:
            sharded.wait()
        except (OSError, CheckpointError):
            pass
    return None, None, False


class BackgroundWrite:
    """One checkpoint's write, running ``work`` in a thread of its own from construction on.

    The thread is not a daemon: a process that ends without waiting still finishes the write
    rather than leaving it half done (the temporary directory would keep the checkpoint invisible,
    but the work would be lost).
    """

    def __init__(self, step: int, work: Callable[[], Outcome]) -> None:
        self.step = step
        self.seconds = 0.0   # how long the write took, in the thread
        self._work = work
        self._outcome: Outcome = (None, None, False)
        self._unexpected: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"scaleloop-checkpoint-{step}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._outcome = self._work()
        except BaseException as exc:   # a bug, not a write error (those are in the outcome): re-raised at wait
            self._unexpected = exc
        finally:
            self._work = _done   # drop the references to the state's copy as soon as it is written
            self.seconds = time.perf_counter() - started

    def wait(self) -> Outcome:
        """Block until the write is over; its outcome (what it raised, if it was not an outcome)."""
        self._thread.join()
        if self._unexpected is not None:
            raise self._unexpected
        return self._outcome


def _done() -> Outcome:
    return (None, None, False)
