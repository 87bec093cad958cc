"""The command line's shared parts, for ``scaleloop`` and its ``bench`` and ``verify`` subcommands.

``Parser`` reports bad flags in one line with exit code 2; ``add_config_flags`` adds one flag per
setting of ``TrainConfig``'s sections (generated from their declarations) and ``flag_values`` reads them back; ``help_tiers`` makes ``--help`` show the
common options and ``--help-all`` every one. No torch here: ``--help`` stays instant.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable, NoReturn, Optional

from scaleloop.config import GROUPS, SETTINGS, coerce, field_types, flag
from scaleloop.errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError  # (exit codes re-exported)


class Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line (no usage dump) with exit code 2.

    Abbreviated flags are refused: otherwise a typo such as ``--epoch 3`` would silently
    set ``--epochs``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # The dests ``--help`` shows when the parser has two tiers (``help_tiers``); None: one tier.
        self.common: Optional[frozenset[str]] = None

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}{_nearest(message, self)} (see: {self.prog} --help)")

    def format_help(self) -> str:
        """The common options only, where ``help_tiers`` gave the parser two tiers; else every one."""
        if self.common is None:
            return super().format_help()
        shown = [a for a in self._actions if a.dest in self.common or isinstance(a, (argparse._HelpAction, _HelpAll))]
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, shown, [])
        formatter.add_text(self.description)
        for group in self._action_groups:
            actions = [a for a in group._group_actions if a in shown]
            if actions:
                formatter.start_section(group.title)
                formatter.add_arguments(actions)
                formatter.end_section()
        # The last line, short enough not to wrap: how to see the rest.
        formatter.add_text(f"{len(self._actions) - len(shown)} more options: {self.prog} --help-all")
        return formatter.format_help()

    def format_full_help(self) -> str:
        """Every option, grouped (what ``--help-all`` prints)."""
        return super().format_help()


class _HelpAll(argparse.Action):
    """``--help-all``: print every option, grouped, and exit 0 (as ``--help`` does)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        full = parser.format_full_help() if isinstance(parser, Parser) else parser.format_help()
        sys.stdout.write(full)
        parser.exit()


def help_tiers(parser: Parser, common: Iterable[str]) -> None:
    """Give ``parser`` two help tiers: ``--help`` shows the options whose dests are in ``common``
    (and ends by saying how to see the rest), ``--help-all`` shows every option, grouped.

    A newcomer reads a screen, not 300 lines; the flags themselves do not change.
    """
    parser.common = frozenset(common)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            action.help = "show the common options and exit"
    parser.add_argument("--help-all", action=_HelpAll, help="show every option, grouped, and exit")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (``config.SETTINGS``), under its group's heading, each help ending with
    its default; a boolean also gets its ``--no-`` form."""
    types = field_types()
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for name, setting in SETTINGS.items():
        default = "not set" if setting.field.default is None else setting.field.default
        # Help that already explains its default ("default: off") is not given a second one.
        listed = setting.help if not setting.choices else f"{setting.help} ({'|'.join(setting.choices)})"
        help_text = listed if "(default:" in listed else f"{listed} (default: {default})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if types[name] is bool:
            groups[setting.group].add_argument(flag(name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if setting.choices:
            kwargs["choices"] = setting.choices
        if setting.field.metadata.get("bare") is not None:   # the value may be left out: the flag alone
            kwargs.update(nargs="?", const=str(setting.field.metadata["bare"]))
        kwargs["metavar"] = name.upper()
        groups[setting.group].add_argument(flag(name), **kwargs)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings' flags that were given, as typed values (flags left out are absent)."""
    return {k: coerce(k, v, flag(k)) for k, v in vars(args).items() if k in SETTINGS}


def _nearest(message: str, parser: argparse.ArgumentParser) -> str:
    """``; did you mean ...?`` for an unknown flag or choice in argparse's ``message``, naming the
    closest known one (difflib's similarity); empty when nothing is close."""
    import difflib
    import re

    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if choice is not None:
        known = re.findall(r"'([^']*)'", choice.group(2))
        close = difflib.get_close_matches(choice.group(1), known, n=2, cutoff=0.6)
        return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    unknown = re.match(r"unrecognized arguments: (.*)$", message)
    if unknown is None:
        return ""
    flags = sorted(_flags_of(parser))
    hints = {}
    for word in unknown.group(1).split():
        flag = word.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.7)
            if close:
                hints[flag] = close[0]
    if len(hints) == 1:
        return f"; did you mean {next(iter(hints.values()))}?"
    return ("; did you mean " + ", ".join(f"{known} (for {typed})" for typed, known in hints.items()) + "?"
            if hints else "")


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every long flag of ``parser`` and of its subcommands' parsers (the error is the top
    parser's, which does not know which subcommand's flag was meant)."""
    flags: set[str] = set()
    for action in parser._actions:   # argparse keeps no public list of them
        flags.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags_of(sub)
    return flags
