"""Building a run: everything ``train``, ``verify``, ``bench`` and ``tune-batch`` train with,
made by one function in one fixed order, so that the same settings give the same weights
whichever of them runs.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
import torch
from torch import nn

from scaleloop.checkpoint.weights import init_weights
from scaleloop.config import TrainConfig
from scaleloop.data.datasets import build_datasets, infer_info
from scaleloop.data.info import Datasets
from scaleloop.data.batch import keeps_target
from scaleloop.data.loader import ShardedLoader
from scaleloop.data.streaming import StreamingLoader, declared_length
from scaleloop.errors import UsageError
from scaleloop.loop.decay import describe_decay, param_groups
from scaleloop.loop.evaluations import check_eval_data
from scaleloop.loop.padding import StepCount, counting_for
from scaleloop.loop.schedule import LearningRate, build_scheduler, scaled_lr
from scaleloop.loop.speed import speed_up_model
from scaleloop.loop.evaluate import MetricFn, resolve_metrics
from scaleloop.loop.tasks import LossFn, resolve_loss
from scaleloop.loop.throughput import Throughput, throughput_of
from scaleloop.models import build_model, count_parameters
from scaleloop.output.memory import parameter_bytes
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.factory import build_strategy
from scaleloop.strategies.base import Strategy


@dataclass
class Run:
    """A built run: placed model, optimizer, schedule, this rank's loader and the loss."""

    cfg: TrainConfig
    env: DistEnv
    data: Datasets
    model: nn.Module                 # as the strategy placed (wrapped, sharded, cut) it
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Any                   # a torch LR scheduler; ``step()`` after each optimizer step
    loader: Union[ShardedLoader, StreamingLoader]
    loss_fn: LossFn                  # ``loss_fn(output, target)``: the mean loss of a batch
    user_loss: bool                  # loss_fn is the user's (--loss), not the model's or the task's
    metrics: dict[str, MetricFn]     # the user's evaluation metrics (--metrics)
    lr: LearningRate
    total_steps: int                 # optimizer steps the whole run takes (the schedule's length)
    parameters: int                  # of the whole model, before a strategy shards or cuts it
    model_bytes: int
    notes: list[str] = field(default_factory=list)   # what --compile/--channels-last did
    weight_decay: str = ""           # which tensors --weight-decay applies to ("" without weight decay)
    count: Optional[StepCount] = None     # the steps' count of real targets over -100 padding (loop.padding)
    throughput: Throughput = field(default_factory=Throughput)   # a log row's tokens/s and MFU (loop.throughput)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights, identical data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data_and_model(cfg: TrainConfig) -> tuple[Datasets, nn.Module]:
    """The datasets and the freshly initialised model, exactly as every run builds them (seeded)."""
    seed_everything(cfg.seed)
    data = build_datasets(cfg.data, data_dir=cfg.data_dir, n_samples=cfg.n_samples,
                          input_dim=cfg.input_dim, image_size=cfg.image_size, seq_len=cfg.seq_len,
                          vocab_size=cfg.vocab_size, test_fraction=cfg.test_fraction, seed=cfg.seed, task=cfg.task)
    if cfg.task != "auto" and data.info.task != cfg.task:
        data = Datasets(data.train, data.test, infer_info(cfg.data, data.train, data.test, task=cfg.task))
    return data, build_model(cfg.model, data.info, hidden_dim=cfg.hidden_dim, d_model=cfg.d_model,
                             n_layers=cfg.n_layers, n_heads=cfg.n_heads)


def build_optimizer(cfg: TrainConfig, params: Iterable[nn.Parameter], lr: Optional[float] = None, *,
                    model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.optimizer`` with its hyperparameters (``lr`` overrides ``cfg.lr``).

    ``model``: the module ``params`` belong to, as placed, for ``--decay-params`` (which tensors
    are embeddings or norms); needed when ``--weight-decay`` is set and the rule is not ``all``.
    """
    lr = cfg.lr if lr is None else lr
    params = list(params)
    groups = param_groups(params, cfg.weight_decay, cfg.decay_params, model)
    if cfg.optimizer == "sgd":
        kind, options = torch.optim.SGD, dict(lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        kind = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
        options = dict(lr=lr, weight_decay=cfg.weight_decay, **_adam_options(cfg))
    if not cfg.fused_optimizer:
        if _plain_cpu(params):
            # The multi-tensor loop, as PyTorch's default is on CUDA (on the CPU it is the per-tensor
            # one): the same arithmetic tensor by tensor, so bitwise the same weights, with fewer
            # Python calls per step (about 0.4 ms of a 49 ms step of a 0.4M-parameter GPT here).
            return kind(groups, foreach=True, **options)
        return kind(groups, **options)  # PyTorch's default implementation for the parameters' device
    if kind is torch.optim.SGD and any(_is_dtensor(p) for p in params):
        # FSDP2's sharded parameters: DTensor has no sharding rule for the fused SGD kernel (it
        # raises at the first step, torch 2.11-2.13); the multi-tensor loop works on shards.
        return kind(groups, foreach=True, **options)
    try:
        # One kernel over all parameters (CUDA and the CPU have them; torch checks the device).
        return kind(groups, fused=True, **options)
    except RuntimeError:
        return kind(groups, foreach=True, **options)  # the multi-tensor loop: a few kernels per step


def _adam_options(cfg: TrainConfig) -> dict[str, Any]:
    """``--betas`` and ``--eps`` where given; left out, torch's own defaults apply (as before they existed)."""
    options: dict[str, Any] = {}
    betas = cfg.optim.adam_betas
    if betas is not None:
        options["betas"] = betas
    if cfg.eps is not None:
        options["eps"] = cfg.eps
    return options


def check_decay_with_pipeline(cfg: TrainConfig) -> None:
    """A pipeline keeps its optimizer in one parameter group, so it cannot leave tensors out of
    weight decay: refused in one line, before any worker starts, rather than decayed differently."""
    if cfg.weight_decay and cfg.decay_params != "all" and cfg.pipeline_layout() is not None:
        raise UsageError(f"a pipeline (--strategy pipeline, --mesh pp=N) applies --weight-decay to every tensor: "
                         f"add --decay-params all (--decay-params {cfg.decay_params} leaves biases and norms out, "
                         "which needs a second parameter group the pipeline does not have)")


def _plain_cpu(params: list[nn.Parameter]) -> bool:
    """Every parameter a plain tensor on the CPU (not a DTensor, or a subclass PyTorch's multi-tensor
    ops may not know)."""
    return bool(params) and all(type(p) in (nn.Parameter, torch.Tensor) and p.device.type == "cpu" for p in params)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return False
    return isinstance(tensor, DTensor)


def check_trainable(name: str, model: nn.Module) -> None:
    """A model with no parameter to train (none at all, or every one with ``requires_grad=False``)
    is refused in one line: an optimizer would have nothing to update, and each strategy would
    fail in its own place and words."""
    if count_parameters(model) > 0:
        return
    frozen = len(list(model.parameters()))
    held = (f"its {frozen} parameter tensor(s) all have requires_grad=False" if frozen
            else f"{type(model).__name__} holds none")
    raise UsageError(f"--model {name} has no parameters to train ({held}): an optimizer would have nothing to "
                     "update; give the model at least one trainable parameter")


def _batch_beyond_the_data(cfg: TrainConfig, samples: Optional[int], steps: Optional[int]) -> list[str]:
    """A batch larger than the training set: what it becomes, said (or refused, when no step is left)."""
    if samples is None or cfg.batch_size <= samples:
        return []
    if steps == 0:
        raise UsageError(f"--batch-size {cfg.batch_size:,} with --drop-last leaves no step: the training set holds "
                         f"{samples:,} samples; use --batch-size {samples:,} or less, or leave out --drop-last")
    return [f"note: --batch-size {cfg.batch_size:,} is larger than the {samples:,} training samples: each epoch is "
            f"one step of all {samples:,}"]


def build_run(cfg: TrainConfig, env: DistEnv, *,
              data: Optional[Callable[[TrainConfig], tuple[Datasets, nn.Module]]] = None) -> Run:
    """Build the run ``cfg`` describes on this rank of ``env``.

    ``data``: what builds the datasets and the model (default: :func:`build_data_and_model`;
    ``bench`` sizes its data to the batch). Every rank builds the same model from the same
    seed; the strategy then places it.
    """
    datasets, model = (data or build_data_and_model)(cfg)
    # --init-from: into the user's own module, on every rank, before any strategy wraps, shards or
    # cuts it (each then places the loaded weights as it would random ones). A checkpoint resumed
    # later (checkpoint.manager) overwrites them: a resume continues the run, whatever it started from.
    init_notes = init_weights(model, cfg.init_from)
    check_eval_data(cfg.evaluation, datasets)
    check_trainable(cfg.model, model)   # here, before any strategy: every one says it alike
    keep_target = keeps_target(model, datasets.train, datasets.info.task)
    if isinstance(keep_target, tuple) and cfg.pipeline_layout() is not None:
        keep_target = False   # a pipeline's first stage takes the input alone; its last computes the loss
    # Of the user's own module, before the strategy wraps it (a Hugging Face model is told counts).
    counting, padding_notes = counting_for(datasets.info, datasets.train, model, cfg.loss, keep_target)
    parameters, model_bytes = count_parameters(model), parameter_bytes(model)
    throughput = throughput_of(model, datasets.info, cfg.precision, env)   # of the whole model, as for parameters
    check_decay_with_pipeline(cfg)
    decay = describe_decay(model, cfg.weight_decay, cfg.decay_params)   # of the whole model, before any cut
    strategy = _make_strategy(cfg, env)
    lr = scaled_lr(cfg.optim)
    notes = datasets.notes + init_notes + speed_up_model(model, cfg, env.device) + padding_notes
    # The strategy makes the model parallel in its fixed order (strategies/parallelize.py): TP, activation
    # checkpointing, data parallelism (FSDP2/DDP/all-reduce), the pipeline split.
    # The optimizer is made after that, from ``placed``'s modules as they then are.
    placed = model
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(cfg, params, lr.peak, model=placed))
    if strategy.recompute:
        what = strategy.parallelism.recomputed_what   # which blocks, and how they were found
        blocks = f"{strategy.recomputed_blocks} blocks" + (f" ({what})" if what else "")
        notes.append(f"activation checkpointing: {blocks} keep only their input and recompute their activations "
                     "in the backward")
    if cfg.compile:
        # In place (nn.Module.compile): the module, its wrappers' isinstance checks and its
        # state_dict keys stay what they were (no ``_orig_mod.`` prefix in checkpoints).
        model.compile()
    # From here on each rank draws its own random numbers (dropout, augmentation), like
    # independent workers would; the data order stays shared, drawn from cfg.seed + epoch.
    torch.manual_seed(cfg.seed + env.rank)
    # A dataset that says ``in_order`` (sequential token-file windows) is read in its own order.
    in_order = getattr(datasets.train, "in_order", False) is True
    loader = strategy.loader(datasets.train, cfg.batch_size, shuffle=not in_order, seed=cfg.seed,
                             drop_last=cfg.drop_last, num_workers=cfg.num_workers, uneven=cfg.elastic)
    notes += _batch_beyond_the_data(cfg, declared_length(datasets.train), loader.sampler.steps_per_epoch)
    pieces = env.world_size * cfg.accumulate
    if cfg.elastic and cfg.batch_size % pieces:
        low = cfg.batch_size // pieces
        notes.append(f"note: --batch-size {cfg.batch_size} does not split evenly over the {env.world_size} worker(s) "
                     f"x {cfg.accumulate} accumulation step(s) this elastic job has now; each micro-batch holds "
                     f"{low} or {low + 1} samples, weighted by its share, so a step is still the mean over "
                     f"{cfg.batch_size} samples")
    try:
        loader.configure(pin_memory=cfg.pin_memory, persistent_workers=cfg.persistent_workers,
                         on_device=cfg.data_on_device, channels_last=cfg.channels_last)
        loader.keep_target = keep_target
    except ValueError as exc:
        raise UsageError(f"--data-on-device: {exc}" if cfg.data_on_device else str(exc)) from None
    total_steps = _total_steps(cfg, loader.sampler.steps_per_epoch)
    return Run(cfg=cfg, env=env, data=datasets, model=model, strategy=strategy, optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg.optim, total_steps), loader=loader,
               loss_fn=resolve_loss(cfg.loss, datasets.info, given_target=bool(keep_target),
                                    per_sample=counting.per_sample if counting and not counting.tell else None),
               user_loss=cfg.loss is not None, metrics=resolve_metrics(cfg.metrics), lr=lr, total_steps=total_steps,
               parameters=parameters, model_bytes=model_bytes, notes=notes, weight_decay=decay,
               count=StepCount(counting, env, strategy.layout.data_parallel) if counting is not None else None,
               throughput=throughput)


def _make_strategy(cfg: TrainConfig, env: DistEnv) -> Strategy:
    """The strategy of ``cfg``'s parallel section, on ``env``, with its precision."""
    settings = cfg.parallel
    if settings.strategy not in ("auto", "mesh"):
        # A config that names another strategy (verify's one-process reference, a bench row)
        # runs that one; the CLI rejects --mesh with another strategy.
        settings = dataclasses.replace(settings, mesh=None)
    if cfg.replica_groups > 1:   # DDP inside the group, torchft between the groups
        from scaleloop.config.sections import split_endpoint
        from scaleloop.strategies.fault_tolerant import FaultTolerantDDP, ReplicaGroup

        assert cfg.replica_group is not None and cfg.lighthouse is not None, "a replica group's launcher sets both"
        host, port = split_endpoint(cfg.lighthouse, "--lighthouse")
        group = ReplicaGroup(index=cfg.replica_group, groups=cfg.replica_groups, lighthouse=f"http://{host}:{port}",
                             gate=f"http://{host}:{port + 1}", timeout_s=cfg.timeout)
        return FaultTolerantDDP.build_for(settings, env, group)
    return build_strategy(settings, env)


def _total_steps(cfg: TrainConfig, per_epoch: Optional[int]) -> int:
    """The optimizer steps the run takes (the schedule's length); ``per_epoch`` None: a stream of
    unknown length (docs/streaming.md), which only ``--max-steps`` bounds."""
    if per_epoch is None and cfg.lr_schedule != "constant" and cfg.max_steps is None:
        raise UsageError(f"--lr-schedule {cfg.lr_schedule} spans the run's steps, and a stream's length is unknown "
                         "until a pass ends: add --max-steps N (the schedule spans N steps), or give the dataset "
                         "a __len__")
    total_steps = per_epoch * cfg.epochs if per_epoch is not None else cfg.max_steps or 0
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    return total_steps
