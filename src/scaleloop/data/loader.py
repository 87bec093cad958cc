"""Batches for one rank, following a ``StepSampler``.

Two paths give the same batches:

- in-memory tensors (``TensorDataset``, ``DictTensorDataset`` and every built-in dataset): a
  batch is one ``index_select`` per tensor — no per-sample ``__getitem__`` and no collation;
- any other ``Dataset``, and any dataset with a ``collate_fn`` of the user's own: a
  ``torch.utils.data.DataLoader`` driven by the sampler's index lists (so worker processes and
  custom collate functions still work).

Options for accelerators (all leave the batches' values unchanged):

- ``on_device``: copy the in-memory tensors to the device once; each batch is then gathered
  on the device (no host-to-device copy per step). For datasets that fit in device memory.
- ``pin_memory``: on CUDA, gather into page-locked memory and copy with ``non_blocking=True``,
  so the host does not wait for the GPU at every batch (default on CUDA).
- ``persistent_workers``: keep the DataLoader's worker processes alive between epochs (the
  in-memory path has no workers; there it changes nothing).
- ``channels_last``: hand 4-d inputs (images) over in ``torch.channels_last`` memory format.

``load=(inputs, target)`` leaves out a part this rank does not use (a pipeline's middle stages
use neither): None in its place, not gathered on the in-memory path and not moved to the device
on the DataLoader path (a map-style dataset still reads whole samples there). Only a tensor is
left out, so every rank still sees a batch of another shape and can refuse it alike.
"""
from __future__ import annotations

import multiprocessing.util
import sys
import tempfile
import traceback
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from scaleloop.data.batch import Columns, TargetRoute, move, split, take, tensors_of
from scaleloop.data.sampler import MicroBatch, StepSampler
from scaleloop.errors import UsageError


class Batch(tuple):
    """``(inputs, target)`` that also knows where it sits in the epoch (``batch.place``: its step,
    micro-step, the step's samples; shortcuts ``batch.step``, ``batch.loss_scale``...).

    It unpacks like a tuple, so ``for x, y in loader`` works. ``inputs`` is what the model is
    called with (a tensor, a tuple of positional inputs or a mapping of keyword inputs, see
    ``scaleloop.data.batch``), ``target`` the labels (None when the model computes its own
    loss from its inputs). Pass the batch itself to ``strategy.backward(loss, batch)`` to weight
    a smaller last micro-batch exactly; ``len(batch)`` is its number of samples.
    """

    place: MicroBatch

    def __new__(cls, x: Any, y: Any, place: MicroBatch) -> "Batch":
        obj = tuple.__new__(cls, (x, y))
        obj.place = place
        return obj

    @property
    def plan(self) -> MicroBatch:
        """The old name of ``place``, kept for scripts written before it was renamed."""
        return self.place

    @property
    def step(self) -> int:
        return self.place.step

    @property
    def last_micro(self) -> bool:
        return self.place.last_micro

    @property
    def loss_scale(self) -> float:
        return self.place.loss_scale

    @property
    def indices(self) -> torch.Tensor:
        return self.place.indices

    def __len__(self) -> int:  # tuple length is 2; len(batch) means samples
        return int(self.place.indices.numel())


class _SampleNamed(Dataset):
    """The user's dataset, read as the DataLoader reads it, with the index of a sample whose
    reading raised added to the error as a note (``scaleloop: while reading sample N``): the
    run's error line names it (runtime.frames reads it back from the worker's traceback)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        read = getattr(self.dataset, "__getitems__", None)
        try:
            # A dataset that reads a batch at once (Hugging Face datasets) does so here too.
            return list(read(indices)) if read else [self._one(i) for i in indices]
        except Exception as exc:
            if read and hasattr(exc, "add_note"):
                exc.add_note(f"scaleloop: while reading sample {indices[0]} or one of the {len(indices) - 1} after it")
            raise

    def _one(self, index: Any) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            if hasattr(exc, "add_note"):   # Python 3.11 and newer
                exc.add_note(f"scaleloop: while reading sample {index}")
            raise


def _quiet_lost_reader(worker_id: int) -> None:
    """Set in each DataLoader worker process (``worker_init_fn``): when the rank that reads the
    batches ends at once (another worker was killed, the run failed), the thread that hands this
    worker's tensors over (multiprocessing's resource sharer) finds its reader gone and would print
    a traceback of BrokenPipeError or ConnectionResetError on the console, under the run's own
    report of what happened. That one is left out; every other error is shown as before."""
    shown = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        handing_over = any(frame.filename.endswith("resource_sharer.py") for frame in traceback.extract_tb(tb))
        if not (issubclass(kind, (BrokenPipeError, ConnectionResetError)) and handing_over):
            shown(kind, value, tb)

    sys.excepthook = hook


# The socket path a worker process hands its tensors through under torch's default sharing strategy:
# TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, at most 107 characters on Linux (AF_UNIX).
_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")
_SOCKET_PATH_MAX = 107


def check_worker_socket_dir() -> None:
    """Raise UsageError where DataLoader worker processes could not hand over a batch: the socket
    they pass it through lies in the temporary directory, and a path over Linux's limit fails in the
    worker's sending thread, where nothing reports it; the run then waits for the batch forever."""
    if (sys.platform != "linux" or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or hasattr(multiprocessing.util, "_get_base_temp_dir")):   # Python 3.13+ picks a short one itself
        return
    tmp = tempfile.gettempdir()
    if len(tmp) + _SOCKET_SUFFIX > _SOCKET_PATH_MAX:
        raise UsageError(f"DataLoader worker processes (--num-workers) cannot pass batches through a socket in "
                         f"the temporary directory {tmp} ({len(tmp)} characters; at most "
                         f"{_SOCKET_PATH_MAX - _SOCKET_SUFFIX} fit): set TMPDIR to a shorter path, or use --num-workers 0")


class _EpochBatches:
    """The current epoch's index lists, as a DataLoader ``batch_sampler`` that outlives epochs
    (a DataLoader with persistent workers is built once and re-iterated every epoch)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ShardedLoader:
    """Iterates this rank's micro-batches for the current epoch, already on ``device``."""

    def __init__(self, dataset: Dataset, sampler: StepSampler, device: torch.device, *,
                 num_workers: int = 0, collate_fn: Optional[Callable[[list], Any]] = None,
                 pin_memory: bool = False, persistent_workers: bool = False, on_device: bool = False,
                 channels_last: bool = False, keep_target: TargetRoute = False,
                 load: tuple[bool, bool] = (True, True)) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        # A collate function of the user's own must see the samples: the fast path, which gathers
        # the tensors as the default collation would, is only for the default.
        self._tensors = tensors_of(dataset) if collate_fn in (None, default_collate) else None
        if num_workers > 0 and self._tensors is None:
            check_worker_socket_dir()
        self.epoch = 0
        self.start_step = 0
        self._loader: Optional[DataLoader] = None
        #: A mapping sample's target entry is also passed to the model (``data.batch.split``).
        self.keep_target = keep_target
        #: Which of (inputs, target) this rank uses (see the module doc).
        self.load = load
        self.configure(pin_memory=pin_memory, persistent_workers=persistent_workers, on_device=on_device,
                       channels_last=channels_last)

    def configure(self, *, pin_memory: Optional[bool] = None, persistent_workers: Optional[bool] = None,
                  on_device: Optional[bool] = None, channels_last: Optional[bool] = None) -> "ShardedLoader":
        """Change how batches reach the device (None: leave that option as it is); returns self.

        Raises ValueError for an option this dataset cannot use (``on_device`` needs in-memory
        tensors, ``persistent_workers`` worker processes).
        """
        if pin_memory is not None:
            self.pin_memory = pin_memory and self.device.type == "cuda"
        if persistent_workers is not None:
            if persistent_workers and self.num_workers == 0:
                raise ValueError("persistent workers need DataLoader worker processes: num_workers > 0")
            self.persistent_workers = persistent_workers
            self._loader = None
        if on_device is not None:
            if on_device and self._tensors is None:
                raise ValueError(f"keeping the data on the device needs in-memory tensors (a TensorDataset or a "
                                 f"built-in dataset); {type(self.dataset).__name__} is read sample by sample")
            if on_device and self.device.type == "cuda":
                need = sum(t.numel() * t.element_size() for t in _values(self._tensors))
                free, _ = torch.cuda.mem_get_info(self.device)
                if need > free // 2:   # the rest is for the model, its activations and the optimizer
                    raise ValueError(f"the training set takes {need / 2**30:.2f} GiB, more than half of the "
                                     f"{free / 2**30:.2f} GiB free on {self.device}; leave the data on the host")
            self.on_device = on_device
        if channels_last is not None:
            self.channels_last = channels_last
        self._source: Optional[Columns] = None  # the tensors batches are gathered from
        return self

    @property
    def in_memory(self) -> bool:
        """True when batches are gathered straight from tensors (the fast path)."""
        return self._tensors is not None

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Choose the epoch's order (same on every rank), optionally resuming at ``start_step``."""
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        return self.sampler.micro_batches_per_epoch(self.start_step)

    def __iter__(self) -> Iterator[Batch]:
        # The fast path's generator itself, not one that delegates to it: a ``yield from`` is one
        # more generator to resume for every batch.
        if self._tensors is not None:
            return self._gathered()
        return self._loaded()

    def _loaded(self) -> Iterator[Batch]:
        """The DataLoader path: any map-style dataset, read sample by sample."""
        places = list(self.sampler.micro_batches(self.epoch, self.start_step))
        # A generator of its own: otherwise each DataLoader iterator draws its worker seed from
        # the global torch RNG, and a run resumed mid-epoch (one extra iterator) would drift
        # from the uninterrupted run's dropout and augmentation randomness.
        seeds = torch.Generator()
        seeds.manual_seed(hash((self.sampler.seed, self.epoch, self.start_step, self.sampler.rank)) & 0x7FFF_FFFF_FFFF)
        batches = [p.indices.tolist() for p in places]
        if self.persistent_workers:
            # Built once: its workers stay alive and re-read the batch sampler every epoch (their
            # random state then runs on from epoch to epoch instead of being re-seeded).
            if self._loader is None:
                self._loader = DataLoader(_SampleNamed(self.dataset), batch_sampler=_EpochBatches(),
                                          num_workers=self.num_workers, collate_fn=self.collate_fn,
                                          pin_memory=self.pin_memory, generator=seeds, persistent_workers=True,
                                          worker_init_fn=_quiet_lost_reader)
            loader = self._loader
            loader.batch_sampler.batches = batches
        else:
            loader = DataLoader(_SampleNamed(self.dataset), batch_sampler=batches, num_workers=self.num_workers,
                                collate_fn=self.collate_fn, pin_memory=self.pin_memory, generator=seeds,
                                worker_init_fn=_quiet_lost_reader)
        for p, sample in zip(places, loader):
            x, y = self._moved(split(sample, self.keep_target))
            if self.channels_last:
                x = _channels_last(x)
            yield Batch(x, y, p)

    def _moved(self, parts: tuple[Any, Any]) -> tuple[Any, Any]:
        """Inputs and target on the device, a tensor that this rank does not load left out."""
        return tuple(None if not keep and isinstance(part, torch.Tensor) else move(part, self.device, self.pin_memory)
                     for part, keep in zip(parts, self.load))  # type: ignore[return-value]

    def _gathered(self) -> Iterator[Batch]:
        """The fast path: each batch is one ``index_select`` per tensor."""
        places = list(self.sampler.micro_batches(self.epoch, self.start_step))
        if self._source is None:
            source = self._tensors
            if self.on_device:
                source = move(source, self.device)
            self._source = source
        if not (isinstance(self._source, tuple) and len(self._source) == 2) or isinstance(self.keep_target, tuple):
            yield from self._gathered_columns(places)   # (a target the model takes: split() makes its call)
            return
        x_all, y_all = self._source
        if self.load != (True, True):
            yield from self._gathered_parts(places, x_all, y_all)
            return
        # (A plain loop below: its cost per batch is part of every training step.)
        if x_all.device.type == y_all.device.type == self.device.type:
            # Gathered where the data already is: on the CPU, or kept on the GPU.
            pieces = [p.indices for p in places]
            if places and self.device.type != "cpu":
                # The epoch's indices go to the device in one copy, not one per batch.
                pieces = torch.cat(pieces).to(x_all.device).split([len(i) for i in pieces])
                for p, idx in zip(places, pieces):
                    x, y = x_all.index_select(0, idx).to(self.device), y_all.index_select(0, idx).to(self.device)
                    yield Batch(_channels_last(x) if self.channels_last else x, y, p)
                return
            if self.channels_last:
                for p, idx in zip(places, pieces):   # the CPU: nothing to move
                    yield Batch(_channels_last(x_all.index_select(0, idx)), y_all.index_select(0, idx), p)
                return
            for p, idx in zip(places, pieces):
                yield Batch(x_all.index_select(0, idx), y_all.index_select(0, idx), p)
            return
        pinned = self.pin_memory
        for p in places:
            idx = p.indices
            if pinned:
                # Page-locked memory (from PyTorch's caching host allocator, which keeps a block
                # until its asynchronous copy has finished) lets the copy overlap the GPU's work.
                x = torch.index_select(x_all, 0, idx, out=_pinned_like(x_all, len(idx)))
                y = torch.index_select(y_all, 0, idx, out=_pinned_like(y_all, len(idx)))
            else:
                x, y = x_all.index_select(0, idx), y_all.index_select(0, idx)
            x, y = x.to(self.device, non_blocking=pinned), y.to(self.device, non_blocking=pinned)
            yield Batch(_channels_last(x) if self.channels_last else x, y, p)

    def _gathered_parts(self, places: list[MicroBatch], x_all: torch.Tensor, y_all: torch.Tensor) -> Iterator[Batch]:
        """The fast path for a rank that loads only the inputs, only the target, or neither."""
        want_x, want_y = self.load
        pinned = self.pin_memory
        for p in places:
            idx = p.indices
            x = x_all.index_select(0, idx.to(x_all.device)).to(self.device, non_blocking=pinned) if want_x else None
            y = y_all.index_select(0, idx.to(y_all.device)).to(self.device, non_blocking=pinned) if want_y else None
            yield Batch(_channels_last(x) if self.channels_last and x is not None else x, y, p)

    def _gathered_columns(self, places: list[MicroBatch]) -> Iterator[Batch]:
        """The fast path for more than two tensors, or named ones: every column gathered, then
        cut into inputs and target like a collated batch."""
        assert self._source is not None
        here = next(iter(_values(self._source))).device
        for p in places:
            sample = take(self._source, p.indices.to(here))
            x, y = self._moved(split(sample, self.keep_target))
            yield Batch(_channels_last(x) if self.channels_last else x, y, p)


def _values(columns: Columns) -> Sequence[torch.Tensor]:
    return list(columns.values()) if isinstance(columns, dict) else columns


def _pinned_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)


def _channels_last(x: Any) -> Any:
    """``x`` in channels-last memory format when it is a 4-d tensor (a batch of images)."""
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x
