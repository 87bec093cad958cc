"""Live tensor bytes of one training step, traced on fake tensors (no memory is allocated).

:class:`LiveBytes` is a ``TorchDispatchMode``: every tensor an op returns is noted by its
storage (views share their base's, so they are not counted twice) and forgotten when Python
frees that storage (``weakref.finalize``). Under ``FakeTensorMode`` the ops only compute
shapes, so a 7B-parameter step is traced in seconds on a CPU.

The trace is a series, op by op, of the bytes alive that the step created; after the backward
the storages that became parameters' ``.grad`` are known, so the series splits into gradient
bytes and the rest (activations saved for the backward, the loss, temporaries that outlive
their op). A layout then rescales each part (the rest with the micro-batch, the gradients with
sharding) and takes the maximum over the series: :mod:`scaleloop.plan.memory`.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class StepSeries:
    """Bytes alive after each op of one forward and backward: gradients, and everything else."""

    other: tuple[int, ...]
    grads: tuple[int, ...]
    forward_ops: int          # how many of the ops belong to the forward (and the loss)
    attention_flops: float = 0.0   # the fused CPU attention's, which the FLOP counter misses

    @property
    def peak(self) -> int:
        """The step's peak of the bytes it created (both parts together)."""
        return max((o + g for o, g in zip(self.other, self.grads)), default=0)

    @property
    def saved(self) -> int:
        """Bytes alive when the forward ends: the activations kept for the backward."""
        return self.other[self.forward_ops - 1] if self.forward_ops else 0


class LiveBytes(TorchDispatchMode):
    """Records, op by op, which storages the ops create and when they are freed."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        # Storages that existed before the step (parameters, buffers, the batch): a view of
        # one (a weight's transpose) is not a new allocation. Held, so that their ids stay theirs.
        self._existing = {id(t.untyped_storage()): t for t in existing}
        self._serial = itertools.count()
        self._alive: dict[int, tuple[int, int]] = {}     # id(storage) -> (serial, bytes)
        self.events: list[list[tuple[int, int]]] = []    # per op: (serial, +bytes or -bytes)
        self._pending: list[tuple[int, int]] = []
        #: FLOPs of the CPU's fused attention, which ``torch.utils.flop_counter`` does not count.
        self.attention_flops = 0.0

    def _freed(self, key: int) -> None:
        serial, nbytes = self._alive.pop(key, (None, 0))
        if serial is not None:
            self._pending.append((serial, -nbytes))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            # Two matmuls of (s_q x d) by (d x s_k) forward, four backward, per batch and head.
            backward = "backward" in name
            q, k = (args[1], args[2]) if backward else (args[0], args[1])
            b, h, sq, d = q.shape
            self.attention_flops += (8 if backward else 4) * b * h * sq * k.shape[2] * d
        changes, self._pending = self._pending, []   # frees since the last op happened before this one's end
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._alive or key in self._existing:
                continue
            serial, nbytes = next(self._serial), storage.nbytes()
            self._alive[key] = (serial, nbytes)
            weakref.finalize(storage, self._freed, key)
            changes.append((serial, nbytes))
        self.events.append(changes)
        return out

    def flush(self) -> list[tuple[int, int]]:
        """The frees noted since the last op (taken)."""
        changes, self._pending = self._pending, []
        return changes

    def serial_of(self, tensor: torch.Tensor) -> int:
        """The serial of the storage ``tensor`` lives in (-1: not created under this mode)."""
        return self._alive.get(id(tensor.untyped_storage()), (-1, 0))[0]


def trace_step(model: torch.nn.Module, forward_loss: Callable[[], torch.Tensor],
               inputs: Iterable[torch.Tensor] = ()) -> StepSeries:
    """Trace ``forward_loss().backward()`` (run it under ``FakeTensorMode``); the gradients
    are left on ``model``'s parameters. ``inputs``: the batch's tensors (not counted)."""
    tracker = LiveBytes([*model.parameters(), *model.buffers(), *inputs])
    with tracker:
        loss = forward_loss()
        forward_ops = len(tracker.events)
        loss.backward()
        del loss
    tracker.events.append(tracker.flush())   # the frees after the last op (the graph, the loss)
    grad_serials = {tracker.serial_of(p.grad) for p in model.parameters() if p.grad is not None}
    other, grads, live_other, live_grads = [], [], 0, 0
    for changes in tracker.events:
        for serial, delta in changes:
            if serial in grad_serials:
                live_grads += delta
            else:
                live_other += delta
        other.append(live_other)
        grads.append(live_grads)
    return StepSeries(tuple(other), tuple(grads), forward_ops, tracker.attention_flops)
