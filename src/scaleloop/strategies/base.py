"""The interface every strategy implements, with the single-process behaviour as default.

A strategy owns what changes between "one process" and "many": how the model is placed,
which samples this rank loads, how gradients are synchronised, and how checkpoints are
written and read. The training step (``scaleloop.loop.step``) and the loop only talk to
:class:`Strategy`; the hand-written-loop calls (``micro_step``, ``autocast``, ``backward``)
are :class:`HandWrittenLoop`'s, which every strategy but the pipeline is. The contract, and
how a new strategy plugs in (its module and one registry entry, the hooks it may override):
docs/strategies.md, "The strategy contract" and "Adding a strategy".

Collectives over ranks are not strategy methods: they are the functions of
``scaleloop.runtime.collectives`` (``sum_over_ranks``, ``gather_object``, ``broadcast_object``,
``barrier``), which need only the ``DistEnv``.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import scaleloop.strategies.distcp as distcp
from scaleloop.checkpoint.background import ShardedSave
from scaleloop.data.batch import call_model
from scaleloop.data.batching import check_batch_split
from scaleloop.data.handed import LoaderArgs, from_dataloader
from scaleloop.data.loader import Batch, ShardedLoader
from scaleloop.data.sampler import StepSampler
from scaleloop.data.streaming import StreamingLoader, StreamSampler, declared_length
from scaleloop.errors import UsageError
from scaleloop.runtime.collectives import gather_object, shard_indices
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.strategies.parallelize import Parallelism, default_parallelism, parallelize
from scaleloop.strategies.precision import Precision
from scaleloop.strategies.repoint import check_optimizer, parameter_names, repoint

if TYPE_CHECKING:
    from scaleloop.strategies.registry import ParallelSettings

OptimizerLike = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_NOTHING = contextlib.nullcontext()   # reusable: it holds no state


class EvalShard(NamedTuple):
    """What one rank evaluates of an evaluation set (see :meth:`Strategy.eval_shard`)."""

    indices: range     #: the samples this rank evaluates (each sample once over all ranks)
    fillers: int = 0   #: forwards to run after its own batches, outputs discarded


class Strategy:
    """The contract, with single-process defaults; subclasses override what their parallelism changes."""

    name = "base"
    #: How a step's global batch reaches the ranks, in words for summaries and notes.
    batch_split = "split evenly over workers"
    #: The mesh dimensions this strategy builds a ``DeviceMesh`` over (none: the default group).
    _mesh_dims: tuple[str, ...] = ()

    def __init__(self, env: DistEnv, precision: Optional[Precision] = None, accumulate: int = 1,
                 sync_batchnorm: bool = False, *, parallelism: Optional[Parallelism] = None) -> None:
        self.env = env
        self.precision = precision or Precision("fp32", env.device)
        self.accumulate_steps = accumulate
        self._sync_batchnorm = sync_batchnorm
        #: The ranks' layout and what ``setup`` applies (``strategies.parallelize``), built once.
        self.parallelism = parallelism if parallelism is not None else self._default_parallelism()
        self._check()

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings",
              parallelism: Parallelism) -> "Strategy":
        """This strategy for checked ``settings`` (``strategies.registry``) and the ``parallelism`` built
        from them, taking the options it has."""
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism)

    def _default_parallelism(self) -> Parallelism:
        """The parallelism of a strategy built without one: every rank a data replica."""
        return default_parallelism(self.env.world_size, self.env.rank)

    @property
    def writes_sharded(self) -> bool:
        """Whether checkpoints are written by every rank in parts (``torch.distributed.checkpoint``)
        rather than whole by rank 0."""
        return False

    # --- hooks for subclasses -----------------------------------------------------------
    def _check(self) -> None:
        """Raise UsageError if this strategy cannot run in ``env`` (and say what to do instead)."""

    def _tensor_parallel(self, model: nn.Module) -> None:
        """Step 1 of :func:`~scaleloop.strategies.parallelize.parallelize`: split the layers the
        model's TP plan names, in place (the mesh strategy's; none elsewhere)."""

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        """Step 3: the (already moved) model made data parallel: DDP, FSDP2, hooks; or as it is."""
        return model

    def _pipeline_split(self, model: nn.Module) -> nn.Module:
        """Step 4: this rank's stages of the model (the pipeline's); or the model as it is."""
        return model

    # --- set-up -------------------------------------------------------------------------
    def _parallelize(self, model: nn.Module) -> nn.Module:
        """The model made parallel as ``parallelism`` says, in its fixed order (``strategies.parallelize``)."""
        return parallelize(model, self)

    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model and make it parallel (:meth:`_parallelize`); returns what this rank trains
        and its optimizer.

        ``optimizer`` is a ``params -> optimizer`` factory, called with the parameters the strategy
        made, or an optimizer object built on ``model``'s parameters: its groups are then moved onto
        the parameters the strategy made (FSDP and tensor parallelism replace them; a pipeline stage
        keeps some), by name, with every group's hyper-parameters, and the same object is returned
        (``strategies.repoint``). An optimizer that already holds state (it has stepped), or holds
        tensors that are not the model's, is refused with a UsageError: pass the factory then."""
        names = self._check_optimizer(model, optimizer)
        model = self._parallelize(model.to(self.env.device))
        return model, self._optimizer_on(model, optimizer, names)

    def _check_optimizer(self, model: nn.Module, optimizer: OptimizerLike) -> Optional[dict[int, list[str]]]:
        """For an optimizer object: its parameters' names in the user's ``model``, taken (and the object
        checked, ``repoint.check_optimizer``) before anything replaces them; None for a factory."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
        names = parameter_names(model)
        check_optimizer(optimizer, names)
        return names

    def _optimizer_on(self, model: nn.Module, optimizer: OptimizerLike,
                      names: Optional[dict[int, list[str]]]) -> torch.optim.Optimizer:
        """The optimizer of the parameters of ``model`` as ``setup`` made it: the factory's, or the
        object's groups re-pointed at them by the names ``_check_optimizer`` took."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return optimizer(model.parameters())
        assert names is not None
        repoint(optimizer, names, self._made_parameters(model), part=self._holds_part)
        return optimizer

    #: This rank trains part of the model's parameters (a pipeline stage): ``setup`` leaves the
    #: others out of an optimizer object's groups.
    _holds_part = False

    def _made_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The parameters this rank trains after ``setup``, by their names in the user's module:
        FSDP2, tensor parallelism and activation checkpointing keep the names, and ``unwrap`` drops
        a wrapper's prefix (DDP's ``module.``)."""
        return dict(self.unwrap(model).named_parameters(remove_duplicate=False))

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper ``setup`` added (DDP, DataParallel), and
        inside ``torch.compile``'s wrapper if the user compiled it: a state_dict of the result
        has the user's own keys (no ``module.`` or ``_orig_mod.`` prefix)."""
        model = _uncompiled(model)
        return _uncompiled(getattr(model, "module", model))

    @property
    def layout(self) -> MeshSpec:
        """How the ranks are laid out, as a mesh (``parallelism.spec``).

        The loader follows it: a step's batch is split over ``layout.data_parallel`` ranks, and this
        rank trains on share ``layout.data_rank(rank)`` (tp and pp ranks of one group share theirs)."""
        return self.parallelism.spec

    def loader(self, dataset: Union[Dataset, DataLoader], batch_size: Optional[int] = None, *,
               shuffle: Optional[bool] = None, seed: int = 0, drop_last: Optional[bool] = None,
               num_workers: Optional[int] = None, collate_fn: Optional[Callable[[list], Any]] = None,
               uneven: bool = False) -> Union[ShardedLoader, StreamingLoader]:
        """Batches for this rank; ``batch_size`` is the GLOBAL batch of one optimizer step, split over
        the data-parallel ranks of :attr:`layout`. A stream (an ``IterableDataset``) is split by the
        rule of ``data.streaming``, in its own order. The one loader of every strategy.

        ``dataset`` may be a ``torch.utils.data.DataLoader``: its dataset, its ``batch_size`` (taken as
        the GLOBAL batch, not a per-rank one), shuffling, ``drop_last``, ``collate_fn``, ``num_workers``
        and ``persistent_workers`` are used; a shuffled epoch's order is still drawn from ``seed``. One
        it cannot honour (a sampler or batch sampler of its own) is refused with a UsageError that says
        what to pass (``data.handed``). Defaults otherwise: ``shuffle=True``, ``drop_last=False``,
        ``num_workers=0``, the default collation.

        ``uneven``: a batch that does not split evenly over the ranks is not refused; the ranks'
        shares then differ by one sample and each is weighted by its share (``StepSampler``), so a step
        is still the mean over the global batch (an elastic job on whatever world size it has).
        """
        persistent = False
        took: Optional[LoaderArgs] = None   # what a DataLoader gave, if one was handed over
        if isinstance(dataset, DataLoader):
            took = from_dataloader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                                   num_workers=num_workers, collate_fn=collate_fn)
            dataset, batch_size, shuffle, drop_last = took.dataset, took.batch_size, took.shuffle, took.drop_last
            num_workers, collate_fn, persistent = took.num_workers, took.collate_fn, took.persistent_workers
        elif batch_size is None:
            raise UsageError("strategy.loader(dataset, batch_size) needs the global batch_size, or a DataLoader "
                             "whose batch_size is the global batch")
        shuffle = True if shuffle is None else shuffle
        drop_last, num_workers = bool(drop_last), num_workers or 0
        world, rank = self.parallelism.data_world, self.parallelism.data_rank
        stream = isinstance(dataset, IterableDataset)
        if not (uneven and not stream and batch_size >= world * self.accumulate_steps):
            try:
                check_batch_split(batch_size, world, self.accumulate_steps)
            except UsageError as err:
                if took is None:
                    raise
                raise UsageError(f"strategy.loader takes the DataLoader's batch_size as the global batch: {err}") from None
        pin, load = self.env.device.type == "cuda", self._loads()
        if stream:
            self._check_stream()
            return StreamingLoader(dataset, StreamSampler(batch_size, world_size=world, rank=rank,
                                                          accumulate=self.accumulate_steps, seed=seed,
                                                          drop_last=drop_last, n=declared_length(dataset)),
                                   self.env.device, num_workers=num_workers, collate_fn=collate_fn, env=self.env,
                                   pin_memory=pin, persistent_workers=persistent, load=load)
        sampler = StepSampler(len(dataset), batch_size, world_size=world, rank=rank,
                              accumulate=self.accumulate_steps, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return ShardedLoader(dataset, sampler, self.env.device, num_workers=num_workers, collate_fn=collate_fn,
                             pin_memory=pin, persistent_workers=persistent, load=load)

    def _loads(self) -> tuple[bool, bool]:
        """Whether this rank loads the inputs and the targets (a pipeline's middle stages need neither)."""
        return True, True

    def _check_stream(self) -> None:
        """Raise UsageError if this strategy cannot split a stream over its layout."""

    # --- one step (loop.step.train_step calls these; a hand-written loop, HandWrittenLoop's) ---
    #: Forward and backward of a micro-batch are one call of the strategy's schedule
    #: (:meth:`forward_backward`), not the model's forward and a backward: the pipeline.
    pipelined = False

    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Context for a micro-batch's forward and backward: on all but the step's ``last``, the
        strategy keeps gradients local (DDP's ``no_sync``, FSDP's deferred reduce-scatter)."""
        return _NOTHING  # (not a generator: entered on every micro-step)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass and the loss: autocast to the run's precision."""
        return self.precision.autocast()

    def begin_step(self, batch: Batch) -> None:
        """Before a step's first forward (``batch``: its first micro-batch): where replica groups take
        their quorum (``strategies.fault_tolerant``); nothing elsewhere."""

    def sync_gradients(self) -> None:
        """After the step's last backward: synchronisation that the wrapper does not do itself
        (``allreduce``'s all-reduce; the checks of parameters no rank used)."""

    def commit(self) -> bool:
        """Whether the optimizer steps on the synchronised gradients: always, but between replica groups
        only where every group's step succeeded (``strategies.fault_tolerant``)."""
        return True

    def forward_backward(self, model: nn.Module, batch: Batch, loss_fn: LossFn) -> Optional[torch.Tensor]:
        """A pipelined strategy's forward and backward of one micro-batch (see :attr:`pipelined`),
        gradients synchronised after the step's last micro-batch.

        ``loss_fn(output, target)`` is the mean loss over the samples it is given. Returns that
        loss for the whole micro-batch, detached, or None on a rank that does not compute it
        (a pipeline's earlier stages).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward_backward "
                                  "(or derive from HandWrittenLoop)")

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The 2-norm of the whole step's gradient, the same on every rank: where gradients are
        split (FSDP's shards, tensor-parallel pieces, pipeline stages) the strategy reduces the
        pieces' norms. Call it after unscaling (fp16)."""
        return total_norm([p.grad for p in model.parameters() if p.grad is not None])

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """A hand-written loop's clipping: unscale (fp16), then clip to the global gradient norm
        (:meth:`grad_norm`, :func:`clip_gradients`); returns the norm before clipping."""
        self.precision.unscale_(optimizer)
        norm = self.grad_norm(model)
        clip_gradients(model, norm, max_norm)
        return norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (skipped by the fp16 scaler on overflow) and zero the gradients. True if stepped."""
        stepped = self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return stepped

    # --- evaluation ---------------------------------------------------------------------
    def eval_shard(self, n: int, batch_size: int) -> EvalShard:
        """Which samples of an ``n``-sample evaluation set this rank evaluates (each sample once
        over all ranks; a pipeline's stages all walk every sample), and how many filler forwards
        it runs after its own batches of ``batch_size``, so that every rank runs as many where a
        forward is a collective (FSDP). Every rank must call it."""
        return EvalShard(shard_indices(n, self.env))

    def eval_forward(self, model: nn.Module, x: Any) -> Any:
        """The model's output for the inputs ``x`` in evaluation (under ``torch.no_grad``), or None
        on a rank that does not produce outputs (a pipeline's earlier stages)."""
        with self.precision.autocast():
            return call_model(model, x)

    # --- the model's state ----------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The user's module's full ``state_dict`` on rank 0, on the CPU or not (every rank must
        call it: for a sharded strategy it is a collective; other ranks may get an empty dict)."""
        return self.unwrap(model).state_dict()

    def sync_buffers(self, model: nn.Module) -> None:
        """Make every rank's buffers (BatchNorm statistics) rank 0's, where the strategy does not
        already (a collective). Called before evaluating, checkpointing and exporting."""

    # --- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Optional[Path],
                        background: Optional[ShardedSave] = None) -> Optional[dict[str, Any]]:
        """The model and optimizer part of a checkpoint (every rank calls it: it may be a collective).

        ``directory`` is the checkpoint's (temporary) directory on the rank that writes
        ``state.pt``, rank 0, and None on the other ranks (and on rank 0 when nothing is written).
        Returns, on that rank only, the entries ``state.pt`` holds for the model and optimizer;
        None on every other rank. Here rank 0 holds the whole state: ``{"model", "optimizer"}``.
        ``background`` (``--async-checkpoint``) matters only to a strategy that ``writes_sharded``:
        it then leaves its shards to DCP's thread; a whole state is copied by the checkpointer.
        """
        if directory is None:
            return None
        return {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                        directory: Path) -> None:
        """Load the model and optimizer part of the checkpoint in ``directory`` whose ``state.pt``
        holds ``state`` (every rank calls it, with the same ``state``).

        Any strategy loads both kinds, written with any world size: a whole-state checkpoint
        (``state["model"]``, ``state["optimizer"]``) and a sharded one (``state["sharded"]``:
        ``torch.distributed.checkpoint`` files in ``directory``, which every rank must see).
        CheckpointError when the checkpoint does not fit the model.
        """
        from scaleloop.checkpoint.state import check_model_state

        if state.get("sharded") is not None:
            _check_sharded(self, model, directory)
            self._load_sharded(model, optimizer, directory)
        else:
            check_model_state(self._expected_model_state(model), state["model"], str(directory))
            self._load_whole(model, optimizer, state)

    def _expected_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint's model must hold: keys and shapes of the user's whole module."""
        return self.unwrap(model).state_dict()

    def _load_whole(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a whole-state checkpoint's ``model`` and ``optimizer`` (on every rank: replicas start equal)."""
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def _load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Load a sharded checkpoint's files, with any world size (a collective); a replicated
        strategy reads the whole state on every rank."""
        distcp.load_state(self.unwrap(model), optimizer, directory)

    # --- the end, and what a run prints --------------------------------------------------
    def close(self) -> None:
        """Release what the strategy itself set up (the end of ``train``)."""

    def describe(self) -> str:
        """The strategy in a few words, starting with its ``name`` (the run's header and summary)."""
        return self.name

    def details(self) -> list[str]:
        """Lines a run prints after its header (how the strategy placed the model, notes)."""
        return []


class HandWrittenLoop(Strategy):
    """The calls of a hand-written training loop (README, examples/), for every strategy whose
    ranks each run the whole model; ``forward_backward`` is made of them::

        with strategy.micro_step(model, batch):
            with strategy.autocast():
                loss = loss_fn(model(x), y)
            strategy.backward(loss, batch)
        if batch.last_micro:
            strategy.optimizer_step(optimizer)

    (``scaleloop train``'s step, ``loop.step.train_step``, is written with the same hooks.)
    """

    def micro_step(self, model: nn.Module, batch: Union[Batch, int]) -> contextlib.AbstractContextManager:
        """The context of one micro-step of a hand-written loop: :meth:`no_sync` for ``batch`` (a
        ``Batch``, or a micro-step's index), so gradients are synchronised after the last only."""
        return self.no_sync(model, last=self.is_sync_step(batch))

    def accumulate(self, model: nn.Module, batch: Union[Batch, int]) -> contextlib.AbstractContextManager:
        """The old name of :meth:`micro_step`, kept so that loops written with it still run; it says
        so once. (``accumulate`` is the number of micro-steps in an optimizer step.)"""
        warnings.warn("strategy.accumulate(model, batch) is now strategy.micro_step(model, batch); the old name "
                      "will be removed (accumulate is the number of micro-steps a step has)", FutureWarning, stacklevel=2)
        return self.micro_step(model, batch)

    def is_sync_step(self, batch: Union[Batch, int]) -> bool:
        """True on the micro-step after which gradients are synchronised and the optimizer steps."""
        if isinstance(batch, Batch):
            return batch.last_micro
        return (batch + 1) % self.accumulate_steps == 0

    def backward(self, loss: torch.Tensor, batch: Optional[Batch] = None) -> None:
        """A hand-written loop's backward on the loss weighted for accumulation (and fp16 loss
        scaling), gradients synchronised after the last micro-step (:meth:`sync_gradients`).

        With a ``Batch`` the weight is its exact share of the global step; without one, the
        micro-batches are assumed equal (weight ``1 / accumulate``).
        """
        weight = batch.loss_scale if batch is not None else 1.0 / self.accumulate_steps
        self.precision.scale(weighted(loss, weight)).backward()
        if batch is None or batch.last_micro:
            self.sync_gradients()

    def forward_backward(self, model: nn.Module, batch: Batch, loss_fn: LossFn) -> Optional[torch.Tensor]:
        x, y = batch
        with self.micro_step(model, batch):
            with self.autocast():
                loss = loss_fn(call_model(model, x), y)
            self.backward(loss, batch)
        return loss.detach()

    def eval_forward(self, model: nn.Module, x: Any) -> Any:
        with self.autocast():
            return call_model(model, x)


def weighted(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """``loss`` times its micro-batch's share of the step. A weight of exactly 1 (one process, no
    accumulation) is skipped: ``x * 1.0`` is ``x`` bit for bit, forward and backward, and the
    multiplication would be one more op per step."""
    return loss * weight if weight != 1.0 else loss


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` taken together: ``torch.nn.utils.get_total_norm(grads)``, bit for bit.

    When every gradient is a plain tensor of one dtype on one CPU or CUDA device (the usual case),
    this is the same two reductions without the Python around them that sorts tensors by device
    and dtype (``get_total_norm`` took about twice as long on a small model, and a log row's norm
    is most of the loop's own cost there; benchmarks/2026-12-06_cpu-2core_overhead-issue55-norm.md).
    Anything else (DTensor shards, mixed dtypes or devices) goes to ``get_total_norm`` itself."""
    first = grads[0] if grads else None
    if (first is not None and first.device.type in ("cpu", "cuda")
            and all(type(g) is torch.Tensor and g.dtype == first.dtype and g.device == first.device
                    and g.layout == torch.strided and not g.requires_grad for g in grads)):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    return torch.nn.utils.get_total_norm(grads)


def clip_gradients(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient of ``model`` by ``max_norm / norm`` where that is below 1 (the rule of
    ``torch.nn.utils.clip_grad_norm_``, bit for bit); ``norm`` is the whole gradient's
    (:meth:`Strategy.grad_norm`). A sharded gradient (DTensor) scales its own shard."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                local.mul_(coef)


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (its ``OptimizedModule`` keeps it as
    ``_orig_mod``); any other module as it is. (``module.compile()`` compiles in place and
    needs no unwrapping.)"""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def _check_sharded(strategy: Strategy, model: nn.Module, directory: Path) -> None:
    """Before loading a sharded checkpoint: every rank sees it, and it fits the model (same error on all ranks)."""
    from scaleloop.checkpoint.state import check_model_state
    from scaleloop.checkpoint.store import CheckpointError

    seen = gather_object((directory / distcp.METADATA_FILE).is_file(), strategy.env)
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(f"sharded checkpoint {str(directory)!r} is not visible to rank(s) "
                              f"{', '.join(map(str, blind))}: every rank reads its shards itself, so the run "
                              "directory must be on a file system that all nodes share")
    saved = {key: (torch.empty(shape, device="meta") if shape is not None else None)
             for key, shape in distcp.saved_model_shapes(directory).items()}
    check_model_state(strategy._expected_model_state(model), saved, str(directory))


class ProcessGroupStrategy(Strategy):
    """A strategy with one process per device in a ``torch.distributed`` process group."""

    def _check(self) -> None:
        if self.env.is_distributed and not torch_dist.is_initialized():
            raise RuntimeError(f"{self.name}: call scaleloop.init_process_group(env) before building the strategy")
