"""A run's result (:class:`RunResult`), the report it ends with, and :func:`finish`: the final
weights and outputs, and the result completed. Where the run stands while it goes (its step,
samples, training time) is the checkpoint's :class:`~scaleloop.checkpoint.manager.Progress`,
which the trainer keeps and :func:`finish` copies in.

The training loss a run reports: loss x samples and samples, summed over the epoch and over
the current log window, in float64.

The sums are exactly those that adding ``[loss * n, n]`` to a float64 tensor after every
micro-batch would give, bit for bit, but a micro-batch only appends its (device) loss to a
list. The additions happen in one go when the sums are read (a log row, a checkpoint, the end
of an epoch), in micro-batch order, so the loop launches no extra tensor operation per step
and never waits for the device in between. Those reads also note the first step whose loss
was not finite on this rank (:meth:`RunningLoss.first_nonfinite_step`), at no cost while the
sums stay finite.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import IterableDataset

from scaleloop.checkpoint.manager import Checkpointer, Progress, Resumed
from scaleloop.checkpoint.weights import (SAFETENSORS_FILE, TORCH_FILE, safetensors_available,
                                          safetensors_bytes)
from scaleloop.hfconfig import is_config_path, save_causal_lm
from scaleloop.loop.build import Run, describe_schedule
from scaleloop.loop.evaluation import EvalResult
from scaleloop.output.footprint import RankMemory, measure, write_json
from scaleloop.output.metrics import plot_curves
from scaleloop.output.rundir import RunDirWriteError, unwritable, write_atomic
from scaleloop.runtime.collectives import gather_object
from scaleloop.runtime.devices import describe_device, to_cpu


@dataclass
class RunResult:
    """What a run reports (the numbers are reduced over all ranks; rank 0's copy is the one
    returned). The loop fills in the losses and evaluations as it reaches them, and :func:`finish`
    the rest (the counts from the run's progress, its facts, memory, checkpoints, wall time)."""

    run_dir: Optional[Path] = None
    device: str = ""
    strategy: str = ""
    world_size: int = 1
    precision: str = ""
    epochs: int = 0                  # epochs this process trained in (counted from the first, as a resumed one is)
    steps: int = 0                   # global optimizer steps, a resumed run's earlier ones included
    samples: int = 0
    train_loss: float = float("nan")
    test: Optional[EvalResult] = None
    samples_per_s: float = 0.0
    train_s: float = 0.0             # seconds in the epochs' step loops (not evaluations or checkpoints)
    wall_s: float = 0.0
    parameters: int = 0
    dropped_per_epoch: int = 0
    in_memory_data: bool = False
    train_samples: int = 0
    steps_per_epoch: int = 0
    last_step_samples: int = 0
    lr: str = ""                     # the learning rate and its schedule, in words
    weight_decay: str = ""           # which tensors weight decay applied to ("" without it)
    checkpoints_written: int = 0
    checkpoint_s: float = 0.0
    checkpoint_background_s: float = 0.0   # --async-checkpoint: the writes' own time, in their thread
    last_checkpoint: Optional[Path] = None
    resumed_from: Optional[Path] = None
    memory: tuple[RankMemory, ...] = ()
    streamed: bool = False           # the training set is a stream (docs/streaming.md)
    skipped_steps: int = 0           # fp16: optimizer steps the GradScaler skipped (counted in ``steps``)
    straggler: str = ""              # the worst straggler reported during the run ("" if none)
    train_loss_over: str = ""        # which steps ``train_loss`` is the mean over ("epoch 2, steps 11-20")
    window_loss: float = float("nan")   # the last log row's train loss (the mean over its window) ...
    window_steps: tuple[int, int] = (0, 0)   # ... and that window's first and last global step
    train_eval: Optional[EvalResult] = None   # --eval-train: the last training loss in evaluation mode ...
    train_eval_step: int = 0         # ... and the global step it was taken at
    nothing_left: bool = False       # the checkpoint had already reached the run's end: no step was taken

    def counted(self, progress: Progress) -> RunResult:
        """This result with the counts of ``progress`` (where the run stands): the steps, samples,
        training seconds and fp16 skipped steps."""
        return replace(self, steps=progress.global_step, samples=progress.samples, train_s=progress.train_s,
                       skipped_steps=progress.skipped_steps)


def finish(run: Run, result: RunResult, checkpointer: Checkpointer, resumed: Optional[Resumed],
           gradient_bytes: Optional[int], started: float) -> RunResult:
    """The end of a run: final weights (the user's own module, unsharded: a collective for a
    sharded strategy), memory per rank; rank 0 writes ``model.pt``, ``memory.json`` and
    ``curves.png`` into ``result.run_dir``. Returns ``result`` (its counts already in:
    :meth:`RunResult.counted`), completed; ``started``: ``perf_counter()`` when the process group formed."""
    env, strategy, sampler = run.env, run.strategy, run.loader.sampler
    final_weights = strategy.full_state_dict(run.model)
    memory = tuple(gather_object(measure(run.model, run.optimizer, env.rank, env.device, gradient_bytes,
                                         run.model_bytes), env))
    strategy.close()
    try:
        if result.run_dir is not None:
            _write_outputs(run, result.run_dir, checkpointer, final_weights, memory)
    except Exception:
        checkpointer.keep_final_copies(None)   # the other machines wait to hear from rank 0
        raise
    checkpointer.keep_final_copies(result.run_dir)   # a machine that does not share the run directory
    result.device, result.strategy, result.world_size = describe_device(env.device), strategy.describe(), env.world_size
    result.precision, result.parameters, result.memory = run.cfg.parallel.precision, run.parameters, memory
    result.samples_per_s = result.samples / max(result.train_s, 1e-9)
    result.wall_s = time.perf_counter() - started
    result.dropped_per_epoch, result.in_memory_data = sampler.dropped_per_epoch, run.loader.in_memory
    result.train_samples, result.steps_per_epoch = sampler.n or 0, sampler.steps_per_epoch or 0
    result.last_step_samples = (len(sampler.step_indices(0, sampler.steps_per_epoch - 1))
                                if sampler.steps_per_epoch else 0)
    result.lr = describe_schedule(run.cfg.optim, run.lr, run.total_steps)
    result.weight_decay = run.weight_decay
    result.checkpoints_written, result.checkpoint_s = checkpointer.written, checkpointer.seconds
    result.checkpoint_background_s = checkpointer.background_seconds
    result.last_checkpoint = checkpointer.last_path
    result.resumed_from = resumed.source if resumed is not None else None
    result.streamed = isinstance(run.data.train, IterableDataset)
    return result


def _write_outputs(run: Run, run_dir: Path, checkpointer: Checkpointer, final_weights: dict[str, Any],
                   memory: tuple[RankMemory, ...]) -> None:
    """Rank 0: ``model.pt`` (and ``model.safetensors``, ``hf/``: :func:`_write_weights`),
    ``memory.json`` and ``curves.png`` in the run directory."""
    try:
        _write_weights(run, run_dir, to_cpu(final_weights))  # on CPU for every strategy: loads anywhere
        write_json(run_dir / "memory.json", memory, run.strategy.name)
        plot_curves(run_dir / "metrics.csv", run_dir / "curves.png")
    except RunDirWriteError as exc:
        raise exc.with_hint(checkpointer.continue_hint(exc.once)) from None
    except OSError as exc:   # memory.json, curves.png
        raise unwritable(run_dir, exc).with_hint(checkpointer.continue_hint("the disk has space")) from None


#: Where a run of a transformers config (``--model config.json``) saves it as transformers does.
HF_DIR = "hf"


def _write_weights(run: Run, run_dir: Path, weights: dict[str, Any]) -> None:
    """The final weights (the user's module's full ``state_dict``, on the CPU) as ``model.pt``;
    as ``model.safetensors`` too where the safetensors package is installed (transformers brings
    it; scaleloop does not require it); and for a ``--model config.json`` run, as the
    transformers model in ``hf/`` (``save_pretrained``: config and safetensors), which
    ``AutoModelForCausalLM.from_pretrained`` loads. Each file appears whole or not at all."""
    buf = io.BytesIO()
    torch.save(weights, buf)
    write_atomic(run_dir / TORCH_FILE, buf.getvalue())
    if safetensors_available():
        write_atomic(run_dir / SAFETENSORS_FILE, safetensors_bytes(weights))
    if not is_config_path(run.cfg.model_data.model):
        return
    # save_pretrained writes several files: into a fresh directory, then renamed into place.
    final, tmp = run_dir / HF_DIR, run_dir / f".{HF_DIR}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_causal_lm(run.cfg.model_data.model, weights, tmp)
        if final.exists():   # an earlier finish of this run directory (a run continued after it)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise unwritable(final, exc) from None


# --- the running loss sums ------------------------------------------------------------------------

class RunningLoss:
    """Running ``(loss x samples, samples)`` of the epoch and of the log window on one rank."""

    def __init__(self) -> None:
        self.epoch = [0.0, 0.0]     # loss x samples, samples
        self.window = [0.0, 0.0]
        self._losses: list[torch.Tensor] = []
        self._counts: list[int] = []
        self._steps: list[int] = []
        self._first_nonfinite: Optional[int] = None

    def add(self, loss: torch.Tensor, n: int, step: int = 0) -> None:
        """A micro-batch's mean loss (a detached scalar tensor) over its ``n`` samples, of optimizer
        step ``step`` (1-based; only to say where a loss first became non-finite)."""
        self._losses.append(loss)
        self._counts.append(n)
        self._steps.append(step)

    def _flush(self) -> None:
        if not self._losses:
            return
        losses, counts, steps = self._losses, self._counts, self._steps
        self._losses, self._counts, self._steps = [], [], []
        # loss.double() * n for each (a float64 product is exactly rounded wherever it is
        # computed), then sequential float64 additions: the same operations, in the same order,
        # as per-step in-place additions. On a device: one multiplication for all of them and
        # one copy to the host; on the CPU, reading each loss is cheaper than building tensors.
        products = (_products_on_host if losses[0].device.type == "cpu" else _products_on_device)(losses, counts)
        e, w = self.epoch, self.window
        for p, c in zip(products, counts):
            e[0] += p
            w[0] += p
            e[1] += c
            w[1] += c
        # A finite total means every product was finite: only a non-finite one is searched.
        if self._first_nonfinite is None and not math.isfinite(w[0]):
            self._first_nonfinite = next((s for p, s in zip(products, steps) if not math.isfinite(p)), None)

    def epoch_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's epoch sums as a float64 tensor (to reduce over ranks)."""
        self._flush()
        return torch.tensor(self.epoch, dtype=torch.float64, device=device)

    def window_values(self) -> list[float]:
        """This rank's log-window sums (loss x samples, samples) as float64 numbers (to reduce over ranks)."""
        self._flush()
        return [float(v) for v in self.window]

    def first_nonfinite_step(self) -> Optional[int]:
        """The first (global) step whose loss was inf or NaN on this rank, if any (reads the losses)."""
        self._flush()
        return self._first_nonfinite

    def new_epoch(self) -> None:
        self._flush()
        self.epoch = [0.0, 0.0]

    def new_window(self) -> None:
        self._flush()
        self.window = [0.0, 0.0]

    def state(self, device: torch.device) -> torch.Tensor:
        """Epoch and window sums as the 4-element float64 tensor a checkpoint saves."""
        self._flush()
        return torch.tensor(self.epoch + self.window, dtype=torch.float64, device=device)

    def load(self, sums: torch.Tensor) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        values = [float(v) for v in sums.detach().cpu().tolist()]
        self._losses, self._counts, self._steps = [], [], []
        self.epoch, self.window = values[0:2], values[2:4]


def _products_on_host(losses: list[torch.Tensor], counts: list[int]) -> list[float]:
    return [loss.item() * c for loss, c in zip(losses, counts)]


def _products_on_device(losses: list[torch.Tensor], counts: list[int]) -> list[float]:
    n = torch.tensor(counts, dtype=torch.float64, device=losses[0].device)
    return (torch.stack(losses).double() * n).tolist()
