"""Which samples each rank sees, in which micro-batch, for every optimizer step (:class:`StepSampler`).

The split is defined on the GLOBAL batch so that the maths does not depend on the world size:

1. Each epoch has one permutation of ``range(n)``, drawn from ``seed + epoch`` (the same on
   every rank, like ``DistributedSampler.set_epoch``).
2. Step ``s`` covers ``perm[s*B : (s+1)*B]`` — the same samples whatever the world size W or
   accumulation K, so N workers with global batch B train on exactly what 1 worker does.
3. The step's samples are cut into K contiguous micro-steps, and each micro-step into W
   contiguous blocks, one per rank (disjoint shards). So micro-step k of step s also covers the
   same samples whatever W is, which keeps BatchNorm statistics (synchronised over ranks)
   identical to one process running the same accumulation.
4. The last step of an epoch may be smaller than B. It is kept (each sample exactly once per
   epoch) and split as evenly as possible; micro-batches then differ by at most one sample,
   and ``loss_scale`` weights each by its share so the update is still the mean over the step.
   Only a tail too small to give every rank and micro-step one sample (fewer than W*K samples)
   is dropped, and reported; ``drop_last`` drops any smaller last step instead. Nothing is
   padded, so no sample is ever counted twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from scaleloop.runtime.collectives import split_sizes  # (re-exported: the data split is the collectives' split)


# Not frozen: a frozen dataclass sets each field through object.__setattr__, and one is made
# per micro-step inside the timed loop (slots: 0.6 us instead of 1.5 us each). Treat it as read-only.
@dataclass(slots=True)
class MicroBatch:
    """The indices one rank trains on in one micro-step, where that micro-step sits (step, micro,
    last micro, the step's samples), and how to weight its loss. A ``Batch`` carries it as ``batch.place``."""

    step: int            # optimizer step within the epoch
    micro: int           # micro-step within the optimizer step, 0..K-1
    last_micro: bool     # the micro-step after which the optimizer steps
    indices: torch.Tensor  # global sample indices (CPU int64)
    step_samples: int    # samples in the whole step, over all ranks
    loss_scale: float    # multiply the micro-batch's mean loss by this before backward


class StepSampler:
    """Each epoch's samples cut into steps, micro-steps and rank shares, as the module docstring
    describes: this rank's ``MicroBatch``es, epoch by epoch."""

    def __init__(self, n: int, global_batch: int, *, world_size: int = 1, rank: int = 0,
                 accumulate: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if n < 1:
            raise ValueError("dataset is empty")
        self.n = n
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.accumulate = accumulate
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        full, tail = divmod(n, global_batch)
        pieces = world_size * accumulate
        keep_tail = tail > 0 and not drop_last and tail >= pieces
        self.steps_per_epoch = full + (1 if keep_tail else 0)
        self.dropped_per_epoch = 0 if keep_tail else tail
        self.used_per_epoch = n - self.dropped_per_epoch

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order (a permutation, or ``arange`` without shuffling)."""
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g)

    def step_indices(self, epoch: int, step: int, order: torch.Tensor | None = None) -> torch.Tensor:
        """All samples of one optimizer step, over all ranks."""
        order = self.order(epoch) if order is None else order
        return order[step * self.global_batch: min((step + 1) * self.global_batch, self.used_per_epoch)]

    def micro_batches(self, epoch: int, start_step: int = 0) -> Iterator[MicroBatch]:
        """This rank's micro-batches for ``epoch``, beginning at optimizer step ``start_step``."""
        layout = self._layout(start_step)
        if not layout:
            return
        # Where each piece lies in the epoch's order is plain integer arithmetic; the index
        # tensors are then cut from the order in one ``split`` (views, no copies) instead of
        # one slice per piece: this runs once per micro-step, inside the timed loop.
        first = pos = layout[0][3]
        sizes: list[int] = []
        for _step, _micro, _last, start, size, _total in layout:
            sizes += (start - pos, size)   # the gap before this rank's piece, then the piece
            pos = start + size
        if self.world_size == 1:
            # One rank's pieces follow each other (no gaps): half as many views to cut.
            pieces = self.order(epoch)[first:pos].split(sizes[1::2])
        else:
            pieces = self.order(epoch)[first:pos].split(sizes)[1::2]
        world = self.world_size
        for (step, micro, last, _start, size, total), indices in zip(layout, pieces):
            # Each rank's gradient is averaged over W ranks (DDP divides by W), so a
            # micro-batch holding share size/total of the step is weighted W * share.
            yield MicroBatch(step, micro, last, indices, total, world * size / total)

    def _layout(self, start_step: int) -> list[tuple[int, int, bool, int, int, int]]:
        """(step, micro, last micro, start in the epoch's order, size, samples in the step) of
        this rank's micro-batches from ``start_step`` on: rules 2-4 of the module docstring."""
        k, rank = self.accumulate, self.rank
        if k == 1 and self.world_size == 1:   # one piece per step: the whole step
            return [(step, 0, True, lo, total, total)
                    for step in range(start_step, self.steps_per_epoch)
                    for lo in (step * self.global_batch,)
                    for total in (min(self.global_batch, self.used_per_epoch - lo),)]
        out = []
        for step in range(start_step, self.steps_per_epoch):
            lo = step * self.global_batch
            total = min(self.global_batch, self.used_per_epoch - lo)
            micro_start = lo
            for micro, micro_size in enumerate(split_sizes(total, k)):
                rank_sizes = split_sizes(micro_size, self.world_size)
                out.append((step, micro, micro == k - 1, micro_start + sum(rank_sizes[:rank]),
                            rank_sizes[rank], total))
                micro_start += micro_size
        return out

    def micro_batches_per_epoch(self, start_step: int = 0) -> int:
        return max(0, self.steps_per_epoch - start_step) * self.accumulate
