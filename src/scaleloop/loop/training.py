"""The training loop behind ``scaleloop train``, written with the public strategy API.

Read it top to bottom: build data and model, let the strategy place them, then for every
micro-batch run forward and backward, and after the last micro-batch of a step clip, step
the optimizer and log. Everything that differs between 1 and N workers is the strategy's.
"""
from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from scaleloop.checkpoint.manager import Checkpointer, Progress
from scaleloop.checkpoint.resume import continues_run, run_dir_for
from scaleloop.config import TrainConfig, to_toml
from scaleloop.data.datasets import build_datasets
from scaleloop.data.info import Datasets
from scaleloop.data.loader import Batch
from scaleloop.runtime.devices import describe_device
from scaleloop.runtime.dist import DistEnv, restart_count
from scaleloop.errors import UsageError
from scaleloop.loop.evaluate import EvalResult, evaluate
from scaleloop.output.memory import MemoryProbe, RankMemory, measure, parameter_bytes, write_json
from scaleloop.output.metrics import MetricsLogger, plot_curves
from scaleloop.models import build_model, count_parameters
from scaleloop.strategies.precision import Precision
from scaleloop.output.rundir import prepare_run_dir, write_atomic
from scaleloop.loop.running import RunningLoss
from scaleloop.loop.schedule import build_scheduler, describe_schedule, scaled_lr
from scaleloop.loop.speed import speed_up_model
from scaleloop.strategies import make_strategy
from scaleloop.loop.tasks import loss_fn

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunResult:
    """What a finished run reports (the numbers are reduced over all ranks)."""

    run_dir: Optional[Path]
    device: str
    strategy: str
    world_size: int
    precision: str
    epochs: int
    steps: int
    samples: int
    train_loss: float
    test: Optional[EvalResult]
    samples_per_s: float
    train_s: float
    wall_s: float
    parameters: int
    dropped_per_epoch: int
    in_memory_data: bool
    train_samples: int = 0
    steps_per_epoch: int = 0
    last_step_samples: int = 0
    lr: str = ""
    checkpoints_written: int = 0
    checkpoint_s: float = 0.0
    last_checkpoint: Optional[Path] = None
    resumed_from: Optional[Path] = None
    memory: tuple[RankMemory, ...] = ()


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights, identical data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data_and_model(cfg: TrainConfig) -> tuple[Datasets, torch.nn.Module]:
    """The datasets and the freshly initialised model, exactly as every run builds them (seeded)."""
    seed_everything(cfg.seed)
    data = build_datasets(cfg.data, data_dir=cfg.data_dir, n_samples=cfg.n_samples,
                          input_dim=cfg.input_dim, image_size=cfg.image_size, seq_len=cfg.seq_len,
                          vocab_size=cfg.vocab_size, test_fraction=cfg.test_fraction, seed=cfg.seed)
    return data, build_model(cfg.model, data.info, hidden_dim=cfg.hidden_dim)


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter],
                    lr: Optional[float] = None) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.optimizer`` with its hyperparameters (``lr`` overrides ``cfg.lr``)."""
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer == "sgd":
        kind, options = torch.optim.SGD, dict(lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        kind = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
        options = dict(lr=lr, weight_decay=cfg.weight_decay)
    if not cfg.fused_optimizer:
        return kind(params, **options)  # PyTorch's default implementation for the parameters' device
    params = list(params)
    try:
        # One kernel over all parameters (CUDA and the CPU have them; torch checks the device).
        return kind(params, fused=True, **options)
    except RuntimeError:
        return kind(params, foreach=True, **options)  # the multi-tensor loop: a few kernels per step


def _progress(total: int, initial: int, desc: str, enabled: bool):  # -> tqdm | None
    if not enabled:
        return None
    from tqdm import tqdm  # imported here: only rank 0 with a progress bar needs it

    # disable=None: a bar on a terminal, plain epoch lines in a log file or CI.
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=True, disable=None)


def preflight(cfg: TrainConfig) -> None:
    """Checks worth doing once, before N worker processes start: names, user code, data directory."""
    from scaleloop.data.datasets import DATASET_NAMES
    from scaleloop.models import MODEL_NAMES
    from scaleloop.plugins import is_factory_spec, resolve_factory

    for what, name, known in (("model", cfg.model, MODEL_NAMES), ("data", cfg.data, DATASET_NAMES)):
        if is_factory_spec(name):
            resolve_factory(name, what)
        elif name.lower() not in known:
            raise UsageError(f"unknown {'dataset' if what == 'data' else what} {name!r}; choose one of "
                             f"{', '.join(known)}, or give 'package.module:factory'")
    if cfg.data == "mnist" and not cfg.data_dir:
        raise UsageError("dataset 'mnist' reads IDX files from a directory: pass --data-dir DIR (it never downloads)")
    if cfg.strategy == "pipeline":
        # The cut into stages is known before any worker starts: a model too shallow for
        # --nproc stages fails here, in one line, rather than in every worker.
        from scaleloop.strategies.pipeline import pipeline_layers, plan_stages

        _, model = build_data_and_model(cfg)
        plan_stages(pipeline_layers(model), cfg.world_size, cfg.model)


def train(cfg: TrainConfig, env: DistEnv, log: Optional[Log] = None,
          on_batch: Optional[Callable[[Batch], None]] = None) -> RunResult:
    """Run the training that ``cfg`` describes on ``env``; rank 0 writes the run directory.

    ``on_batch`` (optional) sees every micro-batch this rank trains on, before its forward pass.
    """
    started = time.perf_counter()
    say: Log = (log or print) if env.is_main else (lambda _msg: None)
    restarting = restart_count() > 0

    # 1. Data and model: built identically on every rank from the same seed.
    data, model = build_data_and_model(cfg)
    info = data.info
    n_params = count_parameters(model)
    model_bytes = parameter_bytes(model)  # before a strategy shards or splits it
    loss_of = functools.partial(loss_fn, info)

    # 2. The strategy places the model, builds the optimizer on the placed parameters, and
    #    decides which samples this rank loads.
    precision = Precision(cfg.precision, env.device)
    strategy = make_strategy(cfg.strategy, env, precision, cfg.accumulate, cfg.sync_batchnorm,
                             microbatches=cfg.microbatches)
    lr = scaled_lr(cfg)
    speed_notes = speed_up_model(model, cfg, env.device)
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(cfg, params, lr.peak))
    if cfg.compile:
        # In place (nn.Module.compile): the module, its wrappers' isinstance checks and its
        # state_dict keys stay what they were (no ``_orig_mod.`` prefix in checkpoints).
        model.compile()
    # From here on each rank draws its own random numbers (dropout, augmentation), like
    # independent workers would; the data order stays shared, drawn from cfg.seed + epoch.
    torch.manual_seed(cfg.seed + env.rank)
    loader = strategy.loader(data.train, cfg.batch_size, shuffle=True, seed=cfg.seed,
                             drop_last=cfg.drop_last, num_workers=cfg.num_workers)
    try:
        loader.configure(pin_memory=cfg.pin_memory, persistent_workers=cfg.persistent_workers,
                         on_device=cfg.data_on_device, channels_last=cfg.channels_last)
    except ValueError as exc:
        raise UsageError(f"--data-on-device: {exc}" if cfg.data_on_device else str(exc)) from None
    plan = loader.plan
    total_steps = plan.steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    scheduler = build_scheduler(optimizer, cfg, total_steps)

    # 3. Continue from a checkpoint if --resume (or a torchrun restart) says so: model,
    #    optimizer, schedule, scaler, RNG states and the position inside the epoch.
    checkpointer = Checkpointer(strategy, cfg, say=say)
    resumed = checkpointer.restore(model, optimizer, scheduler, restarting=restarting)
    progress = resumed.progress if resumed is not None else Progress()

    # 4. Rank 0 owns the run directory.
    run_dir = None
    if env.is_main:
        out = run_dir_for(cfg)
        # Only one of this run directory's own checkpoints continues the run in it; another
        # run's checkpoint starts a new run (a fork), which must not overwrite a run in --out.
        continuing = restarting or (resumed is not None and continues_run(out, resumed.source))
        run_dir = prepare_run_dir(str(out) if out else None, cfg.model, cfg.data, continuing=continuing)
        write_atomic(run_dir / "config.toml", to_toml(cfg).encode())
    checkpointer.attach(run_dir)
    if resumed is not None:
        # Later checkpoints belong to the run before a rewind, or were skipped as damaged: they
        # must not count as the newest for a restart, for --resume auto, or for pruning.
        for moved in checkpointer.retire_after(progress.global_step):
            say(f"note: moved {moved.name} aside: it is later than the checkpoint this run continues from")
    metrics = (MetricsLogger(run_dir, tensorboard=cfg.tensorboard,
                             keep_until_step=progress.global_step if resumed is not None or restarting else None)
               if run_dir is not None else None)
    say(f"scaleloop: {cfg.model} ({n_params:,} parameters) on {info.name} "
        f"({len(data.train):,} train / {len(data.test) if data.test is not None else 0:,} test), "
        f"{strategy.describe()} x {env.world_size} on {describe_device(env.device)}, {cfg.precision}")
    for line in strategy.details() + speed_notes:
        say(line)
    lr_line = describe_schedule(cfg, lr, total_steps)
    if cfg.lr_scaling != "none" or cfg.lr_schedule != "constant" or cfg.warmup_steps:
        say(f"learning rate {lr_line}")
    if plan.dropped_per_epoch:
        say(f"note: the last {plan.dropped_per_epoch} sample(s) of each shuffled epoch are dropped "
            f"({'--drop-last' if cfg.drop_last else 'too few to give every worker and micro-step one'})")
    if resumed is not None:
        where = (f"epoch {progress.epoch + 1}, step {progress.step_in_epoch} of {plan.steps_per_epoch}"
                 if progress.step_in_epoch else f"the end of epoch {progress.epoch}")
        say(f"resuming from {resumed.source} (global step {progress.global_step}: {where}); any steps an "
            "interrupted run took after it are trained again")
        for note in resumed.notes:
            say(note)
    elif restarting:
        say(f"restart {restart_count()}: no checkpoint was written before the failure; starting over")

    # 5. The loop.
    model.train()
    step, samples, train_s = progress.global_step, progress.samples, progress.train_s
    # Running sums (loss x samples, samples) for the epoch and for the current log window;
    # saved in checkpoints so that a resumed epoch reports the loss of the whole epoch.
    running = RunningLoss()
    if resumed is not None:
        running.load(resumed.sums)
    window_start, window_samples = time.perf_counter(), 0
    probe = MemoryProbe()  # gradients exist only between backward and the optimizer step
    train_loss = float("nan")
    step_lr = optimizer.param_groups[0]["lr"]
    test: Optional[EvalResult] = None
    epochs_run = progress.epoch
    done = cfg.max_steps is not None and step >= cfg.max_steps
    if done or progress.epoch >= cfg.epochs:
        say(f"nothing left to train: the checkpoint is at step {step}, epoch {progress.epoch} of {cfg.epochs}"
            + (f", --max-steps {cfg.max_steps}" if cfg.max_steps is not None else "")
            + "; raise --epochs or --max-steps to train further")
        done = True
    try:
        for epoch in range(progress.epoch, cfg.epochs):
            if done:
                break
            first_step = progress.step_in_epoch if epoch == progress.epoch else 0
            loader.set_epoch(epoch, first_step)
            if first_step == 0:
                running.new_epoch()
            in_epoch = first_step
            bar = _progress(plan.steps_per_epoch, first_step, f"epoch {epoch + 1}/{cfg.epochs}",
                            cfg.progress and env.is_main)
            epoch_start = time.perf_counter()
            for batch in loader:
                if on_batch is not None:
                    on_batch(batch)
                with strategy.accumulate(model, batch):
                    loss = strategy.forward_backward(model, batch, loss_of)
                if loss is not None:  # None: this rank computes no loss (a pipeline's earlier stage)
                    running.add(loss, len(batch))
                if not batch.last_micro:
                    continue
                if cfg.clip_grad is not None:
                    strategy.clip_grad_norm(model, optimizer, cfg.clip_grad)
                probe.see_gradients(model)
                strategy.optimizer_step(optimizer)
                step_lr = optimizer.param_groups[0]["lr"]  # the rate this step used
                scheduler.step()
                step += 1
                in_epoch = batch.step + 1
                samples += batch.plan.step_samples
                window_samples += batch.plan.step_samples
                if bar is not None:
                    bar.update(1)
                if step % cfg.log_every == 0:
                    # A collective on every rank at the same step: the reported loss is global.
                    total = strategy.reduce_sum(running.window_sums(env.device)).tolist()
                    now = time.perf_counter()
                    rate = window_samples / max(now - window_start, 1e-9)
                    step_loss = total[0] / total[1]
                    if metrics is not None:
                        metrics.log_step(step, epoch + 1, samples, train_loss=step_loss,
                                         lr=step_lr, samples_per_s=rate,
                                         wall_s=now - started)
                    if bar is not None:
                        bar.set_postfix(loss=f"{step_loss:.4f}", samples_s=f"{rate:,.0f}")
                    running.new_window()
                    window_start, window_samples = now, 0
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    done = True
                    break
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and in_epoch < plan.steps_per_epoch:
                    pause = time.perf_counter()
                    if metrics is not None:
                        metrics.flush()   # the rows up to the checkpoint, on disk with it
                    checkpointer.save(model, optimizer, scheduler,
                                      Progress(epoch, in_epoch, step, samples, train_s + pause - epoch_start),
                                      running.state(env.device))
                    # Checkpoint time is reported on its own, not as training time.
                    paused = time.perf_counter() - pause
                    epoch_start += paused
                    window_start += paused
            train_s += time.perf_counter() - epoch_start
            if bar is not None:
                bar.close()
            epochs_run = epoch + 1
            total = strategy.reduce_sum(running.epoch_sums(env.device)).tolist()
            train_loss = total[0] / total[1] if total[1] > 0 else float("nan")
            test = evaluate(model, data.test, info, strategy) if data.test is not None and len(data.test) else None
            window_start = time.perf_counter()  # evaluation is not training time
            if metrics is not None:
                metrics.log_epoch(epoch + 1, step, samples, train_loss=train_loss,
                                  test_loss=test.loss if test else None,
                                  test_acc=test.accuracy if test else None,
                                  lr=step_lr,
                                  samples_per_s=samples / max(train_s, 1e-9),
                                  wall_s=time.perf_counter() - started)
            say(f"epoch {epoch + 1}: train loss {train_loss:.4f}"
                + (f", test loss {test.loss:.4f}, test accuracy {test.accuracy:.2%}" if test else ""))
            # At the epoch's end (or where --max-steps stopped inside it): the next run starts after it.
            finished_epoch = in_epoch >= plan.steps_per_epoch
            checkpointer.save(model, optimizer, scheduler,
                              Progress(epoch + 1 if finished_epoch else epoch, 0 if finished_epoch else in_epoch,
                                       step, samples, train_s), running.state(env.device))
            window_start = time.perf_counter()
    finally:
        if metrics is not None:
            metrics.close()
    if test is None and data.test is not None and len(data.test):
        test = evaluate(model, data.test, info, strategy)  # nothing trained: report the checkpoint's model

    # 6. Results: final weights (of the user's own module, without wrappers, unsharded: a
    #    collective for a sharded strategy), memory per rank, and curves.
    final_weights = strategy.full_state_dict(model)
    memory = tuple(strategy.gather_object(measure(model, optimizer, env.rank, env.device, probe.gradients, model_bytes)))
    strategy.close()
    if run_dir is not None:
        import io

        buf = io.BytesIO()
        torch.save(final_weights, buf)
        write_atomic(run_dir / "model.pt", buf.getvalue())
        write_json(run_dir / "memory.json", memory, strategy.name)
        plot_curves(run_dir / "metrics.csv", run_dir / "curves.png")
    return RunResult(
        run_dir=run_dir, device=describe_device(env.device), strategy=strategy.describe(),
        world_size=env.world_size, precision=cfg.precision, epochs=epochs_run, steps=step,
        samples=samples, train_loss=train_loss, test=test,
        samples_per_s=samples / max(train_s, 1e-9), train_s=train_s,
        wall_s=time.perf_counter() - started, parameters=n_params,
        dropped_per_epoch=plan.dropped_per_epoch, in_memory_data=loader.in_memory,
        train_samples=plan.n, steps_per_epoch=plan.steps_per_epoch,
        last_step_samples=len(plan.step_indices(0, plan.steps_per_epoch - 1)) if plan.steps_per_epoch else 0,
        lr=lr_line, checkpoints_written=checkpointer.written, checkpoint_s=checkpointer.seconds,
        last_checkpoint=checkpointer.last_path, resumed_from=resumed.source if resumed is not None else None,
        memory=memory)
