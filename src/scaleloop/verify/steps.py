"""The K training steps a verify run takes: ``scaleloop train``'s own run and step.

The run is built by ``loop.build.build_run`` and trained with ``loop.step.Step``, the code
``scaleloop train`` runs, with the recorder watching as the step's observer; what verify
proves therefore holds for ``scaleloop train`` with the same settings. Left out is only what
does not change the weights (evaluation, checkpoints, metrics files).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from torch import nn

from scaleloop.data.info import Datasets
from scaleloop.loop.build import Run, build_data_and_model, build_run
from scaleloop.loop.step import Step
from scaleloop.runtime.dist import DistEnv
from scaleloop.verify.recorder import Recorder


@dataclass(frozen=True)
class RunSpec:
    """How one side of the comparison runs: its strategy and accumulation, and how many steps."""

    strategy: str
    accumulate: int
    steps: int


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
    def build(c: TrainConfig) -> tuple[Datasets, nn.Module]:
        datasets, model = build_data_and_model(c)
        recorder.built(model)   # before the strategy copies rank 0's weights to every rank
        return datasets, model

    run = build_run(cfg.replace(strategy=spec.strategy, accumulate=spec.accumulate, **pipeline), env, data=build)
    plan = run.loader.plan
    if plan.steps_per_epoch == 0:
        raise UsageError(f"the training set ({plan.n} samples) is smaller than one step of "
                         f"--batch-size {cfg.batch_size} with --drop-last; lower --batch-size")
    recorder.attach(run.strategy, run.model)
    step = Step(run, observer=recorder)
    run.model.train()
    done, epoch = 0, 0
    if boundary is not None:
        boundary(run, 0)
    while done < spec.steps:
        run.loader.set_epoch(epoch)
        epoch += 1
        for batch in run.loader:
            step.micro(batch)
            if batch.last_micro:
                step.update()
                done += 1
                if boundary is not None:
                    boundary(run, done)
                if done >= spec.steps:
                    break
    recorder.finish(run.loader, epochs_touched=epoch)
    run.strategy.close()
