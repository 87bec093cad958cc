"""The command line's shared parts, for ``scaleloop`` and its ``bench`` and ``verify`` subcommands.

``Parser`` reports bad flags in one line with exit code 2; ``add_config_flags`` adds one flag per
``TrainConfig`` field and ``flag_values`` reads them back. No torch here: ``--help`` stays instant.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, NoReturn

from scaleloop.config import TrainConfig, coerce, field_types, flag
from scaleloop.errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError  # (exit codes re-exported)


class Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line (no usage dump) with exit code 2.

    Abbreviated flags are refused: otherwise a typo such as ``--epoch 3`` would silently
    set ``--epochs``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, grouped, each help ending with its default."""
    types = field_types()
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        group_name = meta.get("group", "training")
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        default = "not set" if f.default is None else f.default
        # Help that already explains its default ("default: off") is not given a second one.
        listed = meta["help"] if not meta.get("choices") else f"{meta['help']} ({'|'.join(meta['choices'])})"
        help_text = listed if "(default:" in listed else f"{listed} (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if types[f.name] is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        kwargs["metavar"] = f.name.upper()
        group.add_argument(flag(f.name), **kwargs)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TrainConfig`` flags that were given, as typed values (flags left out are absent)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: coerce(k, v, flag(k)) for k, v in vars(args).items() if k in names}
