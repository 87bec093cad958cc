"""Streams: a ``torch.utils.data.IterableDataset`` split over ranks, micro-steps and DataLoader
workers so that every sample is used once per pass, and a pass resumes where it stopped.

The rule (docs/streaming.md), on the stream's samples in order ``s0, s1, ...`` (positions):

1. Step ``s`` takes positions ``[s*B, (s+1)*B)`` for the GLOBAL batch ``B``, whatever the world
   size W or accumulation A, as the map-style sampler (``sampler.StepSampler``) does with its order.
2. Inside a step, position offset ``j`` goes to micro-step ``j % A`` and, in it, to rank
   ``(j // A) % W`` (strided, like ``DistributedSampler``). A micro-step's samples are therefore
   the same whatever W is (BatchNorm statistics synchronised over ranks agree with one process),
   and a step's samples are spread within one sample over the W x A pieces.
3. A last step with fewer than B samples is trained on, weighted exactly (``loss_scale``) like
   the map-style sampler's; with fewer than W x A samples (some piece would be empty), or with
   ``drop_last``, it is dropped, and reported.
4. Every rank reads the whole stream, in the same order, and keeps its share; so every rank
   knows each step's size without a collective, and learns the stream's end when it reads it.
   With K DataLoader workers, each worker also reads the whole stream and keeps every K-th of
   its rank's micro-batches (counted from the pass's first step), which it collates; the
   training process puts them back in order. The stream is read W x K times in all: workers
   take collation and the reading itself off the training process, they do not divide it.
5. A reader hands a step's micro-batches out only once it has read far enough to know that
   step's size and whether another step follows (up to one more step's samples; it keeps
   only its own), so the loop knows which step ends the pass (``steps_per_epoch`` is set then).
6. Resuming at step ``k`` of a pass re-reads the pass's first ``k*B`` samples and discards them,
   unless the stream is stateful: a stream with ``state_dict()`` and ``load_state_dict(state)``
   (the convention of Hugging Face ``datasets``' IterableDataset and of torchdata) has its state
   taken after every step's last sample (``k*B``), carried with that step's last micro-batch,
   and saved in the checkpoint; the resumed pass loads it and reads on from position ``k*B``,
   re-reading nothing.

The stream must yield the same samples in the same order in every process; a stream that
shuffles must do so from the epoch: ``set_epoch(epoch)``, if the dataset has it, is called before
every pass (in each worker too). A ``__len__``, if the dataset has one, gives the pass's length
ahead (for the learning-rate schedule and the progress bar); every pass is checked against it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from scaleloop.data.batch import TargetRoute, move, split
from scaleloop.data.loader import Batch, _channels_last, check_worker_socket_dir
from scaleloop.errors import UsageError


@dataclass(slots=True)
class StreamMicroBatch:
    """One rank's micro-batch of a stream: ``sampler.MicroBatch``'s fields, and the pass's length
    on the micro-batches of its last step."""

    step: int              # optimizer step within the pass
    micro: int             # micro-step within the optimizer step, 0..A-1
    last_micro: bool       # the micro-step after which the optimizer steps
    indices: torch.Tensor  # the samples' positions in the stream (CPU int64)
    step_samples: int      # samples in the whole step, over all ranks
    loss_scale: float      # multiply the micro-batch's mean loss by this before backward
    pass_samples: Optional[int] = None   # the stream's length, on the pass's last step (else None)
    #: A stateful stream's ``state_dict()`` after the step's last sample, on the step's last micro-batch.
    stream_state: Any = None


def is_stateful(dataset: Any) -> bool:
    """Whether ``dataset`` saves and restores its place in a pass (``state_dict``/``load_state_dict``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def declared_length(dataset: Dataset) -> Optional[int]:
    """``len(dataset)``, or None for a stream without ``__len__``."""
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


class StreamSampler:
    """The rule of the module docstring for one rank (which stream positions each step, micro-step
    and rank takes: ``sampler.StepSampler``'s job for a stream), and what is known of a pass's length."""

    shuffle = False   # a stream's order is its own (``set_epoch``)

    def __init__(self, global_batch: int, *, world_size: int = 1, rank: int = 0, accumulate: int = 1,
                 seed: int = 0, drop_last: bool = False, n: Optional[int] = None) -> None:
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.accumulate = accumulate
        self.seed = seed
        self.drop_last = drop_last
        #: Samples in one pass: the dataset's ``__len__``, else what the first pass to reach its end counted.
        self.n = n

    def _kept(self, size: int) -> bool:
        """Whether a step of ``size`` (at most B) samples is trained on (rule 3)."""
        if size <= 0:
            return False
        return size == self.global_batch or (not self.drop_last and size >= self.world_size * self.accumulate)

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps in a pass (None while the pass's length is unknown)."""
        if self.n is None:
            return None
        full, tail = divmod(self.n, self.global_batch)
        return full + (1 if tail and self._kept(tail) else 0)

    @property
    def dropped_per_epoch(self) -> int:
        """Samples at a pass's end that no step trains on (0 while the length is unknown)."""
        tail = self.n % self.global_batch if self.n is not None else 0
        return tail if tail and not self._kept(tail) else 0

    def step_indices(self, epoch: int, step: int) -> torch.Tensor:
        """All positions of one optimizer step, over all ranks."""
        used = (self.n or 0) - self.dropped_per_epoch
        return torch.arange(step * self.global_batch, min((step + 1) * self.global_batch, used))

    def read(self, stream: Iterable[Any], start_step: int = 0, worker: int = 0, workers: int = 1, *,
             from_state: bool = False, snapshot: Optional[Callable[[], Any]] = None,
             ) -> Iterator[tuple[StreamMicroBatch, list[Any]]]:
        """This rank's micro-batches of one pass over ``stream``, from step ``start_step`` on,
        with their samples; with ``workers`` > 1 only those of worker ``worker``. Returns (as the
        generator's value) the number of samples the stream held.

        ``from_state``: the stream was restored to position ``start_step * B`` (rule 6) and yields
        from there. ``snapshot``: called after each step's last sample; what it returns rides on
        that step's last micro-batch (``stream_state``)."""
        B, A, W = self.global_batch, self.accumulate, self.world_size
        ahead = B if self.drop_last else W * A   # read this far into the next step to know it is kept
        mine: dict[tuple[int, int], list[tuple[int, Any]]] = {}   # (step, micro) -> [(position, sample)]
        states: dict[int, Any] = {}   # step k -> the stream's state after position k*B (at most two held)
        step = start_step   # the next step to hand out
        n = first = start_step * B if from_state else 0
        for n, sample in enumerate(stream, first + 1):
            pos = n - 1
            if pos < start_step * B:
                continue   # resuming: the steps already trained are read again and discarded
            s, j = divmod(pos, B)
            micro = j % A
            if (j // A) % W == self.rank and ((s - start_step) * A + micro) % workers == worker:
                mine.setdefault((s, micro), []).append((pos, sample))
            if snapshot is not None and n % B == 0:
                states[n // B] = snapshot()
            while n >= (step + 1) * B + ahead:   # step is full, and another step follows it
                yield from self._hand_out(mine, step, B, None, start_step, worker, workers, states.pop(step + 1, None))
                step += 1
        while self._kept(size := min(B, n - step * B)):
            last = not self._kept(min(B, n - (step + 1) * B))
            yield from self._hand_out(mine, step, size, n if last else None, start_step, worker, workers,
                                      states.pop(step + 1, None))
            step += 1
        return n

    def _hand_out(self, mine: dict[tuple[int, int], list[tuple[int, Any]]], step: int, size: int,
                  pass_samples: Optional[int], start_step: int, worker: int,
                  workers: int, stream_state: Any = None) -> Iterator[tuple[StreamMicroBatch, list[Any]]]:
        A = self.accumulate
        for micro in range(A):
            if ((step - start_step) * A + micro) % workers != worker:
                continue
            held = mine.pop((step, micro))
            # Each rank's gradient is averaged over W ranks, so a micro-batch holding share
            # len/size of the step is weighted W * len / size (as in sampler.StepSampler).
            yield (StreamMicroBatch(step, micro, micro == A - 1, torch.tensor([p for p, _ in held]), size,
                                    self.world_size * len(held) / size, pass_samples,
                                    stream_state if micro == A - 1 else None),
                   [sample for _, sample in held])


class _Reader(IterableDataset):
    """One pass of one rank (of one of its workers): ``(unit, micro-batch, collated samples)`` for each
    micro-batch, then ``(None, None, samples in the stream)``."""

    def __init__(self, dataset: IterableDataset, sampler: StreamSampler, epoch: int, start_step: int,
                 collate_fn: Optional[Callable[[list], Any]], state: Any = None) -> None:
        self.dataset, self.sampler, self.epoch, self.start_step = dataset, sampler, epoch, start_step
        self.collate = collate_fn or default_collate
        self.state = state   # a stateful stream's state at ``start_step``: load it, re-read nothing

    def __iter__(self) -> Iterator[tuple[Optional[int], Optional[StreamMicroBatch], Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(self.epoch)   # type: ignore[attr-defined]
        stateful = is_stateful(self.dataset)
        if self.state is not None:
            self.dataset.load_state_dict(copy.deepcopy(self.state))   # type: ignore[attr-defined]
        # A snapshot of the state at every step's end (not only at checkpoints): a checkpoint may
        # come at any step, when a stop signal arrives, and the reader runs ahead of the loop.
        snapshot = (lambda: copy.deepcopy(self.dataset.state_dict())) if stateful else None   # type: ignore[attr-defined]
        micro_batches = self.sampler.read(self.dataset, self.start_step, worker, workers,
                                       from_state=self.state is not None, snapshot=snapshot)
        while True:
            try:
                p, samples = next(micro_batches)
            except StopIteration as end:   # the stream ended; ``read`` returns its length
                yield None, None, end.value
                return
            yield p.step * self.sampler.accumulate + p.micro, p, self.collate(samples)


def _as_is(item: Any) -> Any:
    return item


class StreamingLoader:
    """Iterates this rank's micro-batches of the current pass over a stream, already on ``device``;
    the loop uses it as it uses ``loader.ShardedLoader`` (``sampler``, ``set_epoch``, ``Batch``es)."""

    in_memory = False   # read sample by sample, never gathered from tensors

    def __init__(self, dataset: IterableDataset, sampler: StreamSampler, device: torch.device, *,
                 num_workers: int = 0, collate_fn: Optional[Callable[[list], Any]] = None,
                 pin_memory: bool = False, persistent_workers: bool = False, on_device: bool = False,
                 channels_last: bool = False, keep_target: TargetRoute = False, env: Any = None,
                 load: tuple[bool, bool] = (True, True)) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.num_workers = num_workers
        if num_workers > 0:
            check_worker_socket_dir()
        self.collate_fn = collate_fn
        self.env = env   # a DistEnv: every rank's pass length is compared at the pass's end
        self.epoch = 0
        self.start_step = 0
        #: The stream's state after the last step handed out, and the one to resume from (see ``state_dict``).
        self._state: Optional[dict[str, Any]] = None
        self._resume: Optional[dict[str, Any]] = None
        self.keep_target = keep_target
        #: Which of (inputs, target) this rank uses: a tensor it does not is not moved to the device.
        self.load = load
        self.pin_memory = self.channels_last = False
        self.configure(pin_memory=pin_memory, persistent_workers=persistent_workers, on_device=on_device,
                       channels_last=channels_last)

    def configure(self, *, pin_memory: Optional[bool] = None, persistent_workers: Optional[bool] = None,
                  on_device: Optional[bool] = None, channels_last: Optional[bool] = None) -> "StreamingLoader":
        """As ``ShardedLoader.configure``; a stream cannot be kept on the device, and its workers
        start again every pass (each reads the stream from its start)."""
        if on_device:
            raise ValueError(f"keeping the data on the device needs in-memory tensors; {type(self.dataset).__name__} "
                             "is a stream (an IterableDataset)")
        if persistent_workers:
            raise ValueError("--persistent-workers: a stream's DataLoader workers start again every pass "
                             "(each reads the stream from its start); drop --persistent-workers")
        if pin_memory is not None:
            self.pin_memory = pin_memory and self.device.type == "cuda"
        if channels_last is not None:
            self.channels_last = channels_last
        return self

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The pass to read next (the stream's ``set_epoch`` gets ``epoch``), from step ``start_step``."""
        self.epoch = epoch
        self.start_step = start_step

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Where a stateful stream stands after the last step handed out: ``{"epoch", "step",
        "state"}`` (``state``: the stream's own ``state_dict()`` after that step's last sample),
        for the checkpoint. None for a stream without state (its resume re-reads the pass)."""
        return self._state

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Resume from ``state`` (from :meth:`state_dict`) when the pass ``set_epoch`` names next
        is the one it was taken in, at the same step; any other pass is read as usual."""
        self._resume = dict(state) if isinstance(state, Mapping) and "state" in state else None

    def _resume_state(self) -> Any:
        """The stream's state to load for the pass about to be read, if it resumes one (once)."""
        saved, self._resume = self._resume, None
        if (saved is None or not is_stateful(self.dataset) or self.start_step == 0
                or (saved.get("epoch"), saved.get("step")) != (self.epoch, self.start_step)):
            return None
        return saved["state"]

    def __iter__(self) -> Iterator[Batch]:
        sampler = self.sampler
        # Worker seeds from the pass (not from the global RNG, nor from where it resumes): a
        # resumed pass's workers draw the same random numbers as the uninterrupted pass's.
        seeds = torch.Generator()
        seeds.manual_seed(hash((sampler.seed, self.epoch, sampler.rank)) & 0x7FFF_FFFF_FFFF)
        reader = _Reader(self.dataset, sampler, self.epoch, self.start_step, self.collate_fn, self._resume_state())
        self._state = None
        loader = DataLoader(reader, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                            pin_memory=self.pin_memory, generator=seeds)
        waiting: dict[int, tuple[StreamMicroBatch, Any]] = {}
        want = self.start_step * sampler.accumulate   # the next micro-batch, in step order
        n = 0
        for unit, p, sample in loader:
            if unit is None:   # a reader reached the stream's end
                n = sample
                continue
            waiting[unit] = (p, sample)
            while want in waiting:   # workers' micro-batches, back in order
                p, sample = waiting.pop(want)
                want += 1
                if p.pass_samples is not None:
                    self._learn(p.pass_samples)   # before the last step trains: the loop sees it end the pass
                if p.stream_state is not None:   # before the step trains: a checkpoint after it saves this
                    self._state = {"epoch": self.epoch, "step": p.step + 1, "state": p.stream_state}
                x, y = (None if not keep and isinstance(part, torch.Tensor) else move(part, self.device, self.pin_memory)
                        for part, keep in zip(split(sample, self.keep_target), self.load))
                yield Batch(_channels_last(x) if self.channels_last else x, y, p)
        if waiting:
            raise RuntimeError(f"stream readers skipped micro-batch {want}; got {sorted(waiting)}")
        self._learn(n)
        self._agree(n)

    def _learn(self, n: int) -> None:
        """The pass held ``n`` samples: the first pass to end sets the length, later ones must match it."""
        if self.sampler.n is None:
            self.sampler.n = n
        elif n != self.sampler.n:
            said = "its __len__ says" if declared_length(self.dataset) is not None else "an earlier pass held"
            raise UsageError(f"the training stream held {n:,} samples in epoch {self.epoch + 1}, but {said} "
                             f"{self.sampler.n:,}: a stream must yield the same samples in every pass "
                             "(docs/streaming.md)")

    def _agree(self, n: int) -> None:
        """Every rank read a stream of the same length (one collective per pass)."""
        if self.env is None or self.env.world_size == 1:
            return
        from scaleloop.runtime.collectives import gather_object

        lengths = gather_object(n, self.env)
        if len(set(lengths)) > 1:
            raise UsageError(f"the ranks read training streams of different lengths ({', '.join(map(str, lengths))}): "
                             "every process must see the same stream, in the same order (docs/streaming.md)")


class StreamEval:
    """This rank's evaluation batches of a stream, each sample once over all ranks: every rank
    reads the whole stream in chunks of ``batch_size`` samples, and ``shard(len(chunk), batch_size)``
    (the strategy's ``eval_shard``) says which of each chunk's samples it evaluates and how many
    filler forwards it adds. Yields ``(collated batch, counted)``; ``samples`` is then the
    stream's length. A rank holds one chunk at a time."""

    def __init__(self, dataset: IterableDataset, shard: Callable[[int, int], tuple[range, int]],
                 batch_size: int) -> None:
        self.dataset, self.shard, self.batch_size = dataset, shard, batch_size
        self.samples = 0

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        stream, size = iter(self.dataset), self.batch_size
        while chunk := list(islice(stream, size)):
            self.samples += len(chunk)
            mine, fillers = self.shard(len(chunk), size)
            for start in range(mine.start, mine.stop, size):
                yield default_collate(chunk[start:min(start + size, mine.stop)]), True
            for _ in range(fillers):
                yield default_collate(chunk[:1]), False
