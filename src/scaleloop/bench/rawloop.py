"""The hand-written PyTorch loops that scaleloop's loop is measured against.

Both are the tutorial's loop — zero the gradients, forward, loss, backward, step — with no
library; they differ only in how batches are made:

- ``gather`` (for ``bench overhead``): each batch is gathered from the in-memory tensors with
  one ``index_select`` per tensor, the data path of scaleloop's in-memory fast path, and the
  loss is summed on the device and read once per epoch. Same data path on both sides, so the
  comparison measures the loop and nothing else.
- ``dataloader`` (for ``bench overhead --mode datapath``): the tutorial's own
  ``DataLoader(dataset, batch_size=B, shuffle=True)``, which reads every sample through
  ``__getitem__`` and collates them, and ``running_loss += loss.item() * len(x)``. The sampler
  is the one ``shuffle=True`` builds (``RandomSampler``) with a generator of its own, re-seeded
  every epoch so that it draws the same permutation as scaleloop's sampler.

Either way the loop trains the same model on the same data in the same order as
``scaleloop train`` with one process, so both end with the same weights: the bench checks that
the loops did the same work. ``--channels-last`` and ``--compile`` are applied to the raw loop
as ``scaleloop train`` applies them (the model and the 4-d inputs in channels-last format; the
model compiled in place), so that the baseline runs the same kernels. Its clock waits for the
GPU at the end of each epoch, as scaleloop's does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from scaleloop.config import TrainConfig
from scaleloop.data.batch import split
from scaleloop.runtime.devices import device_clock

DATA_PATHS = ("gather", "dataloader")


@dataclass(frozen=True)
class RawResult:
    train_s: float          # seconds inside the epoch loops (as RunResult.train_s counts them)
    samples: int
    train_loss: float       # mean loss of the last epoch
    state: dict             # final weights


def raw_train(cfg: TrainConfig, device: torch.device, data_path: str = "gather") -> RawResult:
    """Train ``cfg``'s model on ``cfg``'s data with a plain loop.

    Batches are what the user's dataset gives, read by the one input rule of
    ``scaleloop.data.batch`` (``(x, y)``, ``(x1, ..., xk, y)`` or a mapping with ``labels``) and
    the loss by the one output rule of ``scaleloop.loop.losses`` (a tensor, a tuple, a mapping or
    object with ``logits``, or the model's own ``loss``): the same calls a hand-written loop
    over such a model makes, so the comparison still measures only the loop around them.
    ``gather`` needs a dataset held in memory (``TensorDataset``, ``DictTensorDataset``).
    """
    from scaleloop.data.batch import call_model, take

    run = _build(cfg, device, data_path)
    model, optimizer, loss_fn, to_device, keep = run.model, run.optimizer, run.loss_fn, run.to_device, run.keep
    n, batch = len(run.train), cfg.optim.batch_size
    model.train()
    if data_path == "dataloader":
        return _tutorial_loop(cfg, device, run)
    train_s, samples = 0.0, 0
    epoch_loss = torch.zeros((), device=device)
    for epoch in range(cfg.optim.epochs):
        epoch_loss.zero_()
        start = time.perf_counter()   # drawing the epoch's order is timed, as in scaleloop's loader
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.optim.seed + epoch))
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            x, y = split(to_device(take(run.columns, idx)), keep)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(call_model(model, x), y)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach() * len(idx)
        train_s += device_clock(device) - start   # the epoch's steps have run, not only been queued
        samples += n
    return RawResult(train_s, samples, float(epoch_loss) / n, _weights(model))


class _RawRun(NamedTuple):
    """What the hand-written loops train with, built as ``scaleloop train`` builds it."""

    model: Any
    optimizer: Any
    loss_fn: Callable[[Any, Any], Any]
    to_device: Callable[[Any], Any]
    train: Any                 # the training set
    columns: Any               # its tensors, for the gather path (None for a dataset read sample by sample)
    keep: bool                 # the model takes the target among its inputs


def _build(cfg: TrainConfig, device: torch.device, data_path: str) -> _RawRun:
    from scaleloop.data.batch import keeps_target, tensors_of
    from scaleloop.data.datasets import build_datasets
    from scaleloop.errors import UsageError
    from scaleloop.loop.build import build_optimizer, seed_everything, speed_up_model
    from scaleloop.loop.losses import resolve_loss
    from scaleloop.models import build_model

    if data_path not in DATA_PATHS:
        raise ValueError(f"data_path must be one of {DATA_PATHS}, got {data_path!r}")
    # The same construction, in the same order, as scaleloop.loop.training.train: identical initial
    # weights and data. The loss is scaleloop's, since it only picks the task's loss.
    seed_everything(cfg.optim.seed)
    data = build_datasets(cfg.model_data.data, n_samples=cfg.model_data.n_samples, input_dim=cfg.model_data.input_dim, image_size=cfg.model_data.image_size,
                          seq_len=cfg.model_data.seq_len, vocab_size=cfg.model_data.vocab_size, test_fraction=cfg.model_data.test_fraction,
                          seed=cfg.optim.seed)
    model = build_model(cfg.model_data.model, data.info, hidden_dim=cfg.model_data.hidden_dim).to(device)
    speed_up_model(model, cfg, device)   # --channels-last on the weights; checks that --compile can work
    optimizer = build_optimizer(cfg, model.parameters(), model=model)
    if cfg.parallel.compile:
        model.compile()   # in place, as scaleloop's run does: same graph, same kernels
    to_device = _mover(device, cfg.model_data.channels_last)
    torch.manual_seed(cfg.optim.seed)
    columns = tensors_of(data.train)
    if columns is None and data_path == "gather":
        raise UsageError(f"bench overhead's raw loop gathers batches from tensors held in memory, and --data "
                         f"{cfg.model_data.data!r} is a {type(data.train).__name__}; compare the DataLoader paths with "
                         "--mode datapath")
    return _RawRun(model, optimizer, resolve_loss(cfg.model_data.loss, data.info), to_device, data.train, columns,
                   keeps_target(model, data.train))


def _tutorial_loop(cfg: TrainConfig, device: torch.device, run: _RawRun) -> RawResult:
    """The tutorial's loop, as written there (with scaleloop's permutation, see above)."""
    from torch.utils.data import DataLoader, RandomSampler

    from scaleloop.data.batch import call_model, first_tensor

    model, optimizer, loss_fn, to_device, keep = run.model, run.optimizer, run.loss_fn, run.to_device, run.keep
    n, train_s, samples = len(run.train), 0.0, 0
    shuffle = torch.Generator()
    loader = DataLoader(run.train, batch_size=cfg.optim.batch_size, sampler=RandomSampler(run.train, generator=shuffle))
    running_loss = 0.0
    for epoch in range(cfg.optim.epochs):
        shuffle.manual_seed(cfg.optim.seed + epoch)
        running_loss = 0.0
        start = time.perf_counter()
        for sample in loader:
            x, y = split(to_device(sample), keep)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(call_model(model, x), y)
            loss.backward()
            optimizer.step()
            running_loss += loss.item() * first_tensor(sample).shape[0]
        train_s += device_clock(device) - start
        samples += n
    return RawResult(train_s, samples, running_loss / n, _weights(model))


def _mover(device: torch.device, channels_last: bool) -> Callable[[Any], Any]:
    """The batch onto ``device``; with ``channels_last``, its 4-d tensors (images) in that format,
    as scaleloop's loader hands them over."""
    from scaleloop.data.batch import move

    if not channels_last:
        return lambda batch: move(batch, device)

    def to_format(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        return t

    def moved(batch: Any) -> Any:
        batch = move(batch, device)
        if isinstance(batch, (list, tuple)):
            return type(batch)(to_format(t) for t in batch)
        if isinstance(batch, dict):
            return {k: to_format(v) for k, v in batch.items()}
        return to_format(batch)

    return moved


def _weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
