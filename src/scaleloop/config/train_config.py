"""Run configuration: one frozen dataclass of sections, read from a TOML file and overridden by CLI flags.

This module imports no torch, so that ``scaleloop --help`` answers quickly.

Each section's owner declares its fields once, with their help, choices, help group and tier
(``scaleloop.option``), and checks them (``check``). Everything else is generated here from those
declarations: :data:`SETTINGS`, the one index from a setting's flat name (``lr``, the CLI's
``--lr``, the TOML key ``lr``) to its section and field; the CLI flags (``commands.cmdline``); the
TOML reading and writing; and the check of every choice.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import (Any, Iterable, Mapping, NamedTuple, Optional, Sequence, Union, get_args, get_origin,
                    get_type_hints)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

from scaleloop.checkpoint.settings import CheckpointSettings
from scaleloop.config.sections import (BACKENDS, DECAY_PARAMS, LR_SCALINGS, LR_SCHEDULES, OPTIMIZERS, EvalSettings,
                                       LaunchSettings, OptimSettings)
from scaleloop.data.settings import TASKS, DataSettings
from scaleloop.errors import UsageError
from scaleloop.option import GROUPS, flag
from scaleloop.output.settings import OutputSettings
from scaleloop.strategies.pipeline_schedules import SCHEDULES as PIPELINE_SCHEDULES
from scaleloop.strategies.registry import PRECISIONS, STRATEGIES, ParallelSettings

__all__ = ["TrainConfig", "Setting", "SETTINGS", "SECTIONS", "FileValues", "GROUPS", "flag", "common_fields",
           "field_types", "coerce", "load_toml", "resolve", "to_toml", "BACKENDS", "DECAY_PARAMS", "LR_SCALINGS",
           "LR_SCHEDULES", "OPTIMIZERS", "PIPELINE_SCHEDULES", "PRECISIONS", "STRATEGIES", "TASKS"]


@dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything that defines a training run, in sections. Sizes are global (across all workers).

    The sections (each defined and checked by its owner): ``model_data`` (``data.settings``: the
    model, the data, loading), ``optim`` (``config.sections``: epochs, batch, optimizer, schedule,
    seed), ``output`` (``output.settings``: metric rows, progress, tracker), ``evaluation``
    (``config.sections``), ``checkpointing`` (``checkpoint.settings``: the run directory, checkpoints,
    resume), ``launch`` (``config.sections``: device, processes, machines, rendezvous) and
    ``parallel`` (``strategies.registry``: strategy, mesh, precision, accumulation, each strategy's
    options). The project reads a setting from its section (``cfg.optim.lr``).

    Flat names: every setting also has one flat name, its flag's (``lr`` for ``--lr``), found in
    exactly one section through :data:`SETTINGS`: the CLI's flags, the TOML keys of old files and
    the keys checkpoints save are flat. ``TrainConfig(lr=0.1, nproc=2)`` and ``cfg.replace(lr=0.1,
    nproc=2)`` take flat names (and whole sections by their names); ``cfg.setting("lr")`` reads one
    by its flat name; ``cfg.flat()`` is every setting by its flat name (what checkpoints save and
    trackers log). ``cfg.lr`` still reads ``cfg.optim.lr`` for users' scripts written that way.
    It is all generated from the sections: no setting is declared twice.
    """

    model_data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    output: OutputSettings = field(default_factory=OutputSettings)
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    checkpointing: CheckpointSettings = field(default_factory=CheckpointSettings)
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)

    def __init__(self, model_data: Optional[DataSettings] = None, optim: Optional[OptimSettings] = None,
                 output: Optional[OutputSettings] = None, evaluation: Optional[EvalSettings] = None,
                 checkpointing: Optional[CheckpointSettings] = None, launch: Optional[LaunchSettings] = None,
                 parallel: Optional[ParallelSettings] = None, **settings: Any) -> None:
        given = dict(model_data=model_data, optim=optim, output=output, evaluation=evaluation,
                     checkpointing=checkpointing, launch=launch, parallel=parallel)
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            if name not in SETTINGS:
                raise TypeError(f"TrainConfig has no setting {name!r}")
            changes.setdefault(SETTINGS[name].section, {})[name] = value
        for f in dataclasses.fields(self):
            section = given[f.name] if given[f.name] is not None else f.default_factory()  # type: ignore[misc]
            object.__setattr__(self, f.name, dataclasses.replace(section, **changes.get(f.name, {})))

    def setting(self, name: str) -> Any:
        """A setting by its flat name (its flag's: ``"lr"`` for ``--lr``), from the one section that
        holds it: for code that goes through settings by name (writing TOML, comparing with a job's)."""
        return getattr(getattr(self, SETTINGS[name].section), name)

    def __getattr__(self, name: str) -> Any:
        """The flat view, kept for scripts written against it: ``cfg.lr`` is ``cfg.optim.lr``. The
        project itself reads each setting from its section (checked by tests/test_config_reads.py)."""
        setting = SETTINGS.get(name)
        if setting is None:
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        return getattr(getattr(self, setting.section), name)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes`` applied: settings by their flat names, or whole sections."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainConfig(**{**sections, **{k: v for k, v in changes.items() if k in sections}},
                           **{k: v for k, v in changes.items() if k not in sections})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name, in the sections' order."""
        return {name: getattr(getattr(self, s.section), name) for name, s in SETTINGS.items()}

    def validate(self) -> "TrainConfig":
        """Check every value; raise UsageError naming the flag and what to use instead.

        Here only what every setting shares: a value among its choices. Then each section is
        checked by its owner, in the sections' order, handed what it needs of the others.
        """
        for name, setting in SETTINGS.items():
            value = self.setting(name)
            if setting.choices and value is not None and value not in setting.choices:
                raise UsageError(f"{flag(name)} {value!r} is not one of: {', '.join(setting.choices)}")
        self.model_data.check()
        self.optim.check()
        self.output.check()
        self.evaluation.check()
        self.checkpointing.check()
        self.launch.check()
        # A step's batch is split over every replica group's processes (--replica-groups).
        self.parallel.check(self.launch.data_ranks, self.optim.batch_size, self.launch.elastic_nodes)
        self.parallel.check_replica_groups(self.launch.replica_groups)
        return self

    @property
    def peak_lr(self) -> float:
        """``--lr`` scaled to the global batch by ``--lr-scaling`` (``OptimSettings.peak_lr``)."""
        return self.optim.peak_lr

    @property
    def elastic(self) -> bool:
        """Whether the job's machines may change while it runs (``--nnodes MIN:MAX``, MIN < MAX)."""
        return self.launch.elastic

    @property
    def elastic_nodes(self) -> Optional[str]:
        """``MIN:MAX`` for an elastic job, else None."""
        return self.launch.elastic_nodes

    def pipeline_layout(self) -> Optional[tuple[int, int]]:
        """``(stage processes, replicas)`` when the run is a pipeline, else None (``ParallelSettings``)."""
        return self.parallel.pipeline_layout(self.world_size)

    @property
    def world_size(self) -> int:
        """Processes the launch flags ask for (``--nproc`` x ``--nnodes``)."""
        return self.launch.world_size


class Setting(NamedTuple):
    """One setting as the flat view finds it: the section (``TrainConfig``'s field) that holds it, and
    its field there (the default, and the help, choices, group and tier in ``field.metadata``)."""

    section: str
    field: dataclasses.Field

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def choices(self) -> Sequence[str]:
        return self.field.metadata["choices"]

    @property
    def group(self) -> str:
        return self.field.metadata["group"]

    @property
    def common(self) -> bool:
        return self.field.metadata["common"]


def _index() -> dict[str, Setting]:
    """Flat name -> setting, from the sections alone; a name declared twice (in two sections, or as
    a section's own name) or a field declared without ``scaleloop.option`` fails at import."""
    index: dict[str, Setting] = {}
    for section in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            if "help" not in f.metadata:
                raise TypeError(f"{section.default_factory.__name__}.{f.name} is not declared with "  # type: ignore[union-attr]
                                "scaleloop.option (no help)")
            if f.name in index or f.name in TrainConfig.__dataclass_fields__:
                raise TypeError(f"setting {f.name!r} is declared twice (in {section.name} and elsewhere)")
            index[f.name] = Setting(section.name, f)
    return index


#: The one index of the flat view: each setting's flat name -> its section and field.
SETTINGS: dict[str, Setting] = _index()
#: The section names, in the order they are checked and written.
SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainConfig))


def common_fields() -> tuple[str, ...]:
    """The settings a newcomer needs first (``common=True``): what ``scaleloop train --help``
    shows; ``--help-all`` shows every setting."""
    return tuple(name for name, s in SETTINGS.items() if s.common)


@functools.cache
def field_types() -> dict[str, type]:
    """Each setting's scalar type (``Optional[int]`` -> ``int``). Computed once: the sections are
    fixed, and reading their type hints is slow enough to count in a run's start-up when done
    for every key of a config file."""
    hints = {f.name: tp for s in SECTIONS for f, tp in _hints(TrainConfig.__dataclass_fields__[s])}
    out: dict[str, type] = {}
    for name in SETTINGS:
        tp = hints[name]
        if get_origin(tp) is Union:
            tp = next(a for a in get_args(tp) if a is not type(None))
        out[name] = tp
    return out


def _hints(section: dataclasses.Field) -> Iterable[tuple[dataclasses.Field, Any]]:
    kind = section.default_factory  # type: ignore[misc]
    hints = get_type_hints(kind)
    return [(f, hints[f.name]) for f in dataclasses.fields(kind)]


def coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the field's type, or raise UsageError naming where it came from."""
    tp = field_types()[name]
    if name == "nnodes" and isinstance(value, str) and ":" in value:
        return _min_max(value, source)
    if name == "betas" and isinstance(value, list):   # a config file's betas = [0.9, 0.95]
        value = ",".join(str(v) for v in value)
    if value is None or (isinstance(value, str) and value.lower() == "none"
                         and SETTINGS[name].field.default is None):
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        pass
    what = _KIND_WORDS.get(tp, tp.__name__)
    # A flag names the setting itself ("--batch-size must be ..."); a file names the key in it.
    subject = source if source.startswith("--") else f"{source}: {name}"
    raise UsageError(f"{subject} must be {what}, got {value!r}")


# How a type reads in an error a user sees.
_KIND_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}


def _min_max(value: str, source: str) -> str:
    """``MIN:MAX`` machines, checked (kept as text: ``resolve`` splits it into two fields)."""
    try:
        low, high = (int(part) for part in value.split(":"))
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise UsageError(f"{source}: nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return f"{low}:{high}"


class FileValues(dict):
    """Settings read from config files (flat name -> value), each remembering where it was read:
    ``origin[name]`` is the file and the key, so that a value the checks refuse is reported there."""

    def __init__(self, values: Optional[Mapping[str, Any]] = None,
                 origin: Optional[Mapping[str, tuple[str, str]]] = None) -> None:
        super().__init__(values or {})
        self.origin: dict[str, tuple[str, str]] = dict(origin or {})

    def __setitem__(self, name: str, value: Any) -> None:
        """A value set here, not read from a file, has no origin."""
        super().__setitem__(name, value)
        self.origin.pop(name, None)

    def pop(self, name: str, *default: Any) -> Any:
        self.origin.pop(name, None)
        return super().pop(name, *default)

    @classmethod
    def layered(cls, *layers: Mapping[str, Any]) -> "FileValues":
        """The layers merged, a later one's values winning, each value keeping its origin."""
        merged = cls()
        for layer in layers:
            merged.update(layer)
            for name in layer:
                merged.origin.pop(name, None)
            merged.origin.update(getattr(layer, "origin", {}))
        return merged


def load_toml(path: str | Path) -> FileValues:
    """Read a config file into setting values; UsageError for a missing, unreadable or bad file.

    Accepted forms: flat keys (``lr = 0.1``, the flags' names with ``_`` or ``-``), the same under
    ``[train]``, and the sections as tables (``[optim]`` then ``lr = 0.1``), as :func:`to_toml` writes.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {str(p)!r} cannot be read: {exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    source = f"config file {str(p)!r}"
    if set(raw) == {"train"} and isinstance(raw["train"], dict):
        raw = raw["train"]
    values = FileValues()
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, item in value.items():
                _read_key(values, inner, item, source, section=key)
        else:
            _read_key(values, key, value, source)
    return values


def _read_key(values: FileValues, key: str, value: Any, source: str, section: Optional[str] = None) -> None:
    """One key of a config file (in the table ``section``, if any) into ``values``."""
    name = key.replace("-", "_")
    where = f"[{section}] {key}" if section else key
    owner = SETTINGS[name].section if name in SETTINGS else None
    if owner is None or (section is not None and owner != section):
        names = [n for n, s in SETTINGS.items() if section is None or s.section == section]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        elsewhere = f" (it belongs in [{owner}])" if owner is not None else hint
        raise UsageError(f"{source}: unknown setting {where!r}{elsewhere}")
    if name in values:
        raise UsageError(f"{source}: {name} is given twice")
    values[name] = coerce(name, value, source)
    values.origin[name] = (source, where)


def resolve(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> TrainConfig:
    """Defaults, then the config file, then CLI flags; validated. A value the checks refuse that
    came from a file (not overridden by a flag) is reported with the file and its key."""
    merged = {**file_values, **flag_values}
    if isinstance(merged.get("nnodes"), str):   # elastic "MIN:MAX" (checked by coerce)
        low, high = (int(part) for part in merged["nnodes"].split(":"))
        merged["min_nnodes"], merged["nnodes"] = low, high
    elif "nnodes" in flag_values and "min_nnodes" not in flag_values:
        merged["min_nnodes"] = 0   # --nnodes N on the command line: a fixed job, whatever the file said
    try:
        return TrainConfig(**merged).validate()
    except UsageError as exc:
        origin = {k: v for k, v in getattr(file_values, "origin", {}).items() if k not in flag_values}
        raise _located(exc, origin, merged) from None


def resume_settings(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> "CheckpointSettings":
    """The checkpointing section alone of these values, checked: where a run continues from is
    known before the other settings are checked (they are, with a saved run's settings under them:
    ``--n-heads 8`` alone reads as a size for the default model; for a saved tinygpt run it is not)."""
    settings = TrainConfig(**{**file_values, **flag_values}).checkpointing
    try:
        settings.check()
    except UsageError:
        resolve(file_values, flag_values)   # raises it, naming the file a value came from
        raise
    return settings


def _located(exc: UsageError, origin: Mapping[str, tuple[str, str]], values: Mapping[str, Any]) -> UsageError:
    """``exc`` with the file and key of the first setting it names (as a flag: the checks speak the
    command line's language) whose value came from a config file; as it was if none did."""
    message = str(exc)
    for name in (n.replace("-", "_") for n in re.findall(r"--([a-z][a-z0-9-]*)", message)):
        if name in origin:
            source, key = origin[name]
            return UsageError(f"{source}: {key} = {_toml_value(values[name])}: {message}")
    return exc


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML, one table per section, that ``--config`` reads back to the same run."""
    lines = ["# scaleloop resolved configuration; rerun with: scaleloop train --config <this file>"]
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        for name, setting in SETTINGS.items():
            if setting.section != section:
                continue
            value = cfg.setting(name)
            lines.append(f"# {name} = (not set)" if value is None else f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A setting's value as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    return repr(value)


def _toml_string(value: str) -> str:
    """A TOML basic string: backslash and quote escaped, and control characters (which TOML
    forbids raw, e.g. a newline in a path) written as ``\\uXXXX``."""
    out = []
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
