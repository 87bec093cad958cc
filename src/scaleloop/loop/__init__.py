"""The run and its loop: build a run, take steps, end epochs, finish.

- ``build``: ``build_run`` makes everything a run needs (data, model, strategy, optimizer,
  schedule, loader, loss) in one fixed order; train, verify, bench and tune-batch share it.
- ``preflight``: the checks done once before N workers start, without torch for the common settings.
- ``step``: ``train_step``, the one training step (micro-batches: forward, loss, weighted
  backward; then clipping, optimizer and schedule step), watched by an ``Observer`` (the
  trainer's clock, verify's recorder, bench's timers).
- ``training``: ``train``, a run's life (build, restore, claim the run directory, the trainer).
- ``trainer``: ``Trainer``, the loop over epochs and steps, and its log rows. ``pauses``: the
  evaluations and checkpoints it pauses for. ``throughput``: a log row's tokens/s and MFU, from what
  the run fixed once. ``result``: what the loop counts and a finished run's ``RunResult``.
  ``text``: what the loop prints (the header, the progress bar).
- ``evaluate``: exact evaluation over ranks, and how it scores a model (summed losses, correct
  counts, ``--metrics``). ``evaluations``: what the trainer evaluates and
  when (``--eval-every``, ``--eval-batches``' fixed sample, ``--eval-train``). ``schedule``: learning-rate scaling and schedules
  (``--min-lr``). ``decay``: which tensors weight decay applies to (``--decay-params``).
- ``running_loss``: the running loss sums. ``tasks``: the loss for each task. ``padding``: exact losses
  over -100 padding (a step's loss is the mean over the real targets of the whole step).
- ``health``: the log rows (``Row``, which rank 0 writes to ``metrics.csv`` and the tracker) and
  what they learn on their all-reduce: stragglers, a diverging loss, fp16 skipped steps.
- ``rejoin``: a run in one of several replica groups: meeting the others before the first
  step (a group behind takes a live one's state), and what a rejoined group reports.
- ``startwatch``: a slow start-up step says which it is and where it runs.
- ``speed``: ``--compile``/``--channels-last`` set-up. ``tune``: the largest batch that fits,
  and that search for a run's config (``scaleloop tune-batch``).
- ``ending``: the record of an ending the loop decides (a non-finite loss, a stop signal, ...).
- ``stop_vote``: ``StopVote``, every rank agreeing to stop after the same step on a stop signal.
- ``summary``: the end-of-run summary ``scaleloop train`` prints.
- ``sampling``: ``sample``, text from a finished run's language model (``scaleloop sample``):
  the model rebuilt from its ``config.toml``, its weights loaded weights-only.
- ``profiler``: ``Profiler``, ``--profile N``'s torch.profiler around the trainer's steps (an
  ``Observer`` that passes each call on), and ``profile()``, the same for a hand-written loop.

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
    "preflight": "scaleloop.loop.preflight",
    "build_data_and_model": "scaleloop.loop.build",
    "build_optimizer": "scaleloop.loop.build",
    "seed_everything": "scaleloop.loop.build",
    "train_step": "scaleloop.loop.step",
    "steps_of": "scaleloop.loop.step",
    "Observer": "scaleloop.loop.step",
    "sample": "scaleloop.loop.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'scaleloop.loop' has no attribute {name!r}")
