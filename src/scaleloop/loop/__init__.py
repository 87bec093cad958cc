"""The run and its loop: build a run, take steps, end epochs, finish.

- ``build``: ``build_run`` makes everything a run needs (data, model, strategy, optimizer,
  schedule, loader, loss) in one fixed order; train, verify, bench and tune-batch share it.
- ``preflight``: the checks done once before N workers start, without torch for the common settings.
- ``step``: ``Step``, the one training step (forward, loss, weighted backward, clipping,
  optimizer and schedule step) with an observer for verify's recorder and bench's timers.
- ``training``: ``train``, the loop behind ``scaleloop train``; its ``Trainer``, the ``Hook``
  events it calls (metrics rows, health checks, the stop vote, a recovery report); ``RunResult``.
- ``evaluate``: exact evaluation over ranks. ``evaluations``: what the trainer evaluates and
  when (``--eval-every``, ``--eval-batches``' fixed sample, ``--eval-train``). ``schedule``: learning-rate scaling and schedules
  (``--min-lr``). ``decay``: which tensors weight decay applies to (``--decay-params``).
- ``running``: the running loss sums. ``tasks``: the loss for each task. ``padding``: exact losses
  over -100 padding (a step's loss is the mean over the real targets of the whole step).
- ``health``: what the log rows learn on their all-reduce: stragglers, a diverging loss,
  fp16 skipped steps.
- ``startwatch``: a slow start-up step says which it is and where it runs.
- ``speed``: ``--compile``/``--channels-last`` set-up. ``tune``: the largest batch that fits (``scaleloop tune-batch``).
- ``ending``: the record of an ending the loop decides (a non-finite loss, a stop signal, ...).
- ``preempt``: ``StopVote``, every rank agreeing to stop after the same step on a stop signal.
- ``summary``: the end-of-run summary ``scaleloop train`` prints.
- ``hooks``: what the trainer does at a step's end or a row besides training (metrics rows,
  health checks, the stop vote, the recovery report), each a ``Hook``.

Names are imported lazily: ``import scaleloop.loop`` does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "train": "scaleloop.loop.training",
    "RunResult": "scaleloop.loop.training",
    "Trainer": "scaleloop.loop.training",
    "Hook": "scaleloop.loop.training",
    "Run": "scaleloop.loop.build",
    "build_run": "scaleloop.loop.build",
    "preflight": "scaleloop.loop.preflight",
    "build_data_and_model": "scaleloop.loop.build",
    "build_optimizer": "scaleloop.loop.build",
    "seed_everything": "scaleloop.loop.build",
    "Step": "scaleloop.loop.step",
    "Observer": "scaleloop.loop.step",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop.loop' has no attribute {name!r}")
