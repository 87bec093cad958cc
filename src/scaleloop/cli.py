"""The ``scaleloop`` command: parses flags, builds a config, calls the library. Nothing more.

Torch is imported only inside the subcommands, so ``scaleloop --help`` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, NoReturn, Optional, Sequence

from scaleloop.config import TrainConfig, coerce, field_types, flag, load_toml, resolve
from scaleloop.errors import UsageError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line (no usage dump) with exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, grouped, each help ending with its default."""
    types = field_types()
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        group_name = meta.get("group", "training")
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        default = "not set" if f.default is None else f.default
        help_text = f"{meta['help']} (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if types[f.name] is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        kwargs["metavar"] = f.name.upper()
        group.add_argument(flag(f.name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaleloop", description=(
        "Scale a plain PyTorch training loop from one CPU to many GPUs and machines, "
        "and see what happens when it does."))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = sub.add_parser("train", help="train a model (defaults: SimpleNet on the bundled digits, best device)",
                           description="Train a model. With no flags: SimpleNet on scikit-learn's bundled "
                                       "8x8 digits, on the best device (CUDA > MPS > CPU). Flags override "
                                       "--config, which overrides the defaults.")
    train.add_argument("--config", metavar="FILE", help="TOML file of settings (keys as below, e.g. batch_size = 128)")
    _add_config_flags(train)

    sub.add_parser("env", help="what this machine offers: torch, devices, backends, runnable strategies",
                   description="Report Python, torch, CUDA/NCCL/Gloo/MPS availability, devices, CPU "
                               "cores, and which strategies can run here.")
    return parser


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: coerce(k, v, flag(k)) for k, v in vars(args).items() if k in names}


def cmd_train(args: argparse.Namespace) -> int:
    file_values = load_toml(args.config) if args.config else {}
    cfg = resolve(file_values, _flag_values(args))

    from scaleloop.dist import DistEnv
    from scaleloop.loop import train
    from scaleloop.summary import format_result

    env = DistEnv.from_env(device=cfg.device)
    result = train(cfg, env)
    if env.is_main:
        print(format_result(result))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from scaleloop.envinfo import collect_env, format_env

    print(format_env(collect_env()))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``scaleloop`` console script and ``python -m scaleloop``."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            from scaleloop import __version__

            print(f"scaleloop {__version__}")
            return 0
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        handler = {"train": cmd_train, "env": cmd_env}[args.command]
        return handler(args)
    except UsageError as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nscaleloop: interrupted; everything written so far is kept", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
