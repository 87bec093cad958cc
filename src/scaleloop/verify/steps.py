"""The K training steps a verify run takes: the same code for the reference and for every worker.

They follow ``scaleloop.loop.training.train`` step for step (same seeds, model, optimizer, learning-rate
schedule, loader, accumulation, clipping, precision), so what verify proves holds for
``scaleloop train`` with the same settings, and leave out what does not change the weights
(evaluation, checkpoints, metrics files).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.loop.training import build_data_and_model, build_optimizer
from scaleloop.strategies.precision import Precision
from scaleloop.loop.schedule import build_scheduler, scaled_lr
from scaleloop.strategies import make_strategy
from scaleloop.verify.loss import resolve_loss
from scaleloop.verify.recorder import Recorder


@dataclass(frozen=True)
class RunSpec:
    """How one side of the comparison runs: its strategy and accumulation, and how many steps."""

    strategy: str
    accumulate: int
    steps: int
    loss: Optional[str] = None


def run_steps(cfg: TrainConfig, env: DistEnv, spec: RunSpec, recorder: Recorder) -> None:
    """Train ``spec.steps`` optimizer steps on this rank, telling ``recorder`` what happens."""
    data, model = build_data_and_model(cfg)
    precision = Precision(cfg.precision, env.device)
    strategy = make_strategy(spec.strategy, env, precision, spec.accumulate, cfg.sync_batchnorm)
    peak = scaled_lr(cfg).peak
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(cfg, params, peak))
    # As in the training loop: from here each rank draws its own random numbers (dropout).
    torch.manual_seed(cfg.seed + env.rank)
    loader = strategy.loader(data.train, cfg.batch_size, shuffle=True, seed=cfg.seed,
                             drop_last=cfg.drop_last, num_workers=cfg.num_workers)
    plan = loader.plan
    if plan.steps_per_epoch == 0:
        raise UsageError(f"the training set ({plan.n} samples) is smaller than one step of "
                         f"--batch-size {cfg.batch_size} with --drop-last; lower --batch-size")
    # The schedule the real run would follow, so that its first K steps are the ones checked.
    total = plan.steps_per_epoch * cfg.epochs
    scheduler = build_scheduler(optimizer, cfg, min(total, cfg.max_steps) if cfg.max_steps else total)
    criterion = resolve_loss(spec.loss, data.info)
    recorder.attach(strategy, model)
    model.train()

    step, epoch = 0, 0
    while step < spec.steps:
        loader.set_epoch(epoch)
        epoch += 1
        for batch in loader:
            recorder.micro_batch(batch)
            x, y = batch
            with strategy.accumulate(model, batch):
                with strategy.autocast():
                    loss = criterion(model(x), y)
                strategy.backward(loss, batch)
            recorder.micro_loss(loss, batch)
            if not batch.last_micro:
                continue
            recorder.synced()
            if cfg.clip_grad is not None:
                strategy.clip_grad_norm(model, optimizer, cfg.clip_grad)
            strategy.optimizer_step(optimizer)
            scheduler.step()
            recorder.stepped()
            step += 1
            if step >= spec.steps:
                break
    recorder.finish(loader, epochs_touched=epoch)
    # What the strategy set up for itself (FSDP's one-rank group in a single process). Strategies
    # without a close() predate it and set up nothing.
    close = getattr(strategy, "close", None)
    if callable(close):
        close()
