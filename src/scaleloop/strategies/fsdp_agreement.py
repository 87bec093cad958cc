"""FSDP's contract, checked: every rank runs the same units, forward and backward, in the same order.

FSDP gathers a unit's parameters when the unit's forward runs and when its backward does, and
reduces its gradients after that backward, each time together with every rank. A unit that some
ranks run and others skip (a module called only when a sample is routed to it; one whose output
carries no gradient on some ranks) leaves the ranks in different collectives: a hang until
``--timeout``, or Gloo's abort on mismatched sizes. A parameter that some ranks do not use inside
a unit that they all run is fine (``strategies.unused``).

So at each moment FSDP may communicate for a unit (the start of its forward, which gathers; the
start of its backward, which gathers again and prefetches; the end of its backward, which reduces)
and at the end of each pass, the ranks agree on where they are: one all-reduce of two integers on a
Gloo group of their own (on the CPU: no wait for the GPU), naming the event. While they agree, they
have made the same collectives, so the first disagreement is seen by every rank at once, and every
rank stops there with the same one-line error, instead of waiting on the others. It costs three
small all-reduces per unit and step, on the CPU.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from scaleloop.errors import UsageError


class UnitOrder:
    """The agreement above, hooked on the root module and its units (``units``: name -> module);
    ``timeout`` bounds each agreement as ``--timeout`` bounds every collective (``DistEnv.group_timeout``).
    A disagreement's message names the strategy the user chose (``who``: ``fsdp``, ``--mesh dp=2``);
    ``fix``, when given, follows it in the first sentence (the one a failure report keeps), and
    ``remedy`` (what else trains such a model) ends it."""

    def __init__(self, root: nn.Module, units: dict[str, nn.Module], step: Callable[[], int],
                 timeout: timedelta, who: str = "fsdp", fix: str = "",
                 remedy: str = "or use --strategy allreduce, or ddp --find-unused-parameters") -> None:
        self.names = list(units)
        self.who, self.fix, self.remedy = who, fix, remedy
        self.step = step                       # the training step in progress (for the message)
        self.root = root
        # Every rank builds it, in the same order; on the CPU's own backend when the default group's
        # is not one (NCCL). A fake group (the plan's synchronous measurement) has no Gloo beside it.
        default = torch_dist.get_backend()
        self.group = torch_dist.new_group(backend=None if default in ("gloo", "fake") else "gloo", timeout=timeout)
        self._end_queued = False
        n = len(self.names)
        # Event codes: unit i's forward i, the forward's end n; the start of unit i's backward n+1+i,
        # its end 2n+1+i; the backward's end 3n+1.
        self._handles: list[Any] = []
        for i, unit in enumerate(units.values()):
            # Before FSDP's own hooks (prepend): its pre-forward gathers, its post-forward hooks
            # the outputs' gradients, on which ours must come first.
            self._handles += [
                unit.register_forward_pre_hook(_eager(functools.partial(self._before_forward, i)), prepend=True),
                unit.register_forward_hook(_eager(functools.partial(self._after_forward, n + 1 + i)), prepend=True),
                # After FSDP's pre-forward, which marks the inputs for its reduction at the end of
                # the backward: marked again, ours comes before it in the backward.
                unit.register_forward_pre_hook(_eager(functools.partial(self._mark_inputs, 2 * n + 1 + i)),
                                               with_kwargs=True)]
        self._handles.append(root.register_forward_hook(_eager(self._after_root), prepend=True))

    def close(self) -> None:
        """Remove the hooks and release the group (the end of training; the model stays usable)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        torch_dist.destroy_process_group(self.group)

    # --- the hooks ----------------------------------------------------------------------
    def _before_forward(self, code: int, module: nn.Module, args: Any) -> None:
        self.agree(code)

    def _after_forward(self, code: int, module: nn.Module, args: Any, output: Any) -> None:
        grads = _needing_grad(output)
        if grads:
            torch.autograd.graph.register_multi_grad_hook(grads, functools.partial(self._before_backward, code),
                                                          mode="any")

    def _mark_inputs(self, code: int, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return args, kwargs
        marked = _AgreeAfterBackward.apply(self, code, *(leaves[i] for i in at))
        for i, t in zip(at, marked if isinstance(marked, tuple) else (marked,)):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _before_backward(self, code: int, grad: Any) -> None:
        self._queue_end()
        self.agree(code)

    def _after_root(self, module: nn.Module, args: Any, output: Any) -> None:
        self._end_queued = False
        self.agree(len(self.names))
        grads = _needing_grad(output)
        if grads:
            torch.autograd.graph.register_multi_grad_hook(grads, lambda _grad: self._queue_end(), mode="any")

    def _queue_end(self) -> None:
        # The end of the backward is agreed on before FSDP's own final callback, which reduces the
        # gradients of the units whose backward did not run: FSDP queues it in the first of its
        # pre-backward hooks, and on each tensor ours come first, so the first of ours queues this.
        if not self._end_queued:
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._end_queued = False
        self.agree(3 * len(self.names) + 1)

    # --- the agreement ------------------------------------------------------------------
    def agree(self, code: int) -> None:
        """All ranks at event ``code``, or every rank raises the same UsageError."""
        both = torch.tensor([code, -code], dtype=torch.int64)
        torch_dist.all_reduce(both, op=torch_dist.ReduceOp.MAX, group=self.group)
        high, low = int(both[0]), -int(both[1])
        if high != low:
            where = f"in step {self.step()}" if self.root.training else "in an evaluation"
            raise UsageError(
                f"{self.who}: the ranks parted {where}" + (f"; {self.fix}. One" if self.fix else ": one")
                + f" was at {self._event(low)}, another at {self._event(high)}. "
                "FSDP gathers a unit's parameters and reduces its gradients with all ranks at once, so every rank "
                "must run the same units, forward and backward: a module that only some ranks call, or whose output "
                "carries a gradient on some ranks only (it returned its input untouched), must not be a unit of its "
                "own; keep it inside a unit that every rank runs (fsdp_blocks() names the units), or run it on every "
                "rank (on no samples, if need be)" + (f"; {self.remedy}" if self.remedy else ""))

    def _event(self, code: int) -> str:
        n = len(self.names)
        if code == n:
            return "the end of the forward"
        if code == 3 * n + 1:
            return "the end of the backward"
        if code < n:
            return f"the forward of unit {self.names[code]!r}"
        if code < 2 * n + 1:
            return f"the backward of unit {self.names[code - n - 1]!r}"
        return f"the end of the backward of unit {self.names[code - 2 * n - 1]!r}"


class _AgreeAfterBackward(torch.autograd.Function):
    """Passes a unit's inputs through; its backward, the end of the unit's, agrees on that event."""

    @staticmethod
    def forward(ctx: Any, order: UnitOrder, code: int, *tensors: torch.Tensor) -> Any:
        ctx.order, ctx.code = order, code
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.order.agree(ctx.code)
        return (None, None, *grads)


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run as Python under ``--compile`` (as FSDP's own hooks are): it communicates."""
    return torch._dynamo.disable(hook)


def _needing_grad(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that the backward will reach."""
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
