"""Per-rank peak memory of a layout: parameters, gradients, optimizer state, activations and
communication buffers (the arithmetic; its assumptions are listed in docs/planning.md).

The traced step (:mod:`scaleloop.plan.trace`) gives, op by op, the activation bytes of one
sample and the share of the gradients alive. A rank's peak is its parameters and optimizer
state, plus the largest over the step of (its activations: the traced ones times its micro-batch,
cut by tensor and pipeline parallelism; plus its gradients alive then: all of them, or 1/F under
FSDP), plus its communication buffers; or, when larger, the moment after the backward (every
gradient, the optimizer's temporaries, DDP's buckets).

Each peak says when it is reached (:attr:`Memory.moment`), and its parts are the bytes alive at
that moment, so they add up to it: a part can be 0 there (no gradient yet when the backward
starts; no activation left at the optimizer step) and large in another layout's row whose peak
falls elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelProfile
from scaleloop.plan.trace import StepSeries

#: Optimizer state bytes per parameter: Adam's two fp32 moments, SGD's momentum.
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}
MASTER_BYTES = 4   # scaleloop keeps fp32 parameters (and fp32 gradients) in every precision
#: The layouts whose blocks are FSDP2 units (``--strategy fsdp`` and every ``--mesh`` without pp).
FSDP_FAMILIES = ("fsdp", "hsdp", "fsdp x tp")


def tp_activation_share(tp: int) -> float:
    """The share of a transformer block's activations one tensor-parallel rank keeps: of the
    34 bytes per token and hidden unit a block saves (16-bit; Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", table 2, no sequence parallelism),
    24 are split over the ``tp`` ranks and 10 (norms' inputs, the dropouts) are whole."""
    return (10 + 24 / tp) / 34


@dataclass(frozen=True)
class Memory:
    """One rank's bytes at its peak, by kind; ``host``: what it keeps in host memory instead."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0
    #: When the peak is reached: "forward", "backward start" (no gradient yet), "backward N%"
    #: (N% of the gradients made), "backward end", "pieces in flight" (a 1F1B stage) or
    #: "optimizer step" (activations freed; buffers: the optimizer's temporaries, DDP's buckets).
    moment: str = "backward start"

    @property
    def peak(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers


@dataclass(frozen=True)
class Options:
    """What a run adds to the layout: batch, precision, optimizer, how its optimizer steps."""

    batch_size: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    accumulate: int = 1
    foreach_optimizer: bool = True

    @property
    def param_bytes(self) -> int:
        """Bytes of a parameter as the forward uses it (FSDP's gathered units)."""
        return 2 if self.precision in ("bf16", "fp16") else MASTER_BYTES


def micro_batch(layout: Layout, options: Options) -> float:
    """Samples one rank runs through forward and backward at once (a pipeline piece's for pp)."""
    per_rank = options.batch_size / (layout.data_ranks * options.accumulate)
    return per_rank / layout.microbatches


def _peak_over(series: StepSeries, act_scale: float, grad_bytes: float) -> tuple[float, float, str]:
    """The largest ``other * act_scale + grads_share * grad_bytes`` over the step, its split,
    and when in the step it is (:func:`moment`)."""
    end = series.grads[-1] or 1
    best, split, at = -1.0, (0.0, 0.0), 0
    for index, (other, grads) in enumerate(zip(series.other, series.grads)):
        act, grad = other * act_scale, grads / end * grad_bytes
        if act + grad > best:
            best, split, at = act + grad, (act, grad), index
    return split[0], split[1], moment(series, at)


def moment(series: StepSeries, index: int) -> str:
    """When op ``index`` of the traced step runs, in the table's words (:attr:`Memory.moment`)."""
    if index < series.forward_ops:
        return "forward"
    made = series.grads[index] / (series.grads[-1] or 1)
    if made <= 0:
        return "backward start"
    if made >= 1:
        return "backward end"
    return f"backward {int(made * 100)}%"   # rounded down: "100%" only when all are made


def stage_parameters(profile: ModelProfile, stages: int) -> list[tuple[int, int]]:
    """Each pipeline stage's (parameters, blocks), cut as the pipeline strategy cuts them."""
    from scaleloop.strategies.pipeline import cut_stages

    assignment = cut_stages(list(profile.layers), stages)
    blocks = profile.block_layers if any(profile.block_layers) else (True,) * len(profile.layers)
    return [(count, sum(blocks[i] for i in span)) for count, span in zip(assignment.parameters, assignment.layers)]


def _rank_parameters(profile: ModelProfile, layout: Layout) -> float:
    """Parameter elements on one rank before FSDP's sharding (tensor-parallel layers cut)."""
    return profile.parameters - profile.tp_parameters * (1 - 1 / layout.tp)


def estimate(profile: ModelProfile, layout: Layout, options: Options) -> Memory:
    """The peak memory of the busiest rank of ``layout`` (see the module docstring)."""
    if layout.pp > 1:
        return max((_pipeline_stage(profile, layout, options, s) for s in range(layout.pp)), key=lambda m: m.peak)
    series, act_scale = _activations(profile, layout, options)
    params = _rank_parameters(profile, layout)
    shards = layout.fsdp
    opt_bytes = OPTIMIZER_BYTES.get(options.optimizer, 8)
    static = params * MASTER_BYTES / shards
    optimizer = params * opt_bytes / shards
    grads_all = params * MASTER_BYTES / shards
    act, grad, when = _peak_over(series, act_scale, grads_all)
    block = max(profile.block_parameters, default=0) / layout.tp
    buckets = 0.0
    if layout.family in FSDP_FAMILIES:   # FSDP2 units (a mesh wraps them even when its fsdp size is 1)
        # Gathered: the root unit all step, the current unit and the next (prefetched); the
        # current unit's unsharded gradient before its reduce-scatter. (Two more with checkpointing
        # and one activation for tensor parallelism's sums were once added here, fitted to CPU
        # peaks that missed the frees made in Gloo's threads: tools/plan_validate/measure.py. Measured right,
        # neither is there.)
        buffers = (profile.root_parameters * options.param_bytes + 2 * block * options.param_bytes
                   + block * MASTER_BYTES)
    else:
        # DDP's gradient buckets: a second copy of the gradients, allocated when DDP wraps the
        # model and kept to the end, the optimizer step included.
        buckets = buffers = grads_all if layout.dp > 1 else 0.0
        if options.param_bytes < MASTER_BYTES:
            act += params * options.param_bytes                  # autocast's low-precision copies, saved for backward
    temporaries = _optimizer_temporaries(params / shards, block, options)
    host = 0.0
    if layout.offload:   # the states, the gradients and the optimizer's step are on the host
        host, static, optimizer, grads_all = static + optimizer + grads_all, 0.0, 0.0, 0.0
        grad, temporaries = 0.0, 0.0
    # After the backward the activations and FSDP's gathered units are freed; every gradient is
    # there, and the optimizer's temporaries come on top of DDP's buckets.
    after = grads_all + buckets + temporaries
    if after > act + grad + buffers:
        return Memory(static, grads_all, optimizer, 0.0, buckets + temporaries, host, "optimizer step")
    return Memory(static, grad, optimizer, act, buffers, host, when)


def _activations(profile: ModelProfile, layout: Layout, options: Options) -> tuple[StepSeries, float]:
    """The traced step one rank runs, and what to multiply it by: its micro-batch. Under tensor
    parallelism the step traced on one rank's slices, where the model's split can be cut so
    (``ModelProfile.rank_series``); else the whole model's, times Megatron's share."""
    checkpointed = layout.checkpointing and profile.series_checkpointed is not None
    samples = micro_batch(layout, options)
    if layout.tp > 1:
        local = profile.rank_series(layout.tp, checkpointed)
        if local is not None:
            return local, samples
        samples *= tp_activation_share(layout.tp)
    return (profile.series_checkpointed if checkpointed else profile.series), samples  # type: ignore[return-value]


def _optimizer_temporaries(rank_params: float, block: float, options: Options) -> float:
    """What the optimizer step allocates for itself: one fp32 list the size of this rank's
    parameters when it steps by lists (foreach, CUDA's default), else about two of the largest."""
    return rank_params * MASTER_BYTES if options.foreach_optimizer else 2 * block * MASTER_BYTES


def _pipeline_stage(profile: ModelProfile, layout: Layout, options: Options, stage: int) -> Memory:
    """Stage ``stage`` of a 1F1B pipeline: its layers' parameters, the activations of as many
    pieces as are in flight on it (``pp - stage``, at most the pieces), its receive buffers."""
    stages = stage_parameters(profile, layout.pp)
    params, blocks = stages[stage]
    # The stage's share of the activations: its blocks' (embeddings and the head keep little).
    share = blocks / max(1, sum(profile.block_layers) or len(profile.layers))
    in_flight = min(layout.microbatches, layout.pp - stage)
    opt_bytes = OPTIMIZER_BYTES.get(options.optimizer, 8)
    grads_all = params * MASTER_BYTES
    act, grad, when = _peak_over(profile.series, micro_batch(layout, options) * share * in_flight, grads_all)
    if layout.microbatches > 1:
        # After the first piece's backward the stage's gradients are all there, while the
        # pieces still in flight keep their activations.
        act, grad = max(profile.series.other) * micro_batch(layout, options) * share * in_flight, grads_all
        when = "pieces in flight"
    if options.param_bytes < MASTER_BYTES:
        act += params * options.param_bytes
    # torch.distributed.pipelining allocates, before the step, a receive buffer for every piece:
    # its input (all stages but the first) and its output's gradient (all but the last).
    directions = (stage > 0) + (stage < layout.pp - 1)
    recv = directions * layout.microbatches * micro_batch(layout, options) * profile.spec.seq_len * \
        (profile.hidden or 0) * profile.dtype_bytes
    # After the backward: the gradients, flattened into one buffer for the all-reduce over replicas.
    after = grads_all + (grads_all if layout.dp > 1 else 0.0) + _optimizer_temporaries(params, 0, options)
    if after > act + grad + recv:
        return Memory(params * MASTER_BYTES, grads_all, params * opt_bytes, 0.0, after - grads_all + recv,
                      moment="optimizer step")
    return Memory(params * MASTER_BYTES, grad, params * opt_bytes, act, recv, moment=when)


def breakdown(memory: Memory) -> Sequence[tuple[str, float]]:
    """The parts of the peak, named, in the report's order."""
    return (("parameters", memory.parameters), ("gradients", memory.gradients), ("optimizer", memory.optimizer),
            ("activations", memory.activations), ("buffers", memory.buffers))
