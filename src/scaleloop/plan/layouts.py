"""The candidate layouts of a plan and the ``scaleloop train`` flags that run each.

Families (docs/planning.md): ``dp`` (DDP, replicated), ``fsdp`` (sharded over every rank),
``hsdp`` (sharded inside a node, replicated across nodes: ``--mesh dp=R,fsdp=S``), ``fsdp x tp``
(``--mesh fsdp=F,tp=T``, tensor parallel inside a node), ``pp x dp`` (``--mesh pp=S,dp=R``, 1F1B),
each with and without activation checkpointing (not offered with a pipeline), and fsdp with
``--cpu-offload``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Layout:
    """How the ranks are laid out: sizes of each dimension, and the memory levers."""

    family: str
    dp: int = 1                 # replicas
    fsdp: int = 1               # shards
    tp: int = 1
    pp: int = 1
    checkpointing: bool = False
    offload: bool = False
    microbatches: int = 1       # pipeline pieces per micro-step

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks that see different samples (a step's batch is split over them)."""
        return self.dp * self.fsdp

    @property
    def label(self) -> str:
        sizes = ",".join(f"{n}={s}" for n, s in (("pp", self.pp), ("dp", self.dp), ("fsdp", self.fsdp),
                                                  ("tp", self.tp)) if s > 1) or "dp=1"
        extra = (" +ac" if self.checkpointing else "") + (" +offload" if self.offload else "")
        return f"{self.family} {sizes}{extra}"

    def train_flags(self, per_node: int, nodes: int) -> list[str]:
        """The ``scaleloop train`` flags of this layout (launch included)."""
        flags = ["--nproc", str(per_node)]
        if nodes > 1:   # node 0's line; each node gives its own --node-rank, all the same address
            flags += ["--nnodes", str(nodes), "--node-rank", "0", "--master-addr", "NODE0_HOST"]
        if self.family == "dp":
            flags += ["--strategy", "ddp"]
        elif self.family == "fsdp":
            flags += ["--strategy", "fsdp"]
        elif self.pp > 1 and self.dp == 1:
            flags += ["--strategy", "pipeline"]
        else:
            sizes = [f"{n}={s}" for n, s in (("pp", self.pp), ("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp))
                     if s > 1]
            flags += ["--mesh", ",".join(sizes)]
        if self.pp > 1:
            flags += ["--microbatches", str(self.microbatches), "--pipeline-schedule", "1f1b"]
        if self.checkpointing:
            flags.append("--activation-checkpointing")
        if self.offload:
            flags.append("--cpu-offload")
        return flags


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatches(stages: int, per_replica_batch: int) -> Optional[int]:
    """Pipeline pieces: 4, 2 or 1 per stage (more pieces, a smaller bubble), as the batch allows."""
    for per_stage in (4, 2, 1):
        m = stages * per_stage
        if per_replica_batch % m == 0:
            return m
    return None


def candidates(gpus: int, per_node: int, nodes: int, batch_size: int, heads: Optional[int],
               pipeline_layers: int, with_checkpointing: bool) -> list[Layout]:
    """Every layout of ``gpus`` (``pipeline_layers``: how many layers a pipeline could cut; 0: none;
    ``heads``: tensor parallelism needs it to divide; a pipeline needs ``batch_size`` to split into
    its pieces). Whether ``batch_size`` splits over a layout's data ranks is the caller's to check."""
    out: list[Layout] = []
    levers = (False, True) if with_checkpointing else (False,)
    for ac in levers:
        out.append(Layout("dp", dp=gpus, checkpointing=ac))
        if gpus > 1:
            out.append(Layout("fsdp", fsdp=gpus, checkpointing=ac))
            out.append(Layout("fsdp", fsdp=gpus, checkpointing=ac, offload=True))
        if nodes > 1:
            out.append(Layout("hsdp", dp=nodes, fsdp=per_node, checkpointing=ac))
        elif per_node >= 4:
            out.append(Layout("hsdp", dp=2, fsdp=per_node // 2, checkpointing=ac))
        for tp in _divisors(per_node):
            if 1 < tp and heads and heads % tp == 0:
                out.append(Layout("fsdp x tp", fsdp=gpus // tp, tp=tp, checkpointing=ac))
    for pp in _divisors(gpus):
        if 1 < pp <= pipeline_layers:
            replicas = gpus // pp
            if batch_size % replicas == 0:
                m = _microbatches(pp, batch_size // replicas)
                if m is not None:
                    out.append(Layout("pp x dp", dp=replicas, pp=pp, microbatches=m))
    return out
