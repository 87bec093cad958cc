"""Run configuration: ``TrainConfig``, made of sections (TOML file + CLI flags), each handed to its owner.

- ``train_config``: ``TrainConfig`` (its sections, and the flat view: ``SETTINGS``, the one index from
  a setting's flat name to its section and field), TOML reading and writing, ``validate`` (every
  section's own check);
- ``sections``: the sections whose owners sit above the config (``OptimSettings`` and
  ``EvalSettings`` for the trainer, ``LaunchSettings`` for the launcher); the others live with their owners:
  ``scaleloop.data.settings``, ``scaleloop.output.settings``, ``scaleloop.checkpoint.settings``,
  ``scaleloop.strategies.registry`` (``ParallelSettings``);
- ``saved_settings``: a resumed run's settings, from those saved with the run it continues.

No torch here: ``scaleloop --help`` answers at once.
"""
from scaleloop.config.saved_settings import config_for_resume
from scaleloop.config.sections import EvalSettings, LaunchSettings, OptimSettings, conf_pairs, split_endpoint
from scaleloop.config.train_config import (BACKENDS, DECAY_PARAMS, GROUPS, LR_SCALINGS, LR_SCHEDULES, OPTIMIZERS,
                                       PIPELINE_SCHEDULES, PRECISIONS, SECTIONS, SETTINGS, STRATEGIES, TASKS,
                                       FileValues, Setting, TrainConfig, coerce, common_fields, field_types, flag,
                                       load_toml, resolve, to_toml)

__all__ = ["TrainConfig", "OptimSettings", "EvalSettings", "LaunchSettings", "SECTIONS", "SETTINGS", "Setting",
           "FileValues", "GROUPS", "config_for_resume", "coerce", "common_fields", "field_types", "flag", "load_toml",
           "resolve", "to_toml", "conf_pairs", "split_endpoint", "STRATEGIES", "BACKENDS", "PRECISIONS", "OPTIMIZERS",
           "LR_SCHEDULES", "DECAY_PARAMS", "LR_SCALINGS", "TASKS", "PIPELINE_SCHEDULES"]
