"""Building a run: everything ``train``, ``verify``, ``bench`` and ``tune-batch`` train with,
made by one function in one fixed order, so that the same settings give the same weights
whichever of them runs. Here too are the parts it builds from the
settings: the model's speed options, the optimizer's parameter groups and its learning rate.

Speed options that change how a model runs, not what it computes: ``--channels-last`` and
the checks before ``--compile`` (which ``loop.train`` applies, in place, once the strategy has
wrapped the model). The data-path options live in ``data/loader.py``, ``--fused-optimizer`` in
:func:`build_optimizer`.

Which tensors ``--weight-decay`` applies to (``--decay-params``), as the optimizer's parameter groups.

Decaying a bias or a norm's scale pulls it towards zero for no gain (they do not grow with the
width, and a LayerNorm whose scale decays to zero silences its block), so nanoGPT, torchtitan
and Hugging Face's Trainer decay only the tensors of two or more dimensions: the matrices of
linear layers, convolution kernels and (except ``ndim2-no-embeddings``) embeddings.

The split is decided from each tensor's shape and the module that holds it, so it is the same
whatever the strategy made of the model (a DDP wrapper, FSDP2's sharded DTensors: ``ndim`` is
the whole tensor's).

The learning rate: scaled to the global batch, warmed up, and scheduled over the run's steps.

The schedule is a plain ``torch.optim.lr_scheduler.LambdaLR`` stepped once per optimizer step,
so its state is the scheduler's own ``state_dict`` (saved in every checkpoint).
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
import torch
from torch import nn

from scaleloop.checkpoint.weights import init_weights
from scaleloop.config import TrainConfig
from scaleloop.config.sections import OptimSettings
from scaleloop.data.batch import keeps_target
from scaleloop.data.datasets import build_datasets, infer_info
from scaleloop.data.info import Datasets
from scaleloop.data.loader import ShardedLoader
from scaleloop.data.streaming import StreamingLoader, declared_length
from scaleloop.errors import UsageError
from scaleloop.loop.evaluation import MetricFn, check_eval_data, resolve_metrics
from scaleloop.loop.losses import LossFn, StepCount, counting_for, resolve_loss
from scaleloop.loop.rows import Throughput, throughput_of
from scaleloop.models import build_model, count_parameters
from scaleloop.output.footprint import parameter_bytes
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.base import Strategy
from scaleloop.strategies.factory import build_strategy


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
    count: Optional[StepCount] = None     # the steps' count of real targets over -100 padding (loop.losses)
    throughput: Throughput = field(default_factory=Throughput)   # a log row's tokens/s and MFU (loop.rows)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights, identical data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data_and_model(cfg: TrainConfig) -> tuple[Datasets, nn.Module]:
    """The datasets and the freshly initialised model, exactly as every run builds them (seeded)."""
    seed_everything(cfg.optim.seed)
    data = build_datasets(cfg.model_data.data, data_dir=cfg.model_data.data_dir, n_samples=cfg.model_data.n_samples,
                          input_dim=cfg.model_data.input_dim, image_size=cfg.model_data.image_size, seq_len=cfg.model_data.seq_len,
                          vocab_size=cfg.model_data.vocab_size, test_fraction=cfg.model_data.test_fraction, seed=cfg.optim.seed, task=cfg.model_data.task)
    if cfg.model_data.task != "auto" and data.info.task != cfg.model_data.task:
        data = Datasets(data.train, data.test, infer_info(cfg.model_data.data, data.train, data.test, task=cfg.model_data.task))
    return data, build_model(cfg.model_data.model, data.info, hidden_dim=cfg.model_data.hidden_dim, d_model=cfg.model_data.d_model,
                             n_layers=cfg.model_data.n_layers, n_heads=cfg.model_data.n_heads)


def build_optimizer(cfg: TrainConfig, params: Iterable[nn.Parameter], lr: Optional[float] = None, *,
                    model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.optim.optimizer`` with its hyperparameters (``lr`` overrides ``cfg.optim.lr``).

    ``model``: the module ``params`` belong to, as placed, for ``--decay-params`` (which tensors
    are embeddings or norms); needed when ``--weight-decay`` is set and the rule is not ``all``.
    """
    lr = cfg.optim.lr if lr is None else lr
    params = list(params)
    groups = param_groups(params, cfg.optim.weight_decay, cfg.optim.decay_params, model)
    if cfg.optim.optimizer == "sgd":
        kind, options = torch.optim.SGD, dict(lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    else:
        kind = torch.optim.AdamW if cfg.optim.optimizer == "adamw" else torch.optim.Adam
        options = dict(lr=lr, weight_decay=cfg.optim.weight_decay, **_adam_options(cfg))
    if not cfg.optim.fused_optimizer:
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
    if cfg.optim.eps is not None:
        options["eps"] = cfg.optim.eps
    return options


def check_decay_with_pipeline(cfg: TrainConfig) -> None:
    """A pipeline keeps its optimizer in one parameter group, so it cannot leave tensors out of
    weight decay: refused in one line, before any worker starts, rather than decayed differently."""
    if cfg.optim.weight_decay and cfg.optim.decay_params != "all" and cfg.pipeline_layout() is not None:
        raise UsageError(f"a pipeline (--strategy pipeline, --mesh pp=N) applies --weight-decay to every tensor: "
                         f"add --decay-params all (--decay-params {cfg.optim.decay_params} leaves biases and norms out, "
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
    if samples is None or cfg.optim.batch_size <= samples:
        return []
    if steps == 0:
        raise UsageError(f"--batch-size {cfg.optim.batch_size:,} with --drop-last leaves no step: the training set holds "
                         f"{samples:,} samples; use --batch-size {samples:,} or less, or leave out --drop-last")
    return [f"note: --batch-size {cfg.optim.batch_size:,} is larger than the {samples:,} training samples: each epoch is "
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
    init_notes = init_weights(model, cfg.model_data.init_from)
    check_eval_data(cfg.evaluation, datasets)
    check_trainable(cfg.model_data.model, model)   # here, before any strategy: every one says it alike
    keep_target = keeps_target(model, datasets.train, datasets.info.task)
    if isinstance(keep_target, tuple) and cfg.pipeline_layout() is not None:
        keep_target = False   # a pipeline's first stage takes the input alone; its last computes the loss
    # Of the user's own module, before the strategy wraps it (a Hugging Face model is told counts).
    counting, padding_notes = counting_for(datasets.info, datasets.train, model, cfg.model_data.loss, keep_target)
    parameters, model_bytes = count_parameters(model), parameter_bytes(model)
    throughput = throughput_of(model, datasets.info, cfg.parallel.precision, env)   # of the whole model, as for parameters
    check_decay_with_pipeline(cfg)
    decay = describe_decay(model, cfg.optim.weight_decay, cfg.optim.decay_params)   # of the whole model, before any cut
    strategy = _make_strategy(cfg, env)
    lr = scaled_lr(cfg.optim)
    notes = datasets.notes + init_notes + speed_up_model(model, cfg, env.device) + padding_notes
    # The strategy makes the model parallel in its fixed order (strategies/parallelize.py): TP, activation
    # checkpointing, data parallelism (FSDP2/DDP/all-reduce), the pipeline split.
    # The optimizer is made after that, from ``placed``'s modules as they then are.
    placed = model
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(cfg, params, lr.peak, model=placed))
    if strategy.parallelism.recompute:
        what = strategy.parallelism.recomputed_what   # which blocks, and how they were found
        blocks = f"{strategy.parallelism.recomputed_blocks} blocks" + (f" ({what})" if what else "")
        notes.append(f"activation checkpointing: {blocks} keep only their input and recompute their activations "
                     "in the backward")
    if cfg.parallel.compile:
        # In place (nn.Module.compile): the module, its wrappers' isinstance checks and its
        # state_dict keys stay what they were (no ``_orig_mod.`` prefix in checkpoints).
        model.compile()
    # From here on each rank draws its own random numbers (dropout, augmentation), like
    # independent workers would; the data order stays shared, drawn from cfg.optim.seed + epoch.
    torch.manual_seed(cfg.optim.seed + env.rank)
    # A dataset that says ``in_order`` (sequential token-file windows) is read in its own order.
    in_order = getattr(datasets.train, "in_order", False) is True
    loader = strategy.loader(datasets.train, cfg.optim.batch_size, shuffle=not in_order, seed=cfg.optim.seed,
                             drop_last=cfg.optim.drop_last, num_workers=cfg.model_data.num_workers, uneven=cfg.elastic)
    notes += _batch_beyond_the_data(cfg, declared_length(datasets.train), loader.sampler.steps_per_epoch)
    pieces = env.world_size * cfg.parallel.accumulate
    if cfg.elastic and cfg.optim.batch_size % pieces:
        low = cfg.optim.batch_size // pieces
        notes.append(f"note: --batch-size {cfg.optim.batch_size} does not split evenly over the {env.world_size} worker(s) "
                     f"x {cfg.parallel.accumulate} accumulation step(s) this elastic job has now; each micro-batch holds "
                     f"{low} or {low + 1} samples, weighted by its share, so a step is still the mean over "
                     f"{cfg.optim.batch_size} samples")
    try:
        loader.configure(pin_memory=cfg.model_data.pin_memory, persistent_workers=cfg.model_data.persistent_workers,
                         on_device=cfg.model_data.data_on_device, channels_last=cfg.model_data.channels_last)
        loader.keep_target = keep_target
    except ValueError as exc:
        raise UsageError(f"--data-on-device: {exc}" if cfg.model_data.data_on_device else str(exc)) from None
    total_steps = _total_steps(cfg, loader.sampler.steps_per_epoch)
    return Run(cfg=cfg, env=env, data=datasets, model=model, strategy=strategy, optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg.optim, total_steps), loader=loader,
               loss_fn=resolve_loss(cfg.model_data.loss, datasets.info, given_target=bool(keep_target),
                                    per_sample=counting.per_sample if counting and not counting.tell else None),
               user_loss=cfg.model_data.loss is not None, metrics=resolve_metrics(cfg.model_data.metrics), lr=lr, total_steps=total_steps,
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
    if cfg.launch.replica_groups > 1:   # DDP or FSDP inside the group, torchft between the groups
        from scaleloop.config.sections import split_endpoint
        from scaleloop.strategies.fault_tolerant import ReplicaGroup, build_for

        assert cfg.launch.replica_group is not None and cfg.launch.lighthouse is not None, "a replica group's launcher sets both"
        host, port = split_endpoint(cfg.launch.lighthouse, "--lighthouse")
        group = ReplicaGroup(index=cfg.launch.replica_group, groups=cfg.launch.replica_groups, lighthouse=f"http://{host}:{port}",
                             gate=f"http://{host}:{port + 1}", timeout_s=cfg.launch.timeout)
        return build_for(settings, env, group)
    return build_strategy(settings, env)


def _total_steps(cfg: TrainConfig, per_epoch: Optional[int]) -> int:
    """The optimizer steps the run takes (the schedule's length); ``per_epoch`` None: a stream of
    unknown length (docs/streaming.md), which only ``--max-steps`` bounds."""
    if per_epoch is None and cfg.optim.lr_schedule != "constant" and cfg.optim.max_steps is None:
        raise UsageError(f"--lr-schedule {cfg.optim.lr_schedule} spans the run's steps, and a stream's length is unknown "
                         "until a pass ends: add --max-steps N (the schedule spans N steps), or give the dataset "
                         "a __len__")
    total_steps = per_epoch * cfg.optim.epochs if per_epoch is not None else cfg.optim.max_steps or 0
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)
    return total_steps


# --- the model's speed options: --channels-last, --compile ----------------------------------------

def speed_up_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> list[str]:
    """Apply ``--channels-last`` to ``model`` (in place) and check that ``--compile`` can work
    here; returns the notes a run prints. ``--compile`` itself is applied after the strategy
    has wrapped the model (so that DDP's compiled graph knows its gradient buckets)."""
    notes = []
    if cfg.model_data.channels_last:
        if any(p.dim() == 4 for p in model.parameters()):
            model.to(memory_format=torch.channels_last)
        else:
            notes.append(f"note: --channels-last changes nothing for {cfg.model_data.model}: it has no 4-d (convolution) "
                         "weights")
    if cfg.parallel.compile:
        check_compile(device)
        notes.append("note: --compile: the first steps (and the first evaluation) are slow while "
                     "torch.compile compiles the model")
    return notes


def check_compile(device: torch.device) -> None:
    """UsageError, in one line, when torch.compile's default backend (inductor) cannot generate
    code for ``device`` here: C++ on the CPU, Triton on CUDA."""
    import importlib.util
    import os
    import shutil

    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise UsageError("--compile on the CPU needs a C++ compiler (g++ or clang++ on the PATH) and none was "
                         "found: install one, or drop --compile")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise UsageError("--compile on CUDA needs Triton (pip install triton) and it is not installed: install "
                         "it, or drop --compile")
    # Triton builds its kernel launcher with the system's C compiler ($CC, else cc/gcc/clang).
    compilers = [c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c]
    if device.type == "cuda" and not any(shutil.which(c) for c in compilers):
        raise UsageError("--compile on CUDA needs a C compiler for Triton's launcher (gcc or clang on the PATH, "
                         "or $CC) and none was found: install one, or drop --compile")


# --- the optimizer's parameter groups: which tensors --weight-decay applies to --------------------

ParamGroups = Union[list[nn.Parameter], list[dict[str, Any]]]
_OTHER = "other tensors of under 2 dimensions"
_REASONS = ("biases", "norms", "embeddings", _OTHER)   # in the order the summary names them


def _reason(module: nn.Module, name: str, param: nn.Parameter, rule: str) -> Optional[str]:
    """Why ``param`` (``module``'s own ``name``) is not decayed under ``rule``, or None if it is."""
    if rule == "all":
        return None
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and rule == "ndim2-no-embeddings":
        return "embeddings"
    if param.ndim >= 2:
        return None
    if name == "bias":
        return "biases"
    # Any norm (torch's, or a model's own RMSNorm class): its scale is 1-D.
    return "norms" if "norm" in type(module).__name__.lower() else _OTHER


def not_decayed(model: nn.Module, rule: str) -> dict[int, str]:
    """``id(parameter)`` -> why it is left out of weight decay, for the parameters ``rule`` leaves out.

    Read from ``model``'s modules as they are now: after a strategy placed the model, its
    modules hold the placed parameters (FSDP2 and tensor parallelism replace them in place)."""
    out: dict[int, str] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            reason = _reason(module, name, param, rule)
            if reason is not None:
                out.setdefault(id(param), reason)
    return out


def param_groups(params: Iterable[nn.Parameter], weight_decay: float, rule: str,
                 model: Optional[nn.Module]) -> ParamGroups:
    """``params`` as the optimizer takes them: a plain list when every one is decayed alike (no
    weight decay, ``rule`` all, nothing left out: the optimizer then is exactly the one a
    single-group run had), else the decayed group first and a group with no weight decay.

    ``model``: the module the parameters belong to, for the module-based rules (embeddings,
    norms); required unless ``rule`` is ``all`` or ``weight_decay`` is 0.
    """
    params = list(params)
    if not weight_decay or rule == "all":
        return params
    if model is None:
        raise ValueError(f"decay_params={rule!r} needs the model to tell embeddings and norms apart")
    left_out = not_decayed(model, rule)
    decayed = [p for p in params if id(p) not in left_out]
    rest = [p for p in params if id(p) in left_out]
    if not rest:
        return params
    groups: list[dict[str, Any]] = [{"params": decayed}] if decayed else []
    return groups + [{"params": rest, "weight_decay": 0.0}]


def describe_decay(model: nn.Module, weight_decay: float, rule: str) -> str:
    """One line for the run's header and summary, e.g. ``0.1 on 12 of 20 tensors (ndim2: 2 or more
    dimensions); not on 8: biases, norms``; "" without weight decay."""
    if not weight_decay:
        return ""
    total = len({id(p) for p in model.parameters()})
    if rule == "all":
        return f"{weight_decay:g} on all {total} tensors (--decay-params all)"
    left_out = not_decayed(model, rule)
    reasons = [r for r in _REASONS if r in left_out.values()]
    what = "2 or more dimensions" + (", not embeddings" if rule == "ndim2-no-embeddings" else "")
    text = f"{weight_decay:g} on {total - len(left_out)} of {total} tensors ({rule}: {what})"
    return text + (f"; not on {len(left_out)}: {', '.join(reasons)}" if left_out else "")


# --- the learning rate: scaled, warmed up, scheduled ----------------------------------------------

@dataclass(frozen=True)
class LearningRate:
    """The peak learning rate a run uses, and a sentence saying where it came from."""

    peak: float
    why: str


def scaled_lr(optim: OptimSettings) -> LearningRate:
    """``--lr`` scaled from ``--base-batch-size`` to the global ``--batch-size``
    (:attr:`OptimSettings.peak_lr`), with a sentence saying how."""
    if optim.lr_scaling == "none" or optim.base_batch_size is None:
        return LearningRate(optim.lr, "--lr as given")
    rule = f"{optim.batch_size}/{optim.base_batch_size}" if optim.lr_scaling == "linear" else f"sqrt({optim.batch_size}/{optim.base_batch_size})"
    return LearningRate(optim.peak_lr, f"{optim.lr:g} x {rule}: {optim.lr_scaling} scaling from "
                                       f"--base-batch-size {optim.base_batch_size} to the global batch {optim.batch_size}")


def lr_factor(step: int, *, schedule: str, total_steps: int, warmup_steps: int, floor: float = 0.0) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    ``floor``: ``--min-lr`` as a share of the peak; cosine decays from 1 to it (0: to zero, as
    before the floor existed, bit for bit), step's drops stop at it.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    after = step - warmup_steps
    span = max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * min(1.0, after / span))))
    if schedule == "step":
        return max(floor, 0.1 ** sum(after >= span * frac for frac in (0.5, 0.75)))
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSettings,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``total_steps`` optimizer steps for ``optim.lr_schedule``, ``optim.warmup_steps``
    and ``optim.min_lr``.

    The optimizer's learning rate must already be the peak (see :func:`scaled_lr`); ``--min-lr``
    is a share of it.
    """
    peak = optimizer.param_groups[0]["lr"]
    # (An optimizer at lr 0, as bench's cost-only runs make, has no rate to keep a share of.)
    floor = optim.min_lr / peak if optim.min_lr and peak > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(step, schedule=optim.lr_schedule, total_steps=total_steps,
                         warmup_steps=optim.warmup_steps, floor=floor)

    return _Schedule(optimizer, factor, constant=optim.lr_schedule == "constant" and not optim.warmup_steps)


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """A ``LambdaLR`` (same behaviour, same ``state_dict``) whose ``step`` only counts when the
    schedule is constant: the rate it would set is the one the optimizer already has, and the
    step runs once per optimizer step, inside the timed loop."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float], *,
                 constant: bool) -> None:
        self.constant = constant
        super().__init__(optimizer, factor)

    def step(self, epoch: Optional[int] = None) -> None:
        if self.constant and epoch is None and self._step_count > 1:
            # LambdaLR would set every group's rate to base_lr x 1.0 (unchanged) and count.
            self._step_count += 1
            self.last_epoch += 1
            return
        super().step(epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("constant", None)   # the schedule comes from the config, not the checkpoint
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        constant = self.constant
        super().load_state_dict(state_dict)
        self.constant = constant


def describe_schedule(optim: OptimSettings, lr: LearningRate, total_steps: int) -> str:
    """One line for the run's log and summary."""
    parts = [f"{lr.peak:g} ({lr.why})"]
    if optim.warmup_steps:
        parts.append(f"{optim.warmup_steps} warm-up steps")
    if optim.lr_schedule != "constant":
        parts.append(f"{optim.lr_schedule} schedule over {total_steps} steps")
        if optim.min_lr:
            parts.append(f"down to --min-lr {optim.min_lr:g}")
        elif optim.lr_schedule == "cosine":
            parts.append("down to 0")
    return ", ".join(parts)
