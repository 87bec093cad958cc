"""Checks worth doing once, before N worker processes start: names, user code, data directory.

The launcher runs them (so do verify and bench before their workers) without importing torch
for the common settings: its workers are fresh interpreters that import torch themselves, and a
launcher that imported it too would add its import to every launch. Only what cannot be checked
otherwise imports more: user code (a ``package.module:factory``, which imports its own module),
a token-file directory, a CUDA or MPS device, and a pipeline's cut into stages.
"""
from __future__ import annotations

from scaleloop.config import TrainConfig
from scaleloop.data.settings import DATASET_NAMES, MODEL_NAMES
from scaleloop.errors import UsageError
from scaleloop.hfconfig import config_file, is_config_path
from scaleloop.plugins import is_factory_spec, resolve_factory

# Devices that no number of processes can fail to fit (the others are checked against this machine).
_FIT_ANYWHERE = ("auto", "cpu")


def preflight(cfg: TrainConfig) -> None:
    """Raise UsageError (one line) for settings that would fail in every worker."""
    for what, name, known in (("model", cfg.model_data.model, MODEL_NAMES), ("data", cfg.model_data.data, DATASET_NAMES)):
        if is_factory_spec(name):
            resolve_factory(name, what)
        elif what == "model" and is_config_path(name):
            config_file(name)   # a transformers config.json: that it is there (the workers build it)
        elif name.lower() not in known:
            raise UsageError(f"unknown {'dataset' if what == 'data' else what} {name!r}; choose one of "
                             f"{', '.join(known)}, or give 'package.module:factory'")
    if cfg.model_data.loss is not None:
        resolve_factory(cfg.model_data.loss, "loss")
    if cfg.model_data.metrics:
        from scaleloop.loop.evaluation import resolve_metrics

        resolve_metrics(cfg.model_data.metrics)
    if cfg.model_data.data == "mnist" and not cfg.model_data.data_dir:
        raise UsageError("dataset 'mnist' reads IDX files from a directory: pass --data-dir DIR (it never downloads)")
    if cfg.model_data.data in ("tokenfile", "tokenfile-seq"):
        from scaleloop.data.tokenfile import check_token_dir

        check_token_dir(cfg.model_data.data, cfg.model_data.data_dir)
    if cfg.launch.device.strip().lower() not in _FIT_ANYWHERE:
        # --nproc processes on fewer GPUs: one line here, not a "Duplicate GPU" report from NCCL.
        from scaleloop.runtime.devices import check_processes_fit

        check_processes_fit(cfg.launch.device, cfg.launch.nproc)
    layout = cfg.pipeline_layout()
    if layout is not None:
        # The cut into stages is known before any worker starts: a model too shallow for
        # its stages fails here, in one line, rather than in every worker.
        from scaleloop.loop.build import build_data_and_model, check_decay_with_pipeline, check_trainable

        check_decay_with_pipeline(cfg)
        from scaleloop.strategies.pipeline_schedules import check_pipeline_schedule
        from scaleloop.strategies.pipeline import pipeline_layers, cut_stages

        per_rank = check_pipeline_schedule(cfg.parallel.pipeline_schedule, layout[0], cfg.parallel.microbatches, cfg.parallel.stages_per_rank)
        _, model = build_data_and_model(cfg)
        check_trainable(cfg.model_data.model, model)   # as every strategy says it (loop/build.py), before the cut
        cut_stages(pipeline_layers(model), layout[0] * per_rank, cfg.model_data.model, per_rank)

