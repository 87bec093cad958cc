"""The K training steps a verify run takes: ``scaleloop train``'s own run and step.

The run is built by ``loop.build.build_run`` and trained with ``loop.step.train_step``, the code
``scaleloop train`` runs, with the recorder watching as the step's observer; what verify
proves therefore holds for ``scaleloop train`` with the same settings. Left out is only what
does not change the weights (evaluation, checkpoints, metrics files).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
import torch
from torch import nn
from torch.utils.data import IterableDataset

from scaleloop.data.info import Datasets
from scaleloop.loop.build import Run, build_data_and_model, build_run
from scaleloop.loop.step import steps_of, train_step
from scaleloop.runtime.dist import DistEnv
from scaleloop.verify.data import load_samples
from scaleloop.verify.recorder import Recorder


@dataclass(frozen=True)
class RunSpec:
    """How one side of the comparison runs: its strategy and accumulation, and how many steps."""

    strategy: str
    accumulate: int
    steps: int


def probe_inputs(dataset: Any, n: int = 4) -> Optional[torch.Tensor]:
    """The inputs of the first ``n`` training samples, when they are one tensor (None otherwise:
    streams, keyword inputs, or a dataset that cannot be read by index)."""
    if isinstance(dataset, IterableDataset):
        return None
    try:
        x, _ = load_samples(dataset, range(min(n, len(dataset))))
    except Exception:  # noqa: BLE001 (a probe, not a check: such a dataset is just not probed)
        return None
    return x if isinstance(x, torch.Tensor) else None


#: Called at every step boundary with the run and the steps done so far: 0 before the first step,
#: then after each (``verify.lockstep``: the workers save their state there, one process loads it).
Boundary = Callable[[Run, int], None]


def run_steps(cfg: TrainConfig, env: DistEnv, spec: RunSpec, recorder: Recorder,
              boundary: Optional[Boundary] = None) -> None:
    """Train ``spec.steps`` optimizer steps on this rank, telling ``recorder`` what happens
    (and ``boundary``, if given, where each step begins and ends)."""
    # The reference side runs one process: a pipeline's pieces and schedule apply to the pipeline only.
    pipelined = cfg.replace(strategy=spec.strategy).pipeline_layout() is not None
    pipeline = {} if pipelined else dict(microbatches=1, pipeline_schedule="gpipe", stages_per_rank=0,
                                         sharded_checkpoints=False)
    # DDP's options for parameters without a gradient mean nothing to one process, which has no
    # gradient to synchronise: its reference ignores them (the workers' DDP applies them).
    if spec.strategy == "single":
        pipeline.update(find_unused_parameters=False, static_graph=False)
    def build(c: TrainConfig) -> tuple[Datasets, nn.Module]:
        datasets, model = build_data_and_model(c)
        recorder.built(model, probe_inputs(datasets.train))   # before the strategy copies rank 0's weights
        return datasets, model

    run = build_run(cfg.replace(strategy=spec.strategy, accumulate=spec.accumulate, **pipeline), env, data=build)
    sampler = run.loader.sampler
    if sampler.steps_per_epoch == 0:
        raise UsageError(f"the training set ({sampler.n} samples) is smaller than one step of "
                         f"--batch-size {cfg.optim.batch_size} with --drop-last; lower --batch-size")
    recorder.attach(run.strategy, run.model)
    run.model.train()
    done, epoch = 0, 0
    if boundary is not None:
        boundary(run, 0)
    while done < spec.steps:
        run.loader.set_epoch(epoch)
        epoch += 1
        for micro_batches in steps_of(run.loader):
            train_step(run, micro_batches, recorder)   # the very step scaleloop train takes
            done += 1
            if boundary is not None:
                boundary(run, done)
            if done >= spec.steps:
                break
    recorder.finish(run.loader, epochs_touched=epoch)
    run.strategy.close()
