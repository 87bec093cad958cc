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
from typing import Any, Mapping, Optional, TypeVar, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

from scaleloop.checkpoint.settings import CheckpointSettings
from scaleloop.config.sections import EvalSettings, LaunchSettings, OptimSettings
from scaleloop.data.settings import DataSettings
from scaleloop.errors import UsageError
from scaleloop.output.settings import OutputSettings
from scaleloop.output.trackers import TRACKERS
from scaleloop.strategies.pipeline_schedules import SCHEDULES as PIPELINE_SCHEDULES
from scaleloop.strategies.registry import STRATEGIES, ParallelSettings

S = TypeVar("S")
BACKENDS = ("gloo", "nccl")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "step")
LR_SCALINGS = ("none", "linear", "sqrt")
DECAY_PARAMS = ("ndim2", "ndim2-no-embeddings", "all")
TASKS = ("auto", "classification", "binary", "regression", "lm")


def _opt(default: Any, help: str, choices: tuple[str, ...] = (), group: str = "training",
         common: bool = False) -> Any:
    # common: among the dozen flags a newcomer needs first, which ``train --help`` shows
    # (``--help-all`` shows every field); see ``common_fields``.
    return field(default=default, metadata={"help": help, "choices": choices, "group": group, "common": common})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Sizes are global (across all workers)."""

    # what to train
    model: str = _opt("simplenet", "model: simplenet, biggernet, convnet, tinygpt, or package.module:factory", group="model and data",
                      common=True)
    data: str = _opt("digits", "dataset: digits, random, mnist, images, tokens, tokenfile (random windows of DIR/train.bin), "
                     "tokenfile-seq (sequential windows), or package.module:factory", group="model and data", common=True)
    data_dir: Optional[str] = _opt(None, "directory holding the MNIST IDX files (--data mnist; never downloads), or train.bin "
                                   "and val.bin (--data tokenfile)", group="model and data")
    hidden_dim: int = _opt(128, "hidden width of simplenet/biggernet", group="model and data", common=True)
    n_samples: int = _opt(10_000, "training samples for generated datasets (random, images, tokens)", group="model and data")
    input_dim: int = _opt(20, "features per sample for --data random", group="model and data")
    image_size: int = _opt(32, "side of the square images for --data images", group="model and data")
    seq_len: int = _opt(64, "tokens per sample for --data tokens and tokenfile", group="model and data")
    vocab_size: int = _opt(256, "vocabulary size for --data tokens and tokenfile (DIR/meta.json's vocab_size wins)", group="model and data")
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
    epochs: int = _opt(20, "passes over the training set", common=True)
    max_steps: Optional[int] = _opt(None, "stop after this many optimizer steps (default: no limit)")
    batch_size: int = _opt(64, "GLOBAL batch size: per-device batch = batch_size / (world size x accumulate)",
                            common=True)
    accumulate: int = _opt(1, "micro-batches accumulated into each optimizer step")
    lr: float = _opt(0.01, "learning rate (at --base-batch-size when --lr-scaling is set)", common=True)
    lr_schedule: str = _opt("constant", "learning-rate schedule over the run's optimizer steps "
                            "(step: x0.1 at half and at three quarters of them)", LR_SCHEDULES)
    warmup_steps: int = _opt(0, "optimizer steps of linear learning-rate warm-up from lr/N to lr")
    min_lr: float = _opt(0.0, "the learning rate a decaying --lr-schedule ends at: cosine decays from the peak to "
                         "it, step's drops stop at it")
    lr_scaling: str = _opt("none", "scale --lr with the global batch: linear (x B/base) or sqrt "
                           "(x sqrt(B/base)); needs --base-batch-size", LR_SCALINGS)
    base_batch_size: Optional[int] = _opt(None, "the global batch that --lr was tuned for (for --lr-scaling)")
    optimizer: str = _opt("adam", "optimizer", OPTIMIZERS, common=True)
    betas: Optional[str] = _opt(None, "adam and adamw: the moment decay rates B1,B2, e.g. 0.9,0.95 (default: "
                                "torch's 0.9,0.999)")
    eps: Optional[float] = _opt(None, "adam and adamw: the term added to the denominator (default: torch's 1e-08)")
    weight_decay: float = _opt(0.0, "weight decay (on the tensors --decay-params names)")
    decay_params: str = _opt("ndim2", "which tensors --weight-decay applies to: ndim2 (those of 2 or more dimensions: "
                             "linear and conv weights, embeddings; not biases or norms), ndim2-no-embeddings (not "
                             "embeddings either) or all", DECAY_PARAMS)
    momentum: float = _opt(0.9, "momentum (sgd only)")
    clip_grad: Optional[float] = _opt(None, "clip the global gradient norm to this value (default: off)")
    drop_last: bool = _opt(False, "drop the last, smaller step of each epoch instead of training on it")
    seed: int = _opt(0, "random seed (model init, data order, generated data)")

    # where to run it
    device: str = _opt("auto", "device: auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", group="hardware", common=True)
    strategy: str = _opt("auto", "how to use the hardware", STRATEGIES, group="hardware", common=True)
    mesh: Optional[str] = _opt(None, "lay the ranks out on named dimensions, e.g. dp=2,tp=2: dp (replicated), fsdp or "
                               "shard (sharded), tp (tensor parallel); their product is the world size; implies "
                               "--strategy mesh (docs/strategies.md, '--mesh')", group="hardware")
    activation_checkpointing: bool = _opt(False, "keep only each block's input from the forward and recompute its "
                                          "activations in the backward: less memory, about one more forward of "
                                          "compute, the same results", group="hardware")
    cpu_offload: bool = _opt(False, "fsdp and --mesh: keep the sharded parameters, gradients and optimizer state in "
                             "host memory between uses (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU)",
                             group="hardware")
    precision: str = _opt("fp32", "numeric precision (bf16/fp16 use torch.amp autocast; fp16 adds a GradScaler)", PRECISIONS,
                           group="hardware", common=True)
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
    nproc: int = _opt(1, "worker processes on this machine (one per GPU on CUDA)", group="launch", common=True)
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
    out: Optional[str] = _opt(None, "run directory (default: runs/<date>-<time>-<model>-<data>); an existing run's directory continues that run",
                              group="output", common=True)
    log_every: int = _opt(10, "optimizer steps between metric rows in metrics.csv", group="output")
    eval_every: Optional[int] = _opt(None, "also evaluate every N optimizer steps (at global steps N, 2N, ...), "
                                     "an eval row in metrics.csv each time (default: at epoch ends only)",
                                     group="output")
    eval_batches: Optional[int] = _opt(None, "evaluate a fixed, seeded sample of K batches (K x --batch-size samples) "
                                       "of the test set instead of all of it, the same sample every time and on any "
                                       "number of processes (default: the whole test set)", group="output")
    eval_train: bool = _opt(False, "at each evaluation also take the training loss in evaluation mode over a fixed, "
                            "seeded sample of the training set (--eval-batches batches; all of it without)",
                            group="output")
    progress: bool = _opt(True, "show a progress bar", group="output")
    tracker: str = _opt("tensorboard", "where metrics go besides metrics.csv: TensorBoard events in <run>/tensorboard "
                        "(if installed), a W&B or MLflow run (see docs/tracking.md), or nowhere", TRACKERS, group="output")
    tensorboard: bool = _opt(True, "write the events of --tracker tensorboard (--no-tensorboard: as --tracker none)",
                             group="output")

    def validate(self) -> "TrainConfig":
        """Check every value; raise UsageError naming the flag and what to use instead.

        Each section is checked by its owner (``SECTIONS``); here only what every field shares:
        a value among its choices.
        """
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise UsageError(f"{flag(f.name)} {value!r} is not one of: {', '.join(choices)}")
        for kind in SECTIONS:
            self.section(kind).check()
        return self

    def section(self, kind: type[S]) -> S:
        """One section of this config (``CheckpointSettings``, ``ParallelSettings``, ...): the fields
        it names, taken from the flat ones. A component is handed its section, not the whole config."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    @property
    def checkpointing(self) -> CheckpointSettings:
        """The checkpoint section (``scaleloop.checkpoint.settings``)."""
        return self.section(CheckpointSettings)

    @property
    def evaluation(self) -> EvalSettings:
        """The evaluation section (``scaleloop.config.sections``)."""
        return self.section(EvalSettings)

    @property
    def optim(self) -> OptimSettings:
        """The optimizer-and-schedule section (``scaleloop.config.sections``)."""
        return self.section(OptimSettings)

    @property
    def peak_lr(self) -> float:
        """``--lr`` scaled to the global batch by ``--lr-scaling`` (``OptimSettings.peak_lr``)."""
        return self.optim.peak_lr

    @property
    def parallel(self) -> ParallelSettings:
        """The parallel section (``scaleloop.strategies.registry``)."""
        return self.section(ParallelSettings)

    @property
    def elastic(self) -> bool:
        """Whether the job's machines may change while it runs (``--nnodes MIN:MAX``, MIN < MAX)."""
        return 0 < self.min_nnodes < self.nnodes

    @property
    def elastic_nodes(self) -> Optional[str]:
        """``MIN:MAX`` for an elastic job, else None."""
        return f"{self.min_nnodes}:{self.nnodes}" if self.elastic else None

    def elastic_world_sizes(self) -> range:
        """The world sizes an elastic job may run with (just the one for a fixed job)."""
        low = self.min_nnodes if self.elastic else self.nnodes
        return range(low * self.nproc, self.world_size + 1, self.nproc)

    def pipeline_layout(self) -> Optional[tuple[int, int]]:
        """``(stage processes, replicas)`` when the run is a pipeline, else None (``ParallelSettings``)."""
        return self.parallel.pipeline_layout()

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


def common_fields() -> tuple[str, ...]:
    """The fields a newcomer needs first (``common=True``), in definition order: what
    ``scaleloop train --help`` shows; ``--help-all`` shows every field."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("common"))


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
    if name == "betas" and isinstance(value, list):   # a config file's betas = [0.9, 0.95]
        value = ",".join(str(v) for v in value)
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


# The sections, checked in this order by ``TrainConfig.validate``; each field belongs to one or more.
SECTIONS: tuple[type, ...] = (DataSettings, OptimSettings, OutputSettings, EvalSettings, CheckpointSettings,
                              LaunchSettings, ParallelSettings)
