"""Pipeline model parallelism: the model's layers cut into stages, one stage per process (or
several: the interleaved schedule).

The stages run with ``torch.distributed.pipelining`` (``PipelineStage`` and its GPipe, 1F1B and
interleaved 1F1B schedules); this module decides the cut (``as_sequential()``, an
``nn.Sequential``'s children or a transformers causal LM's blocks: ``hf_stages``; balanced by
parameters), weights each piece's loss so that a step equals one on the whole batch, sums tied
weights' gradients, shares fp16's overflow check between stages and makes checkpoints
whole-model ones. The rules and what is not offered: docs/strategies.md, "--strategy pipeline".
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.checkpoint.background import ShardedSave
from scaleloop.strategies.pipeline_schedules import check_pipeline_schedule, pipeline_pieces
from scaleloop.data.loader import Batch
from scaleloop.data.sampler import split_sizes
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.errors import UsageError
from scaleloop.strategies import distcp
from scaleloop.strategies.parallelize import Parallelism, default_parallelism, order_line
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.base import EvalShard, OptimizerLike, ProcessGroupStrategy
from scaleloop.strategies.unused import used_anywhere

if TYPE_CHECKING:
    from scaleloop.strategies.registry import ParallelSettings

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The model as a flat list of layers run one after another, each taking and returning one
    tensor: its ``as_sequential()``, an ``nn.Sequential``'s children, or a transformers causal
    LM cut at its decoder blocks (``hf_stages``); else UsageError."""
    flat = getattr(model, "as_sequential", None)
    if callable(flat):
        seq = flat()
        if not isinstance(seq, nn.Sequential):
            raise UsageError(f"{type(model).__name__}.as_sequential() must return an nn.Sequential, "
                             f"got {type(seq).__name__}")
        return list(seq)
    if isinstance(model, nn.Sequential):
        return list(model)
    from scaleloop.strategies import hf_stages

    if hf_stages.is_transformers(model):
        return hf_stages.decoder_layers(model)   # cut at its decoder blocks, or refused in one line
    raise UsageError(f"--strategy pipeline cannot cut {type(model).__name__} into stages: make the model an "
                     "nn.Sequential or give it an as_sequential() method returning one with the same "
                     "computation; or use --strategy ddp or fsdp")


def _label(layer: nn.Module) -> str:
    """How the stage lines name a layer: the name its maker gave it (``hf_stages``: ``embed_tokens``,
    ``LlamaDecoderLayer``), else its class."""
    label = getattr(layer, "pipeline_label", None)
    return label if isinstance(label, str) else type(layer).__name__


def _runs(names: tuple[str, ...]) -> list[str]:
    """``names`` with each run of one name said once: ``embed_tokens, 2 x LlamaDecoderLayer``."""
    out: list[tuple[str, int]] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
    return [name if n == 1 else f"{n} x {name}" for name, n in out]


@dataclass(frozen=True)
class StageAssignment:
    """Which layers each stage runs, and how many parameter elements it holds."""

    layers: tuple[range, ...]
    parameters: tuple[int, ...]
    names: tuple[tuple[str, ...], ...]
    #: each stage's blocks, where the layers say which are (``hf_stages``' decoder layers); else ()
    blocks: tuple[int, ...] = ()
    block_name: str = ""   # what those blocks are: ``LlamaDecoderLayer``

    def describe(self) -> list[str]:
        lines = []
        for i, (span, count, names) in enumerate(zip(self.layers, self.parameters, self.names)):
            runs = _runs(names)
            shown = ", ".join(runs) if len(runs) <= 6 else ", ".join(runs[:5]) + f", ... {runs[-1]}"
            lines.append(f"  stage {i}: layers {span.start}-{span.stop - 1} ({shown}), {count:,} parameters")
        return lines


def _own_parameter_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def cut_stages(layers: list[nn.Module], n_stages: int, model_name: str = "the model",
               per_rank: int = 1) -> StageAssignment:
    """Cut ``layers`` into ``n_stages`` contiguous stages, each with parameters, balancing them
    (``per_rank``: stages per process, for the error's advice)."""
    counts = [_own_parameter_count(layer) for layer in layers]
    # Units: a layer with parameters plus the parameter-free layers after it (the first unit
    # also takes any parameter-free layers before it).
    starts = [i for i, c in enumerate(counts) if c > 0]
    if len(starts) < n_stages:
        fewer = ("fewer --stages-per-rank (or --pipeline-schedule 1f1b)" if per_rank > 1
                 else f"--nproc {max(len(starts), 2)} or fewer")
        raise UsageError(f"{model_name} has {len(starts)} layer(s) with parameters, so it cannot be cut into "
                         f"{n_stages} pipeline stages{f' ({per_rank} per process)' if per_rank > 1 else ''}: use "
                         f"{fewer}, a deeper model, or --strategy ddp/fsdp")
    bounds = [0] + starts[1:] + [len(layers)]
    unit_cost = [sum(counts[bounds[u]:bounds[u + 1]]) for u in range(len(starts))]
    cuts = _balanced_cuts(unit_cost, n_stages)
    spans = tuple(range(bounds[a], bounds[b]) for a, b in zip(cuts[:-1], cuts[1:]))
    is_block = [is_pipeline_block(layer) for layer in layers]
    block_names = dict.fromkeys(_label(layer) for layer, block in zip(layers, is_block) if block)
    return StageAssignment(layers=spans,
                           parameters=tuple(sum(counts[i] for i in span) for span in spans),
                           names=tuple(tuple(_label(layers[i]) for i in span) for span in spans),
                           blocks=tuple(sum(is_block[i] for i in span) for span in spans) if block_names else (),
                           block_name=" or ".join(block_names))


def is_pipeline_block(layer: nn.Module) -> bool:
    """Whether a pipeline layer is a block the pipeline counts as one: a stage wrapper around a
    transformers decoder layer (``strategies.hf_stages``) says so with ``pipeline_block = True``."""
    return getattr(layer, "pipeline_block", False) is True


def _balanced_cuts(costs: list[int], parts: int) -> list[int]:
    """Unit boundaries ``[0, ..., len(costs)]`` cutting ``costs`` into ``parts`` non-empty runs
    whose largest sum is as small as possible (dynamic programming; few units)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible largest run when the first i units form k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


@contextlib.contextmanager
def _without_side_effects(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Run a forward whose buffer updates and random draws are undone afterwards."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        # Through .data: the probe's graph may be walked backward later (for gradient shapes),
        # and must not find its saved buffers modified in place.
        for buffer, saved in buffers:
            buffer.data.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


class StageChunk(nn.Module):
    """One stage: a run of the model's layers, under the run's autocast."""

    def __init__(self, layers: list[nn.Module], precision: Precision) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self._precision = precision
        self._probe_next = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._probe_next:
            # torch's PipelineStage first runs a forward of its own to learn the activations'
            # shapes (on empty tensors after stage 0). It must not move BatchNorm statistics
            # or draw dropout masks from the RNG, which would make training depend on it.
            self._probe_next = False
            with _without_side_effects(self, x.device):
                return self._run(x)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        with self._precision.autocast():
            return self.layers(x)


class StageModule(nn.Module):
    """This rank's stages (one, or several with the interleaved schedule), in ``chunks``.

    It remembers the whole model's names of its tensors, so that checkpoints and the exported
    model use the whole model's ``state_dict`` keys and optimizer numbering. Its stages are not
    consecutive layers of the model in general, so it has no ``forward`` of its own.
    """

    def __init__(self, chunks: list[list[nn.Module]], precision: Precision) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(StageChunk(layers, precision) for layers in chunks)
        #: local state_dict key -> the whole model's key(s) for the same tensor
        self.global_keys: dict[str, list[str]] = {}
        #: the whole model's state_dict keys and shapes, in its order
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        #: id(parameter) -> its index in the whole model's ``parameters()``
        self.param_index: dict[int, int] = {}
        self.n_model_params = 0
        #: the whole model's parameter names, in ``parameters()`` order (a tied one by its first name)
        self.param_names: list[str] = []

    def probe_next_forward(self) -> None:
        """Treat each stage's next forward as the schedule's shape inference (``StageChunk.forward``)."""
        for chunk in self.chunks:
            chunk._probe_next = True

    def global_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under the whole model's keys (on the CPU)."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in self.state_dict().items():
            for name in self.global_keys.get(key, ()):
                out[name] = tensor.detach().cpu()
        return out


class PipelineParallel(ProcessGroupStrategy):
    """A pipeline over all ranks: rank r runs stage r (see the module docstring); with the
    interleaved schedule and V stages per rank, stages r, r+N, ..., r+(V-1)N of N*V.

    With ``replicas`` R > 1 (``--mesh pp=S,dp=R``: pipeline x data parallel) there are S
    pipeline positions, each held by R ranks: rank ``p*R + d`` is position p of replica d (the
    mesh's row-major layout). Each replica is a whole pipeline on its share of the batch; after
    the step's last backward each stage's gradients are averaged over its R copies.

    A rank runs only its stages, so ``model(x)`` is not the model's output: a step goes through
    ``forward_backward`` (the step contract), and there are no hand-written-loop calls
    (``micro_step``, ``autocast``, ``backward``: ``HandWrittenLoop``'s).
    """

    name = "pipeline"
    batch_split = "seen whole by every stage"

    _mesh_dims = ("pp", "dp")

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings",
              parallelism: Parallelism) -> "PipelineParallel":
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism,
                   microbatches=settings.microbatches, schedule=settings.pipeline_schedule,
                   stages_per_rank=settings.stages_per_rank, sharded_checkpoints=settings.sharded_checkpoints)

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False, *, microbatches: int = 1, schedule: str = "gpipe",
                 stages_per_rank: int = 0, sharded_checkpoints: bool = False,
                 parallelism: Optional[Parallelism] = None) -> None:
        self.microbatches = microbatches
        #: Each stage writes its own part of a checkpoint (DCP) rather than sending it to rank 0.
        self.sharded_checkpoints = sharded_checkpoints
        self.schedule = schedule
        super().__init__(env, precision, accumulate, sync_batchnorm, parallelism=parallelism)
        self.stages_per_rank = check_pipeline_schedule(schedule, self.positions, microbatches, stages_per_rank)
        self._pp_group: Any = None   # this replica's pipeline ranks (None: all ranks)
        self._dp_group: Any = None   # the ranks holding this rank's stages (replicas > 1)
        if self.precision.scaler is not None:
            # fp16: one overflow check for the whole model. Each stage finds inf/NaN only in its
            # own gradients; ShardedGradScaler all-reduces that finding, so every stage skips
            # the same steps and keeps the same scale (one process's GradScaler, in pieces).
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.precision.scaler = ShardedGradScaler(self.env.device.type, process_group=None)
        #: Which layers each stage runs (the cut), once ``setup`` made it.
        self.stage_assignment: Optional[StageAssignment] = None
        self._module: Optional[StageModule] = None
        self._schedules: dict[tuple[str, int], Any] = {}
        self._piece_counts: dict[tuple[str, int], int] = {}
        self._tied: list[tuple[int, int, Optional[nn.Parameter]]] = []  # (global index, numel, local param)
        self._owned: set[int] = set()  # global indices whose gradient this rank counts in the norm
        self._loss_fn: Optional[LossFn] = None
        self._per_sample = 1.0
        self._piece_losses: list[torch.Tensor] = []
        self._noted_uneven: set[int] = set()
        self.notes: list[str] = []

    def _default_parallelism(self) -> Parallelism:
        return default_parallelism(self.env.world_size, self.env.rank, MeshSpec(pp=self.env.world_size))

    @property
    def replicas(self) -> int:
        """Copies of each stage (the mesh's ``dp``: pipeline x data parallel)."""
        return self.parallelism.spec.dp

    @property
    def positions(self) -> int:
        """Pipeline positions: processes per replica (the mesh's ``pp``)."""
        return self.parallelism.spec.pp

    @property
    def writes_sharded(self) -> bool:
        return self.sharded_checkpoints

    def _check(self) -> None:
        super()._check()
        spec = self.parallelism.spec
        if spec.fsdp > 1 or spec.tp > 1 or spec.world_size != self.env.world_size:
            raise UsageError(f"a pipeline lays its {self.env.world_size} ranks out as pp x dp, not as {spec}")
        if self.positions < 2:
            raise UsageError("--strategy pipeline puts the model's layers on several processes, one stage each: "
                             "run it with --nproc 2 (or more)")
        if self._sync_batchnorm:
            raise UsageError("--sync-batchnorm synchronises BatchNorm over data-parallel ranks; a pipeline has "
                             "none: drop it")
        if self.microbatches < 1:
            raise UsageError(f"--microbatches must be a positive integer, got {self.microbatches}")

    @property
    def stage(self) -> int:
        """This rank's position in its pipeline (its first stage)."""
        return self.env.rank // self.replicas

    @property
    def replica(self) -> int:
        """Which replica of the pipeline this rank belongs to (0 without data parallelism)."""
        return self.env.rank % self.replicas

    @property
    def is_first(self) -> bool:
        """This rank holds the first stage: it feeds the inputs."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage (of every schedule): it computes the loss."""
        return self.stage == self.positions - 1

    def _stage_indices(self) -> list[int]:
        """The stages this rank runs: p, p+N, ... (one per chunk)."""
        return [self.stage + k * self.positions for k in range(self.stages_per_rank)]

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        """With replicas: a process group per pipeline (the stages talk in it) and one per stage
        position (its copies average their gradients in it after each step), from the
        ``(pp, dp)`` device mesh. The model is cut into stages in the next step."""
        if self.replicas > 1 and self._pp_group is None:
            mesh = self.parallelism.device_mesh(self.env, self._mesh_dims)
            self._pp_group, self._dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        return model

    # --- set-up -------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Cut ``model`` into stages and keep this rank's (moved to its device) with its optimizer: the
        factory's, or the optimizer object's group keeping this rank's parameters (``Strategy.setup``)."""
        names = self._check_optimizer(model, optimizer)
        one_group = "--strategy pipeline supports optimizers with one parameter group"
        if isinstance(optimizer, torch.optim.Optimizer) and len(optimizer.param_groups) != 1:
            raise UsageError(one_group)   # (before the cut: nothing done yet)
        stage = self._parallelize(model)
        optimizer = self._optimizer_on(stage, optimizer, names)
        if len(optimizer.param_groups) != 1:
            raise UsageError(one_group)
        if self.precision.scaler is not None:
            # The scale is created by the first scale(), which only the last stage calls; every
            # stage's scaler needs its own before it can unscale its gradients.
            self.precision.scale(torch.zeros((), device=self.env.device))
        return stage, optimizer

    def _pipeline_split(self, model: nn.Module) -> StageModule:
        """This rank's stages of ``model`` (the other stages' layers are not kept)."""
        layers = pipeline_layers(model)
        n_ranks = self.positions
        self.stage_assignment = cut_stages(layers, n_ranks * self.stages_per_rank, type(model).__name__,
                                           self.stages_per_rank)
        names_of: dict[int, list[str]] = {}
        full_state = model.state_dict(keep_vars=True)
        for key, tensor in full_state.items():
            names_of.setdefault(id(tensor), []).append(key)
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        holders: dict[int, list[int]] = {}   # parameter -> the positions holding it, in stage order
        stages_of: dict[int, list[int]] = {}   # parameter -> the stages using it
        for s, span in enumerate(self.stage_assignment.layers):
            for i in span:
                for p in layers[i].parameters():
                    ranks = holders.setdefault(index[id(p)], [])
                    if s % n_ranks not in ranks:
                        ranks.append(s % n_ranks)
                    if s not in stages_of.setdefault(index[id(p)], []):
                        stages_of[index[id(p)]].append(s)

        chunks = [[layers[i] for i in self.stage_assignment.layers[s]] for s in self._stage_indices()]
        stage = StageModule(chunks, self.precision)
        for key, tensor in stage.state_dict(keep_vars=True).items():
            stage.global_keys[key] = names_of.get(id(tensor), [])
        stage.full_shapes = {key: tuple(t.shape) for key, t in full_state.items()}
        stage.param_index = {id(p): index[id(p)] for p in stage.parameters()}
        stage.n_model_params = len(params)
        stage.param_names = [names_of[id(p)][0] for p in params]
        local = {index[id(p)]: p for p in stage.parameters()}
        # A parameter used by two stages of one rank gets both gradients in its own .grad; only
        # ranks that hold separate copies need to add theirs up.
        self._tied = [(g, params[g].numel(), local.get(g)) for g, ranks in sorted(holders.items()) if len(ranks) > 1]
        self._owned = {g for g, ranks in holders.items() if ranks[0] == self.stage}
        for g, ranks in sorted(holders.items()):
            if len(ranks) > 1:
                self.notes.append(f"  tied: {' = '.join(names_of.get(id(params[g]), ['?']))} is held by stages "
                                  f"{', '.join(map(str, stages_of[g]))}; their gradients are summed every step")
        if self.microbatches > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                         for layer in layers for m in layer.modules()):
            self.notes.append(f"note: BatchNorm normalises each of the {self.microbatches} pipeline micro-batches "
                              "on its own, so results differ from one process; --microbatches 1 keeps "
                              "whole-batch statistics")
        self._module = stage.to(self.env.device)
        return self._module

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    _holds_part = True   # this rank's stages: an optimizer object keeps only their parameters

    def _made_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The stage's parameters by the whole model's names (``StageModule.global_keys``; a tied
        parameter by each of its names)."""
        assert isinstance(model, StageModule)
        return {name: param for local, param in model.named_parameters(remove_duplicate=False)
                for name in model.global_keys.get(local, ())}

    def _loads(self) -> tuple[bool, bool]:
        """Only the first stage loads the inputs and only the last the targets."""
        return self.is_first, self.is_last

    def describe(self) -> str:
        name = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}[self.schedule]
        stages = self.positions * self.stages_per_rank
        per_rank = f", {self.stages_per_rank} per process" if self.stages_per_rank > 1 else ""
        replicas = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"pipeline ({stages} stages{self._blocks_per_stage()}{per_rank}{replicas}, "
                f"{self.microbatches} micro-batch(es), {name})")

    def _blocks_per_stage(self) -> str:
        """`` of 2 + 2 LlamaDecoderLayer`` where the cut knows the model's blocks (``hf_stages``), else ''."""
        cut = self.stage_assignment
        if cut is None or not cut.blocks:
            return ""
        return f" of {' + '.join(map(str, cut.blocks))} {cut.block_name}"

    def details(self) -> list[str]:
        lines = self.stage_assignment.describe() if self.stage_assignment is not None else []
        if self.stage_assignment is not None and self.stages_per_rank > 1:
            n = self.positions
            lines += [f"  position {p}: stages {', '.join(str(p + k * n) for k in range(self.stages_per_rank))}"
                      for p in range(n)]
        if self.replicas > 1:
            lines += ["  " + line for line in self.layout.draw()]
            lines.append(f"  each stage's {self.replicas} copies average their gradients after the step's last backward")
        return lines + order_line(self.parallelism) + self.notes

    # --- the schedule -------------------------------------------------------------------
    def _pieces(self, n: int, say: bool = True) -> tuple[int, str]:
        """Equal pieces for a batch of ``n`` and the schedule that runs them (``pipeline_pieces``)."""
        m, schedule = pipeline_pieces(n, self.microbatches, self.schedule, self.positions)
        if say and (m, schedule) != (self.microbatches, self.schedule) and n not in self._noted_uneven:
            self._noted_uneven.add(n)
            if self.env.is_main:
                also = ", with the GPipe schedule (1F1B needs a piece per stage)" if schedule != self.schedule else ""
                print(f"note: a batch of {n} samples does not split into {self.microbatches} equal pipeline "
                      f"micro-batches; it runs as {m} of {n // m}{also}")
        return m, schedule

    def _schedule(self, mode: str, n: int) -> Any:
        """The stages and schedule for batches of ``n`` samples (one per size: the stages'
        receive buffers have fixed shapes)."""
        key = (mode, n)
        if key not in self._schedules:
            from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                      ScheduleInterleaved1F1B)

            assert self._module is not None, "setup() first"
            pieces, schedule = self._pieces(n, say=mode == "train")
            self._piece_counts[key] = pieces
            total = self.positions * self.stages_per_rank
            stages = [PipelineStage(chunk, index, total, self.env.device, group=self._pp_group)
                      for chunk, index in zip(self._module.chunks, self._stage_indices())]
            self._module.probe_next_forward()
            loss = self._piece_loss if mode == "train" else None
            if schedule == "interleaved":
                self._schedules[key] = ScheduleInterleaved1F1B(stages, pieces, loss_fn=loss, scale_grads=False)
            else:
                single = Schedule1F1B if schedule == "1f1b" and mode == "train" else ScheduleGPipe
                self._schedules[key] = single(stages[0], pieces, loss_fn=loss, scale_grads=False)
        return self._schedules[key]

    def _piece_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The piece's mean loss weighted by its share of the step: summed over the pieces and
        # micro-steps, exactly the step's mean loss. fp16 scales what backward starts from.
        assert self._loss_fn is not None
        weighted = self._loss_fn(output, target) * (target.shape[0] * self._per_sample)
        self._piece_losses.append(weighted.detach().float())
        return self.precision.scale(weighted)

    pipelined = True   # a micro-batch's forward and backward are one call of the schedule

    def forward_backward(self, model: nn.Module, batch: Batch, loss_fn: LossFn) -> Optional[torch.Tensor]:
        x, y = batch
        _check_one_tensor(x, y)
        schedule = self._schedule("train", len(batch))
        self._loss_fn = loss_fn
        self._per_sample = batch.loss_scale / len(batch)
        self._piece_losses = []
        if self.is_first:
            schedule.step(x, return_outputs=False)
        elif self.is_last:
            schedule.step(target=y, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        if batch.last_micro:
            self._sum_tied_gradients()
            self._average_over_replicas()
        if not self.is_last:
            return None
        # The pieces' weighted losses add up to the micro-batch's share of the step's loss. (The
        # last ones: on its first step a schedule also calls the loss in its shape inference.)
        pieces = self._piece_counts[("train", len(batch))]
        return torch.stack(self._piece_losses[-pieces:]).sum() / batch.loss_scale

    def _sum_tied_gradients(self) -> None:
        """Add up the gradients of parameters that several stages hold (each has part of it)."""
        if not self._tied:
            return
        device = self.env.device
        # Only those some stage gave a gradient: one that none did has none in one process either.
        local = [p is not None and p.grad is not None for _, _, p in self._tied]
        tied = [t for t, used in zip(self._tied, used_anywhere(local, device, group=self._pp_group)) if used]
        if not tied:
            return
        flat = torch.cat([
            (p.grad.detach().flatten().float() if p is not None and p.grad is not None
             else torch.zeros(numel, device=device))
            for _, numel, p in tied])
        torch_dist.all_reduce(flat, group=self._pp_group)
        offset = 0
        for _, numel, p in tied:
            if p is not None:
                total = flat[offset:offset + numel].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
            offset += numel

    def _average_over_replicas(self) -> None:
        """Each stage's gradients, averaged over its copies in the other replicas (one bucket).

        Each replica weighted its loss by its share of the global step times the replicas (as
        every data-parallel rank does), so the mean over replicas is the whole step's gradient."""
        if self.replicas == 1:
            return
        assert self._module is not None
        params = [p for p in self._module.parameters() if p.requires_grad]
        # A parameter no replica used keeps no gradient, as in one process (strategies.unused);
        # a replica that did not use one that others did adds zeros.
        used = used_anywhere([p.grad is not None for p in params], self.env.device, group=self._dp_group)
        params = [p for p, anywhere in zip(params, used) if anywhere]
        if not params:
            return
        flat = torch.cat([(p.grad.detach().flatten().float() if p.grad is not None
                           else torch.zeros(p.numel(), device=self.env.device)) for p in params])
        torch_dist.all_reduce(flat, group=self._dp_group)
        flat /= self.replicas
        offset = 0
        for p in params:
            mean = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = mean.clone()
            else:
                p.grad.copy_(mean)
            offset += p.numel()

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The norm over ALL stages' gradients (a tied parameter counted once: by the stage that owns it)."""
        assert self._module is not None
        grads = [p.grad for p in self._module.parameters()
                 if p.grad is not None and self._module.param_index[id(p)] in self._owned]
        local = (torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).pow(2).sum()
                 if grads else torch.zeros((), device=self.env.device))
        torch_dist.all_reduce(local, group=self._pp_group)   # the replicas hold equal gradients by now
        return local.sqrt()

    # --- evaluation ---------------------------------------------------------------------
    def eval_shard(self, n: int, batch_size: int) -> EvalShard:
        """Every stage of a replica walks the replica's share of the set (all of it without replicas)."""
        if self.replicas == 1:
            return EvalShard(range(0, n))
        sizes = split_sizes(n, self.replicas)
        start = sum(sizes[:self.replica])
        return EvalShard(range(start, start + sizes[self.replica]))

    def eval_forward(self, model: nn.Module, x: Any) -> Optional[torch.Tensor]:
        _check_one_tensor(x, None)
        schedule = self._schedule("eval", len(x))
        out = schedule.step(x) if self.is_first else schedule.step()
        return out if self.is_last else None

    # --- checkpoints and the exported model ---------------------------------------------
    def _expected_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        assert self._module is not None
        return {key: torch.empty(shape, device="meta") for key, shape in self._module.full_shapes.items()}

    def _gather_to_main(self, obj: Any) -> Optional[list[Any]]:
        out: Optional[list[Any]] = [None] * self.env.world_size if self.env.is_main else None
        torch_dist.gather_object(obj, out, dst=0)
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's ``state_dict`` on rank 0 (gathered from the stages); {} elsewhere."""
        assert self._module is not None
        parts = self._gather_to_main(self._module.global_state())
        if parts is None:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for key, tensor in part.items():
                merged.setdefault(key, tensor)
        missing = [k for k in self._module.full_shapes if k not in merged]
        if missing:
            raise RuntimeError(f"pipeline stages hold no tensor for {', '.join(missing[:4])}")
        return {key: merged[key] for key in self._module.full_shapes}

    def _optimizer_part(self, optimizer: torch.optim.Optimizer) -> tuple[dict[int, Any], dict[str, Any]]:
        assert self._module is not None
        state = optimizer.state_dict()
        local_to_global = {i: self._module.param_index[id(p)]
                           for i, p in enumerate(optimizer.param_groups[0]["params"])}
        moved = {local_to_global[i]: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                                      for k, v in s.items()}
                 for i, s in state["state"].items()}
        group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        return moved, group

    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Optional[Path],
                        background: Optional[ShardedSave] = None) -> Optional[dict[str, Any]]:
        """The whole model's weights and optimizer state, as one process would save them: the
        stages send their parts to rank 0 (every rank calls it); with ``sharded_checkpoints``
        each stage writes its own part under the whole model's names (DCP; with ``background``, in
        DCP's thread)."""
        assert self._module is not None
        if self.sharded_checkpoints:
            return self._save_sharded(optimizer, directory, background)
        weights = self.full_state_dict(model)
        parts = self._gather_to_main(self._optimizer_part(optimizer))
        if parts is None or directory is None:
            return None
        # A tied parameter's state exists on each stage holding it, identical: keep the first.
        merged: dict[int, Any] = {}
        for state, _ in parts:
            for g, s in state.items():
                merged.setdefault(g, s)
        group = parts[0][1]
        n = self._module.n_model_params
        return {"model": weights,
                "optimizer": {"state": dict(sorted(merged.items())),
                              "param_groups": [{**group, "params": list(range(n))}]}}

    def _load_whole(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Take this stage's part of a whole-model checkpoint (written by any strategy)."""
        assert self._module is not None
        saved = state["model"]
        with torch.no_grad():
            for key, tensor in self._module.state_dict().items():
                names = self._module.global_keys.get(key)
                if names:
                    tensor.copy_(saved[names[0]])
        full = state["optimizer"]
        if len(full["param_groups"]) != 1:
            raise ValueError("the checkpoint's optimizer has several parameter groups; the pipeline supports one")
        saved_ids = full["param_groups"][0]["params"]
        params = optimizer.param_groups[0]["params"]
        local_state = {}
        for i, p in enumerate(params):
            saved_id = saved_ids[self._module.param_index[id(p)]]
            if saved_id in full["state"]:
                local_state[i] = full["state"][saved_id]
        group = {k: v for k, v in full["param_groups"][0].items() if k != "params"}
        optimizer.load_state_dict({"state": local_state, "param_groups": [{**group, "params": list(range(len(params)))}]})

    def _save_sharded(self, optimizer: torch.optim.Optimizer, directory: Optional[Path],
                      background: Optional[ShardedSave] = None) -> Optional[dict[str, Any]]:
        """Every stage writes its tensors into rank 0's ``directory`` (torch.distributed.checkpoint),
        named as one process names them, so any strategy and world size can read them back."""
        from scaleloop.checkpoint.store import CheckpointError
        from scaleloop.runtime.collectives import broadcast_object

        shared = broadcast_object(str(directory) if directory is not None else None, self.env)
        if shared is None:
            return None
        if background is not None:   # written in DCP's thread; rank 0 checks the shards once they are
            distcp.save_named(self._module, optimizer, Path(shared), self._module.global_keys,
                              self._module.param_names, background, coordinator=directory is not None)
            return {"sharded": distcp.SHARDED_FORMAT} if directory is not None else None
        distcp.save_named(self._module, optimizer, Path(shared), self._module.global_keys, self._module.param_names)
        error = broadcast_object(distcp.missing_shards(Path(shared)) if directory is not None else None, self.env)
        if error is not None:
            raise CheckpointError(error)
        return {"sharded": distcp.SHARDED_FORMAT} if directory is not None else None

    def _load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Each stage reads its own tensors from a sharded checkpoint (this strategy's own, or fsdp's
        or --mesh's: both use the whole model's names)."""
        assert self._module is not None
        distcp.load_named(self._module, optimizer, directory, self._module.global_keys, self._module.param_names)


__all__ = ["PipelineParallel", "StageModule", "StageAssignment", "pipeline_layers", "cut_stages"]


def _check_one_tensor(x: Any, y: Any) -> None:
    """The pipeline passes one tensor between stages and gives the last stage one target. (A stage
    that does not load a tensor input or target gets None in its place; anything else reaches
    every stage, so that all of them stop with the same line.)"""
    if not (x is None or isinstance(x, torch.Tensor)) or not (y is None or isinstance(y, torch.Tensor)):
        from scaleloop.data.batch import describe

        raise UsageError(f"--strategy pipeline needs batches of one input tensor and one target tensor, got inputs "
                         f"{describe(x)}{'' if y is None else ' and target ' + describe(y)}; "
                         "use ddp or fsdp for models with several or named inputs")
