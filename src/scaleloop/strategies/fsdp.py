"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Data parallel like DDP, but each rank holds 1/N of every parameter, its gradient and its
optimizer state; units (blocks, then the root) are all-gathered for forward and backward and
their gradients reduce-scattered. Mixed precision is FSDP's ``MixedPrecisionPolicy``; one
process runs as a one-rank group. How it shards, which modules are units, precision,
checkpoints: docs/strategies.md, "--strategy fsdp".
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.checkpoint.background import ShardedSave
from scaleloop.errors import UsageError
import scaleloop.strategies.distcp as distcp
from scaleloop.runtime.collectives import broadcast_object, gather_object
from scaleloop.runtime.devices import indexed
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.strategies.base import EvalShard, HandWrittenLoop, ProcessGroupStrategy
from scaleloop.strategies.blocks import DECLARE, count_classes, find_blocks
from scaleloop.strategies.blocks import _has_params, fsdp_blocks, untied_units  # noqa: F401 (re-exported)
from scaleloop.strategies.parallelize import Parallelism, default_parallelism
from scaleloop.strategies.tensor import apply_tensor_parallel, fsdp_placement
from scaleloop.strategies.syncbn import convert_batchnorm
from scaleloop.strategies.unused import used_anywhere

if TYPE_CHECKING:
    from scaleloop.runtime.dist import DistEnv
    from scaleloop.strategies.precision import Precision
    from scaleloop.strategies.registry import ParallelSettings


class FSDP(HandWrittenLoop, ProcessGroupStrategy):
    """Parameters, gradients and optimizer state sharded over ranks with FSDP2's ``fully_shard``."""

    name = "fsdp"
    _mesh_dims: tuple[str, ...] = ("fsdp",)
    _shards_what = "--strategy fsdp shards"

    @classmethod
    def build(cls, env: DistEnv, precision: Precision, settings: "ParallelSettings", parallelism: Parallelism) -> "FSDP":
        return cls(env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism,
                   cpu_offload=settings.cpu_offload)

    def __init__(self, *args: Any, cpu_offload: bool = False, one_unit: bool = False, **kwargs: Any) -> None:
        #: Shards, gradients and optimizer state kept in host memory between uses (--cpu-offload).
        self.cpu_offload = cpu_offload
        #: The whole model is one unit (``--mesh`` with --find-unused-parameters): a rank may skip any module.
        self.one_unit = one_unit
        super().__init__(*args, **kwargs)
        self.units = 0
        self._own_group = False
        self._params: list[nn.Parameter] = []   # the sharded parameters, in the model's order
        self._reached: list[bool] = []          # which of them a backward reached since the last step
        self._hooked: set[int] = set()          # the gathered parameters hooked (their ids)
        self._steps = 0                         # optimizer steps this process has run (for messages)
        self._order: Any = None                 # the units' order, checked (strategies.fsdp_agreement)
        self._blocks: Optional[list[nn.Module]] = None   # the units, found before anything replaced parameters
        self._no_blocks = ""                    # the note when the model gave no units besides the root
        self._unit_classes = ""                 # the sub-units by class, for describe(): "4 x LlamaDecoderLayer"
        self.tp_layers = 0                      # layers tensor parallelism split (--mesh tp=N)

    def _default_parallelism(self) -> Parallelism:
        return default_parallelism(self.env.world_size, self.env.rank, MeshSpec(fsdp=self.env.world_size))

    @property
    def writes_sharded(self) -> bool:
        return True

    def _check(self) -> None:
        super()._check()
        if self.env.device.type not in ("cpu", "cuda"):
            raise UsageError(f"--strategy fsdp runs on CUDA GPUs (NCCL) or on the CPU (Gloo), not on "
                             f"{self.env.device.type}; use --strategy single")
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:  # pragma: no cover - the pinned torch has it
            raise UsageError(f"--strategy fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard), which torch "
                             f"{torch.__version__} lacks; upgrade torch") from None

    # --- set-up -------------------------------------------------------------------------
    def _policy(self, low_precision: bool = True) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.precision.dtype is None or not low_precision:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.precision.dtype, reduce_dtype=torch.float32)

    def _offload(self) -> Any:
        """FSDP2's offload policy: the shards in (pinned, on CUDA) host memory, or none."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not self.cpu_offload:
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda")

    def _ensure_process_group(self) -> None:
        if torch_dist.is_initialized():
            return
        # One process: a one-rank group of our own (several processes get theirs from
        # scaleloop.init_process_group, which _check() insists on).
        cuda = self.env.device.type == "cuda"
        device = indexed(self.env.device)  # device_id must name its GPU: "cuda" alone raises
        if cuda:
            torch.cuda.set_device(device)  # the device mesh and NCCL use the current GPU
        torch_dist.init_process_group(backend=self.env.backend or ("nccl" if cuda else "gloo"),
                                      store=torch_dist.HashStore(), rank=0, world_size=1,
                                      timeout=self.env.group_timeout, device_id=device if cuda else None)
        self._own_group = True

    def _prepare(self, model: nn.Module) -> nn.Module:
        """Before anything replaces a parameter: the process group, SyncBatchNorm, the units
        (``fsdp_blocks``), and every rank on rank 0's weights and buffers (as DDP starts: each
        rank keeps its own slice of its own copy, so copies that differed would stay mixed)."""
        if not _has_params(model):
            raise UsageError(f"{self._shards_what} a model's parameters, and {type(model).__name__} has none; "
                             "use --strategy ddp or single")
        self._ensure_process_group()
        if self._sync_batchnorm and self.env.is_distributed:
            model = convert_batchnorm(model, self.env.device)
        # One unit, the root, runs on every rank whatever modules a rank skips (a rarely routed
        # expert); sub-units let a rank gather less at a time, but only run together.
        found = find_blocks(model)
        self._blocks = [] if self.one_unit else untied_units(model, found.modules)
        if not self.one_unit and not self._blocks:
            # The whole model one unit: gathered whole on every rank, rarely what sharding is for.
            why = (f"{type(model).__name__}'s blocks ({found.describe()}, {found.source}) share weights with "
                   "modules outside them" if found.modules else f"fsdp found no blocks in {type(model).__name__}")
            self._no_blocks = f"note: {why}, so the whole model is one unit, gathered whole on every rank; {DECLARE}"
        if self.env.is_distributed:
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    torch_dist.broadcast(tensor, src=0)
        return model

    def _tensor_parallel(self, model: nn.Module) -> None:
        """The layers of the model's ``tp_plan()`` split over the plan's ``tp`` ranks (``--mesh tp=N``)."""
        if self.parallelism.spec.tp == 1:
            return
        self._prepare(model)   # the units are found before TP replaces their parameters
        mesh = self.parallelism.device_mesh(self.env, self._mesh_dims)
        self.tp_layers = apply_tensor_parallel(model, mesh["tp"])

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        """FSDP2 over the mesh's data dimensions (``fsdp``, or ``(dp, fsdp)``: HSDP)."""
        if self._blocks is None:
            model = self._prepare(model)
        mesh = self.parallelism.data_mesh(self.parallelism.device_mesh(self.env, self._mesh_dims))
        # BatchNorm's parameters stay in full precision under a low-precision policy.
        mixed = self.precision.dtype is not None
        norms = [m for m in model.modules()
                 if mixed and isinstance(m, nn.modules.batchnorm._BatchNorm) and _has_params(m)]
        # Named before fully_shard gives each unit a class of its own (FSDPLlamaDecoderLayer).
        chosen = {id(m) for m in (self._blocks or []) + norms}
        self._unit_classes = count_classes(m for m in model.modules() if id(m) in chosen and m is not model)
        units = shard_units(model, self._blocks or [], mesh, self._policy(), offload=self._offload(),
                            full_precision=norms, full_policy=self._policy(low_precision=False))
        self.units = len(units) + 1
        self._watch_gradients(model, units)
        return model

    def _watch_gradients(self, model: nn.Module, units: dict[str, nn.Module]) -> None:
        """Prepare for parameters that get no gradient on some ranks or steps (``strategies.unused``),
        and check that the ranks run the same ``units`` (the sub-units, by name: ``strategies.fsdp_agreement``).

        A unit reduce-scatters the gradients of its parameters, and every rank must hand it the
        same ones: FSDP is told to put in zeros for a parameter this rank did not use. Which
        parameters some rank did use is then no longer in the reduced gradients, so hooks note,
        on the gathered parameters the forward runs with, which ones each backward reached.
        """
        model.set_reduce_scatter_unused_params(True)
        if self.env.is_distributed and units:
            from scaleloop.strategies.fsdp_agreement import UnitOrder

            self._order = UnitOrder(model, units, step=lambda: self._steps + 1, timeout=self.env.group_timeout,
                                    **self._parted_words())
        self._params = list(model.parameters())   # the sharded parameters the optimizer steps
        index = {id(p): i for i, p in enumerate(self._params)}
        self._reached = [False] * len(self._params)
        for module in model.modules():
            own = {name: index[id(p)] for name, p in module.named_parameters(recurse=False) if id(p) in index}
            if own:
                # It runs after FSDP's own pre-forward hook (prepended), which gathers them.
                hook = _HookGathered(self, own)
                hook.handle = module.register_forward_pre_hook(torch._dynamo.disable(hook))

    def _hook_gathered(self, module: nn.Module, own: dict[str, int]) -> bool:
        """Hook the gathered parameters of ``module`` not hooked yet; True once all of them are.

        The gathered parameter of a sharded one is a tensor of its own, made at the first
        all-gather and reused after; a frozen one needs no hook."""
        done = True
        for name, i in own.items():
            param = getattr(module, name, None)
            if not isinstance(param, torch.Tensor) or id(param) in self._hooked:
                continue
            if param is self._params[i]:
                done = False   # not gathered: called outside its unit's forward; a later call hooks it
                continue
            self._hooked.add(id(param))
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(_Reached(self._reached, i))
        return done

    def sync_gradients(self) -> None:
        # After the step's last backward, its gradients reduce-scattered: a parameter that no
        # rank used has a zero gradient from FSDP (see _watch_gradients), where one process has
        # none; it gets none here, so the optimizer steps neither it nor its state.
        self._steps += 1
        if not self._params:
            return
        local, self._reached[:] = list(self._reached), [False] * len(self._reached)
        unused = [p for p, used in zip(self._params, used_anywhere(local, self.env.device))
                  if not used and p.grad is not None]
        if not unused:   # (the same on every rank: the flags and FSDP's reductions are)
            return
        # FSDP gave them zeros. Anything else means that the hooks missed a backward (a torch whose
        # FSDP gathers into new tensors): better to stop than to drop real gradients.
        found = torch.stack([_local(p.grad).count_nonzero() for p in unused]).sum().float().reshape(1)
        if self.env.is_distributed:
            torch_dist.all_reduce(found)
        if found.item() > 0:
            raise RuntimeError("fsdp: a parameter that no backward reached has a gradient; the hooks that note "
                               "which parameters each backward reaches missed one (strategies/fsdp.py)")
        for param in unused:
            param.grad = None

    def close(self) -> None:
        order, self._order = self._order, None
        if order is not None:
            order.close()
        if self._own_group and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        self._own_group = False

    # --- one step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, last: bool) -> Iterator[None]:
        # Micro-steps before the last keep their (unsharded) gradients local: no
        # reduce-scatter until the last micro-step's backward reduces the accumulated sum.
        setter = getattr(model, "set_requires_gradient_sync", None)
        if setter is None or last:
            yield
            return
        setter(False)
        try:
            yield
        finally:
            setter(True)

    def autocast(self) -> contextlib.AbstractContextManager:
        # The MixedPrecisionPolicy already runs the forward with bf16/fp16 parameters.
        return contextlib.nullcontext()

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        # The gradients are DTensor shards: their norm is reduced over the ranks (DTensor's
        # partial norm), so this is the norm of the whole gradient, the same on every rank.
        norm = super().grad_norm(model)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # --- evaluation ---------------------------------------------------------------------
    def eval_shard(self, n: int, batch_size: int) -> EvalShard:
        # Each forward is a collective (FSDP gathers parameters in it), so a rank with fewer
        # batches (or none) runs as many more as it lacks (on a sample whose output is discarded).
        shard = super().eval_shard(n, batch_size)
        own = math.ceil(len(shard.indices) / batch_size)
        return shard._replace(fillers=max(gather_object(own, self.env)) - own)

    # --- buffers, export ----------------------------------------------------------------
    def sync_buffers(self, model: nn.Module) -> None:
        # FSDP shards parameters, not buffers: each rank's BatchNorm running statistics follow
        # its own batches. DDP broadcasts rank 0's before every forward; this gives the same.
        if not self.env.is_distributed:
            return
        with torch.no_grad():
            for buf in model.buffers():
                torch_dist.broadcast(buf, src=0)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.sync_buffers(model)
        # Gathered shard by shard into rank 0's CPU memory; other ranks get an empty dict.
        with distcp.gathering_strided_pieces():
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # --- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Optional[Path],
                        background: Optional[ShardedSave] = None) -> Optional[dict[str, Any]]:
        """No rank holds the whole state: rank 0 tells every rank ``directory``, each writes its
        shards into it (``torch.distributed.checkpoint``), and ``state.pt`` gets the marker.
        With ``background`` the shards are written in DCP's thread, and rank 0 checks they are all
        there once written (``background.wait``)."""
        shared = broadcast_object(str(directory) if directory is not None else None, self.env)
        if shared is None:
            return None
        self.sync_buffers(model)
        if background is not None:
            distcp.save_state(self.unwrap(model), optimizer, Path(shared), background, coordinator=directory is not None)
            return {"sharded": distcp.SHARDED_FORMAT} if directory is not None else None
        distcp.save_state(self.unwrap(model), optimizer, Path(shared))
        # Every rank stops alike if rank 0 does not see all the shards.
        error = distcp.missing_shards(Path(shared)) if directory is not None else None
        error = broadcast_object(error, self.env)
        if error is not None:
            from scaleloop.checkpoint.store import CheckpointError

            raise CheckpointError(error)
        return {"sharded": distcp.SHARDED_FORMAT} if directory is not None else None

    def _load_whole(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a replicated strategy's checkpoint (full tensors, on every rank) into the shards."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=full)
        saved = state["optimizer"]
        if not saved.get("state") and not saved.get("param_groups"):
            return
        # A plain optimizer state_dict numbers parameters 0, 1, ... in param-group order;
        # the distributed state-dict API names them by their parameter names instead.
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        groups = []
        for group in saved["param_groups"]:
            groups.append({**group, "params": [order[i] for i in group["params"]]})
        named = {"state": {order[int(i)]: v for i, v in saved["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(model, optimizer, named, options=full)

    def _parted_words(self) -> dict[str, str]:
        """How a disagreement of the units' order names this strategy, and what else trains the model."""
        return {}   # UnitOrder's own: fsdp's

    def describe(self) -> str:
        """``fsdp (5 units: 4 x LlamaDecoderLayer + root)``: how many units, and which."""
        offload = ", cpu offload" if self.cpu_offload else ""
        if not self.units:
            return "fsdp"
        which = f"{self._unit_classes} + root" if self._unit_classes else "root"
        return f"fsdp ({self.units} unit{'s' if self.units != 1 else ''}: {which}{offload})"

    def details(self) -> list[str]:
        """The note when the model gave no units besides the root (``_prepare``)."""
        return super().details() + ([self._no_blocks] if self._no_blocks else [])


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class _HookGathered:
    """A module's forward pre-hook: hooks its gathered parameters (``FSDP._hook_gathered``), and
    removes itself once all of them are."""

    def __init__(self, strategy: FSDP, own: dict[str, int]) -> None:
        self.strategy, self.own = strategy, own
        self.handle: Any = None

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.strategy._hook_gathered(module, self.own) and self.handle is not None:
            self.handle.remove()


class _Reached:
    """A gathered parameter's post-accumulate-grad hook: the backward reached parameter ``i``."""

    def __init__(self, reached: list[bool], i: int) -> None:
        self.reached, self.i = reached, i

    def __call__(self, _param: torch.Tensor) -> None:
        self.reached[self.i] = True


def shard_units(model: nn.Module, blocks: list[nn.Module], mesh: Any, policy: Any, *, offload: Any,
                full_precision: list[nn.Module], full_policy: Any) -> dict[str, nn.Module]:
    """FSDP2's ``fully_shard`` over ``mesh``: each of ``blocks`` and ``full_precision`` (with
    ``full_policy``), innermost first (``fully_shard`` must see a unit's sub-units before the unit
    itself), then the root. Returns the sub-units by name. A weight that tensor parallelism split
    in whole parts is sharded on its other dimension (``tensor.fsdp_placement``)."""
    from torch.distributed.fsdp import fully_shard

    block_ids, norm_ids = {id(b) for b in blocks}, {id(m) for m in full_precision}
    units: dict[str, nn.Module] = {}
    for name, module in reversed(list(model.named_modules())):
        if module is model or not (id(module) in norm_ids or id(module) in block_ids):
            continue
        fully_shard(module, mesh=mesh, mp_policy=full_policy if id(module) in norm_ids else policy,
                    shard_placement_fn=fsdp_placement, offload_policy=offload)
        units[name] = module
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=fsdp_placement, offload_policy=offload)
    return units
