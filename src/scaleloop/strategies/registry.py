"""Every strategy, registered once: its name, its class, how many processes it runs and what the
CLI, ``scaleloop env`` and ``scaleloop bench`` need to know of it; and the config's parallel section:
the settings that lay the ranks out and each strategy's options, each declared once with its help
(``scaleloop.option``), and their rules. No torch here.

``ParallelSettings.check`` is the one place that refuses a combination that cannot run: the CLI
calls it through ``TrainConfig.validate`` before any worker starts, and ``build_strategy`` calls
it (``check_layout``) for library users. Adding a strategy means its module and one
:class:`Registered` entry below: every list of strategies (``--strategy``'s choices, the option
checks' messages, ``scaleloop env``, ``scaleloop bench``) is read from :data:`REGISTRY` when used.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from scaleloop.data.batching import check_batch_split
from scaleloop.errors import UsageError
from scaleloop.option import flag, option, require
from scaleloop.strategies.pipeline_schedules import SCHEDULES, check_pipeline_schedule


@dataclass(frozen=True)
class Needs:
    """What a strategy needs of the machine and of torch, as ``scaleloop env`` checks and says it
    (torch is imported there, not here)."""

    cuda: bool = False             # one process drives every CUDA GPU: runs only where there is one
    caveat: str = ""               # (cuda) what to know where there are fewer than two GPUs
    apis: tuple[str, ...] = ()     # torch APIs that must import: "module" or "module:attribute"
    missing: str = ""              # why it cannot run where one of ``apis`` does not import


@dataclass(frozen=True)
class Registered:
    """A strategy as the CLI, the config's checks, ``scaleloop env`` and ``scaleloop bench`` know it,
    without importing its class (no torch)."""

    name: str
    cls: str                  # "module:Class", imported only when the strategy is built (torch)
    processes: str            # "one": a single process (it refuses a distributed job); "many": any number
    #: What it is built on, in a few words: ``scaleloop env`` and the messages that refuse it name it so.
    what: str = ""
    #: The options it implements beyond every strategy's, by their setting names; "elastic": it runs a
    #: job whose machines may change (``--nnodes MIN:MAX``); "sharded_checkpoints": its checkpoints are
    #: always sharded, so the flag changes nothing (a pipeline takes the flag by its layout).
    takes: frozenset[str] = frozenset()
    #: ``processes="one"``: the error for a job of several processes ({world}: how many).
    alone: str = ""
    needs: Needs = Needs()
    #: Picked by ``--mesh``, which lays the ranks out itself: its options are checked with that flag's,
    #: and the messages that list the strategies taking an option name ``--mesh`` instead.
    by_mesh: bool = False
    #: A row of ``scaleloop bench strategies``; one that runs ``processes="many"`` is also one that
    #: ``bench scaling`` runs at every worker count.
    bench: bool = False
    #: For ``scaleloop bench``: the strategy's ``sync_gradients`` is where the gradients are all-reduced
    #: (by hand: ``allreduce``), so timing that call times the step's communication.
    reduces_in_sync_gradients: bool = False
    #: For ``scaleloop bench``: what each rank sends per step, counted in all-reduces of its gradients,
    #: and its collectives per unit, counted in all-reduces (FSDP: 1.5); None where its communication
    #: is the all-reduces that bench times, or is not modelled (``--mesh``: it depends on the mesh).
    allreduce_equivalents: Optional[float] = None

    def one_process_error(self, world_size: int) -> str:
        """Why a job of ``world_size`` processes cannot run this one-process strategy."""
        return (self.alone or "--strategy {name} runs one process, but --nproc x --nnodes = {world}; drop "
                "--nproc/--nnodes").format(name=self.name, world=world_size)


# What the data-parallel strategies take (one process per device, each running the whole model).
_DATA_PARALLEL = frozenset({"compile", "activation_checkpointing", "elastic"})
REGISTRY: dict[str, Registered] = {r.name: r for r in (
    Registered("single", "scaleloop.strategies.single:SingleDevice", "one",
               takes=frozenset({"compile", "activation_checkpointing"}),
               alone="--strategy single runs one process, but --nproc x --nnodes = {world}; use --strategy ddp or "
                     "allreduce", bench=True),
    Registered("dp", "scaleloop.strategies.dataparallel:DataParallel", "one", what="nn.DataParallel",
               alone="--strategy dp (nn.DataParallel) runs ONE process that drives all GPUs; drop --nproc/--nnodes, "
                     "or use --strategy ddp for one process per GPU",
               needs=Needs(cuda=True, caveat="with one GPU it is a no-op wrapper"), bench=True),
    Registered("ddp", "scaleloop.strategies.ddp:DDP", "many",
               takes=_DATA_PARALLEL | {"find_unused_parameters", "static_graph"}, bench=True),
    Registered("allreduce", "scaleloop.strategies.allreduce:ManualAllReduce", "many", takes=_DATA_PARALLEL, bench=True,
               reduces_in_sync_gradients=True),
    Registered("fsdp", "scaleloop.strategies.fsdp:FSDP", "many", what="FSDP2 fully_shard",
               takes=_DATA_PARALLEL | {"cpu_offload", "sharded_checkpoints"},
               needs=Needs(apis=("torch.distributed.fsdp:fully_shard",),
                           missing="needs torch.distributed.fsdp.fully_shard (FSDP2), missing from this torch"),
               # An all-gather of each unit's parameters in forward and again in backward, and a reduce-scatter
               # of its gradients: 3 x (N-1)/N x S bytes per rank, 1.5 times an all-reduce's 2(N-1)/N x S, in
               # 3 collectives per unit.
               bench=True, allreduce_equivalents=1.5),
    Registered("pipeline", "scaleloop.strategies.pipeline:PipelineParallel", "many",
               what="torch.distributed.pipelining stages",
               needs=Needs(apis=("torch.distributed.pipelining",),
                           missing="needs torch.distributed.pipelining, missing from this torch")),
    Registered("mesh", "scaleloop.strategies.mesh_parallel:MeshParallel", "many", what="DeviceMesh, --mesh dp=2,tp=2",
               takes=frozenset({"compile", "activation_checkpointing", "cpu_offload", "find_unused_parameters",
                                "sharded_checkpoints"}),
               needs=Needs(apis=("torch.distributed.device_mesh:init_device_mesh",
                                 "torch.distributed.tensor.parallel:parallelize_module"),
                           missing="needs torch.distributed.device_mesh and torch.distributed.tensor, missing from "
                                   "this torch"),
               by_mesh=True),
)}


class _StrategyNames(Sequence[str]):
    """``auto`` and each registered name, read from :data:`REGISTRY` at every use rather than copied
    at import: a strategy registered later (a plugin, a test) is accepted and offered too."""

    def _names(self) -> tuple[str, ...]:
        return ("auto", *REGISTRY)

    def __getitem__(self, index: Any) -> Any:   # an int or a slice, as a tuple's
        return self._names()[index]

    def __len__(self) -> int:
        return len(REGISTRY) + 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


#: The names ``--strategy`` accepts: ``auto`` (DDP when there are several processes, else single) and each registered one.
STRATEGIES: Sequence[str] = _StrategyNames()
PRECISIONS = ("fp32", "bf16", "fp16")

_hardware = partial(option, group="hardware")


def resolve_strategy_name(name: str, distributed: bool) -> str:
    """``auto`` becomes DDP when the job has several processes, else single-device."""
    if name == "auto":
        return "ddp" if distributed else "single"
    return name


@dataclass(frozen=True)
class ParallelSettings:
    """The config's parallel section: how the ranks are laid out, and each strategy's options."""

    strategy: str = _hardware("auto", "how to use the hardware", STRATEGIES, common=True)
    mesh: Optional[str] = _hardware(None, "lay the ranks out on named dimensions, e.g. dp=2,tp=2: dp (replicated), "
                                    "fsdp or shard (sharded), tp (tensor parallel); their product is the world size; "
                                    "implies --strategy mesh (docs/strategies.md, '--mesh')")
    precision: str = _hardware("fp32", "numeric precision (bf16/fp16 use torch.amp autocast; fp16 adds a GradScaler)",
                               PRECISIONS, common=True)
    accumulate: int = option(1, "micro-batches accumulated into each optimizer step", group="training")
    activation_checkpointing: bool = _hardware(False, "keep only each block's input from the forward and recompute "
                                               "its activations in the backward: less memory, about one more "
                                               "forward of compute, the same results")
    cpu_offload: bool = _hardware(False, "fsdp and --mesh: keep the sharded parameters, gradients and optimizer "
                                  "state in host memory between uses (FSDP2's CPUOffloadPolicy; the optimizer steps "
                                  "on the CPU)")
    microbatches: int = _hardware(1, "--strategy pipeline: cut each micro-step's batch into this many pieces that "
                                  "flow through the stages one after another")
    pipeline_schedule: str = _hardware("gpipe", "--strategy pipeline: the order of the pieces' forwards and "
                                       "backwards: gpipe (all forwards, then all backwards), 1f1b (one forward, one "
                                       "backward: fewer activations held; needs --microbatches >= the stages) or "
                                       "interleaved (1F1B over several stages per process: a smaller bubble)",
                                       SCHEDULES)
    stages_per_rank: int = _hardware(0, "--pipeline-schedule interleaved: model stages per process (0: 2); process r "
                                     "holds stages r, r+N, r+2N, ...")
    sync_batchnorm: bool = _hardware(False, "compute BatchNorm statistics over the global batch (all ranks), as one "
                                     "process would")
    find_unused_parameters: bool = _hardware(False, "ddp and --mesh: allow modules that some ranks skip in a step, "
                                             "whose parameters get no gradient there (ddp: DDP searches the graph "
                                             "after every forward, which costs time; --mesh: the whole model is one "
                                             "FSDP unit, gathered at once)")
    static_graph: bool = _hardware(False, "ddp: the set of parameters used is the same every step (unused ones "
                                   "allowed; cheaper than --find-unused-parameters)")
    compile: bool = option(False, "torch.compile the model (inductor; on the CPU it needs a C++ compiler); the first "
                           "steps are slow while it compiles, and rounding may differ slightly from eager",
                           group="speed")
    sharded_checkpoints: bool = option(False, "pipelines (--strategy pipeline, --mesh pp=N): every stage writes its "
                                       "own part of each checkpoint (torch.distributed.checkpoint) instead of sending "
                                       "it to rank 0, for a model too large to gather; fsdp and --mesh always do",
                                       group="checkpoints")

    def check(self, world_size: int, batch_size: int, elastic_nodes: Optional[str] = None) -> None:
        """Refuse, in one line naming the flags, a layout or option that cannot run on ``world_size``
        processes (``elastic_nodes``: ``MIN:MAX`` machines when the job's may change) with global
        batches of ``batch_size`` (the optimizer section's)."""
        data_ranks = self.check_layout(world_size, elastic_nodes)
        layout = self.pipeline_layout(world_size)
        if layout is not None:
            self._check_pipeline_batch(layout[1], batch_size)
        elif not elastic_nodes:
            check_batch_split(batch_size, data_ranks, self.accumulate)
        elif batch_size < world_size * self.accumulate:
            # Any world size MIN..MAX runs; an uneven split is weighted (strategies/base.py).
            raise UsageError(f"--batch-size {batch_size} gives some of the up to {world_size} workers x "
                             f"{self.accumulate} accumulation step(s) no sample; use at least "
                             f"{world_size * self.accumulate}")

    def check_replica_groups(self, groups: int) -> None:
        """``--replica-groups N``: torchft averages the gradients between the groups and commits a step
        only where every group's succeeded, so each group must be data parallel: ddp, or fsdp (HSDP,
        the groups its replicas: ``strategies.fault_tolerant``); fp16's scaler would skip steps that
        torchft has committed."""
        if groups == 1:
            return
        if self.mesh is not None or self.strategy not in ("auto", "ddp", "fsdp"):
            which = f"--mesh {self.mesh}" if self.mesh is not None else f"--strategy {self.strategy}"
            raise UsageError(f"--replica-groups {groups} runs ddp or fsdp inside each group (torchft averages "
                             f"between groups): {which} is not supported with it; use --strategy ddp or fsdp")
        if self.precision == "fp16":
            raise UsageError(f"--replica-groups {groups} does not take --precision fp16 (its gradient scaler skips "
                             "steps on its own): use bf16 or fp32")

    def check_layout(self, world_size: int, elastic_nodes: Optional[str] = None) -> int:
        """Everything but the batch size; returns the data-parallel ranks a step's batch is split over."""
        if self.strategy != "auto" and self.strategy not in REGISTRY:
            raise UsageError(f"--strategy {self.strategy!r} is not one of: {', '.join(STRATEGIES)}")
        require(self.accumulate >= 1, "accumulate", "a positive integer")
        require(self.microbatches >= 1, "microbatches", "a positive integer")
        data_ranks = self._check_mesh(world_size)
        concrete = resolve_strategy_name(self.strategy, world_size > 1)
        if concrete in REGISTRY and REGISTRY[concrete].processes == "one" and world_size > 1:
            raise UsageError(REGISTRY[concrete].one_process_error(world_size))
        self._check_options(world_size, elastic_nodes)
        require(self.stages_per_rank >= 0, "stages_per_rank", "zero (the default) or a positive integer")
        layout = self.pipeline_layout(world_size)
        if layout is not None:
            self._check_pipeline(world_size, *layout)
        elif self.microbatches > 1:
            raise UsageError(f"--microbatches {self.microbatches} applies to --strategy pipeline (or --mesh pp=N) "
                             "only; to split a step's batch with another strategy use --accumulate")
        elif self.pipeline_schedule != "gpipe" or self.stages_per_rank:
            which = "--stages-per-rank" if self.stages_per_rank else "--pipeline-schedule"
            raise UsageError(f"{which} applies to --strategy pipeline only: add --strategy pipeline, or drop it")
        return data_ranks

    def _check_options(self, world_size: int, elastic_nodes: Optional[str]) -> None:
        """Each option only with the strategies that take it (``Registered.takes``)."""
        if self.mesh is not None:
            self._check_mesh_options(world_size)
        else:
            for name in ("find_unused_parameters", "static_graph"):
                if getattr(self, name) and self._refuses(name):
                    raise UsageError(f"{flag(name)} is an option of DistributedDataParallel: use it with "
                                     f"{_either(_taking(name, '--strategy '))} (not {self.strategy})")
        # A pipeline (--strategy pipeline, --mesh pp=N) takes neither --compile nor recomputation.
        cut = self.pipeline_layout(world_size) is not None
        if self.compile and (cut or self._refuses("compile")):
            if cut:
                why = " (its stages are scheduled by torch.distributed.pipelining): drop --compile"
            else:
                what = REGISTRY[self.strategy].what
                why = (f" ({what})" if what else "") + ": use --strategy ddp"
            raise UsageError(f"--compile does not support {self._refused_by('compile')}{why}")
        if self.cpu_offload and not self._takes("cpu_offload") and self.mesh is None:
            raise UsageError(f"--cpu-offload moves FSDP's shards to host memory: use it with "
                             f"{_either([*_taking('cpu_offload', '--strategy '), '--mesh'])} "
                             f"(not --strategy {self.strategy})")
        if self.activation_checkpointing and (cut or self._refuses("activation_checkpointing")):
            raise UsageError(f"--activation-checkpointing is not offered with "
                             f"{self._refused_by('activation_checkpointing')}; use "
                             f"{_either([*_taking('activation_checkpointing'), '--mesh without pp'])}")
        if self.sharded_checkpoints and not cut and not self._takes("sharded_checkpoints"):
            raise UsageError(f"--sharded-checkpoints applies to pipelines "
                             f"({_either([*_taking('sharded_checkpoints'), '--mesh'], 'and')} always write sharded "
                             f"checkpoints); with --strategy {self.strategy} every rank holds the whole model: drop it")
        if elastic_nodes and (self.mesh is not None or self._refuses("elastic")):
            which = f"--mesh {self.mesh}" if self.mesh is not None else f"--strategy {self.strategy}"
            raise UsageError(f"--nnodes {elastic_nodes}: {which} needs a fixed number of processes; "
                             f"an elastic job runs {_either(_taking('elastic'))}")

    def _takes(self, name: str) -> bool:
        """Whether the strategy named takes the option ``name`` (``auto`` is none of them)."""
        entry = REGISTRY.get(self.strategy)
        return entry is not None and name in entry.takes

    def _refuses(self, name: str) -> bool:
        """Whether the strategy named refuses the option ``name``. ``auto`` is let through: it becomes
        ddp (which takes the options checked this way) or, in one process, single."""
        return self.strategy != "auto" and not self._takes(name)

    def _refused_by(self, name: str) -> str:
        """Who refuses the option ``name``: the strategy named, else the pipeline layout of ``--mesh``."""
        return f"--strategy {self.strategy}" if self._refuses(name) else "--mesh pp=N"

    def _check_mesh_options(self, world_size: int) -> None:
        """--find-unused-parameters makes a mesh's model one FSDP unit; --static-graph is DDP's alone."""
        if self.static_graph:
            raise UsageError(f"--static-graph is an option of DistributedDataParallel, which --mesh {self.mesh} does "
                             "not use: drop it (add --find-unused-parameters where a rank skips a module)")
        if self.find_unused_parameters and self.pipeline_layout(world_size) is not None:
            raise UsageError(f"--find-unused-parameters: --mesh {self.mesh} runs as a pipeline, whose stages train "
                             "parameters without a gradient with no flag: drop it")

    def _check_mesh(self, world_size: int) -> int:
        """The data-parallel ranks a step's batch is split over (all of them without --mesh)."""
        if self.mesh is None:
            if self.strategy == "mesh":
                raise UsageError("--strategy mesh needs the layout: add --mesh, e.g. --mesh dp=2,tp=2")
            return world_size
        if self.strategy not in ("auto", "mesh"):
            raise UsageError(f"--mesh lays out the ranks itself: drop --strategy {self.strategy} (or use --strategy mesh)")
        from scaleloop.runtime.mesh import MeshSpec

        spec = MeshSpec.parse(self.mesh).check(world_size)
        if spec.pp > 1 and (spec.fsdp > 1 or spec.tp > 1):
            raise UsageError(f"--mesh {spec}: pp composes with dp only (pipeline x data parallel); drop fsdp/tp, "
                             "or drop pp")
        return spec.data_parallel

    def pipeline_layout(self, world_size: int) -> Optional[tuple[int, int]]:
        """``(stage processes, replicas)`` when the run on ``world_size`` processes is a pipeline
        (``--strategy pipeline``: every rank a stage; ``--mesh pp=S,dp=R``: S stages, each replicated
        R times), else None."""
        if self.strategy == "pipeline":
            return world_size, 1
        if self.mesh is not None and self.strategy in ("auto", "mesh"):
            from scaleloop.runtime.mesh import MeshSpec

            spec = MeshSpec.parse(self.mesh)
            if spec.pp > 1:
                return spec.pp, spec.dp
        return None

    def _check_pipeline(self, world_size: int, stages: int, replicas: int) -> None:
        """A pipeline needs stages to cut the model into, and data-parallel ranks for SyncBatchNorm."""
        if world_size < 2:
            raise UsageError("--strategy pipeline puts the model's layers on several processes, one stage each: "
                             "add --nproc 2 (or more)")
        if self.sync_batchnorm:
            raise UsageError("--sync-batchnorm synchronises BatchNorm over data-parallel ranks; a pipeline has "
                             "none (each BatchNorm lives on one stage): drop it")
        check_pipeline_schedule(self.pipeline_schedule, stages, self.microbatches, self.stages_per_rank)

    def _check_pipeline_batch(self, replicas: int, batch_size: int) -> None:
        """A pipeline's stages all see their replica's whole batch: it is split over replicas and
        into micro-steps, not over stages."""
        micro = check_batch_split(batch_size, replicas, self.accumulate)
        if micro < self.microbatches:
            raise UsageError(f"--batch-size {batch_size} with --accumulate {self.accumulate} gives micro-steps of "
                             f"{micro} samples, fewer than --microbatches {self.microbatches}; raise --batch-size "
                             f"or lower --microbatches")


def _taking(name: str, prefix: str = "") -> list[str]:
    """The strategies that take the option ``name`` as ``--strategy`` picks them (``prefix`` + name), in
    the registry's order; the one ``--mesh`` picks is left to the messages, which name that flag."""
    return [prefix + r.name for r in REGISTRY.values() if name in r.takes and not r.by_mesh]


def _either(names: Sequence[str], last: str = "or") -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"
