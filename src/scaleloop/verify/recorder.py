"""What one verify run records, on every rank, and how rank 0 writes it down.

The training step (``loop.step.train_step``) calls the recorder, its observer, at fixed points of each step. Every
rank records its own micro-batches (sample indices, a SHA-256 of the data, the local loss) and
which parameters received a gradient; rank 0 also saves, after every optimizer step, all
parameters and the synchronised gradients of that step. At the end the ranks' records are
gathered to rank 0, which writes ``record.json`` next to the per-step ``step-NNNN.pt`` files.

Parameters and gradients are always saved whole, under the names of the user's module: a
sharded (FSDP) parameter is gathered from its shards, and under the pipeline strategy, where
each rank holds one stage (a ``StageModule``), the stages' parts are gathered to rank 0 and
named by the whole model's ``state_dict`` keys. Only the pipeline's last stage computes the
loss; the others add zeros to the step's loss sums.

Every collective here (the step loss, the explained step's all-reduce, the final gathers) is
called by every rank at the same point, so ranks never wait on each other forever.
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from scaleloop.data.loader import Batch, ShardedLoader
from scaleloop.runtime.collectives import gather_object, sum_over_ranks
from scaleloop.runtime.dist import DistEnv
from scaleloop.launching.worker import describe_exception
from scaleloop.loop.step import Observer
from scaleloop.strategies.base import Strategy
from scaleloop.strategies.pipeline import StageModule
from scaleloop.verify.data import batch_digest
from scaleloop.verify.hashing import digest, full_tensor, is_sharded
from scaleloop.verify.probes import output_digest
from scaleloop.verify.buffers import parameter_names, saved_buffers, unique_state
from scaleloop.verify.sync import check_sync

RECORD_FILE = "record.json"


def step_file(run_dir: Path, step: int) -> Path:
    """Where rank 0 saves the parameters and buffers (after) and gradients (of) optimizer step ``step``
    (1-based); step 0 holds the model as built, before the strategy places it and before any step."""
    return run_dir / f"step-{step:04d}.pt"


def failure_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"failure-rank{rank}.json"


class Recorder(Observer):
    """Records one process's view of a verify run (as the step's observer); rank 0 writes it into ``out``."""

    def __init__(self, env: DistEnv, out: Path, *, explain_step: Optional[int] = None,
                 audit_data: bool = False, check_sync: bool = False) -> None:
        self.env = env
        self.out = out
        self.explain_step = explain_step
        self.audit_data = audit_data
        self.check_sync = check_sync
        self.step = 1                       # the optimizer step being trained (1-based)
        self.losses: list[float] = []       # global loss of each finished step
        self.micro: list[dict[str, Any]] = []
        self.no_grad: dict[int, list[str]] = {}
        self.explain: Optional[dict[str, Any]] = None
        self.audit: list[dict[str, Any]] = []
        self._sums = torch.zeros(2, dtype=torch.float64)
        # The step's micro-batch losses, read when the step's gradients are synchronised: over -100
        # padding the step weighs them by its count of real targets first (loop.losses).
        self._pending: list[tuple[dict[str, Any], torch.Tensor, int]] = []
        self._factor = 1.0                  # that weight, on the gradients too (Observer.counted)
        self._used: set[str] = set()
        self._local: Optional[torch.Tensor] = None
        self._grads: dict[str, torch.Tensor] = {}
        # Whether the parameter hooks see this strategy's gradients (decided at step 1). FSDP
        # computes gradients on gathered copies and writes only the reduced shard into .grad,
        # so hooks on the sharded parameters never run: "unused" and "before sync" are unknown.
        self.hooks_see_grads: Optional[bool] = None
        self.strategy: Optional[Strategy] = None
        self.module: Optional[nn.Module] = None
        # Under the pipeline strategy this rank holds one stage of the model: its parameters
        # are recorded under the whole model's names and gathered from all stages to rank 0.
        self.stage = False
        self._names: dict[str, str] = {}    # local parameter name -> the user's module's name
        self.first_param = ""
        # Per rank r > 0: the state_dict keys whose initial tensor differs from rank 0's (as built).
        self.initial_diverging: list[dict[str, Any]] = []
        # The ranks r > 0 whose output for the same inputs and weights differs from rank 0's.
        self.output_diverging: list[int] = []
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)

    # --- set-up ------------------------------------------------------------------------
    def built(self, model: nn.Module, sample: Optional[torch.Tensor] = None) -> None:
        """The model as this rank built it, before the strategy places it (DDP and the all-reduce
        strategy then copy rank 0's weights to every rank, hiding a per-rank initialisation).

        Rank 0 saves its whole state as step 0; every rank's digests are gathered (a collective)
        to name the tensors another rank built differently. With ``sample`` (a few training
        inputs, the same on every rank), each rank's training-mode output for it from one fixed
        seed is compared too: where the weights agree, an output that differs comes from code
        that depends on the rank.
        """
        params = parameter_names(model)
        state = dict(unique_state(model))
        if self.env.is_main:
            torch.save({"params": {n: t.detach().cpu().clone() for n, t in state.items() if n in params},
                        "buffers": {n: t.detach().cpu().clone() for n, t in state.items() if n not in params},
                        "grads": {}}, step_file(self.out, 0))
        mine = {"state": {n: digest(t) for n, t in state.items()}, "output": self._output_digest(model, sample)}
        every = gather_object(mine, self.env)
        states = [e["state"] for e in every]
        self.initial_diverging = [{"rank": r, "names": [n for n in states[0] if theirs.get(n) != states[0][n]]}
                                  for r, theirs in enumerate(states) if r > 0 and theirs != states[0]]
        outputs = [e["output"] for e in every]
        self.output_diverging = ([r for r, out in enumerate(outputs) if r > 0 and out != outputs[0]]
                                 if not self.initial_diverging and None not in outputs else [])

    @staticmethod
    def _output_digest(model: nn.Module, sample: Optional[torch.Tensor]) -> Optional[str]:
        if sample is None or self_is_meta(model):
            return None
        try:
            device = next((p.device for p in model.parameters()), sample.device)
            return output_digest(model, sample.to(device))
        except Exception:  # noqa: BLE001 (a model that cannot run this probe is simply not probed)
            return None

    def attach(self, strategy: Strategy, model: nn.Module) -> None:
        """Watch the (wrapped) ``model``: a hook on each parameter sees its local gradient."""
        self.strategy = strategy
        self.module = strategy.unwrap(model)
        self.stage = isinstance(self.module, StageModule)
        self._names = whole_model_names(self.module)
        trainable = [(self._names[n], p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.first_param = trainable[0][0] if trainable else ""
        for name, param in trainable:
            param.register_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        # A tensor hook runs when this rank's backward has computed the parameter's gradient,
        # before it is accumulated into .grad and before DDP's all-reduce (which hooks the
        # accumulation): it is the local gradient, the one each rank would step with alone.
        def hook(grad: torch.Tensor) -> None:
            self._used.add(name)
            if name == self.first_param and self.step == self.explain_step:
                local = grad.detach().float().clone()
                self._local = local if self._local is None else self._local + local
        return hook

    # --- during a step -----------------------------------------------------------------
    def micro_batch(self, batch: Batch) -> None:
        """Before the forward pass: which samples this rank trains on, and a digest of their data."""
        x, y = batch
        self.micro.append({"step": self.step, "epoch_step": batch.step, "micro": batch.place.micro,
                           "indices": batch.indices.tolist(), "sha": batch_digest(x, y),
                           "loaded": _loaded(batch)})

    def micro_done(self, batch: Batch, loss: Optional[torch.Tensor]) -> None:
        """After backward: the micro-batch's loss, and its weight in the step's loss."""
        if loss is None:   # a pipeline's earlier stage computes no loss
            return
        self._pending.append((self.micro[-1], loss.detach(), len(batch)))

    def counted(self, factor: float) -> None:
        """Over -100 padding: the synchronised gradients were multiplied by ``factor`` (for --explain)."""
        self._factor = factor

    def synced(self) -> None:
        """After the step's last backward, gradients synchronised: loss, unused parameters, gradients."""
        _, module = self._attached()
        for entry, loss, n in self._pending:
            value = float(loss.float())
            entry.update(loss=value, n=n)
            self._sums += torch.tensor([value * n, float(n)], dtype=torch.float64)
        self._pending = []
        total = sum_over_ranks(self._sums.to(self.env.device), self.env).cpu()
        self.losses.append(float(total[0] / total[1]) if float(total[1]) > 0 else float("nan"))
        self._sums.zero_()
        if self.hooks_see_grads is None:
            fired = torch.tensor([1.0 if self._used else 0.0], device=self.env.device)
            self.hooks_see_grads = float(sum_over_ranks(fired, self.env)) > 0  # the same answer on every rank
        if self.hooks_see_grads:
            trainable = [self._names[n] for n, p in module.named_parameters() if p.requires_grad]
            self.no_grad[self.step] = [n for n in trainable if n not in self._used]
        self._used.clear()
        scale = self._grad_scale()
        grads = self._whole(lambda p: p.grad)
        if self.step == self.explain_step and not self.stage:
            # A pipeline's ranks hold different parameters: no local gradients to all-reduce.
            self._explain(module, scale)
        self._factor = 1.0
        self._grads = {name: g.float() / scale for name, g in grads.items()}

    def stepped(self) -> None:
        """After the optimizer step: rank 0 saves this step's parameters, buffers and gradients."""
        params = self._whole(lambda p: p)
        buffers = self._buffers()
        if self.env.is_main:
            torch.save({"params": params, "buffers": buffers, "grads": self._grads}, step_file(self.out, self.step))
        self._grads = {}
        self.step += 1

    def _whole(self, pick: Callable[[nn.Parameter], Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``pick(param)`` of every parameter of the whole model, on the CPU, by the user's module's
        names, on rank 0 ({} elsewhere); parameters whose ``pick`` is None are left out.

        A collective (every rank must call it): sharded tensors are gathered from their shards,
        and a pipeline's stages send their parts to rank 0 (a tied parameter held by several
        stages is taken from the first: the strategy keeps its copies equal).
        """
        _, module = self._attached()
        if not self.stage:
            out = {}
            for name, param in module.named_parameters():
                t = pick(param)
                if t is not None:
                    whole = full_tensor(t)  # every rank: gathering a sharded tensor is a collective
                    if self.env.is_main:
                        out[name] = whole.detach().cpu().clone()
            return out
        mine = {}
        for name, param in module.named_parameters():
            t = pick(param)
            if t is not None:
                mine[self._names[name]] = t.detach().cpu().clone()
        parts = gather_object(mine, self.env)
        if not self.env.is_main:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, t in part.items():
                merged.setdefault(name, t)
        order = {name: i for i, name in enumerate(getattr(module, "full_shapes", {}))}  # state_dict order
        return {name: merged[name] for name in sorted(merged, key=lambda n: order.get(n, len(order)))}

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer the whole model saves (``state_dict``, no parameter), on the CPU, on rank 0
        ({} elsewhere). A collective, as :meth:`_whole`: a pipeline's stages send theirs to rank 0."""
        _, module = self._attached()
        if not self.stage:
            out = {}
            for name, t in saved_buffers(module).items():
                whole = full_tensor(t)
                if self.env.is_main:
                    out[name] = whole.detach().cpu().clone()
            return out
        params = {g for local, _ in module.named_parameters() for g in module.global_keys.get(local, ())}
        mine = {name: t.clone() for name, t in module.global_state().items() if name not in params}
        merged: dict[str, torch.Tensor] = {}
        for part in gather_object(mine, self.env):
            for name, t in part.items():
                merged.setdefault(name, t)
        return merged if self.env.is_main else {}

    def _grad_scale(self) -> float:
        scaler = self._attached()[0].precision.scaler
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def _explain(self, module: nn.Module, scale: float) -> None:
        """The first layer's gradient before and after synchronisation, and an all-reduce by hand."""
        param = dict(module.named_parameters()).get(self.first_param)
        if param is None:  # a model without trainable parameters: nothing to explain
            return
        local = (self._local / scale) if self._local is not None else None
        synced = full_tensor(param.grad).detach().float() / scale if param.grad is not None else None
        averaged = None
        if self.hooks_see_grads:
            # What the strategy should have done, done here explicitly: sum every rank's local
            # gradient and divide by the number of ranks (over -100 padding, then weigh the step's
            # real targets as the step did: loop.losses).
            # (a DTensor's .shape is the whole parameter's: no collective needed here)
            mine = local if local is not None else torch.zeros(tuple(param.shape))
            averaged = sum_over_ranks(mine.to(self.env.device), self.env) / self.env.world_size
            if self._factor != 1.0:
                averaged = averaged * self._factor
        self.explain = {
            "param": self.first_param,
            "local_norm": float(local.norm()) if local is not None else None,
            "synced_norm": float(synced.norm()) if synced is not None else None,
            "allreduced_norm": float(averaged.norm()) if averaged is not None else None,
            "synced_vs_allreduced": (float((synced.to(averaged.device) - averaged).abs().max())
                                     if synced is not None and averaged is not None else None),
            "count_factor": self._factor,   # over -100 padding: the step's weight for its real targets
            "writes_files": bool(self.env.is_main),
            # Sharded parameters (FSDP's DTensors): every rank writes its part of each checkpoint.
            "writes_checkpoint_shard": is_sharded(param),
        }
        self._local = None

    # --- after the last step -----------------------------------------------------------
    def audit_epochs(self, loader: ShardedLoader, epochs: int) -> None:
        """Every batch this rank's loader gives over ``epochs`` whole epochs: indices and digest."""
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                x, y = batch
                self.audit.append({"epoch": epoch, "step": batch.step, "micro": batch.place.micro,
                                   "indices": batch.indices.tolist(), "sha": batch_digest(x, y),
                                   "loaded": _loaded(batch)})

    def finish(self, loader: ShardedLoader, epochs_touched: int) -> None:
        """Audit the data if asked, hash every tensor on every rank, gather all to rank 0, write."""
        strategy, module = self._attached()
        if self.audit_data:
            self.audit_epochs(loader, max(1, epochs_touched))
        sync = check_sync(strategy, module) if self.check_sync else None
        mine = {"rank": self.env.rank, "micro": self.micro, "no_grad": self.no_grad,
                "explain": self.explain, "audit": self.audit}
        ranks = gather_object(mine, self.env)
        if not self.env.is_main:
            return
        record = {"world_size": self.env.world_size, "strategy": strategy.describe(),
                  "accumulate": strategy.accumulate_steps, "steps_done": len(self.losses),
                  "losses": self.losses, "first_param": self.first_param,
                  "n_samples": len(loader.dataset), "ranks": ranks, "sync": sync,
                  "initial_diverging": self.initial_diverging, "output_diverging": self.output_diverging,
                  "pipeline_stages": self.env.world_size if self.stage else 0}
        (self.out / RECORD_FILE).write_text(json.dumps(record), encoding="utf-8")

    def fail(self, exc: BaseException) -> None:
        """Write what this rank knows about a failed run (no collectives: the others may be gone)."""
        self.out.mkdir(parents=True, exist_ok=True)
        names = ([self._names.get(n, n) for n, p in self.module.named_parameters() if p.requires_grad]
                 if self.module is not None else [])
        record = {"rank": self.env.rank, "step": self.step, "steps_done": len(self.losses),
                  "losses": self.losses, "first_param": self.first_param,
                  "error": f"{type(exc).__name__}: {exc}".strip(),
                  "traceback": traceback.format_exc(),
                  "no_grad": [n for n in names if n not in self._used] if self._used and self.hooks_see_grads else [],
                  "no_grad_before": self.no_grad}
        # The user's frame, the time, and whether it only lost a peer: which rank failed first.
        described = describe_exception(exc, self.env.rank)
        record.update({k: described[k] for k in ("frame", "communication", "timed_out", "waiting_in", "time")})
        failure_file(self.out, self.env.rank).write_text(json.dumps(record), encoding="utf-8")

    def _attached(self) -> tuple[Strategy, nn.Module]:
        if self.strategy is None or self.module is None:
            raise RuntimeError("Recorder.attach(strategy, model) must be called first")
        return self.strategy, self.module


def self_is_meta(model: nn.Module) -> bool:
    """A model built on the meta device (no values yet): nothing to run."""
    return any(p.is_meta for p in model.parameters())


def whole_model_names(module: nn.Module) -> dict[str, str]:
    """Each parameter's name in ``module`` -> its name in the user's model.

    The same for a whole model (or one wrapped and unwrapped again); for a pipeline stage
    (``StageModule``), the whole model's ``state_dict`` key of the tensor (the first, for a
    tied one, which is what the whole model's ``named_parameters()`` gives).
    """
    if not isinstance(module, StageModule):
        return {name: name for name, _ in module.named_parameters()}
    return {name: (module.global_keys.get(name) or [name])[0] for name, _ in module.named_parameters()}


def _loaded(batch: Batch) -> list[bool]:
    """Which of (inputs, target) the batch carries (a pipeline stage leaves out what it does not use)."""
    return [part is not None for part in batch]
