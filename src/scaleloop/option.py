"""A setting's one declaration: its default, help, choices, help group and tier (no torch).

Every section of the run's config declares each of its fields with :func:`option`
(``data.settings``, ``output.settings``, ``checkpoint.settings``, ``strategies.registry``,
``config.sections``); ``scaleloop.config`` generates the CLI flags, the TOML keys, the help and
the check of the choices from these declarations alone. It sits on the bottom floor so that every
owner of a section, whatever its floor, declares its fields the same way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from scaleloop.errors import UsageError

#: The groups ``--help-all`` lists the flags in, in this order (a field names its own).
GROUPS = ("model and data", "training", "hardware", "speed", "launch", "checkpoints", "output")


def option(default: Any, help: str, choices: Sequence[str] = (), *, group: str, common: bool = False,
           bare: Any = None) -> Any:
    """A dataclass field declared as a setting: ``help`` is its flag's help, ``choices`` the values
    it accepts (checked for every section alike; a tuple, or a sequence that reads them when used,
    as ``--strategy``'s reads the strategy registry), ``group`` its heading in ``--help-all`` (one of
    :data:`GROUPS`), and ``common`` puts it among the dozen flags ``train --help`` shows.

    ``bare`` (not None): the flag's value may be left out, and the flag alone means ``bare``
    (``--profile`` is ``--profile 3``; ``--profile 5`` is 5)."""
    assert group in GROUPS, group
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "group": group,
                                                        "common": common, "bare": bare})


def flag(name: str) -> str:
    """The CLI flag for a setting's name: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def require(ok: bool, name: str, what: str) -> None:
    """UsageError ``--NAME must be WHAT`` unless ``ok``: a section's check of one value."""
    if not ok:
        raise UsageError(f"{flag(name)} must be {what}")
