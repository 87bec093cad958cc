"""Predicted step time of a layout: compute from FLOPs at a stated MFU, communication from the
links (the ring formulas of :mod:`scaleloop.bench.costmodel`), overlapped where the strategy
overlaps it. An estimate with its assumptions listed in docs/planning.md.

- compute: the counted FLOPs of a rank's samples (its tensor-parallel slice) / (peak x MFU),
  a third more with activation checkpointing (one more forward), at least ``MIN_GPU_STEP_S``;
- dp: the gradients' ring all-reduce, hidden behind the backward as far as it lasts;
- fsdp / hsdp: all-gather of each unit for the forward and again for the backward, and a
  reduce-scatter of its gradients (each (N-1)/N of the bytes over the link), prefetched behind
  the compute; hsdp adds the shards' all-reduce across replicas, one a unit;
- tp: four all-reduces of a block's activations per block (two forward, two backward; one more
  with checkpointing, in the recomputed forward), not hidden;
- pp: a piece's activation and its gradient to and from each neighbouring stage (a middle
  stage has two), the 1F1B bubble, (S - 1) / M of the compute added (on cores shared by more ranks, only
  what the busy stages leave idle: :func:`bubble`), and the stage's gradient all-reduce over
  replicas after the last backward;
- offload: the shards cross PCIe twice (forward, backward) and the gradients once, and the
  optimizer steps on the host (28 bytes of host memory traffic per parameter);
- scaleloop's own agreement between FSDP's ranks (``strategies/fsdp_agreement.py``): small all-reduces on
  a Gloo group at each unit's forward (again in a checkpointed unit's recomputed forward),
  backward start and end, and at the pass ends, plus one for the parameters no rank used
  (``strategies/unused.py``): not hidden (they wait);
- where the target cannot overlap (a CPU: Gloo's threads share the cores), nothing is hidden;
- each collective costs at least the target's ``least_s`` of its group's size (a CPU with more
  ranks than cores: an all-reduce's cost between bursts of compute, measured for the whole group
  and for pairs: a pair waits for fewer peers to be scheduled; of a few numbers for the
  agreements and a pipeline's sends, of a tensor for the rest, whose every ring step waits;
  more for the groups of a 2-D mesh, which cross; 0 on GPUs);
- the host's own work, where it was measured (:mod:`scaleloop.plan.hostwork`, per micro-batch):
  on a target that cannot overlap (a CPU) what the layout adds to the plain loop comes on top,
  slowed by the ranks sharing a core (``Target.host_share``), and so does a pipeline stage's
  dispatch of its pieces beyond one plain pass (``HostWork.pipeline``); on a GPU the host works while the
  device computes, and the step takes at least the host's whole work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from scaleloop.bench.costmodel import MIN_GPU_STEP_S, Interconnect
from scaleloop.plan.hostwork import HostWork
from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import FSDP_FAMILIES, MASTER_BYTES, Options, micro_batch
from scaleloop.plan.profile import ModelProfile
from scaleloop.plan.target import Target

#: Bytes of host memory an Adam step reads and writes per parameter (costmodel's figure).
ADAM_BYTES = 28


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank, and its parts."""

    compute_s: float
    comm_s: float          # communication that was not hidden
    total_s: float
    samples_per_s: float
    host_s: float = 0.0    # the host's work the step was given (see the module docstring)


def _collective_s(link: Interconnect, ranks: int, nbytes: float, factor: float, calls: int,
                  least_s: float = 0.0) -> float:
    """``factor`` x (N-1)/N of ``nbytes`` over ``link`` plus the latency of ``calls`` ring collectives
    of ``factor`` x (N-1) steps each (an all-reduce: 2, an all-gather or a reduce-scatter: 1), each
    at least ``least_s`` (``Target.least_s``: an all-reduce's) x ``factor`` / 2: it waits once a
    ring step, and an all-gather has half an all-reduce's steps."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) * nbytes / ranks / link.bandwidth_Bps + calls * factor * max(
        (ranks - 1) * link.latency_s, least_s / 2)


def compute_s(profile: ModelProfile, layout: Layout, options: Options, target: Target, mfu: float) -> float:
    """Seconds of matrix work on one rank per optimizer step (before the pipeline's bubble)."""
    samples = options.batch_size / layout.data_ranks
    flops = profile.flops_per_sample * samples / (layout.tp * layout.pp)
    if layout.checkpointing:
        flops *= 4 / 3
    return flops / (target.flops(options.precision) * mfu)


def _spans_nodes(group: int, inner: int, target: Target) -> bool:
    """Whether a group of ``group`` ranks, ``inner`` apart in the rank order, leaves a node."""
    return group * inner > target.per_node


def comm_s(profile: ModelProfile, layout: Layout, options: Options, target: Target) -> tuple[float, float]:
    """(seconds that can hide behind the compute, seconds that cannot) of one step's collectives."""
    params = profile.parameters - profile.tp_parameters * (1 - 1 / layout.tp)
    units = len(profile.block_parameters) + 1
    # A layout of two parallel dimensions or more crosses its groups (Target.least_s).
    crossed = sum(size > 1 for size in (layout.dp, layout.fsdp, layout.tp, layout.pp)) > 1

    def least(ranks: int, data: bool = True) -> float:
        return target.least_s(ranks, data, crossed and ranks < layout.world)

    hidden = exposed = 0.0   # hidden: behind the backward (DDP) or the whole compute (FSDP's prefetch)
    if layout.pp > 1:
        stage = params / layout.pp * MASTER_BYTES
        link = target.link(layout.dp, _spans_nodes(layout.dp, 1, target))
        exposed += _collective_s(link, layout.dp, stage, 2, 1, least(layout.dp))
        if profile.hidden:
            pieces = layout.microbatches * options.accumulate
            act = micro_batch(layout, options) * profile.spec.seq_len * profile.hidden * options.param_bytes
            p2p = target.link(2, _spans_nodes(layout.pp, layout.dp, target))
            # The busiest stage's transfers a piece: a middle stage receives and sends in both
            # passes (4); the first and the last have a neighbour on one side only (2).
            transfers = 2 if layout.pp == 2 else 4
            exposed += transfers * pieces * (act / p2p.bandwidth_Bps + max(p2p.latency_s, least(2, False)))
        return hidden, exposed
    if layout.tp > 1 and profile.hidden:
        act = micro_batch(layout, options) * profile.spec.seq_len * profile.hidden * options.param_bytes
        # Two sums a block forward, two backward; with checkpointing the recomputed forward runs
        # the first again (it stops once the backward has what it saved: the second is not needed).
        sums = 4 + (1 if layout.checkpointing else 0)
        per_sum = _collective_s(target.inside, layout.tp, act, 2, 1, least(layout.tp))
        exposed += sums * len(profile.block_parameters) * per_sum
    if layout.fsdp > 1:
        link = target.link(layout.fsdp, _spans_nodes(layout.fsdp, layout.tp, target))
        gathered = params * options.param_bytes
        floor = least(layout.fsdp)
        hidden += _collective_s(link, layout.fsdp, 2 * gathered, 1, 2 * units, floor)      # forward and backward
        hidden += _collective_s(link, layout.fsdp, params * MASTER_BYTES, 1, units, floor)  # reduce-scatter
        if layout.offload:
            hidden += (2 * gathered + params * MASTER_BYTES) / layout.fsdp / target.host_Bps
            exposed += params / layout.fsdp * ADAM_BYTES / target.host_adam_Bps
    if layout.family in FSDP_FAMILIES and layout.world > 1:
        # Three a unit (its forward, its backward's start and end), one more where checkpointing
        # runs its forward again, and three a step (the passes' ends, the unused parameters).
        agreements = (4 if layout.checkpointing else 3) * len(profile.block_parameters) + 2 + 1
        exposed += agreements * max(2 * (layout.world - 1) * target.host_latency_s, least(layout.world, False))
    if layout.dp > 1:
        shard = params * MASTER_BYTES / layout.fsdp
        link = target.link(layout.dp, _spans_nodes(layout.dp, layout.fsdp * layout.tp, target))
        # DDP sums its buckets of 25 MiB; FSDP's replicas (hsdp) sum each unit's shard on its own.
        calls = units if layout.fsdp > 1 else max(1, round(shard / (25 * 2**20)))
        hidden += _collective_s(link, layout.dp, shard, 2, calls, least(layout.dp))
    return hidden, exposed


def bubble(layout: Layout, target: Target) -> float:
    """A pipeline's 1F1B bubble as a share of its compute: (S - 1) / M. Where the ranks outnumber
    the cores they share, a stage that waits hands its core to another rank; at least one stage
    of each of the ``dp`` pipelines has work at any time, and only the cores those leave idle are
    lost (none where ``dp`` ranks fill the cores)."""
    share = (layout.pp - 1) / layout.microbatches
    if target.cores and layout.world > target.cores:
        share *= max(0.0, 1 - layout.dp / target.cores)
    return share


def step_time(profile: ModelProfile, layout: Layout, options: Options, target: Target, mfu: float,
              host: Optional[HostWork] = None) -> StepTime:
    """The step's predicted seconds and samples per second (see the module docstring); ``host``:
    the host's work measured per layout (None: left out)."""
    # However small the model, an eager step takes some kernel launches (costmodel's floor).
    compute = max(compute_s(profile, layout, options, target, mfu), MIN_GPU_STEP_S)
    if layout.pp > 1:
        compute *= 1 + bubble(layout, target)
    hidden, exposed = comm_s(profile, layout, options, target)
    # What can hide does so behind the backward (two thirds of the compute; DDP's buckets), or
    # behind all of it where FSDP prefetches the next unit's gather during the forward too.
    window = 0.0 if not target.overlaps else compute if layout.fsdp > 1 else compute * 2 / 3
    extra = max(0.0, hidden - window) + exposed
    total = compute + extra
    passes = options.accumulate * layout.microbatches
    host_s = 0.0
    if host is not None and not target.overlaps:
        host_s = (host.extra(layout) * passes + host.pipeline(layout) * options.accumulate) * target.host_share
        total += host_s
    elif host is not None:
        host_s = host.total(layout) * passes
        total = max(total, host_s)
    return StepTime(compute, extra, total, options.batch_size / total, host_s)
