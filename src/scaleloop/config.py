"""Run configuration: one frozen dataclass, read from a TOML file and overridden by CLI flags.

This module imports no torch, so that ``scaleloop --help`` answers quickly.

Every field carries its own help text and (where it has them) its choices, so the CLI, the
config file, the validation and the saved ``config.toml`` all come from one definition.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

from scaleloop.data.batching import check_batch_split, check_pipeline_schedule
from scaleloop.errors import UsageError
from scaleloop.output.trackers import TRACKERS, check_installed

STRATEGIES = ("auto", "single", "dp", "ddp", "allreduce", "fsdp", "pipeline", "mesh")
BACKENDS = ("gloo", "nccl")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "step")
LR_SCALINGS = ("none", "linear", "sqrt")
TASKS = ("auto", "classification", "binary", "regression", "lm")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _opt(default: Any, help: str, choices: tuple[str, ...] = (), group: str = "training") -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "group": group})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Sizes are global (across all workers)."""

    # what to train
    model: str = _opt("simplenet", "model: simplenet, biggernet, convnet, tinygpt, or package.module:factory", group="model and data")
    data: str = _opt("digits", "dataset: digits, random, mnist, images, tokens, or package.module:factory", group="model and data")
    data_dir: Optional[str] = _opt(None, "directory holding the MNIST IDX files (for --data mnist; never downloads)", group="model and data")
    hidden_dim: int = _opt(128, "hidden width of simplenet/biggernet", group="model and data")
    n_samples: int = _opt(10_000, "training samples for generated datasets (random, images, tokens)", group="model and data")
    input_dim: int = _opt(20, "features per sample for --data random", group="model and data")
    image_size: int = _opt(32, "side of the square images for --data images", group="model and data")
    seq_len: int = _opt(64, "tokens per sample for --data tokens", group="model and data")
    vocab_size: int = _opt(256, "vocabulary size for --data tokens", group="model and data")
    test_fraction: float = _opt(0.2, "share held out as the test set (digits, generated datasets)", group="model and data")
    task: str = _opt("auto", "what the target is: auto (from the first sample), classification, binary, "
                     "regression (mean squared error) or lm", TASKS, group="model and data")
    loss: Optional[str] = _opt(None, "your loss, package.module:fn, fn(prediction, target) -> the mean loss over the "
                               "batch (default: the model's own loss if it returns one, else the task's)",
                               group="model and data")
    metrics: Optional[str] = _opt(None, "your evaluation metrics, package.module:fn[,...], fn(prediction, target) -> "
                                  "one value per sample (or the batch mean); reported over the whole test set",
                                  group="model and data")

    # how to train
    epochs: int = _opt(20, "passes over the training set")
    max_steps: Optional[int] = _opt(None, "stop after this many optimizer steps (default: no limit)")
    batch_size: int = _opt(64, "GLOBAL batch size: per-device batch = batch_size / (world size x accumulate)")
    accumulate: int = _opt(1, "micro-batches accumulated into each optimizer step")
    lr: float = _opt(0.01, "learning rate (at --base-batch-size when --lr-scaling is set)")
    lr_schedule: str = _opt("constant", "learning-rate schedule over the run's optimizer steps "
                            "(step: x0.1 at half and at three quarters of them)", LR_SCHEDULES)
    warmup_steps: int = _opt(0, "optimizer steps of linear learning-rate warm-up from lr/N to lr")
    lr_scaling: str = _opt("none", "scale --lr with the global batch: linear (x B/base) or sqrt "
                           "(x sqrt(B/base)); needs --base-batch-size", LR_SCALINGS)
    base_batch_size: Optional[int] = _opt(None, "the global batch that --lr was tuned for (for --lr-scaling)")
    optimizer: str = _opt("adam", "optimizer", OPTIMIZERS)
    weight_decay: float = _opt(0.0, "weight decay")
    momentum: float = _opt(0.9, "momentum (sgd only)")
    clip_grad: Optional[float] = _opt(None, "clip the global gradient norm to this value (default: off)")
    drop_last: bool = _opt(False, "drop the last, smaller step of each epoch instead of training on it")
    seed: int = _opt(0, "random seed (model init, data order, generated data)")

    # where to run it
    device: str = _opt("auto", "device: auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", group="hardware")
    strategy: str = _opt("auto", "how to use the hardware", STRATEGIES, group="hardware")
    mesh: Optional[str] = _opt(None, "lay the ranks out on named dimensions, e.g. dp=2,tp=2: dp (replicated), fsdp or "
                               "shard (sharded), tp (tensor parallel); their product is the world size; implies "
                               "--strategy mesh (docs/strategies.md, '--mesh')", group="hardware")
    activation_checkpointing: bool = _opt(False, "keep only each block's input from the forward and recompute its "
                                          "activations in the backward: less memory, about one more forward of "
                                          "compute, the same results", group="hardware")
    cpu_offload: bool = _opt(False, "fsdp and --mesh: keep the sharded parameters, gradients and optimizer state in "
                             "host memory between uses (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU)",
                             group="hardware")
    precision: str = _opt("fp32", "numeric precision (bf16/fp16 use torch.amp autocast; fp16 adds a GradScaler)", PRECISIONS, group="hardware")
    num_workers: int = _opt(0, "DataLoader worker processes (only for datasets that are not in-memory tensors)", group="hardware")
    microbatches: int = _opt(1, "--strategy pipeline: cut each micro-step's batch into this many pieces that "
                             "flow through the stages one after another", group="hardware")
    pipeline_schedule: str = _opt("gpipe", "--strategy pipeline: the order of the pieces' forwards and backwards: "
                                  "gpipe (all forwards, then all backwards), 1f1b (one forward, one backward: fewer "
                                  "activations held; needs --microbatches >= the stages) or interleaved (1F1B over "
                                  "several stages per process: a smaller bubble)", PIPELINE_SCHEDULES, group="hardware")
    stages_per_rank: int = _opt(0, "--pipeline-schedule interleaved: model stages per process (0: 2); process r holds "
                                "stages r, r+N, r+2N, ...", group="hardware")
    sync_batchnorm: bool = _opt(False, "compute BatchNorm statistics over the global batch (all ranks), as one process would", group="hardware")
    find_unused_parameters: bool = _opt(False, "ddp: allow parameters that get no gradient in a step (DDP searches the "
                                        "graph after every forward; costs time)", group="hardware")
    static_graph: bool = _opt(False, "ddp: the set of parameters used is the same every step (unused ones allowed; "
                              "cheaper than --find-unused-parameters)", group="hardware")

    # speed: how the same computation runs, not what it computes (see docs/benchmarking.md)
    compile: bool = _opt(False, "torch.compile the model (inductor; on the CPU it needs a C++ compiler); the first "
                         "steps are slow while it compiles, and rounding may differ slightly from eager", group="speed")
    channels_last: bool = _opt(False, "channels-last memory format for the model's 4-d weights and its 4-d inputs "
                               "(convolutions: faster on recent GPUs); a model without 4-d weights is left as it is",
                               group="speed")
    fused_optimizer: bool = _opt(False, "the optimizer's one-kernel implementation (fused=True, on CUDA and the CPU; "
                                 "foreach=True where there is none): much faster steps, rounding may differ slightly",
                                 group="speed")
    pin_memory: bool = _opt(True, "on CUDA: gather batches in page-locked host memory and copy them with "
                            "non_blocking=True, so the host does not wait for the GPU at every batch", group="speed")
    persistent_workers: bool = _opt(False, "keep the DataLoader's worker processes alive between epochs "
                                    "(needs --num-workers 1 or more)", group="speed")
    data_on_device: bool = _opt(False, "copy the whole in-memory training set to the device once and gather every "
                                "batch there, with no copy per step (it must fit in device memory)", group="speed")

    # how many processes, on how many machines (N > 1 re-launches under torch.distributed.run)
    nproc: int = _opt(1, "worker processes on this machine (one per GPU on CUDA)", group="launch")
    nnodes: int = _opt(1, "machines in the job: N, or MIN:MAX for elastic membership (with --rdzv-endpoint: the "
                       "job goes on with as few as MIN machines and admits returning ones, up to MAX)", group="launch")
    min_nnodes: int = _opt(0, "the fewest machines an elastic job goes on with (set by --nnodes MIN:MAX; 0: --nnodes)",
                           group="launch")
    node_rank: int = _opt(0, "this machine's index, 0..nnodes-1 (with --master-addr)", group="launch")
    master_addr: Optional[str] = _opt(None, "address of node 0 (static rendezvous; default: single-node standalone)", group="launch")
    master_port: int = _opt(29500, "port on node 0 for --master-addr", group="launch")
    rdzv_endpoint: Optional[str] = _opt(None, "host:port of a c10d rendezvous (elastic; instead of --master-addr/--node-rank)", group="launch")
    rdzv_id: str = _opt("scaleloop", "job id shared by all nodes of one --rdzv-endpoint job", group="launch")
    rdzv_conf: Optional[str] = _opt(None, "torchrun's --rdzv-conf for --rdzv-endpoint, e.g. last_call_timeout=5,"
                                    "join_timeout=600 (docs/multinode.md, 'Faults')", group="launch")
    local_addr: Optional[str] = _opt(None, "this machine's address as the others reach it (default: the address "
                                     "that routes to --rdzv-endpoint)", group="launch")
    shared_fs: str = _opt("auto", "whether every machine sees the same run directory: auto (checked at the start), "
                          "yes, or no (every machine then keeps a verified copy of each checkpoint)",
                          ("auto", "yes", "no"), group="launch")
    max_restarts: int = _opt(0, "times torchrun restarts the worker group after a failure", group="launch")
    signal: str = _opt("SIGUSR1", "a signal that, like SIGTERM and SIGUSR1, stops the run after the current step with a "
                       "checkpoint (preemption; see docs/slurm.md)", group="launch")
    requeue: bool = _opt(False, "after such a stop under SLURM, put the job back into the queue (scontrol requeue)",
                         group="launch")
    backend: Optional[str] = _opt(None, "process-group backend (default: nccl on CUDA, gloo on CPU)", BACKENDS, group="launch")
    timeout: float = _opt(1800.0, "seconds a collective waits for the slowest rank before the run stops with a report "
                                  "naming the rank behind; keep it above your longest first step (torch.compile) "
                                  "and checkpoint save (default: 1800, as torch's own)", group="launch")

    # checkpoints: what a run needs to continue exactly after a crash, a kill or Ctrl-C
    checkpoints: bool = _opt(True, "write checkpoints to <run>/checkpoints (at every epoch end and every "
                             "--checkpoint-every steps)", group="checkpoints")
    checkpoint_every: int = _opt(0, "also checkpoint every N optimizer steps (0: only at epoch ends)", group="checkpoints")
    keep_checkpoints: int = _opt(3, "how many of the newest checkpoints to keep", group="checkpoints")
    sharded_checkpoints: bool = _opt(False, "pipelines (--strategy pipeline, --mesh pp=N): every stage writes its own "
                                     "part of each checkpoint (torch.distributed.checkpoint) instead of sending it to "
                                     "rank 0, for a model too large to gather; fsdp and --mesh always do",
                                     group="checkpoints")
    resume: str = _opt("auto", "auto: continue from the newest valid checkpoint in --out if there is one; "
                       "never; or a checkpoint/run directory to continue from", group="checkpoints")

    # what to write
    out: Optional[str] = _opt(None, "run directory (default: runs/<date>-<time>-<model>-<data>)", group="output")
    log_every: int = _opt(10, "optimizer steps between metric rows in metrics.csv", group="output")
    progress: bool = _opt(True, "show a progress bar", group="output")
    tracker: str = _opt("tensorboard", "where metrics go besides metrics.csv: TensorBoard events in <run>/tensorboard "
                        "(if installed), a W&B or MLflow run (see docs/tracking.md), or nowhere", TRACKERS, group="output")
    tensorboard: bool = _opt(True, "write the events of --tracker tensorboard (--no-tensorboard: as --tracker none)",
                             group="output")

    def validate(self) -> "TrainConfig":
        """Check every value; raise UsageError naming the flag and what to use instead."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise UsageError(f"{flag(f.name)} {value!r} is not one of: {', '.join(choices)}")
        positive = ("hidden_dim", "n_samples", "input_dim", "image_size", "seq_len", "vocab_size",
                    "epochs", "batch_size", "accumulate", "log_every", "microbatches")
        for name in positive:
            _require(getattr(self, name) >= 1, name, "a positive integer")
        _require(self.max_steps is None or self.max_steps >= 1, "max_steps", "a positive integer")
        _require(self.lr > 0, "lr", "a positive number")
        _require(self.weight_decay >= 0, "weight_decay", "zero or positive")
        _require(self.momentum >= 0, "momentum", "zero or positive")
        _require(self.clip_grad is None or self.clip_grad > 0, "clip_grad", "a positive number")
        _require(0 <= self.test_fraction < 1, "test_fraction", "in [0, 1)")
        _require(self.num_workers >= 0, "num_workers", "zero or positive")
        for name in ("loss", "metrics"):
            for spec in (getattr(self, name) or "").split(","):
                if getattr(self, name) is not None and ":" not in spec:
                    raise UsageError(f"{flag(name)} {spec.strip()!r}: expected 'package.module:function'")
        if (self.find_unused_parameters or self.static_graph) and self.strategy not in ("auto", "ddp"):
            which = "--find-unused-parameters" if self.find_unused_parameters else "--static-graph"
            raise UsageError(f"{which} is an option of DistributedDataParallel: use it with --strategy ddp "
                             f"(not {self.strategy})")
        if self.persistent_workers and self.num_workers == 0:
            raise UsageError("--persistent-workers keeps DataLoader worker processes between epochs, and "
                             "--num-workers is 0 (no workers): add --num-workers N, or drop it")
        if self.compile and (self.strategy in ("dp", "pipeline") or self.pipeline_layout()):
            raise UsageError(f"--compile does not support {'--strategy ' + self.strategy if self.strategy in ('dp', 'pipeline') else '--mesh pp=N'} "
                             + ("(nn.DataParallel): use --strategy ddp" if self.strategy == "dp" else
                                "(its stages are scheduled by torch.distributed.pipelining): drop --compile"))
        _require(self.nproc >= 1, "nproc", "a positive integer")
        _require(self.nnodes >= 1, "nnodes", "a positive integer")
        _require(0 <= self.min_nnodes <= self.nnodes, "min_nnodes", f"in 0..{self.nnodes} (--nnodes MIN:MAX)")
        _require(0 <= self.node_rank < self.nnodes, "node_rank", f"in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        _require(1 <= self.master_port <= 65535, "master_port", "a port number in 1..65535")
        _require(self.max_restarts >= 0, "max_restarts", "zero or positive")
        from scaleloop.runtime.preempt import signal_number

        signal_number(self.signal)   # a name that is no catchable signal: one line now, not at the stop
        _require(self.timeout > 0, "timeout", "a positive number of seconds")
        _require(self.warmup_steps >= 0, "warmup_steps", "zero or positive")
        _require(self.base_batch_size is None or self.base_batch_size >= 1, "base_batch_size", "a positive integer")
        if self.lr_scaling != "none" and self.base_batch_size is None:
            raise UsageError(f"--lr-scaling {self.lr_scaling} scales --lr from the batch it was tuned for: "
                             "add --base-batch-size N")
        _require(self.checkpoint_every >= 0, "checkpoint_every", "zero (epoch ends only) or a positive integer")
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", "a positive integer (use --no-checkpoints to write none)")
        _require(bool(self.resume.strip()), "resume", "auto, never, or a checkpoint path")
        check_installed(self.tracker)   # a missing W&B/MLflow package: now, before the run directory exists
        if self.nnodes > 1 and not (self.master_addr or self.rdzv_endpoint):
            nnodes = f"{self.min_nnodes}:{self.nnodes}" if self.elastic else str(self.nnodes)
            raise UsageError(f"--nnodes {nnodes} needs where to meet: "
                             + ("--rdzv-endpoint HOST:PORT (an elastic job meets at a c10d rendezvous)" if self.elastic
                                else "--master-addr HOST (with --node-rank) or --rdzv-endpoint HOST:PORT"))
        if self.rdzv_endpoint and self.master_addr:
            raise UsageError("give either --master-addr (static) or --rdzv-endpoint (elastic), not both")
        if self.rdzv_endpoint:   # now, before the launcher makes the run directory
            split_endpoint(self.rdzv_endpoint)
            conf_pairs(self.rdzv_conf)
        if self.elastic:
            self._check_elastic()
        if self.strategy == "single" and self.world_size > 1:
            raise UsageError(f"--strategy single runs one process, but --nproc x --nnodes = {self.world_size}; "
                             "use --strategy ddp or allreduce")
        if self.strategy == "dp" and self.world_size > 1:
            raise UsageError("--strategy dp (nn.DataParallel) runs ONE process that drives all GPUs; "
                             "drop --nproc/--nnodes, or use --strategy ddp for one process per GPU")
        self._check_memory_levers()
        data_ranks = self._check_mesh()
        _require(self.stages_per_rank >= 0, "stages_per_rank", "zero (the default) or a positive integer")
        layout = self.pipeline_layout()
        if self.sharded_checkpoints and layout is None and self.strategy not in ("fsdp", "mesh"):
            raise UsageError(f"--sharded-checkpoints applies to pipelines (fsdp and --mesh always write sharded "
                             f"checkpoints); with --strategy {self.strategy} every rank holds the whole model: drop it")
        if layout is not None:
            self._check_pipeline(*layout)
        else:
            if self.microbatches > 1:
                raise UsageError(f"--microbatches {self.microbatches} applies to --strategy pipeline (or --mesh pp=N) "
                                 "only; to split a step's batch with another strategy use --accumulate")
            if self.pipeline_schedule != "gpipe" or self.stages_per_rank:
                which = "--stages-per-rank" if self.stages_per_rank else "--pipeline-schedule"
                raise UsageError(f"{which} applies to --strategy pipeline only: add --strategy pipeline, or drop it")
            if not self.elastic:
                check_batch_split(self.batch_size, data_ranks, self.accumulate)
            elif self.batch_size < self.world_size * self.accumulate:
                # Any world size MIN..MAX runs; an uneven split is weighted (strategies/base.py).
                raise UsageError(f"--batch-size {self.batch_size} gives some of the up to {self.world_size} workers x "
                                 f"{self.accumulate} accumulation step(s) no sample; use at least "
                                 f"{self.world_size * self.accumulate}")
        return self

    @property
    def elastic(self) -> bool:
        """Whether the job's machines may change while it runs (``--nnodes MIN:MAX``, MIN < MAX)."""
        return 0 < self.min_nnodes < self.nnodes

    def _check_elastic(self) -> None:
        """An elastic job runs on whatever world size its machines give: only strategies that
        work on any world size, and a rendezvous that can change."""
        if not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.min_nnodes}:{self.nnodes} lets machines leave and join, which needs the "
                             "c10d rendezvous: add --rdzv-endpoint HOST:PORT (instead of --master-addr)")
        if self.mesh is not None or self.strategy in ("pipeline", "mesh", "dp", "single"):
            which = f"--mesh {self.mesh}" if self.mesh is not None else f"--strategy {self.strategy}"
            raise UsageError(f"--nnodes {self.min_nnodes}:{self.nnodes}: {which} needs a fixed number of processes; "
                             "an elastic job runs ddp, allreduce or fsdp")

    def elastic_world_sizes(self) -> range:
        """The world sizes an elastic job may run with (just the one for a fixed job)."""
        low = self.min_nnodes if self.elastic else self.nnodes
        return range(low * self.nproc, self.world_size + 1, self.nproc)

    def _check_memory_levers(self) -> None:
        """--activation-checkpointing and --cpu-offload only where they are implemented and tested."""
        if self.cpu_offload and self.strategy not in ("fsdp", "mesh") and self.mesh is None:
            raise UsageError(f"--cpu-offload moves FSDP's shards to host memory: use it with --strategy fsdp or --mesh "
                             f"(not --strategy {self.strategy})")
        if self.activation_checkpointing and (self.strategy in ("dp", "pipeline") or self.pipeline_layout()):
            which = f"--strategy {self.strategy}" if self.strategy in ("dp", "pipeline") else "--mesh pp=N"
            raise UsageError(f"--activation-checkpointing is not offered with {which}; use single, "
                             "ddp, allreduce, fsdp or --mesh without pp")

    def _check_mesh(self) -> int:
        """The data-parallel ranks a step's batch is split over (all of them without --mesh)."""
        if self.mesh is None:
            if self.strategy == "mesh":
                raise UsageError("--strategy mesh needs the layout: add --mesh, e.g. --mesh dp=2,tp=2")
            return self.world_size
        if self.strategy not in ("auto", "mesh"):
            raise UsageError(f"--mesh lays out the ranks itself: drop --strategy {self.strategy} (or use --strategy mesh)")
        from scaleloop.runtime.mesh import MeshSpec   # (imports torch: only when --mesh is given)

        spec = MeshSpec.parse(self.mesh).check(self.world_size)
        if spec.pp > 1 and (spec.fsdp > 1 or spec.tp > 1):
            raise UsageError(f"--mesh {spec}: pp composes with dp only (pipeline x data parallel); drop fsdp/tp, "
                             "or drop pp")
        return spec.data_parallel

    def pipeline_layout(self) -> Optional[tuple[int, int]]:
        """``(stage processes, replicas)`` when the run is a pipeline (``--strategy pipeline``:
        every rank a stage; ``--mesh pp=S,dp=R``: S stages, each replicated R times), else None."""
        if self.strategy == "pipeline":
            return self.world_size, 1
        if self.mesh is not None and self.strategy in ("auto", "mesh"):
            from scaleloop.runtime.mesh import MeshSpec

            spec = MeshSpec.parse(self.mesh)
            if spec.pp > 1:
                return spec.pp, spec.dp
        return None

    def _check_pipeline(self, stages: int, replicas: int) -> None:
        """A pipeline's stages all see their replica's whole batch: it is split over replicas and
        into micro-steps, not over stages."""
        if self.world_size < 2:
            raise UsageError("--strategy pipeline puts the model's layers on several processes, one stage each: "
                             "add --nproc 2 (or more)")
        if self.sync_batchnorm:
            raise UsageError("--sync-batchnorm synchronises BatchNorm over data-parallel ranks; a pipeline has "
                             "none (each BatchNorm lives on one stage): drop it")
        micro = check_batch_split(self.batch_size, replicas, self.accumulate)
        if micro < self.microbatches:
            raise UsageError(f"--batch-size {self.batch_size} with --accumulate {self.accumulate} gives micro-steps of "
                             f"{micro} samples, fewer than --microbatches {self.microbatches}; raise --batch-size "
                             f"or lower --microbatches")
        check_pipeline_schedule(self.pipeline_schedule, stages, self.microbatches, self.stages_per_rank)

    @property
    def world_size(self) -> int:
        """Processes the launch flags ask for (``--nproc`` x ``--nnodes``)."""
        return self.nproc * self.nnodes

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes`` applied (the dataclass is frozen)."""
        return dataclasses.replace(self, **changes)


def flag(name: str) -> str:
    """The CLI flag for a field name: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def _require(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise UsageError(f"{flag(name)} must be {what}")


def field_types() -> dict[str, type]:
    """Each field's scalar type (``Optional[int]`` -> ``int``)."""
    hints = get_type_hints(TrainConfig)
    out: dict[str, type] = {}
    for f in dataclasses.fields(TrainConfig):
        tp = hints[f.name]
        if get_origin(tp) is Union:
            tp = next(a for a in get_args(tp) if a is not type(None))
        out[f.name] = tp
    return out


def coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the field's type, or raise UsageError naming where it came from."""
    tp = field_types()[name]
    if name == "nnodes" and isinstance(value, str) and ":" in value:
        return _min_max(value, source)
    if value is None or (isinstance(value, str) and value.lower() == "none"
                         and TrainConfig.__dataclass_fields__[name].default is None):
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        pass
    raise UsageError(f"{source}: {name} must be {tp.__name__}, got {value!r}")


def _min_max(value: str, source: str) -> str:
    """``MIN:MAX`` machines, checked (kept as text: ``resolve`` splits it into two fields)."""
    try:
        low, high = (int(part) for part in value.split(":"))
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise UsageError(f"{source}: nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return f"{low}:{high}"


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a config file into field values; UsageError for a missing, unreadable or bad file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {str(p)!r} cannot be read: {exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    # Accept both a flat file and one whose settings sit under [train].
    if set(raw) == {"train"} and isinstance(raw["train"], dict):
        raw = raw["train"]
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"config file {str(p)!r}: unknown setting {key!r}{hint}")
        values[name] = coerce(name, value, f"config file {str(p)!r}")
    return values


def resolve(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> TrainConfig:
    """Defaults, then the config file, then CLI flags; validated."""
    merged = {**file_values, **flag_values}
    if isinstance(merged.get("nnodes"), str):   # elastic "MIN:MAX" (checked by coerce)
        low, high = (int(part) for part in merged["nnodes"].split(":"))
        merged["min_nnodes"], merged["nnodes"] = low, high
    elif "nnodes" in flag_values and "min_nnodes" not in flag_values:
        merged["min_nnodes"] = 0   # --nnodes N on the command line: a fixed job, whatever the file said
    return TrainConfig(**merged).validate()


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML that ``--config`` reads back to the same run."""
    lines = ["# scaleloop resolved configuration; rerun with: scaleloop train --config <this file>"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            lines.append(f"# {f.name} = (not set)")
        elif isinstance(value, bool):
            lines.append(f"{f.name} = {'true' if value else 'false'}")
        elif isinstance(value, str):
            lines.append(f'{f.name} = {_toml_string(value)}')
        else:
            lines.append(f"{f.name} = {value!r}")
    return "\n".join(lines) + "\n"


def _toml_string(value: str) -> str:
    """A TOML basic string: backslash and quote escaped, and control characters (which TOML
    forbids raw, e.g. a newline in a path) written as ``\\uXXXX``."""
    out = []
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as host and port; UsageError for anything else."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    return host, int(port)


def conf_pairs(user_conf: Optional[str]) -> list[str]:
    """``--rdzv-conf``'s ``KEY=VALUE`` pairs; UsageError for anything else (checked with the config)."""
    pairs = [p.strip() for p in (user_conf or "").split(",") if p.strip()]
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf {user_conf!r}: expected KEY=VALUE[,KEY=VALUE...], "
                             "e.g. last_call_timeout=5,join_timeout=600")
    return pairs
