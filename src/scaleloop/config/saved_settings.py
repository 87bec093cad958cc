"""A resumed run's settings: those saved with the run it continues, then ``--config``, then flags."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from scaleloop.checkpoint.resume import LEGACY_VALUES
from scaleloop.checkpoint.store import locate, run_dir_of
from scaleloop.config.train_config import FileValues, TrainConfig, load_toml, resolve, resume_settings

#: The settings of a replica-groups job on one machine (``--replica-groups N --nproc P``), in the
#: job's directory beside its groups' (``launching.replica_groups``): resuming the job reads them as
#: a run's ``config.toml`` (a job's directory has none: it holds no run of its own).
JOB_CONFIG = "job.toml"


def config_for_resume(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> TrainConfig:
    """The run's settings: the saved ``config.toml`` of the run being resumed (if any), then
    ``--config`` values, then flags. Without a run to resume: just ``--config`` then flags.

    A run in ``--out`` that wrote no checkpoint yet (stopped at start-up, or killed before or
    while writing its first) still gives its saved settings: the run that starts over in its
    directory (``output.rundir.prepare_run_dir``) trains with them, never with the defaults.
    A replica-groups job's directory gives its job's settings (:data:`JOB_CONFIG`)."""
    settings = resume_settings(file_values, flag_values)   # where to continue from, first
    if settings.resume == "never":
        return resolve(file_values, flag_values)
    source = Path(settings.out) if settings.resume == "auto" and settings.out else None
    if settings.resume not in ("auto", "never"):
        source = run_dir_of(locate(Path(settings.resume)))
    if source is None:
        return resolve(file_values, flag_values)
    saved_file = source / "config.toml"
    if not saved_file.is_file():
        saved_file = source / JOB_CONFIG
        if not saved_file.is_file():
            return resolve(file_values, flag_values)
    # A run saved before a setting existed continues as it trained (weight decay on every tensor).
    saved = FileValues.layered(LEGACY_VALUES, load_toml(saved_file))
    # Which checkpoint to take is this invocation's choice, never an old run's.
    saved.pop("resume", None)
    # Without --out the run goes on in the directory it came from.
    saved["out"] = str(source)
    # A pipeline's pieces mean nothing to the strategy a resumed run switches to.
    new_strategy = {**file_values, **flag_values}.get("strategy")
    if new_strategy not in (None, "pipeline"):
        for name in ("microbatches", "pipeline_schedule", "stages_per_rank", "sharded_checkpoints"):
            if name not in {**file_values, **flag_values}:
                saved.pop(name, None)
    return resolve(FileValues.layered(saved, file_values), flag_values)
