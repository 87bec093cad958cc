"""The config's sections whose owners sit above the config: the trainer's optimizer and schedule,
its evaluations, and the launcher's processes and machines. (Sections owned by the floors below are defined there:
``data.settings``, ``output.settings``, ``checkpoint.settings``, ``strategies.registry``.)

Each section is a frozen dataclass whose fields are declared once, with their help
(``scaleloop.option``), and which checks its own values (``check``). No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

from scaleloop.errors import UsageError
from scaleloop.option import flag, option, require
from scaleloop.runtime.preempt import signal_number

OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "step")
LR_SCALINGS = ("none", "linear", "sqrt")
DECAY_PARAMS = ("ndim2", "ndim2-no-embeddings", "all")
BACKENDS = ("gloo", "nccl")

_training = partial(option, group="training")
_output = partial(option, group="output")
_launch = partial(option, group="launch")


@dataclass(frozen=True)
class OptimSettings:
    """How long to train, the batch, the optimizer, the learning rate and its schedule, the seed."""

    epochs: int = _training(20, "passes over the training set", common=True)
    max_steps: Optional[int] = _training(None, "stop after this many optimizer steps (default: no limit)")
    batch_size: int = _training(64, "GLOBAL batch size: per-device batch = batch_size / (world size x accumulate)",
                                common=True)
    lr: float = _training(0.01, "learning rate (at --base-batch-size when --lr-scaling is set)", common=True)
    lr_schedule: str = _training("constant", "learning-rate schedule over the run's optimizer steps "
                                 "(step: x0.1 at half and at three quarters of them)", LR_SCHEDULES)
    warmup_steps: int = _training(0, "optimizer steps of linear learning-rate warm-up from lr/N to lr")
    min_lr: float = _training(0.0, "the learning rate a decaying --lr-schedule ends at: cosine decays from the peak "
                              "to it, step's drops stop at it")
    lr_scaling: str = _training("none", "scale --lr with the global batch: linear (x B/base) or sqrt "
                                "(x sqrt(B/base)); needs --base-batch-size", LR_SCALINGS)
    base_batch_size: Optional[int] = _training(None, "the global batch that --lr was tuned for (for --lr-scaling)")
    optimizer: str = _training("adam", "optimizer", OPTIMIZERS, common=True)
    betas: Optional[str] = _training(None, "adam and adamw: the moment decay rates B1,B2, e.g. 0.9,0.95 (default: "
                                     "torch's 0.9,0.999)")
    eps: Optional[float] = _training(None, "adam and adamw: the term added to the denominator (default: torch's "
                                     "1e-08)")
    weight_decay: float = _training(0.0, "weight decay (on the tensors --decay-params names)")
    decay_params: str = _training("ndim2", "which tensors --weight-decay applies to: ndim2 (those of 2 or more "
                                  "dimensions: linear and conv weights, embeddings; not biases or norms), "
                                  "ndim2-no-embeddings (not embeddings either) or all", DECAY_PARAMS)
    momentum: float = _training(0.9, "momentum (sgd only)")
    clip_grad: Optional[float] = _training(None, "clip the global gradient norm to this value (default: off)")
    drop_last: bool = _training(False, "drop the last, smaller step of each epoch instead of training on it")
    seed: int = _training(0, "random seed (model init, data order, generated data)")
    fused_optimizer: bool = option(False, "the optimizer's one-kernel implementation (fused=True, on CUDA and the "
                                   "CPU; foreach=True where there is none): much faster steps, rounding may differ "
                                   "slightly", group="speed")

    def check(self) -> None:
        for name in ("epochs", "batch_size"):
            require(getattr(self, name) >= 1, name, "a positive integer")
        require(self.max_steps is None or self.max_steps >= 1, "max_steps", "a positive integer")
        require(self.lr > 0, "lr", "a positive number")
        require(self.weight_decay >= 0, "weight_decay", "zero or positive")
        require(self.momentum >= 0, "momentum", "zero or positive")
        require(self.clip_grad is None or self.clip_grad > 0, "clip_grad", "a positive number")
        require(self.warmup_steps >= 0, "warmup_steps", "zero or positive")
        require(self.base_batch_size is None or self.base_batch_size >= 1, "base_batch_size", "a positive integer")
        if self.lr_scaling != "none" and self.base_batch_size is None:
            raise UsageError(f"--lr-scaling {self.lr_scaling} scales --lr from the batch it was tuned for: "
                             "add --base-batch-size N")
        self._check_min_lr()
        self._check_adam_options()

    @property
    def peak_lr(self) -> float:
        """``--lr`` scaled from ``--base-batch-size`` to the global ``--batch-size`` (``--lr-scaling``).

        Linear scaling keeps the size of an epoch's total update when the batch grows (k times the
        batch, k times fewer steps, so k times the step); sqrt scaling keeps the gradient noise
        scale instead and is the usual choice for Adam-like optimizers at large batches.
        """
        if self.lr_scaling == "none" or self.base_batch_size is None:
            return self.lr
        ratio = self.batch_size / self.base_batch_size
        return self.lr * (ratio if self.lr_scaling == "linear" else math.sqrt(ratio))

    @property
    def adam_betas(self) -> Optional[tuple[float, float]]:
        """``--betas`` as two numbers (None: the optimizer's default); UsageError if malformed."""
        if self.betas is None:
            return None
        parts = self.betas.split(",")
        try:
            b1, b2 = (float(part) for part in parts)
        except ValueError:
            b1 = b2 = math.nan   # wrong count or not numbers: refused below, as out of range
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise UsageError(f"--betas {self.betas!r}: expected two numbers in [0, 1) separated by a comma, "
                             "e.g. --betas 0.9,0.95")
        return b1, b2

    def _check_min_lr(self) -> None:
        require(self.min_lr >= 0, "min_lr", "zero or positive")
        if self.min_lr and self.lr_schedule == "constant":
            raise UsageError(f"--min-lr {self.min_lr:g} is the floor of a decaying schedule, and --lr-schedule "
                             "constant does not decay: add --lr-schedule cosine (or step), or leave out --min-lr")
        if self.min_lr >= self.peak_lr:
            raise UsageError(f"--min-lr {self.min_lr:g} must be below the peak learning rate {self.peak_lr:g} "
                             "(--lr, scaled by --lr-scaling): the schedule decays from the peak to it")

    def _check_adam_options(self) -> None:
        given = [name for name in ("betas", "eps") if getattr(self, name) is not None]
        if given and self.optimizer not in ("adam", "adamw"):
            flags = " and ".join(f"--{name}" for name in given)
            raise UsageError(f"{flags} {'are' if len(given) > 1 else 'is'} for --optimizer adam and adamw; "
                             f"--optimizer {self.optimizer} has no such setting: use --optimizer adamw (or adam), "
                             f"or leave out {flags}")
        self.adam_betas   # (raises for a malformed value)
        require(self.eps is None or self.eps > 0, "eps", "a positive number, e.g. 1e-8")


@dataclass(frozen=True)
class EvalSettings:
    """When the trainer evaluates and on what: every ``eval_every`` steps besides each epoch's end,
    on a fixed sample of ``eval_batches`` batches (None: the whole test set), and with
    ``eval_train`` on a sample of the training set too (``scaleloop.loop.evaluation``)."""

    eval_every: Optional[int] = _output(None, "also evaluate every N optimizer steps (at global steps N, 2N, ...), "
                                        "an eval row in metrics.csv each time (default: at epoch ends only)")
    eval_batches: Optional[int] = _output(None, "evaluate a fixed, seeded sample of K batches (K x --batch-size "
                                          "samples) of the test set instead of all of it, the same sample every time "
                                          "and on any number of processes (default: the whole test set)")
    eval_train: bool = _output(False, "at each evaluation also take the training loss in evaluation mode over a "
                               "fixed, seeded sample of the training set (--eval-batches batches; all of it without)")

    def check(self) -> None:
        if self.eval_every is not None and self.eval_every < 1:
            raise UsageError(f"--eval-every must be a positive number of optimizer steps, got {self.eval_every} "
                             "(leave it out to evaluate at epoch ends only)")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise UsageError(f"--eval-batches must be a positive number of batches, got {self.eval_batches} "
                             "(leave it out to evaluate the whole test set)")

    def sample_size(self, batch_size: int) -> Optional[int]:
        """Samples an evaluation reads from each set with global batches of ``batch_size`` (the
        optimizer section's): None for all of them."""
        return None if self.eval_batches is None else self.eval_batches * batch_size


@dataclass(frozen=True)
class LaunchSettings:
    """How many processes on how many machines, where they meet, and how the launcher treats them."""

    device: str = option("auto", "device: auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", group="hardware",
                         common=True)
    nproc: int = _launch(1, "worker processes on this machine (one per GPU on CUDA); auto: one per GPU, else 1 "
                         "(on the command line)", common=True)
    nnodes: int = _launch(1, "machines in the job: N, or MIN:MAX for elastic membership (with --rdzv-endpoint: the "
                          "job goes on with as few as MIN machines and admits returning ones, up to MAX)")
    min_nnodes: int = _launch(0, "the fewest machines an elastic job goes on with (set by --nnodes MIN:MAX; "
                              "0: --nnodes)")
    node_rank: int = _launch(0, "this machine's index, 0..nnodes-1 (with --master-addr)")
    master_addr: Optional[str] = _launch(None, "address of node 0 (static rendezvous; default: single-node "
                                         "standalone)")
    master_port: int = _launch(29500, "port on node 0 for --master-addr")
    rdzv_endpoint: Optional[str] = _launch(None, "host:port of a c10d rendezvous (elastic; instead of "
                                           "--master-addr/--node-rank)")
    rdzv_id: str = _launch("scaleloop", "job id shared by all nodes of one --rdzv-endpoint job")
    rdzv_conf: Optional[str] = _launch(None, "torchrun's --rdzv-conf for --rdzv-endpoint, e.g. last_call_timeout=5,"
                                       "join_timeout=600 (docs/multinode.md, 'Faults')")
    local_addr: Optional[str] = _launch(None, "this machine's address as the others reach it (default: the address "
                                        "that routes to --rdzv-endpoint)")
    max_restarts: int = _launch(0, "times torchrun restarts the worker group after a failure")
    signal: str = _launch("SIGUSR1", "a signal that, like SIGTERM and SIGUSR1, stops the run after the current step "
                          "with a checkpoint (preemption; see docs/slurm.md)")
    requeue: bool = _launch(False, "after such a stop under SLURM, put the job back into the queue (scontrol requeue)")
    backend: Optional[str] = _launch(None, "process-group backend (default: nccl on CUDA, gloo on CPU)", BACKENDS)
    replica_groups: int = _launch(1, "replica groups that train as one data-parallel job under torchft (pip install "
                                  "'scaleloop[ft]'): a group that is lost is restarted and rejoins from a live one "
                                  "while the others go on; on one machine --nproc is split over the groups "
                                  "(docs/fault-tolerance.md)")
    replica_group: Optional[int] = _launch(None, "start only replica group I of --replica-groups N (one launch per "
                                           "group, on its own machine or job; needs --lighthouse); --nproc is then "
                                           "this group's processes (default with --lighthouse: REPLICA_GROUP_ID, "
                                           "torchft's variable, or a SLURM job array's SLURM_ARRAY_TASK_ID)")
    lighthouse: Optional[str] = _launch(None, "HOST:PORT of the torchft lighthouse that replica groups meet at "
                                        "(python -m scaleloop.launching.lighthouse; default on one machine: one the "
                                        "launcher starts)")
    timeout: float = _launch(1800.0, "seconds a collective waits for the slowest rank before the run stops with a "
                             "report naming the rank behind; keep it above your longest first step (torch.compile) "
                             "and checkpoint save (default: 1800, as torch's own)")

    @property
    def elastic(self) -> bool:
        """Whether the job's machines may change while it runs (``--nnodes MIN:MAX``, MIN < MAX)."""
        return 0 < self.min_nnodes < self.nnodes

    @property
    def elastic_nodes(self) -> Optional[str]:
        """``MIN:MAX`` for an elastic job, else None."""
        return f"{self.min_nnodes}:{self.nnodes}" if self.elastic else None

    @property
    def world_size(self) -> int:
        """Processes the launch flags ask for (``--nproc`` x ``--nnodes``)."""
        return self.nproc * self.nnodes

    def check(self) -> None:
        require(self.nproc >= 1, "nproc", "a positive integer")
        require(self.nnodes >= 1, "nnodes", "a positive integer")
        require(0 <= self.min_nnodes <= self.nnodes, "min_nnodes", f"in 0..{self.nnodes} (--nnodes MIN:MAX)")
        require(0 <= self.node_rank < self.nnodes, "node_rank", f"in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        require(1 <= self.master_port <= 65535, "master_port", "a port number in 1..65535")
        require(self.max_restarts >= 0, "max_restarts", "zero or positive")
        signal_number(self.signal)   # a name that is no catchable signal: one line now, not at the stop
        require(self.timeout > 0, "timeout", "a positive number of seconds")
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
        self._check_replica_groups()
        if self.elastic and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.min_nnodes}:{self.nnodes} lets machines leave and join, which needs the "
                             "c10d rendezvous: add --rdzv-endpoint HOST:PORT (instead of --master-addr)")

    @property
    def data_ranks(self) -> int:
        """Processes that train on different samples, over every replica group: ``--nproc`` on one
        machine (split over the groups), ``--nproc`` x ``--replica-groups`` where each group is
        launched on its own (``--replica-group``, ``--lighthouse``)."""
        if self.group_on_its_own:
            return self.world_size * self.replica_groups
        return self.world_size

    @property
    def group_on_its_own(self) -> bool:
        """Whether this launch starts one replica group of several (``--lighthouse`` names where the
        others meet), not all of them with their lighthouse."""
        return self.replica_groups > 1 and (self.replica_group is not None or self.lighthouse is not None)

    def _check_replica_groups(self) -> None:
        """``--replica-groups``: torchft installed, groups of whole processes on one machine each,
        and the flags of a group launched on its own."""
        require(self.replica_groups >= 1, "replica_groups", "a positive integer")
        if self.replica_groups == 1:
            for name in ("replica_group", "lighthouse"):
                if getattr(self, name) is not None:
                    raise UsageError(f"{flag(name)} names a replica group's place among several: add "
                                     "--replica-groups N (N >= 2), or drop it")
            return
        groups = f"--replica-groups {self.replica_groups}"
        import importlib.util

        if importlib.util.find_spec("torchft") is None:
            raise UsageError(f"{groups} needs torchft, which is not installed: pip install 'scaleloop[ft]'")
        if self.nnodes > 1 or self.master_addr or self.rdzv_endpoint:
            raise UsageError(f"{groups}: each replica group runs on one machine (--nnodes 1); start one group per "
                             "machine with --replica-group I --lighthouse HOST:PORT instead of --nnodes, "
                             "--master-addr or --rdzv-endpoint")
        if self.replica_group is None and self.lighthouse is None:   # all groups here: --nproc is split
            if self.nproc % self.replica_groups:
                raise UsageError(f"--nproc {self.nproc} does not split into {groups} of equal size: use a "
                                 f"multiple of {self.replica_groups}")
            return
        # A group on its own. Without --replica-group its index comes from the job's variables, read
        # by the launcher where it runs (launching.jobs.replica_group_in_job), not here.
        if self.replica_group is not None:
            require(0 <= self.replica_group < self.replica_groups, "replica_group",
                    f"in 0..{self.replica_groups - 1} ({groups})")
        if self.lighthouse is None:
            raise UsageError(f"--replica-group {self.replica_group} meets the other groups at their lighthouse: "
                             "add --lighthouse HOST:PORT (python -m scaleloop.launching.lighthouse starts one)")
        split_endpoint(self.lighthouse, "--lighthouse")


def split_endpoint(endpoint: str, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as host and port; UsageError for anything else (naming ``what``)."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{what} {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
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
