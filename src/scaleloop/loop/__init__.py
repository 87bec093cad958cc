"""The run and its loop: build a run, take steps, end epochs, finish.

- ``build``: ``build_run`` makes everything a run needs (data, model, strategy, optimizer,
  schedule, loader, loss) in one fixed order; train, verify, bench and tune-batch share it. With it
  the parts it builds from the settings: the model's speed options (``--compile``,
  ``--channels-last``), the optimizer's parameter groups (which tensors weight decay applies to,
  ``--decay-params``) and its learning rate (scaling, warm-up, schedules, ``--min-lr``).
- ``step``: ``train_step``, the one training step (micro-batches: forward, loss, weighted
  backward; then clipping, optimizer and schedule step), watched by an ``Observer`` (the
  trainer's clock, verify's recorder, bench's timers).
- ``training``: ``train``, a run's life (build, restore, claim the run directory, the trainer),
  and a run in one of several replica groups (``--replica-groups``): meeting the others before the
  first step (a group behind takes a live one's state), and what a rejoined group reports.
- ``trainer``: ``Trainer``, the loop over epochs and steps, and its log rows.
- ``pauses``: where training pauses, and where it stops: the evaluations and checkpoints the
  trainer pauses for; ``StopVote``, every rank agreeing to stop after the same step on a stop
  signal; the record of an ending the loop decides (a non-finite loss, a stop signal, ...).
- ``result``: what the loop counts (the running loss sums) and a finished run's ``RunResult``.
- ``rows``: the log rows (``Row``, which rank 0 writes to ``metrics.csv`` and the tracker) and
  what they learn on their all-reduce: stragglers, a diverging loss, fp16 skipped steps; a row's
  tokens/s and MFU, from what the run fixed once.
- ``text``: what the loop prints: the header, the progress bar, the end-of-run summary
  ``scaleloop train`` prints.
- ``losses``: the loss for each task, the one rule for what a model returns, and exact losses
  over -100 padding (a step's loss is the mean over the real targets of the whole step).
- ``evaluation``: exact evaluation over ranks, and how it scores a model (summed losses, correct
  counts, ``--metrics``); what the trainer evaluates and when (``--eval-every``,
  ``--eval-batches``' fixed sample, ``--eval-train``).
- ``profiler``: ``Profiler``, ``--profile N``'s torch.profiler around the trainer's steps (an
  ``Observer`` that passes each call on), and ``profile()``, the same for a hand-written loop;
  imported only with ``--profile``.

Elsewhere, where their jobs live: the checks before N workers start (``launching.preflight``),
a slow start-up step named (``runtime.startwatch``), the largest batch that fits
(``plan.tune``) and text from a trained language model (``scaleloop.sampling``).

Names are imported lazily: ``import scaleloop.loop`` does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "train": "scaleloop.loop.training",
    "RunResult": "scaleloop.loop.result",
    "Trainer": "scaleloop.loop.trainer",
    "Run": "scaleloop.loop.build",
    "build_run": "scaleloop.loop.build",
    "preflight": "scaleloop.launching.preflight",
    "build_data_and_model": "scaleloop.loop.build",
    "build_optimizer": "scaleloop.loop.build",
    "seed_everything": "scaleloop.loop.build",
    "train_step": "scaleloop.loop.step",
    "steps_of": "scaleloop.loop.step",
    "Observer": "scaleloop.loop.step",
    "sample": "scaleloop.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop.loop' has no attribute {name!r}")
